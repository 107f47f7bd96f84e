"""Core throughput benchmark, side by side in one run on this machine.

    python benchmarks/core.py [--shards 300] [--repeat 3] [--submit 10000]

Starts its own redis-server on a free port and measures, alternating the contenders each round:
  * floor:   a loop spawning `python -c <no-op script>` with a JSON payload on stdin (what any
             fresh-interpreter executor pays per task);
  * gpumesh: one `gpumesh worker` draining a job of no-op shards (submit to last result);
  * plain RQ: one RQ SimpleWorker (JSON serializer) whose jobs each run the same script in a fresh
             `python -c` subprocess (benchmarks/rq_noop.py), enqueue to last result;
  * submit:  seconds to submit a job of N shards (script, job, tasks and RQ jobs in one MULTI/EXEC).
Prints medians and ratios as a Markdown table, and the command that reproduced it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from gpumesh.broker import Broker
from gpumesh.models import JobOptions
from gpumesh.server import free_port
from gpumesh.settings import Settings

NOOP = "import json, sys\npayload = json.load(sys.stdin)\nprint(json.dumps({'i': payload['i']}))\n"


def start_redis(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(tmp)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return proc, url


def floor(n: int) -> float:
    """Tasks per second of a bare spawn loop: interpreter start, payload on stdin, one JSON line back."""
    t0 = time.perf_counter()
    for i in range(n):
        subprocess.run(
            [sys.executable, "-c", NOOP], input=json.dumps({"i": i}).encode(), capture_output=True, check=True
        )
    return n / (time.perf_counter() - t0)


def through_gpumesh(broker: Broker, n: int) -> float:
    t0 = time.perf_counter()
    job = broker.submit(NOOP, "noop.py", [{"i": i} for i in range(n)], JobOptions()).job_id
    while not broker.job_status(job).finished:
        time.sleep(0.02)
    elapsed = time.perf_counter() - t0
    assert broker.job_status(job).tasks.done == n
    return n / elapsed


def through_plain_rq(url: str, n: int) -> float:
    from rq import Queue
    from rq.serializers import JSONSerializer

    conn = redis.Redis.from_url(url)
    q = Queue("plain-rq-bench", connection=conn, serializer=JSONSerializer)
    t0 = time.perf_counter()
    q.enqueue_many([Queue.prepare_data("rq_noop.run", args=(NOOP, {"i": i}), result_ttl=600) for i in range(n)])
    while q.finished_job_registry.count < n:
        assert q.failed_job_registry.count == 0, "plain RQ jobs failed"
        time.sleep(0.02)
    elapsed = time.perf_counter() - t0
    conn.delete(q.finished_job_registry.key)  # the next round counts from zero
    return n / elapsed


def submit_seconds(broker: Broker, n: int) -> float:
    payloads = [{"i": i, "cost": 1 + i % 5} for i in range(n)]
    t0 = time.perf_counter()
    broker.submit(NOOP, "noop.py", payloads, JobOptions())
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=300, help="no-op shards per throughput round")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; medians are reported")
    ap.add_argument("--submit", type=int, default=10_000, help="shards in the submit benchmark")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="gpumesh-bench-"))
    server, url = start_redis(tmp)
    env = {**os.environ, "GPUMESH_URL": url, "XDG_CACHE_HOME": str(tmp / "cache")}
    worker = None
    try:
        broker = Broker(Settings(url=url))
        worker = subprocess.Popen(
            [sys.executable, "-m", "gpumesh", "worker", "--score", "1", "--log-level", "WARNING"],
            env=env, start_new_session=True,
        )  # fmt: skip
        while not broker.live_scores():
            time.sleep(0.05)
        rq_bin = str(Path(sys.executable).parent / "rq")
        rq_worker = subprocess.Popen(
            [rq_bin, "worker", "--url", url, "-w", "rq.worker.SimpleWorker", "--serializer", "rq.serializers.JSONSerializer",
             "--path", str(Path(__file__).parent), "-q", "plain-rq-bench"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        through_gpumesh(broker, 20)  # warm-up: script cache, connections
        through_plain_rq(url, 20)
        floors, meshes, plains, submits = [], [], [], []
        for _ in range(args.repeat):
            floors.append(floor(args.shards))
            meshes.append(through_gpumesh(broker, args.shards))
            plains.append(through_plain_rq(url, args.shards))
        for proc in (worker, rq_worker):
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        worker = None
        for _ in range(args.repeat):
            broker.r.flushall()
            submits.append(submit_seconds(broker, args.submit))
        f, m, s = statistics.median(floors), statistics.median(meshes), statistics.median(submits)
        pr = statistics.median(plains)
        rows = [
            ("floor: `python -c` spawn loop, tasks/s", f"{f:.1f}", ", ".join(f"{x:.1f}" for x in floors)),
            ("gpumesh, one worker, no-op shards/s", f"{m:.1f}", ", ".join(f"{x:.1f}" for x in meshes)),
            ("plain RQ, subprocess per job, tasks/s", f"{pr:.1f}", ", ".join(f"{x:.1f}" for x in plains)),
            ("gpumesh ÷ floor", f"{m / f:.2f}", ""),
            ("gpumesh ÷ plain RQ", f"{m / pr:.2f}", ""),
            (f"submit of {args.submit:,} shards, s", f"{s:.2f}", ", ".join(f"{x:.2f}" for x in submits)),
        ]
        print(f"| measure ({args.repeat} rounds, {args.shards} shards each) | median | rounds |")
        print("| --- | --- | --- |")
        for row in rows:
            print("| " + " | ".join(row) + " |")
        print(
            f"\nreproduce: python benchmarks/core.py --shards {args.shards} --repeat {args.repeat} --submit {args.submit}"
        )
    finally:
        if worker is not None:
            os.killpg(worker.pid, signal.SIGKILL)
        server.terminate()
        server.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
