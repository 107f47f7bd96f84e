"""The ``gpumesh`` command: thin Click commands over the Python API (broker, worker, server, local).

Data goes to stdout, progress and errors to stderr. Exit codes: 0 ok · 1 job ended failed/cancelled ·
2 bad usage or input · 3 broker unreachable or refused the credentials · 4 not found.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import click
import redis

from . import __version__, render
from .broker import Broker, mask_url, translate
from .errors import BrokerError, GpumeshError, NotFound, UsageError
from .models import JobOptions, JobStatus, parse_payloads
from .settings import Settings, config_path

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


# -- running a mesh --------------------------------------------------------------------------------


log_format_option = click.option(
    "--log-format", default="text", show_default=True, type=click.Choice(["text", "json"]),
    help="json: one JSON object per line, for containers and journals.",
)  # fmt: skip


def worker_options(f: Any) -> Any:
    for option in reversed(
        [
            click.option("--name", help="Name shown in `gpumesh workers` (default: the hostname)."),
            click.option(
                "--score", type=click.FloatRange(min=0, min_open=True), help="Skip the benchmark; use this GFLOP/s."
            ),
            click.option("--rebench", is_flag=True, help="Benchmark again instead of using the cached score."),
            click.option("--burst", is_flag=True, help="Exit when the queues are empty instead of waiting for work."),
            click.option(
                "--log-level", default="INFO", show_default=True, type=click.Choice(["DEBUG", "INFO", "WARNING"])
            ),
            log_format_option,
            click.option(
                "--gpus",
                metavar="all|none|0,1",
                help="One worker process per GPU, each pinned with CUDA_VISIBLE_DEVICES, under a supervisor "
                "that restarts a crashed one. none: one CPU-only worker.",
            ),
            click.option(
                "--trust",
                "trust",
                multiple=True,
                type=click.Path(dir_okay=False, path_type=Path),
                help="Run only tasks signed by this public key (repeatable; also GPUMESH_TRUSTED_KEYS).",
            ),
            click.option(
                "--sandbox-user",
                metavar="USER",
                help="Run tasks as this user (the worker must run as root), out of reach of the worker's "
                "environment, command line and files.",
            ),
            click.option("--exit-with-parent", type=int, hidden=True),
        ]
    ):
        f = option(f)
    return f


def _run_worker(ctx: click.Context, url: str | None, opts: dict[str, Any]) -> None:
    from . import capability, logfmt
    from .worker import MeshWorker

    logfmt.setup(opts["log_level"], opts["log_format"])
    broker = connect(ctx, url)
    if opts["gpus"] is not None:
        _supervise(ctx, broker, opts)
        return
    trusted = [*opts["trust"], *[Path(p) for p in broker.settings.trusted_keys.split(",") if p.strip()]]
    verifier = None
    if trusted:
        from .signing import Verifier

        verifier = Verifier(trusted)
    sandbox_user = _sandbox_user(opts["sandbox_user"], broker.settings.sandbox_python or sys.executable)
    cap = capability.probe(broker.settings.cache_dir, refresh=opts["rebench"], score=opts["score"])
    w = MeshWorker(
        broker, cap, name=opts["name"], cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        parent_pid=opts["exit_with_parent"], verifier=verifier, sandbox_user=sandbox_user,
    )  # fmt: skip
    w.work(burst=opts["burst"], logging_level=logging.getLevelName(logging.getLogger("rq").level))
    if w.fatal:
        raise BrokerError(w.fatal)


def _sandbox_user(name: str | None, python: str) -> tuple[int, int] | None:
    if not name:
        return None
    import pwd

    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise UsageError(f"--sandbox-user: no user named {name!r} on this machine") from None
    if os.geteuid() != 0:
        raise UsageError("--sandbox-user needs the worker to run as root (it switches to that user for each task)")
    if entry.pw_uid == 0:
        raise UsageError("--sandbox-user must not be root")
    try:
        ok = subprocess.run(
            [python, "-c", "import json, ctypes, resource"], user=entry.pw_uid, group=entry.pw_gid, extra_groups=[],
            capture_output=True, cwd="/",
        ).returncode == 0  # fmt: skip
    except OSError:
        ok = False
    if not ok:
        raise UsageError(
            f"--sandbox-user {name} cannot run {python} (it must be able to read the interpreter and its "
            "libraries); install Python where that user can read it and set GPUMESH_SANDBOX_PYTHON"
        )
    return entry.pw_uid, entry.pw_gid


def _supervise(ctx: click.Context, broker: Broker, opts: dict[str, Any]) -> None:
    import socket

    from .supervisor import Supervisor, parse_gpus

    gpus = parse_gpus(opts["gpus"])
    args = [broker.url, "--log-level", opts["log_level"], "--log-format", opts["log_format"]]
    args += ["--score", str(opts["score"])] if opts["score"] else []
    args += ["--rebench"] if opts["rebench"] else []
    args += ["--burst"] if opts["burst"] else []
    args += [a for path in opts["trust"] for a in ("--trust", str(path))]
    args += ["--sandbox-user", opts["sandbox_user"]] if opts["sandbox_user"] else []
    sup = Supervisor(gpus, args, opts["name"] or socket.gethostname(), restart=not opts["burst"])
    ctx.exit(sup.run())


@main.command()
@click.argument("broker_url", metavar="[URL]", required=False)
@worker_options
@url_option
@click.pass_context
def worker(ctx: click.Context, broker_url: str | None, url: str | None, **opts: Any) -> None:
    """Benchmark this machine, join the mesh at URL and run tasks until stopped.

    The benchmark runs once per machine and is cached; --score skips it. SIGTERM or Ctrl-C
    finishes the current task and exits; a second one hands the task back to the queue at once.
    Tuning: GPUMESH_LEASE_TTL (30 s), GPUMESH_HEARTBEAT_INTERVAL (5 s), GPUMESH_TIERS (3).
    """
    _run_worker(ctx, broker_url or url, opts)


@main.command()
@click.argument("address", metavar="HOST:PORT")
@click.option(
    "--token",
    required=True,
    help="The worker credential: PASSWORD (user `worker`) or USER:PASSWORD (from `gpumesh access add`).",
)
@worker_options
@click.pass_context
def join(ctx: click.Context, address: str, token: str, **opts: Any) -> None:
    """Join the mesh at HOST:PORT with a token: `gpumesh worker` in the original tool's form.

    Same as `gpumesh worker redis://:TOKEN@HOST:PORT/0`; a redis:// or rediss:// ADDRESS keeps its scheme.
    """
    scheme, rest = ("redis", address)
    if "://" in address:
        scheme, rest = address.split("://", 1)
    hostport = urlsplit(f"//{rest}").netloc.rsplit("@", 1)[-1]
    if not hostport:
        raise UsageError(f"join needs HOST:PORT, got {address!r}")
    user, _, password = token.rpartition(":")
    _run_worker(ctx, f"{scheme}://{quote(user or 'worker', safe='')}:{quote(password, safe='')}@{hostport}/0", opts)


@main.command()
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address to listen on; 0.0.0.0 for every interface."
)
@click.option("--port", default=6390, show_default=True, type=click.IntRange(1, 65535))
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Jobs, password and logs [~/.local/share/gpumesh/broker].",
)
@click.option("--public", is_flag=True, help="Open a public ngrok TCP tunnel (pip install 'gpumesh[tunnel]').")
@click.option("--metrics-port", type=click.IntRange(1, 65535), help="Also export Prometheus metrics on 127.0.0.1:PORT.")
@log_format_option
@click.pass_context
def serve(
    ctx: click.Context,
    host: str,
    port: int,
    data_dir: Path | None,
    public: bool,
    metrics_port: int | None,
    log_format: str,
) -> None:
    """Start a broker for the mesh: Redis with a generated password, kept across restarts.

    It listens on 127.0.0.1 unless --host says otherwise, persists jobs in an append-only file,
    never evicts queue data, prints the lines to copy on other machines, runs the reaper, and stops
    Redis cleanly on Ctrl-C. Run it again with the same --data-dir to keep jobs and password.
    """
    from . import logfmt
    from .server import BrokerServer, default_data_dir, is_loopback, lan_address

    logfmt.setup("INFO", log_format)
    tunnel_url = None
    if public:
        try:
            from pyngrok import ngrok
        except ImportError:
            raise UsageError("--public needs pyngrok: pip install 'gpumesh[tunnel]'") from None
    server = BrokerServer(data_dir or default_data_dir(), host=host, port=port).start()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        settings = Settings.load(url=server.url)
        broker = Broker(settings).ping()
        broker.epoch()
        if metrics_port:
            from .metrics import serve_metrics

            serve_metrics(broker, metrics_port)
            logging.getLogger("gpumesh.serve").info("metrics on http://127.0.0.1:%d/metrics", metrics_port)
        join_host = lan_address() if host in ("0.0.0.0", "::") else ("127.0.0.1" if host == "localhost" else host)
        lines = [f"gpumesh broker listening on {host}:{port}, data in {server.data_dir}"]
        if not is_loopback(host):
            err.print(
                f"[bold red]WARNING: the broker listens on {host}: anyone who can reach port {port} and has the "
                "password can run code on every worker. Keep the password secret; prefer a VPN or TLS.[/]"
            )
        join = server.url_for("worker", join_host)
        submit_url = server.url_for("submitter", join_host)
        if public:
            tunnel = ngrok.connect(port, "tcp")
            public_host, public_port = urlsplit(tunnel.public_url).netloc.rsplit(":", 1)
            tunnel_url = server.url_for("worker", public_host, int(public_port))
            submit_url = server.url_for("submitter", public_host, int(public_port))
            err.print(
                "[bold red]WARNING: the broker is now reachable from the whole internet at "
                f"{public_host}:{public_port}. Whoever has the join line can run code on your workers. "
                "Redis traffic through the tunnel is not encrypted; use TLS (rediss://) for anything private.[/]"
            )
        lines += [
            "",
            "Join a worker on another machine:",
            f"  gpumesh worker '{tunnel_url or join}'",
            "Submit a job:",
            f"  gpumesh submit examples/grid_search.py --payloads examples/payloads.json --url '{submit_url}' --wait",
            "",
            "A credential per person (revocable): gpumesh access add NAME",
            f"Admin URL: in {server.data_dir / 'credentials.json'} (mode 0600)",
        ]
        if tunnel_url:
            lines += ["On this machine or its LAN:", f"  gpumesh worker '{join}'"]
        click.echo("\n".join(lines), nl=True)
        sys.stdout.flush()
        while not stop.wait(settings.heartbeat_interval):
            try:
                report = broker.reap_once()
                if any(report.values()):
                    logging.getLogger("gpumesh.serve").info("reaper: %s", report)
            except redis.RedisError as exc:
                logging.getLogger("gpumesh.serve").warning("reaper: %s", translate(exc, server.url))
        err.print("stopping the broker (append-only file flushed)")
        broker.close()
    finally:
        if tunnel_url:
            ngrok.kill()
        server.stop()


@main.command()
@click.argument("script")
@click.option("--payloads", "payloads_spec", required=True, metavar="FILE|-", help="JSON list of payload objects.")
@click.option(
    "--local", "workers", default=2, show_default=True, type=click.IntRange(1, 64), help="Local workers to start."
)
@click.option("--name", default="", help="A name for the job.")
@click.option("--timeout", type=float, default=3600, show_default=True, help="Seconds per attempt.")
@click.option("--max-attempts", type=int, default=3, show_default=True, help="Attempts per task before it fails.")
@click.option(
    "--format", "fmt", type=click.Choice(["table", "json", "jsonl", "csv"]), default="table", show_default=True
)
@json_option
@click.pass_context
def run(
    ctx: click.Context, script: str, payloads_spec: str, workers: int, fmt: str, as_json: bool, **opts: Any
) -> None:
    """Run SCRIPT on a private local mesh: a broker and N workers on this machine, one command.

    Prints the results and exits with the job's code (0 done, 1 failed or cancelled). Everything it
    started is stopped on the way out.
    """
    from .local import LocalMesh

    source, payloads, options = _job_input(script, payloads_spec, opts)
    fmt = "json" if as_json else fmt
    with LocalMesh(workers, Settings.load()) as mesh:
        assert mesh.broker is not None
        err.print(f"local mesh: private broker and {workers} worker(s) up")
        res = mesh.broker.submit(source, Path(script).name, payloads, options)
        try:
            st = render.follow(lambda: mesh.broker.job_status(res.job_id), quiet=as_json)  # type: ignore[union-attr]
        except KeyboardInterrupt:
            err.print("interrupted: stopping the local mesh")
            ctx.exit(130)
        rows = mesh.broker.results(res.job_id)
    if fmt == "table":
        render.out().print(render.results_table(rows))
    else:
        click.echo(render.results_text(rows, fmt), nl=False)
    exit_for(ctx, st)


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
        options = JobOptions(name=opts["name"], timeout=opts["timeout"], max_attempts=opts["max_attempts"])
    except ValueError as exc:
        first = exc.errors()[0]  # type: ignore[attr-defined]
        raise UsageError(f"--{str(first['loc'][0]).replace('_', '-')}: {first['msg']}") from None
    return source, payloads, options


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
@click.option("--name", default="", help="A name for the job.")
@click.option("--timeout", type=float, default=3600, show_default=True, help="Seconds per attempt.")
@click.option("--max-attempts", type=int, default=3, show_default=True, help="Attempts per task before it fails.")
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
    (JSON). Payloads may carry "cost" (a positive number) so heavy tasks go to strong workers.
    Everything is checked before anything is written; the job appears whole or not at all.
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
    """Show a job's status and task counts."""
    broker = connect(ctx, url)
    st = _wait(ctx, broker, job_id, quiet=as_json) if watch else broker.job_status(job_id)
    if as_json:
        emit_json(st.model_dump(mode="json"))
    elif not watch:
        click.echo(render.status_line(st) + (f"  [{st.name}]" if st.name else ""))
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


