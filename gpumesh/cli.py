"""The ``gpumesh`` command: thin Click commands over the Python API (broker, worker, server, local).

Data goes to stdout, progress and errors to stderr. Exit codes: 0 ok · 1 job ended failed/cancelled ·
2 bad usage or input · 3 broker unreachable or refused the credentials · 4 not found.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click
import redis

from . import __version__, render
from .broker import Broker, translate
from .errors import GpumeshError, UsageError
from .models import JobOptions, JobStatus, parse_payloads
from .settings import Settings

err = render.err


class Group(click.Group):
    """Turns every gpumesh error into one line and its exit code; a traceback only with --debug."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except GpumeshError as exc:
            self._die(ctx, exc, exc.exit_code)
        except redis.RedisError as exc:
            self._die(ctx, translate(exc, (ctx.obj or {}).get("url", "")), 3)

    @staticmethod
    def _die(ctx: click.Context, exc: Exception, code: int) -> None:
        if (ctx.obj or {}).get("debug"):
            raise exc
        click.echo(f"error: {exc}", err=True)
        ctx.exit(code)


url_option = click.option(
    "--url",
    metavar="URL",
    help="Broker URL: redis://[:PASSWORD@]HOST:PORT/DB, or rediss:// for TLS "
    "(default: $GPUMESH_URL, then the config file, then redis://127.0.0.1:6379/0).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout, nothing else.")


def connect(ctx: click.Context, url: str | None) -> Broker:
    settings = Settings.load(url=url)
    ctx.obj["url"] = settings.url
    broker = Broker(settings)
    ctx.call_on_close(broker.close)
    return broker.ping()


def emit_json(data: Any) -> None:
    click.echo(render.dump(data))


def exit_for(ctx: click.Context, st: JobStatus) -> None:
    if st.status != "done":
        ctx.exit(1)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="gpumesh")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Run data-parallel Python work on a mesh of uneven machines.

    A job is a script plus a JSON list of payloads; each payload is one task. Workers benchmark
    themselves and take tasks from the tier that matches their strength.

    \b
    One machine, one command:   gpumesh run examples/grid_search.py --payloads examples/payloads.json --local 2
    A broker others can join:   gpumesh serve            (prints the worker and submit lines to copy)
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


# -- jobs ------------------------------------------------------------------------------------------


def _read_payloads(spec: str) -> list[dict[str, Any]]:
    if spec == "-":
        return parse_payloads(sys.stdin.read(), "payloads on stdin")
    try:
        text = Path(spec).read_text()
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


def _job_input(script: str, payloads_spec: str, opts: dict[str, Any]) -> tuple[str, list[dict[str, Any]], JobOptions]:
    """Everything validated before anything is written anywhere."""
    source = _read_script(script)
    payloads = _read_payloads(payloads_spec)
    try:
        options = JobOptions(
            name=opts["name"],
            timeout=opts["timeout"],
            max_attempts=opts["max_attempts"],
            speculate=opts.get("speculate", True),
            priority=opts.get("priority", 0),
            requires=tuple(opts.get("require", ())),
        )
    except ValueError as exc:
        first = exc.errors()[0]  # type: ignore[attr-defined]
        flag = {"requires": "require"}.get(str(first["loc"][0]), str(first["loc"][0]))
        raise UsageError(f"--{flag.replace('_', '-')}: {first['msg'].removeprefix('Value error, ')}") from None
    return source, payloads, options


def job_options(f: Any) -> Any:
    """The options every command that starts a job shares (submit, run)."""
    for option in reversed(
        [
            click.option("--name", default="", help="A name for the job."),
            click.option("--timeout", type=float, default=3600, show_default=True, help="Seconds per attempt."),
            click.option(
                "--max-attempts", type=int, default=3, show_default=True, help="Attempts per task before it fails."
            ),
            click.option(
                "--priority",
                type=int,
                default=0,
                show_default=True,
                help="Higher runs first: a worker takes work of the highest priority it can run. Jobs of equal "
                "priority share the workers out, so a small job is not stuck behind a big one.",
            ),  # fmt: skip
            click.option(
                "--require",
                multiple=True,
                metavar="EXPR",
                help="Run every task only on workers that meet EXPR (repeatable): KEY=VALUE, KEY!=VALUE, "
                "KEY>=NUMBER, KEY<=NUMBER or KEY~TEXT (substring), e.g. vram_gb>=40, gpu~a100, device=cuda. "
                'A payload may add its own: "requires": ["vram_gb>=80"].',
            ),  # fmt: skip
            click.option(
                "--speculate/--no-speculate",
                default=True,
                show_default=True,
                help="Let a worker at least twice as strong run a backup copy of a straggler (a task on a much "
                "weaker worker); the first result wins and the other copy is killed, so a task may run twice "
                "at once.",
            ),  # fmt: skip
        ]
    ):
        f = option(f)
    return f


