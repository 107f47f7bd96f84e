"""``gpumesh lent``'s record: every attempt this machine ran, kept on this machine (not in the broker), readable
by the worker's user alone, bounded, and written whether or not the broker answers.

One JSON object a line, appended as each attempt ends. Past :data:`MAX_BYTES` the older half goes.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

MAX_BYTES = 4 << 20  # about 15,000 attempts


def path_of(configured: str = "") -> Path:
    """Where the record is: ``GPUMESH_LENT_FILE``, else $XDG_STATE_HOME/gpumesh/lent.jsonl (~/.local/state)."""
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpumesh" / "lent.jsonl"


def append(path: Path, entry: dict[str, Any]) -> None:
    """Add one attempt to the record (mode 0600 in a 0700 directory), trimming it past MAX_BYTES."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    line = (json.dumps(entry, separators=(",", ":"), sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, line)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size > MAX_BYTES:
        _trim(path)


def _trim(path: Path) -> None:
    """Keep the newer half of the record (whole lines), replaced in one rename."""
    data = path.read_bytes()
    keep = data[len(data) - MAX_BYTES // 2 :]
    keep = keep[keep.find(b"\n") + 1 :]
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, keep)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read(path: Path, since: float = 0.0) -> list[dict[str, Any]]:
    """The attempts recorded that started at or after ``since`` (Unix time), oldest first; a line that does
    not decode (a write cut short by a crash) is left out."""
    rows = []
    with contextlib.suppress(FileNotFoundError), open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and float(row.get("start") or 0) >= since:
                rows.append(row)
    return rows


def now() -> float:
    return time.time()
