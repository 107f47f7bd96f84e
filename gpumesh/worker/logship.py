"""Ships task output to Redis from a thread of its own, so a slow or cut-off broker never stalls the
loop that enforces a task's timeout, memory cap and lease.

A line waits up to LINGER_S before the thread sends it, with whatever else came meanwhile. A short attempt's
lines are taken before that by the report of its end (:meth:`LogShipper.riding`), which sends them in its own
round trip: a task of a few milliseconds costs no round trip of its own for its log. A long attempt's output
streams in batches at most LINGER_S apart (``gpumesh logs -f`` polls more slowly than that).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator

import redis

from gpumesh.store import tasklog
from gpumesh.store.tasklog import Line

log = logging.getLogger("gpumesh.worker")

LINGER_S = 0.05  # how long a line waits for others (and for its attempt's report) before the thread sends it
BATCH = 500  # lines at most in one of the thread's round trips; this many waiting are sent at once
QUIET_S = 1.0  # with no line for this long, the thread sleeps until one comes


class LogShipper(threading.Thread):
    def __init__(self, client: redis.Redis, capacity: int = 50_000, linger: float | None = None) -> None:
        super().__init__(name="gpumesh-logs", daemon=True)
        self.r = client
        self.capacity = capacity
        self.linger = LINGER_S if linger is None else linger
        self.dropped = 0
        self._lines: deque[Line] = deque()
        self._oldest = 0.0  # when the oldest waiting line was put
        self._sending = False  # the thread has a batch in flight
        self._held = False  # a report took the waiting lines and sends them (riding): the thread sends nothing
        self._urgent = 0  # flushes under way: send what waits at once
        self._sleeping = False  # the thread waits for a line with no timeout: put() wakes it
        self._cv = threading.Condition()

    def put(self, task_id: str, stream: str, line: str) -> None:
        with self._cv:
            if len(self._lines) >= self.capacity:
                self.dropped += 1
                return
            if not self._lines:
                self._oldest = time.monotonic()
            self._lines.append((task_id, stream, line))
            if self._sleeping or len(self._lines) == BATCH:
                self._cv.notify_all()

    def run(self) -> None:
        while True:
            with self._cv:
                batch = self._next_batch()
                self._sending = True
            try:
                tasklog.send(self.r, batch)
            except redis.RedisError as exc:
                self.lost(len(batch), exc)
            finally:
                with self._cv:
                    self._sending = False
                    self._cv.notify_all()

    def _next_batch(self) -> list[Line]:
        """Under the lock: wait for lines that are due (waited LINGER_S, a full batch, or a flush) and take them.
        While lines come, the thread wakes every LINGER_S instead of at each line's arrival."""
        quiet_since = time.monotonic()
        while True:
            now = time.monotonic()
            if self._lines and not self._held:
                due = self._oldest + self.linger - now
                if due <= 0 or self._urgent or len(self._lines) >= BATCH:
                    batch = [self._lines.popleft() for _ in range(min(BATCH, len(self._lines)))]
                    return batch  # what is left is as old (_oldest holds): it goes next, at once
                self._cv.wait(due)
                quiet_since = time.monotonic()
            elif self._held or now - quiet_since < QUIET_S:
                self._cv.wait(self.linger)
            else:
                self._sleeping = True
                try:
                    self._cv.wait()
                finally:
                    self._sleeping = False
                quiet_since = time.monotonic()

    def lost(self, n: int, exc: Exception) -> None:
        """``n`` lines could not be sent (``exc``): counted and said."""
        with self._cv:
            self.dropped += n
        log.warning("%d log lines lost: %s", n, exc)

    @contextlib.contextmanager
    def riding(self, timeout: float) -> Iterator[list[Line]]:
        """Every line not sent yet, taken for the caller to send in its own round trip (before the report it
        precedes, as the thread would have sent them); the thread sends nothing until the block ends, so the
        order of lines is kept. The caller empties the list once they are sent: what it still holds when the
        block ends goes back, first in line, for the thread to send. A batch the thread has in flight is waited
        for first, up to ``timeout``: past it nothing is taken, and the thread sends the lines as usual."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._sending and time.monotonic() < deadline:
                self._cv.wait(deadline - time.monotonic())
            if self._sending:
                lines: list[Line] = []
            else:
                lines, self._held = list(self._lines), True
                self._lines.clear()
        try:
            yield lines
        finally:
            with self._cv:
                if lines:  # not sent (the report failed): the thread sends them, ahead of what came since
                    self._lines.extendleft(reversed(lines))
                    self._oldest = time.monotonic() - self.linger
                self._held = False
                self._cv.notify_all()

    def flush(self, timeout: float) -> bool:
        """Send every waiting line now and wait until it has been sent (or given up on); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            self._urgent += 1
            self._cv.notify_all()
            try:
                while self._lines or self._sending:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cv.wait(left)
                return True
            finally:
                self._urgent -= 1
