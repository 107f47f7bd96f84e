"""Output for people and for machines: progress while a job runs, tables, result formats.

On a terminal: a live progress bar on stderr. Elsewhere: one plain line on stderr whenever the counts
change. With ``--json`` nothing but the final document goes to stdout.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import re
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TextIO

from gpumesh.models import Capability, JobStatus, TaskResult, TierLoad, Waiting, WorkerInfo, error_summary

if TYPE_CHECKING:
    from rich.console import Console, Group
    from rich.progress import Progress
    from rich.table import Table

# rich is imported where something is drawn, not with this module: `status --json` and every other
# machine-readable command never load it (tests/cli/test_cli_start.py counts).

# Every C0 control but tab and newline, DEL, and every C1 control (U+0080-U+009F: 0x9B is a CSI of its own on some
# terminals), shown as the escape Python would write: a string a task, worker or submitter stored never moves the
# cursor, clears the screen, recolours what follows, sets a window title, writes the clipboard (OSC 52) or makes a
# link (OSC 8) in the terminal of the person who reads it. And the bidirectional formatting characters (U+061C,
# U+200E-U+200F, U+202A-U+202E, U+2066-U+2069), shown as \u escapes: a right-to-left override makes "txt.exe" of
# "exe.txt" and reorders a line so that what it shows is not what it holds.
_CONTROLS = {c: f"\\x{c:02x}" for c in [*range(0x00, 0x09), *range(0x0B, 0x20), 0x7F, *range(0x80, 0xA0)]}
_CONTROLS.update({c: f"\\u{c:04x}" for c in [0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]})


def plain(text: object) -> str:
    """``text`` with its control characters neutralised (tab and newline kept): what may reach a terminal of a
    string read from Redis."""
    return str(text).translate(_CONTROLS)


def cell(text: object, style: str = "") -> Any:
    """A table cell that is plain text, never rich markup: ``[red]`` in a name stays those five characters."""
    from rich.text import Text

    return Text(plain(text), style=style)


def _console(**kw: Any) -> Console:
    """A rich console whose markup and emoji codes are off, and which neutralises the controls of every string it
    prints (:func:`plain`): what is drawn styled is built as rich Text, by this module."""
    from rich.console import Console

    class PlainConsole(Console):
        def print(self, *objects: Any, **options: Any) -> None:
            super().print(*(plain(o) if isinstance(o, str) else o for o in objects), **options)

    return PlainConsole(highlight=False, markup=False, emoji=False, **kw)


@functools.cache
def _err() -> Console:
    """The console on stderr, made on first use."""
    return _console(stderr=True, soft_wrap=True)  # a message stays one line, whatever the width


def __getattr__(name: str) -> Any:
    """``render.err``: the console on stderr, made on first use."""
    if name == "err":
        return _err()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def out() -> Console:
    """Console for tables on stdout: the terminal's width, or wide enough that piped ids are never cut."""
    console = _console()
    return console if console.is_terminal else _console(width=240)


def _table(*headers: str, title: str | None = None) -> Table:
    from rich.table import Table

    table = Table(title=title)
    for h in headers:
        table.add_column(h, overflow="fold")  # wrap long values rather than cut ids with an ellipsis
    return table


class Rate:
    """Tasks ended per second since watching began, and the time left at that rate."""

    def __init__(self, first: JobStatus) -> None:
        self.t0 = time.monotonic()
        self.ended0 = self._ended(first)

    @staticmethod
    def _ended(st: JobStatus) -> int:
        return st.tasks.done + st.tasks.failed + st.tasks.cancelled

    def describe(self, st: JobStatus) -> tuple[str, str]:
        elapsed = time.monotonic() - self.t0
        ended = self._ended(st) - self.ended0
        if ended <= 0 or elapsed <= 0:
            return "-", "-"
        rate = ended / elapsed
        left = st.tasks.total - self._ended(st)
        return f"{rate:.1f}/s", _duration(left / rate) if left else "0s"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def tasks(n: int) -> str:
    """``1 task``, ``2 tasks``."""
    return f"{n} task" if n == 1 else f"{n} tasks"


def status_line(st: JobStatus, rate: Rate | None = None) -> str:
    t = st.tasks
    at = f" (priority {st.priority})" if st.priority else ""  # the default, 0, goes unsaid
    line = (
        f"{st.job_id} {st.status}{at}: {t.done}/{t.total} done, {t.running} running, {t.queued} queued, "
        f"{t.failed} failed"
    )
    if t.failed and st.failed_by_kind:  # how they failed: "3 failed (script 2, memory 1)"
        line += " (" + ", ".join(f"{k} {n}" for k, n in st.failed_by_kind.items()) + ")"
    if t.cancelled:
        line += f", {t.cancelled} cancelled"
    if st.paused_handbacks:  # time lost to lenders' pauses: what those attempts had run when handed back
        line += f", {st.paused_handbacks} handed back by pauses ({_duration(st.paused_lost_s)} of work lost)"
    if rate is not None and not st.finished:
        speed, eta = rate.describe(st)
        if speed != "-":
            line += f" ({speed}, ETA {eta})"
    return plain(line)


