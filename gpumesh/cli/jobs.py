"""``gpumesh submit``, ``jobs``, ``results``, ``workers``, ``top``, ``logs``, ``cancel``, ``retry`` and
``pull``, and ``status``'s table and ``--watch`` (``gpumesh.cli.status`` defines the command): the
commands that submit and read jobs."""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from gpumesh.api import check_expires, follow_logs
from gpumesh.cli import render
from gpumesh.cli.helpers import (
    emit_json,
    env_options,
    err,
    exit_for,
    explain_failures,
    job_options,
    json_option,
    open_mesh,
    patient,
    project_options,
    resolve_job,
    stopped_waiting,
    url_option,
    wait_for,
)  # fmt: skip
from gpumesh.errors import UsageError
from gpumesh.settings import Settings

if TYPE_CHECKING:
    from rich.console import Group

    from gpumesh.models import TaskResult


@click.command()
@click.argument("script", required=False)
@click.option("--payloads", "payloads_spec", metavar="FILE|-", help="JSON list of payload objects.")
@job_options
@project_options
@env_options
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
    type=float,
    default=7 * 86400,
    show_default=True,
    help="Seconds a signed job stays valid: 1 to a year (31536000).",
)
@url_option
@json_option
@click.pass_context
def submit(
    ctx: click.Context, /, script: str | None, payloads_spec: str | None, wait: bool, idempotency_key: str | None,
    sign_key: Path | None, expires: float, url: str | None, as_json: bool, job_file: Path | None, **opts: Any,
) -> None:  # fmt: skip
    """Submit SCRIPT with one task per payload; print the job id.

    The script reads its payload as JSON on stdin and prints its result as the last stdout line
    (JSON); with --reuse-process it defines main(payload), called for each task in a process that stays
    loaded, which returns the result. Payloads may carry "cost" (a positive number): when a worker asks for work, the strongest
    workers get the heaviest tasks. Everything is checked before anything is written; the job
    appears whole or not at all. If no live worker meets some tasks' requirements, submit warns and
    the tasks wait until one joins.

    With --project DIR the folder travels with the job (only the files the mesh does not hold yet
    are sent) and submit prints one line: files and bytes sent, and what the rules left out. With
    no SCRIPT, the job is read from ./gpumesh.toml (or -f FILE); flags override it.

    Packages travel with the job: a script's PEP 723 block, --with, --requirements, the project's
    pyproject.toml (uv.lock honoured) or the job file's [env] are locked here with uv, for every
    platform, and each worker's machine builds that lock once, before it takes the job's tasks
    (`gpumesh status JOB` shows "preparing env … for JOB"; docs/environments.md):

    
      gpumesh submit fit.py --payloads p.json --with numpy --with 'scikit-learn>=1.4'
      gpumesh submit fit.py --payloads p.json --requirements requirements.txt --python '>=3.11'
    """
    got = resolve_job(ctx, script, payloads_spec, job_file, opts, Settings.load(url=url))  # errors name the flags
    expires = check_expires(expires, "--expires")
    mesh = open_mesh(ctx, url)
    job = mesh.submit_checked(
        got.source, got.name, got.payloads, got.options, idempotency_key=idempotency_key, sign_key=sign_key,
        expires=expires, project=got.project, siblings=got.siblings, env=got.env,
    )  # fmt: skip
    res, broker = job.submitted, mesh.broker
    assert res is not None
    if res.project is not None:
        err.print(res.project.summary, markup=False, highlight=False)
    try:  # the job is written: from here Ctrl-C stops this command, never the job
        res.waiting_for = job.status().waiting_for
        for w in res.waiting_for:
            err.print(f"warning: {render.waiting_line(w)}")
        if res.existing and not as_json:
            err.print(f"existing job {res.job_id}: the idempotency key was used before with the same request; "
                      "nothing new was submitted")  # fmt: skip
        if not wait:
            if as_json:
                emit_json(res.model_dump(exclude={k for k in ("project", "env") if getattr(res, k) is None}))
            else:
                if not res.existing:  # no tier forecast here: placement is decided when a worker asks
                    at = f" at priority {res.priority}" if res.priority else ""
                    err.print(f"submitted job {res.job_id}: {render.tasks(res.tasks)}{at}")
                click.echo(res.job_id)
            return
        if not as_json and not res.existing:
            err.print(f"submitted job {res.job_id}: {render.tasks(res.tasks)} (Ctrl-C stops waiting, not the job)")
        st = wait_for(ctx, broker, res.job_id, quiet=as_json)
    except KeyboardInterrupt:
        stopped_waiting(ctx, res.job_id, waiting=wait)
    if as_json:  # the job has ended: Ctrl-C from here is a plain interruption (cli.group)
        emit_json(st.model_dump(mode="json"))
    else:
        click.echo(render.plain(f"{st.job_id} {st.status}"))
        explain_failures(mesh, st)
    exit_for(ctx, st)


