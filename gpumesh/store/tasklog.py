"""A task's log: a Redis stream per task (keys.task_log), one entry per line, each with the stream it came
from (stdout, stderr, or gpumesh for the worker's own notes), trimmed to about LOG_STREAM_MAXLEN lines."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpumesh.store import keys

LOG_STREAM_MAXLEN = 10_000

Line = tuple[str, str, str]  # (task id, stream, line)


def append(pipe: Any, lines: Iterable[Line]) -> int:
    """Queue an XADD per line on ``pipe`` (a redis-py pipeline); returns how many."""
    n = 0
    for task_id, stream, line in lines:
        pipe.xadd(keys.task_log(task_id), {"stream": stream, "line": line}, maxlen=LOG_STREAM_MAXLEN, approximate=True)
        n += 1
    return n
