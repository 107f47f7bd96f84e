"""``gpumesh worker``, ``join``, ``serve`` and ``run``: the commands that start parts of a mesh."""

from __future__ import annotations

import logging
import re
import sys
import threading
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import click

from gpumesh.cli import render
from gpumesh.cli.helpers import (
    connect,
    err,
    exit_for,
    job_options,
    json_option,
    project_options,
    resolve_job,
    url_option,
)
from gpumesh.errors import UsageError
from gpumesh.settings import Settings
from gpumesh.store import reaper

SERVE_PORT = 6390  # `gpumesh serve`'s port, and what `join HOST` dials when HOST has none

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
                "--log-level",
                default="INFO",
                show_default=True,
                type=click.Choice(["DEBUG", "INFO", "WARNING"]),
                help="How much the worker logs.",
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
                metavar="KEY",
                help="Run only tasks signed by this public key: a .pub file or an inline ed25519:BASE64 key, as "
                "serve's worker line pins it (repeatable; also GPUMESH_TRUSTED_KEYS). Trust never comes from Redis.",
            ),
            click.option(
                "--sandbox-user",
                metavar="USER",
                help="Run tasks as this user (the worker must run as root), out of reach of the worker's "
                "environment, command line and files.",
            ),
            click.option(
                "--no-isolation",
                "no_isolation",
                is_flag=True,
                help="Do not confine tasks with Landlock (on by default where the kernel has it; also "
                "GPUMESH_ISOLATION=false): a task can then read whatever the worker's user can.",
            ),
            click.option(
                "--read-path",
                "read_path",
                multiple=True,
                metavar="PATH",
                help="Under isolation, let tasks read PATH too, e.g. a dataset or model cache (repeatable; "
                "also GPUMESH_READ_PATHS).",
            ),
            click.option(
                "--write-path",
                "write_path",
                multiple=True,
                metavar="PATH",
                help="Under isolation, let tasks write PATH too (repeatable; also GPUMESH_WRITE_PATHS). Every "
                "job's tasks share it: not for caches on a mesh with several submitters (see --cache-path).",
            ),
            click.option(
                "--cache-path",
                "cache_path",
                multiple=True,
                metavar="PATH",
                help="Under isolation, a cache tasks read (a Hugging Face or torch hub cache you fill yourself, its own "
                "folder: ~/.cache/huggingface/hub, never a folder that holds a login token, which is refused): "
                "each attempt sees it through an overlay of its own, whose writes go when the attempt ends, so no "
                "job leaves code there for another (repeatable; also GPUMESH_CACHE_PATHS).",
            ),
            click.option(
                "--warm/--fresh",
                default=True,
                show_default=True,
                help="warm: fork each attempt from a zygote that started Python (and --preload) once: the same "
                "sandbox, none of the start-up cost. fresh: a new interpreter for each attempt, for scripts "
                "that must not share the zygote's imported modules or sys.path (docs/explanation/warm-and-fresh.md).",
            ),
            click.option(
                "--preload",
                metavar="MODULES",
                help="Modules the warm zygote imports once, e.g. torch,numpy (never initialises CUDA).",
            ),
            click.option(
                "--resource",
                "resource",
                multiple=True,
                metavar="KEY=VALUE",
                help="Declare a resource tasks may require (repeatable), next to what the probe finds (device, "
                "gpu or cpu, vram_gb, vram_free_gb, cpu_cores, ram_gb, task_memory_gb) and overriding it, e.g. "
                "--resource vram_gb=80 --resource dataset=imagenet. Names are case-sensitive.",
            ),
            click.option(
                "--lend",
                "lend",
                multiple=True,
                metavar="WHEN",
                help="When this machine takes work: always (default); idle[=MIN] (nobody used its keyboard, mouse "
                "or terminals for MIN minutes, 5 by default); HH:MM-HH:MM (local time; repeat for more windows); "
                "gpu-free (no process but the worker's uses the GPU). Repeatable: all must allow. Paused, it takes "
                "no task, and a running one gets SIGTERM, GPUMESH_STOP_GRACE seconds, then SIGKILL, and goes back "
                "to the queue without spending an attempt.",
            ),
            click.option(
                "--pause-when",
                "pause_when",
                multiple=True,
                metavar="CMD",
                help="Pause while the shell command CMD exits 0, e.g. --pause-when 'pgrep -x steam' (repeatable). "
                "A probe that fails or hangs counts as paused.",
            ),
            click.option(
                "--max-vram-gb",
                type=click.FloatRange(min=0, min_open=True),
                help="At most this much GPU memory per task: published as vram_gb (tasks that require more go "
                "elsewhere), given to tasks as GPUMESH_MAX_VRAM_GB, and a task that uses more is killed.",
            ),
            click.option(
                "--cpu-cores",
                type=click.IntRange(min=1),
                help="Run the worker and its tasks on this many of the machine's cores (CPU affinity).",
            ),
            click.option(
                "--max-task-hours",
                type=click.FloatRange(min=0, min_open=True),
                help="Take no task whose job's timeout is longer than this many hours.",
            ),
            click.option(
                "--accept-from",
                metavar="NAME,...",
                help="Run only jobs submitted with these credentials (their names in `gpumesh access list`).",
            ),
            click.option(
                "--checkpoint-every",
                type=click.FloatRange(min=0),
                metavar="SEC",
                help="Save each task's GPUMESH_CHECKPOINT_DIR this often, besides when the task asks "
                "(gpumesh.checkpoint()) and when it is stopped (also GPUMESH_CHECKPOINT_EVERY; 0: off, the default).",
            ),
            click.option(
                "--no-envs",
                "no_envs",
                is_flag=True,
                help="Run only jobs without an environment, in this worker's own Python: never build one "
                "(also GPUMESH_ENVS=false).",
            ),
            click.option(
                "--env-cache",
                "env_cache",
                metavar="DIR",
                help="Where this machine's workers build and share environments (also GPUMESH_ENV_CACHE; its "
                "size: GPUMESH_ENV_CACHE_MB). See `gpumesh envs`.",
            ),
            click.option(
                "--allow-builds",
                "allow_builds",
                is_flag=True,
                help="Let an environment run packages' build code (sdists) on this machine, for jobs submitted "
                "with --allow-builds; by default only wheels whose hashes match the lock install.",
            ),
            click.option("--exit-with-parent", type=int, hidden=True),
        ]
    ):
        f = option(f)
    return f