def _admin(data_dir: Path | None, url: str | None) -> redis.Redis:
    from .server import default_data_dir

    if url is None:
        d = data_dir or default_data_dir()
        try:
            creds = json.loads((d / "credentials.json").read_text())
            conf = dict(line.split(" ", 1) for line in (d / "redis.conf").read_text().splitlines() if " " in line)
        except FileNotFoundError:
            raise UsageError(f"no broker data in {d}; pass --data-dir (as given to serve) or --url ADMIN_URL") from None
        host = conf["bind"] if conf["bind"] not in ("0.0.0.0", "::") else "127.0.0.1"
        url = f"redis://admin:{quote(creds['admin'], safe='')}@{host}:{conf['port']}/0"
    client = redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=3)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise translate(exc, url) from None
    return client


@main.group()
def keys() -> None:
    """Ed25519 keys for signed jobs: submitters sign, workers started with --trust verify."""


@keys.command("generate")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path), default=".", show_default=True)
@click.option("--name", default="gpumesh-signing", show_default=True)
def keys_generate(directory: Path, name: str) -> None:
    """Write NAME.key (private, mode 0600: keep it with the submitters) and NAME.pub (for the workers)."""
    from .signing import generate

    priv, pub = generate(directory, name)
    click.echo(f"{priv}\n{pub}")
    err.print(f"submit with --sign-key {priv}; start workers with --trust {pub}")


