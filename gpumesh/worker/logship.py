"""Ships task output to Redis from a thread of its own, so a slow or cut-off broker never stalls the
loop that enforces a task's timeout, memory cap and lease."""

from __future__ import annotations

import logging
import queue
import threading
import time

import redis

from gpumesh.store import keys

log = logging.getLogger("gpumesh.worker")

LOG_STREAM_MAXLEN = 10_000


class LogShipper(threading.Thread):
    def __init__(self, client: redis.Redis, capacity: int = 50_000) -> None:
        super().__init__(name="gpumesh-logs", daemon=True)
        self.r = client
        self.q: queue.Queue[tuple[str, str, str]] = queue.Queue(maxsize=capacity)
        self.dropped = 0

    def put(self, task_id: str, stream: str, line: str) -> None:
        try:
            self.q.put_nowait((task_id, stream, line))
        except queue.Full:
            self.dropped += 1

    def run(self) -> None:
        while True:
            batch = [self.q.get()]
            while len(batch) < 500:
                try:
                    batch.append(self.q.get_nowait())
                except queue.Empty:
                    break
            try:
                with self.r.pipeline(transaction=False) as p:
                    for task_id, stream, line in batch:
                        p.xadd(
                            keys.task_log(task_id),
                            {"stream": stream, "line": line},
                            maxlen=LOG_STREAM_MAXLEN,
                            approximate=True,
                        )
                    p.execute()
            except redis.RedisError as exc:
                self.dropped += len(batch)
                log.warning("%d log lines lost: %s", len(batch), exc)
            finally:
                for _ in batch:
                    self.q.task_done()

    def flush(self, timeout: float) -> bool:
        """Wait until every queued line has been sent (or given up on); False on timeout."""
        deadline = time.monotonic() + timeout
        with self.q.all_tasks_done:
            while self.q.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.q.all_tasks_done.wait(left)
        return True