def show_status(ctx: click.Context, job_id: str, watch: bool, url: str | None, as_json: bool) -> None:
    """``gpumesh status`` but for ``--json`` without ``--watch``, which gpumesh.cli.status answers itself."""
    mesh = open_mesh(ctx, url)
    st = wait_for(ctx, mesh.broker, job_id, quiet=as_json) if watch else mesh.job(job_id).status()
    if as_json:
        emit_json(st.model_dump(mode="json"))
    elif not watch:
        click.echo(render.status_line(st) + (f"  [{render.plain(st.name)}]" if st.name else ""))
        for w in st.waiting_for:
            click.echo("  " + render.waiting_line(w))
        if st.preparing:
            click.echo(f"  preparing env {(st.env or '')[:12]} for {st.job_id} on {', '.join(st.preparing)}")
    if not as_json:
        explain_failures(mesh, st)
    if watch:
        exit_for(ctx, st)


@click.command()
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 10_000), help="How many jobs to list.")
@url_option
@json_option
@click.pass_context
def jobs(ctx: click.Context, limit: int, url: str | None, as_json: bool) -> None:
    """List recent jobs, newest first."""
    rows = open_mesh(ctx, url).jobs(limit)
    if as_json:
        emit_json([r.model_dump(mode="json") for r in rows])
    else:
        render.out().print(render.jobs_table(rows))


@click.command()
@click.argument("job_id")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "jsonl", "csv"]), default="table", show_default=True,
              help="table for people; json, jsonl or csv for programs.")  # fmt: skip
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    help="Write to FILE instead of stdout.",
)
@click.option("--verify", is_flag=True,
              help="Exit 1 when a done task's result does not verify (see below), naming the tasks.")  # fmt: skip
@url_option
@json_option
@click.pass_context
def results(
    ctx: click.Context, job_id: str, fmt: str, output: Path | None, verify: bool, url: str | None, as_json: bool
) -> None:
    """Print a job's per-task results in payload order (--json is --format json).

    Each worker credential signs its results with a key of its own that the admin registered (`gpumesh
    serve`, `gpumesh access add`). The "signed by" column (JSON: "verified", "signed_by") says which
    credential a result came from, and marks one that does not verify (written into Redis by someone
    else, or changed since) as NOT VERIFIED; "verified" is null for a task with no result, or on a
    broker with no registered result keys.

    \b
    Example:
      gpumesh results 8f3c2a1b9d0e --format csv -o results.csv
      gpumesh results 8f3c2a1b9d0e --verify --json > results.json
    """
    if as_json:
        fmt = "json"
    if fmt == "table" and output:
        raise UsageError("--output needs --format json, jsonl or csv")
    # Read a page at a time and written as read: a job of a million tasks is never held whole here.
    check = _Verified()
    rows = check.watch(open_mesh(ctx, url).job(job_id).iter_results())
    if fmt == "table":
        page: list[TaskResult] = []
        signed: bool | None = None
        for row in itertools.chain(rows, [None]):
            if row is not None:
                page.append(row)
            if page and (row is None or len(page) == RESULTS_TABLE_PAGE):
                signed = any(r.verified is not None for r in page) if signed is None else signed
                render.out().print(render.results_table(page, signed=signed, header=check.shown == 0))
                check.shown += len(page)
                page = []
        if not check.shown:
            render.out().print(render.results_table([]))
    elif output:
        with output.open("w") as f:
            n = render.write_results(rows, fmt, f)
        err.print(f"wrote {n} results to {output}")
    else:
        render.write_results(rows, fmt, sys.stdout)
    if verify and check.bad:
        which = ", ".join(str(i) for i in check.bad[:20]) + (", ..." if check.n_bad > 20 else "")
        why = "" if check.any_checked else " (this broker registers no result keys)"
        err.print(f"error: {check.n_bad} result(s) do not verify{why}: task(s) {which}")
        ctx.exit(1)


