"""Throughput per worker, side by side in one run on this machine.

    python benchmarks/core.py [--shards 100] [--warm-shards 500] [--repeat 3]

Starts its own redis-server on a free port and measures, alternating the contenders each round:
  * floor:   a loop spawning `python -c <no-op script>` with a JSON payload on stdin (what any
             fresh-interpreter executor pays per task);
  * gpumesh: one `gpumesh worker` draining a job of no-op shards (submit to last result), in
             fresh mode (a new interpreter per task, started while the one before runs) and warm
             mode (`--warm`, forked from a zygote);
  * one core: the floor and the fresh-mode worker again, each pinned to CPU 0 (`taskset -c 0`), so the
             next interpreter's head start cannot use the other core: what fresh mode gives when
             every core has a worker of its own;
  * plain RQ: one RQ SimpleWorker (JSON serializer) whose jobs each run the same script in a fresh
             `python -c` subprocess (benchmarks/rq_noop.py), enqueue to last result;
  * RQ's ceiling: the same RQ worker running a function that returns at once (RQ's own cost per job).
Each contender has its own Redis database, so idle workers never take another's work.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import redis
from common import PrivateRedis, med, publish, rounds, start_worker, stop, table

from gpumesh.broker import Broker
from gpumesh.models import JobOptions
from gpumesh.settings import Settings

NOOP = "import json, sys\npayload = json.load(sys.stdin)\nprint(json.dumps({'i': payload['i']}))\n"


def floor(n: int, cpus: set[int] | None = None) -> float:
    """Tasks per second of a bare spawn loop: interpreter start, payload on stdin, one JSON line back.
    With ``cpus``, the loop and its children run on those CPUs only."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus or before)
    try:
        t0 = time.perf_counter()
        for i in range(n):
            subprocess.run(
                [sys.executable, "-c", NOOP], input=json.dumps({"i": i}).encode(), capture_output=True, check=True
            )
        return n / (time.perf_counter() - t0)
    finally:
        os.sched_setaffinity(0, before)


def through_gpumesh(broker: Broker, n: int) -> float:
    t0 = time.perf_counter()
    job = broker.submit(NOOP, "noop.py", [{"i": i} for i in range(n)], JobOptions()).job_id
    while not broker.job_status(job).finished:
        time.sleep(0.01)
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
        time.sleep(0.01)
    elapsed = time.perf_counter() - t0
    conn.delete(q.finished_job_registry.key)  # the next round counts from zero
    return n / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=100, help="no-op shards per fresh-interpreter round")
    ap.add_argument("--warm-shards", type=int, default=500, help="no-op shards per warm and RQ-ceiling round")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; medians are reported")
    args = ap.parse_args()

    server = PrivateRedis()
    tmp = server.tmp
    env = {"XDG_CACHE_HOME": str(tmp / "cache")}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        brokers = {
            "fresh": Broker(Settings(url=server.db(1))),
            "warm": Broker(Settings(url=server.db(2))),
            "pinned": Broker(Settings(url=server.db(3))),
        }
        for mode, broker in brokers.items():
            extra = ["--warm"] if mode == "warm" else []
            prefix = ["taskset", "-c", "0"] if mode == "pinned" else []
            procs.append(start_worker(broker.url, 1, *extra, env=env, prefix=prefix))
            while not broker.live_scores():
                time.sleep(0.05)
        rq_bin = str(Path(sys.executable).parent / "rq")
        procs.append(subprocess.Popen(
            [rq_bin, "worker", "--url", server.url, "-w", "rq.worker.SimpleWorker", "--serializer",
             "rq.serializers.JSONSerializer", "--path", str(Path(__file__).parent), "-q", "plain-rq-bench"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        ))  # fmt: skip
        for b in brokers.values():
            through_gpumesh(b, 20)  # warm-up: script cache, connections
        through_plain_rq(server.url, 20)
        floors, fresh, warm, plain, ceiling, floors1, fresh1 = [], [], [], [], [], [], []
        for _ in range(args.repeat):
            floors.append(floor(args.shards))
            fresh.append(through_gpumesh(brokers["fresh"], args.shards))
            floors1.append(floor(args.shards, {0}))
            fresh1.append(through_gpumesh(brokers["pinned"], args.shards))
            warm.append(through_gpumesh(brokers["warm"], args.warm_shards))
            plain.append(through_plain_rq(server.url, args.shards))
            ceiling.append(through_plain_rq(server.url, args.warm_shards, "rq_noop.nothing"))
        f, m, w, p, c = med(floors), med(fresh), med(warm), med(plain), med(ceiling)
        f1, m1 = med(floors1), med(fresh1)
        rows = [
            ("floor: `python -c` spawn loop", f"{f:.1f}", rounds(floors, "{:.1f}")),
            ("plain RQ, a `python -c` subprocess per job", f"{p:.1f}", rounds(plain, "{:.1f}")),
            ("**gpumesh worker** (fresh interpreter per task, started ahead)", f"{m:.1f}", rounds(fresh, "{:.1f}")),
            ("floor, on one core (CPU 0)", f"{f1:.1f}", rounds(floors1, "{:.1f}")),
            ("**gpumesh worker**, on one core (`taskset -c 0`)", f"{m1:.1f}", rounds(fresh1, "{:.1f}")),
            ("**gpumesh worker --warm** (forked from a zygote)", f"{w:.1f}", rounds(warm, "{:.1f}")),
            ("RQ's ceiling: a no-op function, no subprocess", f"{c:.1f}", rounds(ceiling, "{:.1f}")),
        ]
        ratios = [
            ("gpumesh fresh ÷ floor (target ≥ 0.80)", f"{m / f:.2f}"),
            ("gpumesh fresh ÷ floor, both on one core", f"{m1 / f1:.2f}"),
            ("gpumesh fresh ÷ plain RQ", f"{m / p:.2f}"),
            ("gpumesh --warm ÷ floor", f"{w / f:.2f}"),
            ("gpumesh --warm ÷ RQ's ceiling", f"{w / c:.2f}"),
        ]
        body = (
            table(["contender (one worker, no-op shards)", "tasks/s, median", "rounds"], rows)
            + "\n\n"
            + table(["ratio", "value"], ratios)
        )
        cmd = (
            f"python benchmarks/core.py --shards {args.shards} --warm-shards {args.warm_shards} --repeat {args.repeat}"
        )
        publish("core", "Throughput per worker", body, cmd)
    finally:
        stop(procs)
        server.stop()


if __name__ == "__main__":
    main()