@main.group()
def access() -> None:
    """Per-person worker credentials on a broker that `gpumesh serve` runs (run it on that machine)."""


access_options = [
    click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), help="serve's data dir [default]."),
    click.option("--url", metavar="ADMIN_URL", help="The admin URL instead of reading it from the data dir."),
]


def _access_opts(f: Any) -> Any:
    for option in reversed(access_options):
        f = option(f)
    return f


@access.command("add")
@click.argument("name")
@click.option("--host", help="Address workers reach the broker at (default: the admin URL's).")
@_access_opts
def access_add(name: str, host: str | None, data_dir: Path | None, url: str | None) -> None:
    """Create (or rotate) the worker credential of NAME and print their join line."""
    from .server import add_worker, broker_url, worker_user

    admin = _admin(data_dir, url)
    password = add_worker(admin, name)
    kw = admin.connection_pool.connection_kwargs
    click.echo(f"gpumesh worker '{broker_url(password, host or kw['host'], kw['port'], user=worker_user(name))}'")
    err.print(f"revoke with: gpumesh access revoke {name}")


@access.command("revoke")
@click.argument("name")
@_access_opts
def access_revoke(name: str, data_dir: Path | None, url: str | None) -> None:
    """Delete NAME's worker credential; their connected workers are disconnected at once."""
    from .server import revoke_worker

    if not revoke_worker(_admin(data_dir, url), name):
        raise NotFound(f"no worker credential named {name!r}; `gpumesh access list` shows them")
    err.print(f"revoked {name}: their workers are disconnected and cannot reconnect")