def _run_worker(ctx: click.Context, url: str | None, opts: dict[str, Any]) -> None:
    """Parse the worker flags and hand over to gpumesh.worker.build, which assembles and runs the worker."""
    from gpumesh import logfmt
    from gpumesh.worker import build

    logfmt.setup(opts["log_level"], opts["log_format"])
    options = build.WorkerOptions(
        name=opts["name"], score=opts["score"], rebench=opts["rebench"], burst=opts["burst"],
        trust=tuple(opts["trust"]), sandbox_user=opts["sandbox_user"], warm=opts["warm"], preload=opts["preload"],
        resources=tuple(opts["resource"]), exit_with_parent=opts["exit_with_parent"], gpus=opts["gpus"],
        log_level=opts["log_level"], log_format=opts["log_format"],
        rq_logging_level=logging.getLevelName(logging.getLogger("rq").level),
        lend=tuple(opts["lend"]), pause_when=tuple(opts["pause_when"]), max_vram_gb=opts["max_vram_gb"],
        cpu_cores=opts["cpu_cores"], max_task_hours=opts["max_task_hours"], accept_from=opts["accept_from"],
    )  # fmt: skip
    from gpumesh.requirements import parse_resource

    for r in options.resources:  # a bad --resource is a usage error before anything connects
        parse_resource(r)
    if options.name is not None and not WORKER_NAME.fullmatch(options.name):
        raise UsageError(
            f"--name {options.name!r}: a worker's name is 1 to 64 letters, digits and . _ - @ + : (starting with a "
            "letter or digit), as others' terminals and pages show it; e.g. --name lab-a100"
        )
    _isolation_flags(opts)
    build.lender_limits(options)  # a bad --lend or limit is a usage error before anything connects
    code = build.run(connect(ctx, url, worker=True), options)
    if code:
        ctx.exit(code)


