"""Recovery: seconds from SIGKILL of a worker (and its task) to the task running on another worker.

    python benchmarks/recovery.py [--repeat 3]

Worker A starts the task's first attempt; an idle worker B waits. A's whole process group is
SIGKILLed; the clock stops when attempt 2 writes its marker on B. Run with the default settings
(lease TTL 30 s, heartbeat 5 s) and with short ones (2 s, 0.4 s). Target: ≤ lease TTL + 2 heartbeats.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

from common import PrivateRedis, med, publish, rounds, start_worker, stop, table

from gpumesh.models import JobOptions
from gpumesh.settings import Settings
from gpumesh.store import keys
from gpumesh.store.broker import Broker

TASK = """import json, os, sys, time
json.load(sys.stdin)
open(os.path.join({tmp!r}, "attempt-" + os.environ["GPUMESH_ATTEMPT"]), "w").write(os.environ["GPUMESH_WORKER_ID"])
if os.environ["GPUMESH_ATTEMPT"] == "1":
    time.sleep(600)
print("{{}}")
"""


def one(url: str, tmp: Path, ttl: float, hb: float) -> float:
    env = {"XDG_CACHE_HOME": str(tmp / "cache"), "GPUMESH_LEASE_TTL": str(ttl), "GPUMESH_HEARTBEAT_INTERVAL": str(hb)}
    marks = tmp / f"marks-{time.monotonic_ns()}"
    marks.mkdir()
    broker = Broker(Settings(url=url, lease_ttl=ttl, heartbeat_interval=hb))
    broker.r.flushall()
    a = start_worker(url, 1, env=env)
    b = None
    try:
        while not broker.live_scores():
            time.sleep(0.05)
        job = broker.submit(TASK.format(tmp=str(marks)), "t.py", [{}], JobOptions(max_attempts=3)).job_id
        while not (marks / "attempt-1").exists():
            time.sleep(0.02)
        b = start_worker(url, 1, env=env)
        while len(broker.live_scores()) < 2:
            time.sleep(0.05)
        time.sleep(hb * 1.5)  # B is idle in its blocking pop, as a worker would be
        t0 = time.monotonic()
        os.killpg(a.pid, signal.SIGKILL)
        while not (marks / "attempt-2").exists():
            time.sleep(0.01)
        elapsed = time.monotonic() - t0
        while broker.r.hget(keys.task(keys.task_id(job, 0)), "status") != "done":
            time.sleep(0.05)
        return elapsed
    finally:
        stop([p for p in (a, b) if p is not None])
        broker.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    server = PrivateRedis()
    tmp = server.tmp
    rows = []
    try:
        for name, ttl, hb in (("defaults", 30.0, 5.0), ("short TTLs", 2.0, 0.4)):
            xs = [one(server.url, tmp, ttl, hb) for _ in range(args.repeat)]
            target = ttl + 2 * hb
            rows.append((name, f"{ttl:g} s", f"{hb:g} s", f"{med(xs):.2f}", rounds(xs), f"≤ {target:g} s",
                         "yes" if max(xs) <= target else "no"))  # fmt: skip
    finally:
        server.stop()
    body = table(
        ["settings", "lease TTL", "heartbeat", "SIGKILL → running elsewhere, s (median)", "rounds", "target",
         "every round within"],
        rows,
    )  # fmt: skip
    body += (
        "\n\nWhy it takes about one TTL: the killed worker's lease lapses at most one TTL after its last renewal; "
        "the next reaper pass (every heartbeat, on some live worker) re-queues the task, and the idle worker's "
        "blocking pop takes it at once."
    )
    publish(
        "recovery", "Recovery after a worker is killed", body, f"python benchmarks/recovery.py --repeat {args.repeat}"
    )


if __name__ == "__main__":
    main()
