"""The ``gpumesh`` command: thin Click commands over :mod:`gpumesh.broker` and :mod:`gpumesh.worker`.

Data goes to stdout, chatter to stderr. Exit codes: 0 ok, 1 job ended failed/cancelled,
2 bad usage or input, 3 broker unreachable or refused the credentials, 4 not found.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import click
import redis
from rich.console import Console
from rich.table import Table

from . import __version__
from .broker import Broker, translate
from .errors import GpumeshError, UsageError
from .models import JobOptions, JobStatus, parse_payloads
from .settings import Settings

err = Console(stderr=True, highlight=False)


class Group(click.Group):
    """Turns every gpumesh error into one line and its exit code; a traceback only with --debug."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except GpumeshError as exc:
            self._die(ctx, exc, exc.exit_code)
        except redis.RedisError as exc:
            url = (ctx.obj or {}).get("url", "")
            self._die(ctx, translate(exc, url), 3)

    @staticmethod
    def _die(ctx: click.Context, exc: Exception, code: int) -> None:
        if (ctx.obj or {}).get("debug"):
            raise exc
        click.echo(f"error: {exc}", err=True)
        ctx.exit(code)


url_option = click.option(
    "--url",
    metavar="URL",
    help="Broker URL, redis://[:PASSWORD@]HOST:PORT/DB or rediss://… (default: $GPUMESH_URL, the config file, "
    "then redis://127.0.0.1:6379/0).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")


def connect(ctx: click.Context, url: str | None, **settings: Any) -> Broker:
    s = Settings.load(url=url, **settings)
    ctx.obj["url"] = s.url
    broker = Broker(s)
    ctx.call_on_close(broker.close)
    return broker.ping()


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpumesh")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Run data-parallel Python work on a mesh of uneven machines.

    A job is a script plus a JSON list of payloads; each payload is one task. Workers benchmark
    themselves and take tasks from the tier that matches their strength.
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


# -- worker ----------------------------------------------------------------------------------------