# What a worker may call itself: plain characters (no control, no markup, no space), as a host name would be.
WORKER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+:-]{0,63}")


def _isolation_flags(opts: dict[str, Any]) -> None:
    """--no-isolation, --read-path, --write-path, --cache-path: as the settings they stand for (flags over the environment),
    so that the worker's settings, and the per-GPU workers that --gpus starts, see them."""
    import os

    for path in (*opts["read_path"], *opts["write_path"]):
        if not os.path.exists(path):
            raise UsageError(f"--read-path/--write-path {path}: no such file or directory")
    for path in opts["cache_path"]:
        if not os.path.isdir(path):
            raise UsageError(f"--cache-path {path}: no such directory; make it (and fill it) first")
        if any(c in os.path.abspath(path) for c in ",:\\"):
            raise UsageError(f"--cache-path {path}: a cache's path may not hold ',', ':' or '\\'; link it elsewhere")
    if opts["no_isolation"]:
        os.environ["GPUMESH_ISOLATION"] = "false"
    if opts.get("checkpoint_every") is not None:  # a setting, so that the per-GPU workers see it too
        os.environ["GPUMESH_CHECKPOINT_EVERY"] = repr(opts["checkpoint_every"])
    if opts.get("no_envs"):
        os.environ["GPUMESH_ENVS"] = "false"
    if opts.get("allow_builds"):
        os.environ["GPUMESH_ALLOW_BUILDS"] = "true"
    if opts.get("env_cache"):
        os.environ["GPUMESH_ENV_CACHE"] = os.path.abspath(opts["env_cache"])
    for flag, var in (
        ("read_path", "GPUMESH_READ_PATHS"), ("write_path", "GPUMESH_WRITE_PATHS"), ("cache_path", "GPUMESH_CACHE_PATHS")
    ):  # fmt: skip
        paths = [os.path.abspath(p) for p in opts[flag]]
        if paths:
            os.environ[var] = os.pathsep.join([*paths, *([os.environ[var]] if os.environ.get(var) else [])])


@click.command()
@click.argument("broker_url", metavar="[URL]", required=False)
@worker_options
@url_option
@click.pass_context
def worker(ctx: click.Context, /, broker_url: str | None, url: str | None, **opts: Any) -> None:
    """Benchmark this machine, join the mesh at URL and run tasks until stopped.

    The benchmark runs once per machine and is cached; --score skips it. SIGTERM or Ctrl-C
    finishes the current task and exits; a second one, a second or more later, hands the task
    back to the queue at once.
    Tuning: GPUMESH_LEASE_TTL (30 s), GPUMESH_HEARTBEAT_INTERVAL (5 s), GPUMESH_TIERS (3).

    Lending (docs/how-to/lend-a-machine.md), for example:

    \b
      gpumesh worker URL --lend 22:00-07:00 --lend idle=10
      gpumesh worker URL --lend gpu-free --max-vram-gb 12 --cpu-cores 4
      gpumesh worker URL --pause-when 'pgrep -x steam' --max-task-hours 2 --accept-from alice,bob

    `gpumesh lent` then lists what ran here.

    Jobs with packages (docs/environments.md): the worker builds a job's environment with uv before it
    takes the job's tasks (once per machine; `gpumesh workers` shows "preparing env … for JOB"), from
    the index its own uv settings name, wheels only, as the --sandbox-user when there is one:

    \b
      UV_INDEX_URL=https://pypi.internal/simple gpumesh worker URL --env-cache /srv/gpumesh-envs
      gpumesh worker URL --no-envs             # only jobs without packages, in this Python
    """
    _run_worker(ctx, broker_url or url, opts)