def _wait(ctx: click.Context, broker: Broker, job_id: str, quiet: bool) -> JobStatus:
    try:
        return render.follow(lambda: broker.job_status(job_id), quiet=quiet)
    except KeyboardInterrupt:
        click.echo(
            f"stopped waiting; job {job_id} keeps running. Follow it with: gpumesh status {job_id} --watch", err=True
        )
        ctx.exit(130)


@main.command()
@click.argument("script")
@click.option("--payloads", "payloads_spec", required=True, metavar="FILE|-", help="JSON list of payload objects.")
@job_options
@click.option("--wait", is_flag=True, help="Follow the job to its end; exit 1 if it failed or was cancelled.")
@click.option(
    "--idempotency-key", metavar="KEY", help="Submitting again with the same KEY returns the same job, not a new one."
)
@click.option(
    "--sign-key", type=click.Path(dir_okay=False, path_type=Path),
    help="Sign every task with this Ed25519 key (also GPUMESH_SIGNING_KEY).",
)  # fmt: skip
@click.option(
    "--expires",
    type=click.FloatRange(min=1),
    default=7 * 86400,
    show_default=True,
    help="Seconds a signed job stays valid.",
)
@url_option
@json_option
@click.pass_context
def submit(
    ctx: click.Context, script: str, payloads_spec: str, wait: bool, idempotency_key: str | None,
    sign_key: Path | None, expires: float, url: str | None, as_json: bool, **opts: Any,
) -> None:  # fmt: skip
    """Submit SCRIPT with one task per payload; print the job id.

    The script reads its payload as JSON on stdin and prints its result as the last stdout line
    (JSON). Payloads may carry "cost" (a positive number): when a worker asks for work, the strongest
    workers get the heaviest tasks. Everything is checked before anything is written; the job
    appears whole or not at all. If no live worker meets some tasks' requirements, submit warns and
    the tasks wait until one joins.
    """
    source, payloads, options = _job_input(script, payloads_spec, opts)
    broker = connect(ctx, url)
    key = sign_key or (Path(broker.settings.signing_key) if broker.settings.signing_key else None)
    signer = None
    if key is not None:
        from .signing import Signer

        signer = Signer(key)
    res = broker.submit(
        source, Path(script).name, payloads, options, idempotency_key=idempotency_key, signer=signer, expires_in=expires
    )
    res.waiting_for = broker.job_status(res.job_id, waiting=True).waiting_for
    for w in res.waiting_for:
        err.print(f"warning: {render.waiting_line(w)}")
    if not wait:
        if as_json:
            emit_json(res.model_dump())
        else:
            tiers = ", ".join(f"tier {t}: {n}" for t, n in res.tiers.items())
            err.print(f"submitted job {res.job_id}: {res.tasks} tasks ({tiers})")
            click.echo(res.job_id)
        return
    if not as_json:
        err.print(f"submitted job {res.job_id}: {res.tasks} tasks (Ctrl-C stops waiting, not the job)")
    st = _wait(ctx, broker, res.job_id, quiet=as_json)
    if as_json:
        emit_json(st.model_dump(mode="json"))
    else:
        click.echo(f"{st.job_id} {st.status}")
    exit_for(ctx, st)


@main.command()
@click.argument("job_id")
@click.option(
    "--watch", is_flag=True, help="Follow the job to its end with a progress bar; exit 1 if it did not succeed."
)
@url_option
@json_option
@click.pass_context
def status(ctx: click.Context, job_id: str, watch: bool, url: str | None, as_json: bool) -> None:
    """Show a job's status and task counts, and which queued tasks no live worker may run."""
    broker = connect(ctx, url)
    st = _wait(ctx, broker, job_id, quiet=as_json) if watch else broker.job_status(job_id, waiting=True)
    if as_json:
        emit_json(st.model_dump(mode="json"))
    elif not watch:
        click.echo(render.status_line(st) + (f"  [{st.name}]" if st.name else ""))
        for w in st.waiting_for:
            click.echo("  " + render.waiting_line(w))
    if watch:
        exit_for(ctx, st)