@main.command()
@click.argument("broker_url", metavar="[URL]", required=False)
@click.option("--name", help="Name shown in `gpumesh workers` (default: the hostname).")
@click.option("--score", type=click.FloatRange(min=0, min_open=True), help="Skip the benchmark and use this GFLOP/s.")
@click.option("--rebench", is_flag=True, help="Benchmark again instead of using the cached score.")
@click.option("--burst", is_flag=True, help="Exit when the queues are empty instead of waiting for work.")
@click.option("--log-level", default="INFO", show_default=True, type=click.Choice(["DEBUG", "INFO", "WARNING"]))
@url_option
@click.pass_context
def worker(
    ctx: click.Context, broker_url: str | None, name: str | None, score: float | None, rebench: bool, burst: bool,
    log_level: str, url: str | None,
) -> None:  # fmt: skip
    """Benchmark this machine, join the mesh and run tasks until stopped.

    URL (or --url) is the broker. SIGTERM or Ctrl-C finishes the current task and exits; a second
    one hands the task back to the queue at once. Tuning: GPUMESH_LEASE_TTL (30 s),
    GPUMESH_HEARTBEAT_INTERVAL (5 s), GPUMESH_TIERS (3).
    """
    import os

    from . import capability
    from .worker import MeshWorker

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("rq").setLevel(logging.WARNING if log_level != "DEBUG" else logging.DEBUG)
    broker = connect(ctx, broker_url or url)
    cap = capability.probe(broker.settings.cache_dir, refresh=rebench, score=score)
    w = MeshWorker(broker, cap, name=name, cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    w.work(burst=burst, logging_level=logging.getLevelName(logging.getLogger("rq").level))


# -- submit and reading ----------------------------------------------------------------------------


def _read_payloads(spec: str) -> list[dict[str, Any]]:
    if spec == "-":
        return parse_payloads(sys.stdin.read(), "payloads on stdin")
    path = Path(spec)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UsageError(f"payloads file {spec} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read payloads file {spec}: {exc}") from None
    return parse_payloads(text, spec)


def _read_script(spec: str) -> str:
    path = Path(spec)
    if not path.is_file():
        raise UsageError(f"script {spec} does not exist or is not a file")
    try:
        source = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read script {spec}: {exc}") from None
    try:
        compile(source, spec, "exec")
    except SyntaxError as exc:
        raise UsageError(f"script {spec} has a syntax error at line {exc.lineno}: {exc.msg}") from None
    return source


def _progress_line(st: JobStatus) -> str:
    t = st.tasks
    return (
        f"{st.job_id} {st.status}: {t.done}/{t.total} done, {t.running} running, {t.queued} queued, {t.failed} failed"
    )


def wait_for(broker: Broker, job_id: str, quiet: bool = False, poll: float = 0.5) -> JobStatus:
    """Poll until the job ends; progress lines on stderr when they change."""
    last = ""
    try:
        while True:
            st = broker.job_status(job_id)
            line = _progress_line(st)
            if not quiet and line != last:
                err.print(line)
                last = line
            if st.finished:
                return st
            time.sleep(poll)
    except KeyboardInterrupt:
        err.print(f"stopped waiting; job {job_id} keeps running. Follow it with: gpumesh status {job_id}")
        sys.exit(130)


@main.command()
@click.argument("script")
@click.option("--payloads", "payloads_spec", required=True, metavar="FILE|-", help="JSON list of payload objects.")
@click.option("--name", default="", help="A name for the job.")
@click.option("--timeout", type=float, default=3600, show_default=True, help="Seconds per attempt.")
@click.option("--max-attempts", type=int, default=3, show_default=True, help="Attempts per task before it fails.")
@click.option("--wait", is_flag=True, help="Wait for the job to end; exit 1 if it failed or was cancelled.")
@url_option
@json_option
@click.pass_context
def submit(
    ctx: click.Context, script: str, payloads_spec: str, name: str, timeout: float, max_attempts: int,
    wait: bool, url: str | None, as_json: bool,
) -> None:  # fmt: skip
    """Submit SCRIPT with one task per payload.

    The script reads its payload as JSON on stdin and prints its result as the last stdout line
    (JSON). Payloads may carry "cost" (a positive number) so heavy tasks go to strong workers.
    """
    source = _read_script(script)
    payloads = _read_payloads(payloads_spec)
    try:
        options = JobOptions(name=name, timeout=timeout, max_attempts=max_attempts)
    except ValueError as exc:
        first = exc.errors()[0]  # type: ignore[attr-defined]
        raise UsageError(f"--{first['loc'][0].replace('_', '-')}: {first['msg']}") from None
    broker = connect(ctx, url)
    res = broker.submit(source, Path(script).name, payloads, options)
    if not wait:
        if as_json:
            emit_json(res.model_dump())
        else:
            tiers = ", ".join(f"tier {t}: {n}" for t, n in res.tiers.items())
            err.print(f"submitted job {res.job_id}: {res.tasks} tasks ({tiers})")
            click.echo(res.job_id)
        return
    if not as_json:
        err.print(f"submitted job {res.job_id}: {res.tasks} tasks; waiting (Ctrl-C stops waiting, not the job)")
    st = wait_for(broker, res.job_id, quiet=as_json)
    if as_json:
        emit_json(st.model_dump(mode="json"))
    else:
        click.echo(f"{st.job_id} {st.status}")
    if st.status != "done":
        ctx.exit(1)


@main.command()
@click.argument("job_id")
@url_option
@json_option
@click.pass_context
def status(ctx: click.Context, job_id: str, url: str | None, as_json: bool) -> None:
    """Show a job's status and task counts."""
    st = connect(ctx, url).job_status(job_id)
    if as_json:
        emit_json(st.model_dump(mode="json"))
    else:
        click.echo(_progress_line(st) + (f"  [{st.name}]" if st.name else ""))


@main.command()
@url_option
@json_option
@click.pass_context
def jobs(ctx: click.Context, url: str | None, as_json: bool) -> None:
    """List recent jobs, newest first."""
    rows = connect(ctx, url).jobs()
    if as_json:
        emit_json([r.model_dump(mode="json") for r in rows])
        return
    table = Table("job", "name", "status", "done", "failed", "total", "created")
    for r in rows:
        created = r.created_at.strftime("%Y-%m-%d %H:%M:%S") if r.created_at else ""
        table.add_row(r.job_id, r.name, r.status, str(r.tasks.done), str(r.tasks.failed), str(r.tasks.total), created)
    Console().print(table)


@main.command()
@click.argument("job_id")
@click.option(
    "--format", "fmt", type=click.Choice(["table", "json", "jsonl", "csv"]), default="table", show_default=True,
    help="table for people; json, jsonl or csv for programs.",
)  # fmt: skip
@url_option
@click.pass_context
def results(ctx: click.Context, job_id: str, fmt: str, url: str | None) -> None:
    """Print a job's per-task results in payload order."""
    rows = connect(ctx, url).results(job_id)
    dumped = [r.model_dump(mode="json") for r in rows]
    if fmt == "json":
        emit_json(dumped)
    elif fmt == "jsonl":
        for d in dumped:
            click.echo(json.dumps(d))
    elif fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(dumped[0]) if dumped else ["index"])
        w.writeheader()
        for d in dumped:
            w.writerow({**d, "result": json.dumps(d["result"])})
        click.echo(buf.getvalue(), nl=False)
    else:
        table = Table("#", "status", "result", "error", "attempts", "worker", "s")
        for r in rows:
            table.add_row(
                str(r.index), r.status, json.dumps(r.result) if r.result is not None else "",
                (r.error or "").splitlines()[0] if r.error else "", str(r.attempts), r.worker or "",
                f"{r.duration_s:.2f}" if r.duration_s is not None else "",
            )  # fmt: skip
        Console().print(table)


