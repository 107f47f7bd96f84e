"""``gpumesh status``. What a pipeline polls, ``status JOB --json``, is answered with redis-py alone:
the settings it needs are read without building :class:`~gpumesh.settings.Settings`, and the status is
printed as :mod:`gpumesh.store.jobstatus` reads it (:mod:`gpumesh.jobstate`'s fields), with no pydantic model, rich or RQ imported. The
table, ``--watch`` and the explanation of failures take the full path (``gpumesh.cli.jobs``)."""

from __future__ import annotations

import math
import re
from typing import Any

import click

from gpumesh.cli.options import emit_json, json_option, url_option
from gpumesh.layers import DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_LEASE_TTL, DEFAULT_URL, NAMES, layered


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


# A number as a GPUMESH_* variable or the config file writes it, in ASCII: what float() and pydantic read alike.
_DECIMAL = re.compile(r"[ \t]*[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?[ \t]*")


def _number(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and _DECIMAL.fullmatch(value):
        return float(value)
    return None


def _settings(url: str | None) -> tuple[str, float]:
    """The broker URL and the lease TTL (how long a worker counts as live), layered as Settings layers them.
    Whatever Settings might read otherwise (a number not in plain decimals, a lease shorter than two
    heartbeats, a config file key it does not know) goes through Settings, which refuses it in one line as
    every command does; the settings this command does not use are not read."""
    values = layered(("url", "lease_ttl", "heartbeat_interval"), {"url": url})
    broker_url = values.get("url", DEFAULT_URL)
    ttl = _number(values.get("lease_ttl", DEFAULT_LEASE_TTL))
    beat = _number(values.get("heartbeat_interval", DEFAULT_HEARTBEAT_INTERVAL))
    known = set(values) <= set(NAMES)
    if isinstance(broker_url, str) and ttl and beat and known and math.isfinite(ttl) and 0 < 2 * beat <= ttl:
        return broker_url, ttl
    from gpumesh.settings import Settings

    full = Settings.load(url=url)  # raises the UsageError that says what is wrong
    return full.url, full.worker_ttl