RESULTS_TABLE_PAGE = 1000  # rows a table of `gpumesh results` draws at once


class _Verified:
    """What `results --verify` reports, counted while the rows stream past."""

    def __init__(self) -> None:
        self.bad: list[int] = []  # the first 20 indexes of done tasks whose result does not verify
        self.n_bad = 0
        self.any_checked = False  # some such result was checked against a registered key
        self.shown = 0

    def watch(self, rows: Iterator[TaskResult]) -> Iterator[TaskResult]:
        for r in rows:
            if r.status == "done" and r.verified is not True:
                self.n_bad += 1
                self.any_checked = self.any_checked or r.verified is not None
                if len(self.bad) < 20:
                    self.bad.append(r.index)
            yield r


@click.command()
@url_option
@json_option
@click.pass_context
def workers(ctx: click.Context, url: str | None, as_json: bool) -> None:
    """List live workers with their device, score and tier (score band: 0 the weakest), then each tier: its RQ
    queue, its workers, the tasks waiting in that queue (the next 20 at most) and all the queued tasks it gets."""
    mesh = open_mesh(ctx, url)
    rows = mesh.workers()
    if as_json:
        # ``paused`` only for a worker its lender's probes pause (``worker --lend``)
        emit_json([r.model_dump(mode="json", exclude=None if r.paused else {"paused"}) for r in rows])
    else:
        render.out().print(render.workers_table(rows))
        render.out().print(render.tiers_table(mesh.tiers()))


@click.command()
@click.option(
    "--interval", default=1.0, show_default=True, type=click.FloatRange(min=0.1), help="Seconds between refreshes."
)
@click.option("--once", is_flag=True, help="Print one snapshot and exit (the default when stdout is not a terminal).")
@url_option
@click.pass_context
def top(ctx: click.Context, interval: float, once: bool, url: str | None) -> None:
    """A live view of the workers (tier, score, current task), the tiers' queues and the recent jobs. Ctrl-C quits."""
    from rich.live import Live

    mesh = open_mesh(ctx, url)
    console = render.out()

    def snapshot() -> Group:
        return render.top_view(mesh.workers(), mesh.jobs(15), mesh.tiers())

    view = patient(snapshot, mesh.broker)

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


@click.command()
@click.argument("target", metavar="JOB|TASK")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until the job or task ends.")
@url_option
@click.pass_context
def logs(ctx: click.Context, target: str, follow: bool, url: str | None) -> None:
    """Print the output of a task, or of every task of a job: its stdout to stdout, stderr to stderr."""
    broker = open_mesh(ctx, url).broker
    try:
        for tid, stream, line in follow_logs(broker, target, follow, 0.5, err.print):  # a job's or a task's
            # A task's output as text: its control characters (colours included) neutralised, as all it stored.
            prefix = f"[{render.plain(tid)}] " if tid != target else ""
            if stream == "gpumesh":
                click.echo(f"{prefix}--- {render.plain(line)} ---", err=True)
            else:
                click.echo(f"{prefix}{render.plain(line)}", err=stream == "stderr")
    except KeyboardInterrupt:
        ctx.exit(130)


@click.command()
@click.argument("job_id")
@click.option("--keep-files", is_flag=True, help="Keep the output files its done tasks stored (for `gpumesh pull`).")
@url_option
@json_option
@click.pass_context
def cancel(ctx: click.Context, job_id: str, keep_files: bool, url: str | None, as_json: bool) -> None:
    """Cancel a job: queued tasks never run, running ones are killed within a heartbeat. The output files
    its done tasks stored are deleted too (pull them first, or pass --keep-files)."""
    mesh = open_mesh(ctx, url)
    st = mesh.job(job_id).cancel(keep_files=True)
    if not keep_files:
        n = mesh.broker.drop_files(job_id)
        if n and not as_json:
            err.print(f"deleted the output files of {n} task(s); --keep-files keeps them")
    if as_json:
        emit_json(st.model_dump(mode="json"))
    else:
        click.echo(render.status_line(st))