@main.command()
@url_option
@json_option
@click.pass_context
def workers(ctx: click.Context, url: str | None, as_json: bool) -> None:
    """List live workers with their device, score and tier."""
    rows = connect(ctx, url).workers()
    if as_json:
        emit_json([r.model_dump(mode="json") for r in rows])
        return
    table = Table("worker", "host", "device", "GFLOP/s", "tier", "state", "task")
    for r in rows:
        table.add_row(
            r.id,
            r.hostname,
            f"{r.device} {r.device_name}",
            f"{r.score_gflops:.1f}",
            str(r.tier),
            r.state,
            r.current_task or "",
        )
    Console().print(table)


@main.command()
@click.argument("target", metavar="JOB|TASK")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until the job or task ends.")
@url_option
@click.pass_context
def logs(ctx: click.Context, target: str, follow: bool, url: str | None) -> None:
    """Print the stdout/stderr lines of a task, or of every task of a job."""
    broker = connect(ctx, url)
    seen: dict[str, int] = {}
    while True:
        counts: dict[str, int] = {}
        for tid, stream, line in broker.logs(target):
            counts[tid] = counts.get(tid, 0) + 1
            if counts[tid] > seen.get(tid, 0):
                prefix = f"[{tid}] " if tid != target else ""
                if stream == "gpumesh":
                    click.echo(f"{prefix}--- {line} ---", err=True)
                else:
                    click.echo(f"{prefix}{line}", err=stream == "stderr")
        seen = counts
        if not follow or _ended(broker, target):
            return
        time.sleep(0.5)


def _ended(broker: Broker, target: str) -> bool:
    try:
        return broker.job_status(target).finished
    except GpumeshError:
        return broker.task(target).get("status") in ("done", "failed", "cancelled")


@main.command()
@click.argument("job_id")
@url_option
@json_option
@click.pass_context
def cancel(ctx: click.Context, job_id: str, url: str | None, as_json: bool) -> None:
    """Cancel a job: queued tasks never run, running ones are killed within a heartbeat."""
    st = connect(ctx, url).cancel(job_id)
    if as_json:
        emit_json(st.model_dump(mode="json"))
    else:
        click.echo(_progress_line(st))


if __name__ == "__main__":
    main()
