"""What every gpumesh command shares: one-line errors with exit codes, the common options, connecting,
reading a job's input, waiting for a job (like rq's ``rq/cli/helpers.py``)."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from gpumesh import api
from gpumesh.cli import render
from gpumesh.cli.group import Group as Group  # where commands have always found it
from gpumesh.cli.options import emit_json as emit_json
from gpumesh.cli.options import json_option as json_option
from gpumesh.cli.options import url_option as url_option
from gpumesh.errors import UsageError
from gpumesh.models import DEFAULT_RETRY_ON, JobOptions, JobStatus, check_reusable, error_summary, parse_payloads
from gpumesh.settings import Settings
from gpumesh.store.broker import Broker

if TYPE_CHECKING:
    from gpumesh.envs.lock import Lock
    from gpumesh.project import Packed


class _Stderr:
    """The console on stderr (render's), made when first printed to: rich loads then, not with every command."""

    def __getattr__(self, name: str) -> Any:
        return getattr(render._err(), name)


err = _Stderr()
T = TypeVar("T")


def open_mesh(ctx: click.Context, url: str | None) -> api.Mesh:
    """The Python API's Mesh for one command (what the job commands are a thin layer over), closed with it."""
    return api.Mesh(connect(ctx, url))


def connect(ctx: click.Context, url: str | None, worker: bool = False) -> Broker:
    """A broker connection for one command, closed with it. A command gives up on a broker that does not
    answer within seconds (exit 3); a worker's client also waits out its own blocking calls."""
    settings = Settings.load(url=url)
    ctx.obj["url"] = settings.url
    if worker:
        broker = Broker(settings, blocking_timeout=math.ceil(settings.heartbeat_interval))
    else:
        broker = Broker(settings, retries=1, health_check=False)  # a broker that does not answer: exit 3 in ~10 s
    ctx.call_on_close(broker.close)
    return broker.ping(say=lambda line: err.print(line, markup=False))


def exit_for(ctx: click.Context, st: JobStatus) -> None:
    if st.status != "done":
        ctx.exit(1)


def explain_failures(mesh: api.Mesh, st: JobStatus, limit: int = 5) -> None:
    """On stderr, why a job's tasks failed: the first few, each in one line (kind, exception, message),
    and the commands that show the rest."""
    if not st.tasks.failed:
        return
    rows, total = mesh.job(st.job_id).failures(limit)
    for row in rows:
        err.print(f"  task {row.index} failed: {error_summary(row.status, row.error, row.error_kind)}", markup=False)
        err.print(f"    its output: gpumesh logs {row.task_id}", markup=False)
    if total > len(rows):
        err.print(f"  ... and {total - len(rows)} more failed task(s)", markup=False)
    err.print(f"  every task's result and error: gpumesh results {st.job_id}", markup=False)


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


def _flag(field: str) -> str:
    return "--" + {"requires": "require"}.get(field, field).replace("_", "-")


@dataclass
class JobInput:
    """Everything a command that starts a job read and checked before writing anything."""

    source: str
    name: str
    payloads: list[dict[str, Any]]
    options: JobOptions
    project: Packed | None = None
    siblings: tuple[str, ...] = ()
    env: Lock | None = None


def resolve_job(
    ctx: click.Context, script: str | None, payloads_spec: str | None, job_file: Path | None, opts: dict[str, Any],
    settings: Settings,
) -> JobInput:  # fmt: skip
    """A job from flags, or from a job file (``job_file``, or ./gpumesh.toml when no SCRIPT is given) with the
    flags given on the command line overriding it. Nothing is written here."""
    from gpumesh.jobfile import NAME, Spec, load

    spec: Spec | None = None
    if script is None or job_file is not None:
        spec = load(job_file or Path(NAME))

    def given(name: str) -> bool:
        source = ctx.get_parameter_source(name)
        return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")

    if spec is not None:
        j = spec.job
        file_values = {"name": j.name, "timeout": float(j.timeout), "max_attempts": j.max_attempts,
                       "priority": j.priority, "require": tuple(j.requires), "output": tuple(j.outputs),
                       "include": tuple(j.include), "reuse_process": j.reuse_process}  # fmt: skip
        if j.retry_on is not None:
            file_values["retry_on"] = ",".join(j.retry_on)
        for key, value in file_values.items():
            if not given(key):
                opts[key] = value
        if not given("project") and spec.project is not None:
            opts["project"] = str(spec.project)
    script_path = Path(script) if script is not None else spec.script if spec is not None else None
    if script_path is None:
        raise UsageError("give a SCRIPT, or a job file (gpumesh.toml, -f FILE)")
    if payloads_spec is not None:
        payloads = _read_payloads(payloads_spec)
    elif spec is not None:
        payloads = spec.payloads()
    else:
        raise UsageError("--payloads FILE is required (or a job file's job.payloads)")
    source, name = api.script_source(script_path)
    options = api.job_options(
        name=opts["name"], timeout=opts["timeout"], max_attempts=opts["max_attempts"],
        speculate=opts.get("speculate", True), priority=opts.get("priority", 0), requires=opts.get("require", ()),
        retry_on=opts.get("retry_on"), reuse_process=opts.get("reuse_process", False),
        outputs=opts.get("output", ()), preload=_preload(opts, spec), flag=_flag,
    )  # fmt: skip
    if options.reuse_process:
        check_reusable(source, str(script_path))
    project = opts.get("project")
    env = _resolve_env(source, name, spec, opts, project)
    if project is None:
        if opts.get("include"):
            raise UsageError("--include names files of a project: give --project DIR too")
        return JobInput(source, name, payloads, options, None, api.siblings_of(script_path), env)
    packed, name = api.pack_project(script_path, name, project, opts.get("include", ()), settings)
    return JobInput(source, name, payloads, options, packed, env=env)


def _preload(opts: dict[str, Any], spec: Any) -> tuple[str, ...]:
    """--preload (repeatable, each a comma list), else the job file's [env] preload."""
    given = [name for value in opts.get("preload", ()) for name in value.split(",")]
    if given:
        return tuple(given)
    return tuple(spec.env.preload) if spec is not None and spec.env is not None else ()


def _resolve_env(source: str, name: str, spec: Any, opts: dict[str, Any], project: str | None) -> Lock | None:
    """The job's environment, declared by the script's PEP 723 block, the project's pyproject.toml, the job file's
    [env], --requirements and --with; locked here with uv (a resolution that fails is bad input)."""
    from gpumesh.envs import declare, lock

    if opts.get("no_env"):
        return None
    file_env = spec.env if spec is not None else None
    with_ = [*(file_env.dependencies if file_env is not None else []), *opts.get("with_", ())]
    requirements = opts.get("requirements") or (spec.requirements if spec is not None else None)
    python = opts.get("python") or (file_env.python if file_env is not None else "")
    builds = bool(opts.get("allow_builds")) or bool(file_env is not None and file_env.allow_builds)
    declared = declare(
        source, name, with_=with_, requirements=requirements, project=Path(project) if project else None,
        python=python, allow_builds=builds,
    )  # fmt: skip
    return lock(declared, Path(project) if project else None)


def env_options(f: Any) -> Any:
    """--with, --requirements, --python, --allow-builds, --no-env (submit): the job's environment."""
    for option in reversed(
        [
            click.option(
                "--with",
                "with_",
                multiple=True,
                metavar="SPEC",
                help="A package the job's tasks need, e.g. --with 'numpy>=1.26' (repeatable). With a script's "
                "PEP 723 block, --requirements and the project's pyproject.toml it is locked here with uv and "
                "built once on each worker's machine (docs/environments.md).",
            ),  # fmt: skip
            click.option(
                "--requirements",
                type=click.Path(dir_okay=False, exists=True, path_type=str),
                metavar="FILE",
                help="The job's packages from a requirements.txt (or a pylock.toml).",
            ),  # fmt: skip
            click.option(
                "--python",
                "python",
                metavar="SPEC",
                help="The Python the job's environment needs, e.g. '>=3.12' (as requires-python): only workers "
                "that have it take its tasks.",
            ),  # fmt: skip
            click.option(
                "--allow-builds",
                "allow_builds",
                is_flag=True,
                help="Let the environment build packages from source (sdists) on workers started with "
                "--allow-builds too; by default only wheels install, and no package's build code runs.",
            ),  # fmt: skip
            click.option(
                "--preload",
                "preload",
                multiple=True,
                metavar="MODULE",
                help="A module of the job's environment that warm workers import once for the job, before its "
                "tasks, so each task starts with it imported, e.g. --preload numpy --preload mylib.model "
                "(repeatable, or comma-separated). It is imported in a zygote of the job's own, confined as its "
                "tasks are; a preload that fails fails the job's tasks, naming the module.",
            ),  # fmt: skip
            click.option(
                "--no-env",
                "no_env",
                is_flag=True,
                help="Ignore the script's PEP 723 block and the project's dependencies: run in the workers' Python.",
            ),  # fmt: skip
        ]
    ):
        f = option(f)
    return f


def project_options(f: Any) -> Any:
    """--project, --include and --output (submit, run)."""
    for option in reversed(
        [
            click.option(
                "--project",
                type=click.Path(file_okay=False, path_type=str),
                metavar="DIR",
                help="Ship the folder DIR with the job (SCRIPT lies inside it): each task runs in a working "
                "directory holding its files, DIR first on sys.path. .git, virtualenvs, __pycache__, what "
                ".gitignore/.gpumeshignore exclude and secret-looking files stay behind.",
            ),  # fmt: skip
            click.option(
                "--include",
                multiple=True,
                metavar="GLOB",
                help="Send the project's files GLOB names though they look like secrets or are ignored (repeatable).",
            ),  # fmt: skip
            click.option(
                "--output",
                multiple=True,
                metavar="GLOB",
                help="Bring back files the task writes in its working directory that GLOB matches, e.g. "
                "'outputs/*.json' (repeatable; gitignore syntax): artifacts, as GPUMESH_OUTPUT_DIR's files are.",
            ),  # fmt: skip
            click.option(
                "-f",
                "--file",
                "job_file",
                type=click.Path(dir_okay=False, path_type=Path),
                metavar="FILE",
                help="Read the job from FILE (default ./gpumesh.toml when no SCRIPT is given); flags override it.",
            ),  # fmt: skip
        ]
    ):
        f = option(f)
    return f


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
                help="Higher runs first (an integer from -1000000 to 1000000): a worker takes work of the highest "
                "priority it can run. Jobs of equal priority share the workers out, so a small job is not stuck "
                "behind a big one.",
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
                "--retry-on",
                metavar="KINDS",
                default=",".join(DEFAULT_RETRY_ON),
                show_default=True,
                help="Failure kinds retried while attempts remain, comma-separated: script (non-zero exit, "
                "traceback, no JSON result), timeout, memory (over its cap or out of CUDA memory: retried on a "
                "worker with more when one is live), lost (worker or lease lost; a lapsed lease does not spend an "
                "attempt, up to 3 times); or all, none. A script that fails is not run again unless you add "
                "script.",
            ),  # fmt: skip
            click.option(
                "--reuse-process",
                is_flag=True,
                help="Load once, run many: on each worker the job's tasks run one after another in one process "
                "that stays loaded, so what the script loads at module level (a model, a CUDA context) is loaded "
                "once per worker. The script defines main(payload), called for each task, which returns the result "
                "(e.g. gpumesh submit infer.py --payloads p.json --reuse-process). Tasks of the job then see each "
                "other's leftovers in memory and files; other jobs and the host stay isolated (docs/reuse.md).",
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


def patient(call: Callable[[], T], broker: Broker) -> Callable[[], T]:
    """``call`` riding out a broker outage (see gpumesh.api.patient), told on stderr. For the commands
    that follow a job; the others answer at once."""
    return api.patient(call, broker.settings, lambda line: err.print(line))


def stopped_waiting(ctx: click.Context, job_id: str, waiting: bool = True) -> NoReturn:
    """Ctrl-C once the job is written: the job keeps running, and the shell gets 130 (128 + SIGINT)."""
    what = "stopped waiting" if waiting else "interrupted"
    click.echo(f"{what}; job {job_id} keeps running. Follow it with: gpumesh status {job_id} --watch", err=True)
    ctx.exit(130)


def wait_for(ctx: click.Context, broker: Broker, job_id: str, quiet: bool) -> JobStatus:
    try:
        # Each read waits for one of the job's tasks to end (its stream of ends) or a second to pass: no poll.
        return render.follow(patient(broker.follow(job_id), broker), quiet=quiet, interval=0)
    except KeyboardInterrupt:
        stopped_waiting(ctx, job_id)