@main.command()
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 10_000))
@url_option
@json_option
@click.pass_context
def jobs(ctx: click.Context, limit: int, url: str | None, as_json: bool) -> None:
    """List recent jobs, newest first."""
    rows = connect(ctx, url).jobs(limit)
    if as_json:
        emit_json([r.model_dump(mode="json") for r in rows])
    else:
        render.out().print(render.jobs_table(rows))


@main.command()
@click.argument("job_id")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "jsonl", "csv"]), default="table", show_default=True,
              help="table for people; json, jsonl or csv for programs.")  # fmt: skip
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    help="Write to FILE instead of stdout.",
)
@url_option
@click.pass_context
def results(ctx: click.Context, job_id: str, fmt: str, output: Path | None, url: str | None) -> None:
    """Print a job's per-task results in payload order."""
    rows = connect(ctx, url).results(job_id)
    if fmt == "table":
        if output:
            raise UsageError("--output needs --format json, jsonl or csv")
        render.out().print(render.results_table(rows))
        return
    text = render.results_text(rows, fmt)
    if output:
        output.write_text(text)
        err.print(f"wrote {len(rows)} results to {output}")
    else:
        click.echo(text, nl=False)


@main.command()
@url_option
@json_option
@click.pass_context
def workers(ctx: click.Context, url: str | None, as_json: bool) -> None:
    """List live workers with their device, score and tier."""
    rows = connect(ctx, url).workers()
    if as_json:
        emit_json([r.model_dump(mode="json") for r in rows])
    else:
        render.out().print(render.workers_table(rows))


@main.command()
@click.option(
    "--interval", default=1.0, show_default=True, type=click.FloatRange(min=0.1), help="Seconds between refreshes."
)
@click.option("--once", is_flag=True, help="Print one snapshot and exit (the default when stdout is not a terminal).")
@url_option
@click.pass_context
def top(ctx: click.Context, interval: float, once: bool, url: str | None) -> None:
    """A live view of the workers (tier, score, current task) and the recent jobs. Ctrl-C quits."""
    from rich.live import Live

    broker = connect(ctx, url)
    console = render.out()
    view = lambda: render.top_view(broker.workers(), broker.jobs(15))  # noqa: E731
    if once or not console.is_terminal:
        console.print(view())
        return
    try:
        with Live(view(), console=console, refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(interval)
                live.update(view())
    except KeyboardInterrupt:
        pass


@main.command()
@click.argument("target", metavar="JOB|TASK")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until the job or task ends.")
@url_option
@click.pass_context
def logs(ctx: click.Context, target: str, follow: bool, url: str | None) -> None:
    """Print the output of a task, or of every task of a job: its stdout to stdout, stderr to stderr."""
    broker = connect(ctx, url)
    cursors: dict[str, str] = {}
    try:
        while True:
            ended = not follow or broker.target_ended(target)  # read before the lines: none is missed
            for tid, stream, line in broker.logs(target, cursors):
                prefix = f"[{tid}] " if tid != target else ""
                if stream == "gpumesh":
                    click.echo(f"{prefix}--- {line} ---", err=True)
                else:
                    click.echo(f"{prefix}{line}", err=stream == "stderr")
            if ended:
                return
            time.sleep(0.5)
    except KeyboardInterrupt:
        ctx.exit(130)


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
        click.echo(render.status_line(st))


@main.command()
@click.argument("job_id")
@click.option("--wait", is_flag=True, help="Follow the job to its end; exit 1 if it did not succeed.")
@url_option
@json_option
@click.pass_context
def retry(ctx: click.Context, job_id: str, wait: bool, url: str | None, as_json: bool) -> None:
    """Re-queue the failed tasks of a job, each with a fresh set of attempts."""
    broker = connect(ctx, url)
    n, st = broker.retry(job_id)
    if not as_json:
        err.print(f"re-queued {n} failed task(s) of {job_id}" if n else f"job {job_id} has no failed task to retry")
    if wait and n:
        st = _wait(ctx, broker, job_id, quiet=as_json)
    if as_json:
        emit_json({"requeued": n, **st.model_dump(mode="json")})
    else:
        click.echo(render.status_line(st))
    if wait:
        exit_for(ctx, st)


# The other commands live next door and register themselves on `main` when imported.
from . import cli_admin, cli_mesh  # noqa: E402, F401

if __name__ == "__main__":
    main()