def waiting_line(w: Waiting) -> str:
    """Why queued tasks do not run: no live worker meets what they require."""
    return plain(_waiting_line(w))


def _waiting_line(w: Waiting) -> str:
    if w.signer == "unsigned":
        return (
            f"{w.tasks} task(s) wait: every live worker that could run them runs only signed tasks "
            "(started with --trust), and this job is not signed: submit it with --sign-key KEY"
        )
    if w.signer:
        return (
            f"{w.tasks} task(s) wait: they are signed by key {w.signer}, which no live worker that could run "
            "them trusts: start one with --trust that key's .pub file"
        )
    if not w.requires:
        return f"{w.tasks} task(s) wait: no worker is live (start one with `gpumesh worker URL`)"
    what = ", ".join(w.requires)
    return (
        f"{w.tasks} task(s) wait for a worker with {what}: no live worker has it (`gpumesh workers --json` "
        "shows what each offers; a worker declares more with --resource KEY=VALUE)"
    )


def follow(poll: Callable[[], JobStatus], quiet: bool, interval: float = 0.25) -> JobStatus:
    """Follow a job until it ends, showing progress on stderr (a bar on a terminal, lines elsewhere): ``poll``
    answers its status, ``interval`` seconds after the last answer (0 where ``poll`` itself waits for a change:
    a :class:`~gpumesh.store.broker.JobFollower`)."""
    st = poll()
    if quiet:
        while not st.finished:
            if interval:
                time.sleep(interval)
            st = poll()
        return st
    rate = Rate(st)
    err = _err()
    if not err.is_terminal:
        last = ""
        while True:
            counts = status_line(st)  # a new line when the counts change, not each time the rate does
            if counts != last:
                err.print(status_line(st, rate))
                last = counts
            if st.finished:
                return st
            if interval:
                time.sleep(interval)
            st = poll()
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("{task.fields[job]}", style="bold", markup=False),
        BarColumn(),
        TextColumn("{task.completed:.0f}/{task.total:.0f} done"),
        TextColumn("{task.fields[failed]} failed", style="red", markup=False),
        TextColumn("{task.fields[running]} running"),
        TextColumn("{task.fields[rate]}"),
        TextColumn("ETA {task.fields[eta]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=False) as bar:
        task = bar.add_task("job", total=st.tasks.total, job=plain(st.job_id), failed=0, running=0, rate="-", eta="-")
        while True:
            speed, eta = rate.describe(st)
            bar.update(
                task, completed=st.tasks.done, failed=st.tasks.failed, running=st.tasks.running, rate=speed, eta=eta
            )
            if st.finished:
                break
            if interval:
                time.sleep(interval)
            st = poll()
    err.print(status_line(st))
    return st


def results_text(rows: Iterable[TaskResult], fmt: str) -> str:
    buf = io.StringIO()
    write_results(rows, fmt, buf)
    return buf.getvalue()


def write_results(rows: Iterable[TaskResult], fmt: str, out: TextIO) -> int:
    """Write the rows as json, jsonl or csv to ``out`` as they come, so that a job of a million tasks is never
    held whole (json writes what ``json.dumps(rows, indent=2)`` would, a row at a time); how many rows."""
    if fmt not in ("json", "jsonl", "csv"):
        raise ValueError(fmt)
    n = 0
    writer: csv.DictWriter[str] | None = None
    if fmt == "csv":
        writer = csv.DictWriter(out, fieldnames=list(TaskResult.model_fields), lineterminator="\n")
        writer.writeheader()
    for row in rows:
        d = row.model_dump(mode="json")
        if fmt == "json":
            out.write(
                ("[\n" if n == 0 else ",\n") + "\n".join("  " + line for line in json.dumps(d, indent=2).splitlines())
            )
        elif fmt == "jsonl":
            out.write(json.dumps(d) + "\n")
        elif writer is not None:
            cells = {
                **d,
                "result": json.dumps(d["result"]) if d["result"] is not None else "",
                "artifacts": " ".join(a["path"] for a in d["artifacts"]),
                "skipped_artifacts": " ".join(a["path"] for a in d["skipped_artifacts"]),
            }
            writer.writerow({k: csv_cell(v) for k, v in cells.items()})
        n += 1
    if fmt == "json":
        out.write("[]\n" if n == 0 else "\n]\n")
    return n


_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: object) -> object:
    """A CSV cell a spreadsheet shows as text, never runs: one that starts as a formula may (``=``, ``+``, ``-``,
    ``@``, a tab or CR: ``=HYPERLINK(...)``, ``@SUM(...)``) gets a leading ``'``, as OWASP advises; a plain number
    (``-1.5``) stays one. Its controls are neutralised as a terminal's are (:func:`plain`)."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    text = str(value)
    if text.startswith(FORMULA_STARTS) and not _NUMBER.fullmatch(text):
        text = "'" + text
    return plain(text)


def results_table(rows: Iterable[TaskResult], signed: bool | None = None, header: bool = True) -> Table:
    """``signed``: with the "signed by" column (None: when a row was checked against registered result keys);
    ``header``: False for the pages after the first of a long job's table (gpumesh results draws a page of
    rows at a time)."""
    rows = list(rows)
    if signed is None:
        signed = any(r.verified is not None for r in rows)  # a broker that registers result keys
    table = _table("#", "status", "result", "error", "attempts", "worker", "s", *(["signed by"] if signed else []))
    table.show_header = header
    for r in rows:
        table.add_row(
            *map(cell, (
                str(r.index),
                r.status,
                json.dumps(r.result) if r.result is not None else "",
                error_summary(r.status, r.error, r.error_kind) if r.error else "",
                str(r.attempts),
                r.worker or "",
                f"{r.duration_s:.2f}" if r.duration_s is not None else "",
            )),
            *([signed_mark(r)] if signed else []),
        )  # fmt: skip
    return table


def signed_mark(r: TaskResult) -> Any:
    """Who signed a result, or a loud mark when it does not verify (results --verify exits 1 for it): rich Text,
    whose words a stored string can neither restyle nor hide (its controls are neutralised, and markup is none)."""
    if r.verified is None:
        return cell("")
    if r.verified:
        return cell(r.signed_by or "")
    mark = cell("NOT VERIFIED", style="bold red")
    if r.signed_by:
        mark.append_text(cell(f" (claims {r.signed_by})"))
    return mark


def workers_table(rows: Iterable[WorkerInfo]) -> Table:
    table = _table("worker", "host", "device", "GFLOP/s", "tier", "gpumesh", "state", "task", title="workers")
    for r in rows:
        table.add_row(
            *map(cell, (r.id, r.hostname, f"{r.device} {r.device_name}", f"{r.score_gflops:.1f}", str(r.tier), r.release,
                        f"paused: {r.paused}" if r.paused else r.state,
                        f"preparing {r.preparing}" if r.preparing else r.current_task or ""))
        )  # fmt: skip
    return table


def tiers_table(rows: Iterable[TierLoad]) -> Table:
    """Each tier: the RQ queue rq-dashboard lists, who serves it, what waits in that queue and all it has queued."""
    table = _table("tier", "RQ queue", "workers", "waiting in queue", "queued for it", title="tiers")
    for t in rows:
        queued = f"≈ {t.queued:,}" if t.estimated else f"{t.queued:,}"
        table.add_row(*map(cell, (str(t.tier), t.queue, ", ".join(t.workers) or "—", f"{t.waiting:,}", queued)))
    return table


def jobs_table(rows: Iterable[JobStatus]) -> Table:
    table = _table(
        "job", "name", "status", "priority", "done", "running", "queued", "failed", "total", "created", title="jobs"
    )
    for r in rows:
        t = r.tasks
        created = r.created_at.strftime("%Y-%m-%d %H:%M:%S") if r.created_at else ""
        table.add_row(*map(cell, (
            r.job_id, r.name, r.status, str(r.priority), str(t.done), str(t.running), str(t.queued), str(t.failed),
            str(t.total), created,
        )))  # fmt: skip
    return table


def top_view(workers: list[WorkerInfo], jobs: list[JobStatus], tiers: list[TierLoad] | None = None) -> Group:
    from rich.console import Group

    return Group(workers_table(workers), *([tiers_table(tiers)] if tiers is not None else []), jobs_table(jobs))


def capability_table(cap: Capability) -> Table:
    """One row: what a task can require of this machine, and its score; a score that cannot be ranked
    against numpy or torch machines says so in its own cell, where it is read."""
    vram = cap.vram_gb is not None
    headers = ["device", "name", "cores", "RAM"] + (["VRAM"] if vram else []) + ["GFLOP/s", "backend"]
    table = _table(*headers)
    cells = [cap.device, cap.device_name, str(cap.cpu_cores or "?"), f"{cap.ram_gb:.1f} GiB" if cap.ram_gb else "?"]
    if vram:
        free = f" ({cap.vram_free_gb:.1f} free)" if cap.vram_free_gb is not None else ""
        cells.append(f"{cap.vram_gb:.1f} GiB{free}")
    # A pure-Python score is below 0.1: show its digits, not "0.0".
    score = f"{cap.score_gflops:.1f}" if cap.score_gflops >= 10 else f"{cap.score_gflops:.3g}"
    cells += [score if cap.comparable else f"{score} (not comparable)", cap.backend]
    table.add_row(*map(cell, cells))
    return table


class TransferBar:
    """Bytes fetched by ``pull``: a bar on a terminal (thread-safe: rich's Progress locks), nothing elsewhere."""

    def __init__(self, quiet: bool) -> None:
        self.progress: Progress | None = None
        if not quiet and _err().is_terminal:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.progress = Progress(
                TextColumn("pull"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                console=_err(), transient=False,
            )  # fmt: skip
        self.task: Any = None

    def __enter__(self) -> TransferBar:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def start(self, files: int, total: int) -> None:
        if self.progress is not None:
            self.task = self.progress.add_task("pull", total=total)

    def advance(self, n: int) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.advance(self.task, n)


def transfer_bar(quiet: bool) -> TransferBar:
    return TransferBar(quiet)