@access.command("list")
@_access_opts
def access_list(data_dir: Path | None, url: str | None) -> None:
    """List the per-person worker credentials."""
    from .server import list_workers

    for name in list_workers(_admin(data_dir, url)):
        click.echo(name)


@main.command()
@click.option("--port", default=9464, show_default=True, type=click.IntRange(1, 65535))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@url_option
@click.pass_context
def metrics(ctx: click.Context, port: int, host: str, url: str | None) -> None:
    """Export Prometheus metrics for the mesh: queue depth per tier, live workers per tier and device,
    task outcomes, lease expiries, task durations, broker round trip. Runs until Ctrl-C."""
    from .metrics import serve_metrics

    broker = connect(ctx, url)
    serve_metrics(broker, port, host)
    err.print(f"metrics on http://{host}:{port}/metrics for {broker.url_masked}")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


@main.command()
@json_option
def bench(as_json: bool) -> None:
    """Probe and benchmark this machine (in a child process) and cache the score workers use."""
    from . import capability

    settings = Settings.load()
    if not as_json:
        err.print("benchmarking (matmul, about a second)…")
    cap = capability.probe(settings.cache_dir, refresh=True)
    if as_json:
        emit_json(cap.model_dump())
    else:
        render.out().print(render.capability_table(cap))


