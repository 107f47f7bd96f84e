"""Task logs: one Redis stream per job (keys.job_log), one entry per line of any of its tasks, holding the
task's index, the stream the line came from (stdout, stderr, or gpumesh for the worker's own notes) and
the line.

Why one stream per job, not one per task: a stream's first node takes about 4.7 KB however little it holds,
so a stream per task made a task's one-line log cost more than everything else a finished task keeps.
In the job's stream a short line costs tens of bytes (entries share their field names, and an entry id is
stored as a difference from its node's first), a follower of a job reads one key from one cursor in the order
the lines were written, across attempts and tasks, and the log goes with its job in one step. Lines inline
in the task's hash would make most hashes outgrow Redis's compact encoding (64-byte values), and compressed
chunks would have to be rewritten to follow them.

What it costs: one task's log is read by scanning the job's lines written while the task lived, from its
first start (``log_from`` on the task, server ms, written by its first lease) to LATE_MS after its end, a page
at a time: a task of a big job whose neighbours print a lot reads their lines too.
The cap is per attempt (the sandbox's log cap, GPUMESH_LOG_MAX_BYTES, with the truncation marked): the
stream is never trimmed, so a job's log stays whole until the job is deleted.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from gpumesh.store import keys

PAGE = 1000  # entries a read asks for at once
LATE_MS = 60_000  # a line of a task that ended is looked for this long after its end (a worker's note follows it)
TERMINAL = ("done", "failed", "cancelled")

Line = tuple[str, str, str]  # (task id, stream, line)
Entry = tuple[str, int, str, str]  # (entry id, task index, stream, line)


def _split(task_id: str) -> tuple[str, str]:
    job_id = keys.job_of_task(task_id)
    return job_id, task_id[len(job_id) + 1 :]


def command(task_id: str, stream: str, line: str) -> tuple[str, ...]:
    """The XADD that appends one line of a task to its job's log."""
    job_id, index = _split(task_id)
    return ("XADD", keys.job_log(job_id), "*", "index", index, "stream", stream, "line", line)


def append(pipe: Any, lines: Iterable[Line]) -> int:
    """Queue an XADD per line on ``pipe`` (a redis-py pipeline), on the stream of the line's job; how many."""
    n = 0
    for task_id, stream, line in lines:
        pipe.execute_command(*command(task_id, stream, line))
        n += 1
    return n


def send(r: Any, lines: Iterable[Line]) -> None:
    """Append these lines to their jobs' logs, in one round trip."""
    with r.pipeline(transaction=False) as p:
        append(p, lines)
        p.execute()


def _entries(r: Any, key: str, lo: str, hi: str = "+") -> Iterator[Entry]:
    """The stream's entries from ``lo`` to ``hi`` (XRANGE bounds), a page per round trip."""
    while True:
        page = r.xrange(key, min=lo, max=hi, count=PAGE)
        for entry_id, f in page:
            try:
                index = int(f.get("index", -1))
            except ValueError:  # an entry some credential wrote: no task's
                index = -1
            yield entry_id, index, f.get("stream", "stdout"), f.get("line", "")
        if len(page) < PAGE:
            return
        lo = "(" + page[-1][0]


def job_lines(r: Any, job_id: str, after: str | None = None) -> Iterator[Entry]:
    """Every line of the job's log after entry ``after`` (None: from its first), in the order written."""
    return _entries(r, keys.job_log(job_id), "(" + after if after else "-")


def task_lines(r: Any, task_id: str, after: str | None = None) -> tuple[list[tuple[str, str]], str | None]:
    """(the task's (stream, line)s after entry ``after``, the last entry scanned: the cursor to pass next).
    The task's status is read first, so a caller that saw it ended has every line of it."""
    job_id, index = _split(task_id)
    log_from, status, finished = r.hmget(keys.task(task_id), "log_from", "status", "finished_at")
    if not log_from and status == "queued":
        return [], after  # never ran
    lo = "(" + after if after else (f"{log_from}-0" if log_from else "-")  # no log_from: leased by an older version
    hi = "+"
    if status in TERMINAL and finished:
        try:
            hi = str(int(float(finished) * 1000) + LATE_MS)
        except ValueError:
            pass
    out: list[tuple[str, str]] = []
    last = after
    want = int(index) if index.isdigit() else -2
    for entry_id, i, stream, line in _entries(r, keys.job_log(job_id), lo, hi):
        last = entry_id
        if i == want:
            out.append((stream, line))
    return out, last