@click.command()
@click.argument("address", metavar="HOST:PORT")
@click.option(
    "--token",
    required=True,
    help="The worker credential: PASSWORD (user `worker`) or USER:PASSWORD (from `gpumesh access add`).",
)
@click.option(
    "--ca-fingerprint",
    metavar="sha256:HEX",
    help="For a `serve --tls` broker: its CA's fingerprint (printed by serve). Implies rediss://.",
)
@worker_options
@click.pass_context
def join(ctx: click.Context, /, address: str, token: str, ca_fingerprint: str | None, **opts: Any) -> None:
    """Join the mesh at HOST:PORT with a token: `gpumesh worker` in the original tool's form.

    Same as `gpumesh worker redis://worker:TOKEN@HOST:PORT/0` (a TOKEN of the form USER:PASSWORD, from
    `gpumesh access add`, keeps its user); a redis:// or rediss:// ADDRESS keeps its scheme. With
    --ca-fingerprint: `gpumesh worker rediss://worker:TOKEN@HOST:PORT/0?ca_fingerprint=sha256:HEX`.
    A `gpumesh serve` broker signs its jobs: pass its --trust ed25519:... key as its worker line does.
    """
    scheme, rest = ("redis", address)
    if "://" in address:
        scheme, rest = address.split("://", 1)
    hostport = urlsplit(f"//{rest}").netloc.rsplit("@", 1)[-1]
    if not hostport:
        raise UsageError(f"join needs HOST:PORT, got {address!r}")
    try:
        port = urlsplit(f"//{hostport}").port
    except ValueError:
        raise UsageError(f"join needs HOST:PORT with a number for PORT, got {address!r}") from None
    if port is None:
        hostport += f":{SERVE_PORT}"  # what `gpumesh serve` listens on unless told otherwise
    query = ""
    if ca_fingerprint is not None:
        from gpumesh.store import tlspin

        if scheme == "redis" and "://" in address:
            raise UsageError("--ca-fingerprint is for TLS: give rediss://HOST:PORT or plain HOST:PORT")
        scheme, query = "rediss", f"?{tlspin.PARAM}={tlspin.parse_fingerprint(ca_fingerprint)}"
    user, _, password = token.rpartition(":")
    _run_worker(
        ctx, f"{scheme}://{quote(user or 'worker', safe='')}:{quote(password, safe='')}@{hostport}/0{query}", opts
    )