@main.group()
def config() -> None:
    """Write or show the config file that every command reads (mode 0600)."""


@config.command("init")
@click.option("--url", help="The broker URL to store (asked for on a terminal when omitted).")
@click.option("--force", is_flag=True, help="Overwrite an existing config file.")
def config_init(url: str | None, force: bool) -> None:
    """Store the broker URL so commands need no --url or GPUMESH_URL."""
    path = config_path()
    if path.exists() and not force:
        raise UsageError(f"{path} already exists; pass --force to overwrite it")
    if url is None:
        if not sys.stdin.isatty():
            raise UsageError("config init needs --url when not run on a terminal")
        url = click.prompt("Broker URL (redis://:PASSWORD@HOST:PORT/0)", hide_input=True)
    Settings.load(url=url)  # validates it
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"# gpumesh settings; keys as in `gpumesh config show`\nurl = {json.dumps(url)}\n")
    os.chmod(path, 0o600)
    err.print(f"wrote {path} (mode 0600) for {mask_url(url)}")


@config.command("show")
@json_option
def config_show(as_json: bool) -> None:
    """Print the settings in effect (flags aside), with the password masked."""
    s = Settings.load()
    data = {**s.model_dump(mode="json"), "url": mask_url(s.url), "config_file": str(config_path())}
    if as_json:
        emit_json(data)
    else:
        for k, v in data.items():
            click.echo(f"{k} = {v}")


if __name__ == "__main__":
    main()