@click.command()
@click.argument("job_id")
@click.option("--wait", is_flag=True, help="Follow the job to its end; exit 1 if it did not succeed.")
@click.option("--cancelled", is_flag=True, help="Re-queue the cancelled tasks too (resume a cancelled job).")
@url_option
@json_option
@click.pass_context
def retry(ctx: click.Context, job_id: str, wait: bool, cancelled: bool, url: str | None, as_json: bool) -> None:
    """Re-queue the failed tasks of a job (with --cancelled, its cancelled ones too), each with a fresh
    set of attempts."""
    mesh = open_mesh(ctx, url)
    n = mesh.job(job_id).retry(cancelled=cancelled)
    broker = mesh.broker
    st = broker.job_status(job_id)
    if not as_json:
        what = "failed or cancelled" if cancelled else "failed"
        err.print(f"re-queued {n} {what} task(s) of {job_id}" if n else f"job {job_id} has no {what} task to retry")
    if wait and n:
        st = wait_for(ctx, broker, job_id, quiet=as_json)
    if as_json:
        emit_json({"requeued": n, **st.model_dump(mode="json")})
    else:
        click.echo(render.status_line(st))
        if wait:
            explain_failures(mesh, st)
    if wait:
        exit_for(ctx, st)


@click.command()
@click.argument("job_id")
@click.argument("task", required=False, metavar="[TASK]")
@click.option("--to", "dest", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Write DIR/<task index>/<path> (created if missing).")  # fmt: skip
@click.option("--glob", "pattern", metavar="PATTERN", help='Only the paths matching PATTERN, e.g. "*.pt" or "plots/*".')
@click.option("--force", is_flag=True, help="Fetch again even the files already there and whole.")
@click.option("--parallel", default=8, show_default=True, type=click.IntRange(1, 64), help="Files fetched at once.")
@url_option
@json_option
@click.pass_context
def pull(
    ctx: click.Context, job_id: str, task: str | None, dest: Path, pattern: str | None, force: bool, parallel: int,
    url: str | None, as_json: bool,
) -> None:  # fmt: skip
    """Fetch the files a job's tasks wrote to GPUMESH_OUTPUT_DIR (or one TASK's: its index or id).

    Checksums are verified and a file already there and whole is skipped, so pulling again is cheap.
    Exits 1 when some task has no files because it did not complete, 4 for an unknown job or task.
    """
    broker = open_mesh(ctx, url).broker
    bar = render.transfer_bar(quiet=as_json)
    with bar:
        got = broker.pull(job_id, dest, task, pattern=pattern, force=force, parallel=parallel,
                          on_start=bar.start, on_bytes=bar.advance)  # fmt: skip
    for note in got.notes:
        err.print(f"note: {note}", markup=False)  # paths are the task's: never read as markup
    for index, status in got.not_done:
        err.print(f"task {index} has no files: it is {status}")
    if as_json:
        emit_json({
            "job_id": job_id, "fetched": [str(p) for p in got.fetched], "present": [str(p) for p in got.present],
            "bytes": got.bytes, "not_done": [{"index": i, "status": s} for i, s in got.not_done], "notes": got.notes,
        })  # fmt: skip
    else:
        err.print(
            f"pulled {len(got.fetched)} file(s), {got.bytes / (1 << 20):.1f} MiB, into {dest}"
            f" ({len(got.present)} already there and whole)",
            markup=False,
        )
    if got.not_done:
        ctx.exit(1)


@click.command()
@click.option("--force", is_flag=True, help="Overwrite an existing gpumesh.toml.")
@click.option(
    "--dir", "folder", type=click.Path(file_okay=False, path_type=Path), default=Path("."), show_default=True,
    help="The folder to look in and write to.",
)  # fmt: skip
def init(force: bool, folder: Path) -> None:
    """Write a commented gpumesh.toml (a job file) from what this folder holds.

    It names the script (the one with an if __name__ == "__main__" guard, or the only .py at the top),
    a payloads*.json file, and mentions a requirements file. Then `gpumesh submit` with no arguments
    submits it (flags override its values)."""
    from gpumesh import jobfile

    target = folder / jobfile.NAME
    if target.exists() and not force:
        raise UsageError(f"{target} exists already; edit it, or pass --force to write a new one")
    found = jobfile.guess(folder)
    target.write_text(jobfile.template(found))
    err.print(f"wrote {target}", markup=False)
    for what in ("script", "payloads"):
        if not found[what]:
            err.print(f"  no {what} found: fill in job.{what} before `gpumesh submit`", markup=False)