@click.command()
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address to listen on; 0.0.0.0 for every interface."
)
@click.option("--port", default=SERVE_PORT, show_default=True, type=click.IntRange(1, 65535),
              help="Port Redis listens on.")  # fmt: skip
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Jobs, password and logs [~/.local/share/gpumesh/broker].",
)
@click.option(
    "--tls/--no-tls",
    default=None,
    help="TLS only (rediss://), with a CA and server certificate made at the first --tls start and kept in the "
    "data dir; the printed lines pin the CA by fingerprint. Default: as the data dir was last served.",
)
@click.option("--public", is_flag=True, help="Open a public ngrok TCP tunnel (needs the tunnel extra, pyngrok).")
@click.option(
    "--insecure-public",
    is_flag=True,
    help="Allow --public without --tls: the password and all traffic cross the internet in clear.",
)
@click.option("--metrics-port", type=click.IntRange(1, 65535), help="Also export Prometheus metrics on 127.0.0.1:PORT.")
@click.option(
    "--fsync",
    type=click.Choice(["always", "everysec"]),
    default="always",
    show_default=True,
    help="When the append-only file reaches the disk. always: before Redis replies, so a crash loses no "
    "acknowledged lease or result (a few ms more per task). everysec: once a second; a crash may lose the "
    "last second or two of them, and the tasks whose results are lost run again.",
)
@click.option(
    "--no-sign", is_flag=True,
    help="Print lines for unsigned jobs (no --trust, no --sign-key): then any credential that can write to "
    "Redis, a worker's included, can run code on every worker. Not recommended.",
)  # fmt: skip
@log_format_option
@click.pass_context
def serve(
    ctx: click.Context,
    host: str,
    port: int,
    data_dir: Path | None,
    tls: bool | None,
    public: bool,
    insecure_public: bool,
    metrics_port: int | None,
    log_format: str,
    no_sign: bool = False,
    fsync: str = "always",
) -> None:
    """Start a broker for the mesh: Redis with a generated password, kept across restarts.

    It listens on 127.0.0.1 unless --host says otherwise, persists jobs in an append-only file,
    never evicts queue data, prints the lines to copy on other machines, runs the reaper, and stops
    Redis cleanly on Ctrl-C (killed hard, it takes Redis with it on Linux; a serve on the same
    --data-dir stops one a killed serve left running, and says so). Run it again with the same
    --data-dir to keep jobs and password.
    With --tls the lines are rediss://...?ca_fingerprint=sha256:...: a client fetches the broker's CA,
    checks it against the fingerprint before sending anything, and caches it.

    Jobs are signed by default: at first start serve makes a job-signing key pair in the data dir
    (signing.key, mode 0600, and signing.pub). The submit line signs with the private key (copy it to
    submit from another machine; GPUMESH_SIGNING_KEY or signing_key in the config file sign every
    submit without --sign-key); the worker line pins the public
    key inline (--trust ed25519:...), so a worker never takes trust from Redis and runs only jobs signed
    with it. serve also registers the result key of the `worker` credential in the broker, which
    `gpumesh results` verifies results with. --no-sign prints unsigned lines.
    """
    from gpumesh import logfmt
    from gpumesh.server.serve import ServeOptions, serving

    logfmt.setup("INFO", log_format)
    opts = ServeOptions(
        host=host,
        port=port,
        data_dir=data_dir,
        tls=tls,
        public=public,
        insecure_public=insecure_public,
        metrics_port=metrics_port,
        no_sign=no_sign,
        fsync=fsync,
    )
    stop = threading.Event()
    with serving(opts, stop) as served:
        for warning in served.warnings:
            err.print(warning, style="bold red")
        click.echo("\n".join(served.lines), nl=True)
        sys.stdout.flush()
        reaper.reap_until(served.broker, stop, served.settings.heartbeat_interval)
        err.print("stopping the broker (append-only file flushed)")


@click.command()
@click.argument("script", required=False)
@click.option("--payloads", "payloads_spec", metavar="FILE|-", help="JSON list of payload objects.")
@click.option(
    "--local", "workers", default=2, show_default=True, type=click.IntRange(1, 64), help="Local workers to start."
)
@job_options
@project_options
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json", "jsonl", "csv"]),
    default="table",
    show_default=True,
    help="table for people; json, jsonl or csv for programs.",
)
@json_option
@click.pass_context
def run(
    ctx: click.Context, /, script: str | None, payloads_spec: str | None, workers: int, fmt: str, as_json: bool,
    job_file: Path | None, **opts: Any,
) -> None:  # fmt: skip
    """Run SCRIPT on a private local mesh: a broker and N workers on this machine, one command.

    Prints the results and exits with the job's code (0 done, 1 failed or cancelled). Everything it
    started is stopped on the way out.
    """
    from gpumesh.server.local import LocalMesh

    got = resolve_job(ctx, script, payloads_spec, job_file, opts, Settings.load())
    fmt = "json" if as_json else fmt
    with LocalMesh(workers, Settings.load()) as mesh:
        broker = mesh.broker
        assert broker is not None
        err.print(f"local mesh: private broker and {workers} worker(s) up")
        res = broker.submit(got.source, got.name, got.payloads, got.options, project=got.project, siblings=got.siblings)
        if got.project is not None:
            err.print(got.project.summary(), markup=False, highlight=False)
        try:
            st = render.follow(lambda: broker.job_status(res.job_id), quiet=as_json)
        except KeyboardInterrupt:
            err.print("interrupted: stopping the local mesh")
            ctx.exit(130)
        rows = broker.results(res.job_id)
    if fmt == "table":
        render.out().print(render.results_table(rows))
    else:
        click.echo(render.results_text(rows, fmt), nl=False)
    exit_for(ctx, st)
