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


class Record:
    """The record a worker appends to: opened once (mode 0600, in a 0700 directory), opened again when it was
    moved or deleted, trimmed past MAX_BYTES."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def _open(self) -> int:
        if self._fd is not None:
            try:
                if os.fstat(self._fd).st_nlink and os.path.samestat(os.fstat(self._fd), os.stat(self.path)):
                    return self._fd
            except OSError:
                pass
            self.close()
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)
        self._fd = fd
        return fd

    def append(self, entry: dict[str, Any]) -> None:
        """Add one attempt to the record."""
        fd = self._open()
        os.write(fd, (json.dumps(entry, separators=(",", ":"), sort_keys=True) + "\n").encode())
        if os.fstat(fd).st_size > MAX_BYTES:
            _trim(self.path)
            self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


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
