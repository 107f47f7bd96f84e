"""Core throughput benchmark, side by side in one run on this machine.

    python benchmarks/core.py [--shards 300] [--repeat 3] [--submit 10000]

Starts its own redis-server on a free port and measures, alternating the contenders each round:
  * floor:   a loop spawning `python -c <no-op script>` with a JSON payload on stdin (what any
             fresh-interpreter executor pays per task);
  * gpumesh: one `gpumesh worker` draining a job of no-op shards (submit to last result), in
             fresh mode (a new interpreter per task) and warm mode (`--warm`, forked from a zygote);
  * RQ's ceiling: the same RQ worker running a function that returns at once (RQ's own cost per job);
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


def through_plain_rq(url: str, n: int, func: str = "rq_noop.run") -> float:
    from rq import Queue
    from rq.serializers import JSONSerializer

    conn = redis.Redis.from_url(url)
    q = Queue("plain-rq-bench", connection=conn, serializer=JSONSerializer)
    t0 = time.perf_counter()
    q.enqueue_many([Queue.prepare_data(func, args=(NOOP, {"i": i}), result_ttl=600) for i in range(n)])
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
    ap.add_argument("--warm-shards", type=int, default=1000, help="no-op shards per warm-mode round")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; medians are reported")
    ap.add_argument("--submit", type=int, default=10_000, help="shards in the submit benchmark")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="gpumesh-bench-"))
    server, url = start_redis(tmp)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp / "cache")}
    workers: list[subprocess.Popen[bytes]] = []
    try:
        # Each contender has its own Redis database, so the idle ones never take the others' work.
        brokers = {"fresh": Broker(Settings(url=url[:-1] + "1")), "warm": Broker(Settings(url=url[:-1] + "2"))}
        for mode, broker in brokers.items():
            workers.append(subprocess.Popen(
                [sys.executable, "-m", "gpumesh", "worker", "--score", "1", "--log-level", "WARNING",
                 *(["--warm"] if mode == "warm" else [])],
                env={**env, "GPUMESH_URL": broker.url}, start_new_session=True,
            ))  # fmt: skip
            while not broker.live_scores():
                time.sleep(0.05)
        broker = brokers["fresh"]
        rq_bin = str(Path(sys.executable).parent / "rq")
        rq_worker = subprocess.Popen(
            [rq_bin, "worker", "--url", url, "-w", "rq.worker.SimpleWorker", "--serializer", "rq.serializers.JSONSerializer",
             "--path", str(Path(__file__).parent), "-q", "plain-rq-bench"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        workers.append(rq_worker)
        for b in brokers.values():
            through_gpumesh(b, 20)  # warm-up: script cache, connections
        through_plain_rq(url, 20)
        floors, meshes, warms, plains, ceilings, submits = [], [], [], [], [], []
        for _ in range(args.repeat):
            floors.append(floor(args.shards))
            meshes.append(through_gpumesh(brokers["fresh"], args.shards))
            warms.append(through_gpumesh(brokers["warm"], args.warm_shards))
            plains.append(through_plain_rq(url, args.shards))
            ceilings.append(through_plain_rq(url, args.warm_shards, "rq_noop.nothing"))
        for proc in workers:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        workers = []
        for _ in range(args.repeat):
            broker.r.flushall()
            submits.append(submit_seconds(broker, args.submit))
        f, m, s = statistics.median(floors), statistics.median(meshes), statistics.median(submits)
        pr, w, c = statistics.median(plains), statistics.median(warms), statistics.median(ceilings)
        rows = [
            ("floor: `python -c` spawn loop, tasks/s", f"{f:.1f}", ", ".join(f"{x:.1f}" for x in floors)),
            ("gpumesh fresh, one worker, no-op shards/s", f"{m:.1f}", ", ".join(f"{x:.1f}" for x in meshes)),
            ("gpumesh --warm, one worker, no-op shards/s", f"{w:.1f}", ", ".join(f"{x:.1f}" for x in warms)),
            ("plain RQ, subprocess per job, tasks/s", f"{pr:.1f}", ", ".join(f"{x:.1f}" for x in plains)),
            (
                "RQ's ceiling: a no-op function, no subprocess, jobs/s",
                f"{c:.1f}",
                ", ".join(f"{x:.1f}" for x in ceilings),
            ),
            ("gpumesh fresh ÷ floor", f"{m / f:.2f}", ""),
            ("gpumesh fresh ÷ plain RQ", f"{m / pr:.2f}", ""),
            ("gpumesh --warm ÷ floor", f"{w / f:.2f}", ""),
            ("gpumesh --warm ÷ RQ's ceiling", f"{w / c:.2f}", ""),
            (f"submit of {args.submit:,} shards, s", f"{s:.2f}", ", ".join(f"{x:.2f}" for x in submits)),
        ]
        print(f"| measure ({args.repeat} rounds, {args.shards} shards each) | median | rounds |")
        print("| --- | --- | --- |")
        for row in rows:
            print("| " + " | ".join(row) + " |")
        print(
            f"\nreproduce: python benchmarks/core.py --shards {args.shards} --warm-shards {args.warm_shards} --repeat {args.repeat} --submit {args.submit}"
        )
    finally:
        for proc in workers:
            os.killpg(proc.pid, signal.SIGKILL)
        server.terminate()
        server.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
