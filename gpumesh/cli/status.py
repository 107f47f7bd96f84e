"""``gpumesh status``. What a pipeline polls, ``status JOB --json``, is answered with redis-py alone:
the settings it needs are read without building :class:`~gpumesh.settings.Settings`, and the status is
printed as :mod:`gpumesh.store.jobstatus` reads it (:mod:`gpumesh.jobstate`'s fields), with no pydantic model, rich or RQ imported. The
table, ``--watch`` and the explanation of failures take the full path (``gpumesh.cli.jobs``)."""

from __future__ import annotations

import math
from typing import Any

import click

from gpumesh.cli.options import emit_json, json_option, url_option
from gpumesh.layers import DEFAULT_LEASE_TTL, DEFAULT_URL, layered


@click.command()
@click.argument("job_id")
@click.option(
    "--watch", is_flag=True, help="Follow the job to its end with a progress bar; exit 1 if it did not succeed."
)
@url_option
@json_option
@click.pass_context
def status(ctx: click.Context, job_id: str, watch: bool, url: str | None, as_json: bool) -> None:
    """Show a job's status and task counts, and which queued tasks no live worker may run."""
    if as_json and not watch:
        emit_json(read_json(ctx, url, job_id))
        return
    from gpumesh.cli.jobs import show_status

    show_status(ctx, job_id, watch, url, as_json)


def read_json(ctx: click.Context, url: str | None, job_id: str) -> dict[str, Any]:
    """``JobStatus.model_dump(mode="json")`` of the job, read as Broker.job_status reads it."""
    from gpumesh import jobstate
    from gpumesh.store import jobstatus
    from gpumesh.store.connection import SOCKET_TIMEOUT, client

    broker_url, ttl = _settings(url)
    ctx.obj["url"] = broker_url  # for the one line an error of the broker's becomes (cli.group)
    r = client(broker_url, decode=True, socket_timeout=SOCKET_TIMEOUT, retries=1, health_check=False)
    ctx.call_on_close(r.close)
    return jobstate.to_json(jobstatus.read(r, job_id, ttl))


def _settings(url: str | None) -> tuple[str, float]:
    """The broker URL and the lease TTL (how long a worker counts as live), layered as Settings layers
    them. Anything unusual in them goes through Settings, which refuses it in one line; the settings
    this command does not use are not read."""
    values = layered(("url", "lease_ttl"), {"url": url})
    broker_url, ttl = values.get("url", DEFAULT_URL), values.get("lease_ttl", DEFAULT_LEASE_TTL)
    try:
        ttl = float(ttl)
    except (TypeError, ValueError):
        ttl = math.nan
    if isinstance(broker_url, str) and math.isfinite(ttl) and ttl > 0:
        return broker_url, ttl
    from gpumesh.settings import Settings

    full = Settings.load(url=url)  # raises the UsageError that says what is wrong
    return full.url, full.worker_ttl
