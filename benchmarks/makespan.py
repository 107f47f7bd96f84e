"""Makespan on an emulated uneven fleet: gpumesh's tiers (with and without --speculate) vs. one FIFO queue.

    python benchmarks/makespan.py [--scores 1,2,4,8] [--unit 1.0] [--repeat 3]

Four real `gpumesh worker --warm --score S` processes emulate a fleet whose strengths are 1, 2, 4
and 8; each task sleeps cost × unit ÷ S, so a worker twice as strong finishes twice as fast. The
same skewed mix of costs (most light, a few heavy, in a fixed shuffled order) runs through:
  * gpumesh: tiered queues (heavy tasks to strong workers, strong workers also drain lighter tiers);
  * gpumesh --speculate: the same, plus backup copies of stragglers once nothing is queued;
  * FIFO: four plain RQ workers with the same strengths on one queue, tasks in submission order.
The lower bound is max(Σcost ÷ Σscore, max cost ÷ max score) × unit: no schedule can beat it.
A second fleet has a straggler: its score-4 worker (named "straggler") runs slower than its score
claims, as a shared or throttled machine would: at a quarter of it, then (--severe) at a sixteenth,
where a task it holds at the end outlasts the rest of the fleet. Its bounds use the real speeds.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from pathlib import Path

import redis
from common import PrivateRedis, med, publish, rounds, start_worker, stop, table

from gpumesh.broker import Broker
from gpumesh.models import JobOptions
from gpumesh.settings import Settings

SLEEP = """import json, os, sys, time
p = json.load(sys.stdin)
speed = float(os.environ["GPUMESH_WORKER_SCORE"])
if os.environ["GPUMESH_WORKER_ID"].startswith("straggler"):
    speed /= p["slowdown"]  # a machine slower than its benchmark said: shared, throttled
time.sleep(p["cost"] * p["unit"] / speed)
print(json.dumps({"cost": p["cost"]}))
"""
COSTS = [1.0] * 40 + [4.0] * 6 + [12.0] * 3 + [30.0]  # skewed: most light, a few heavy, one very heavy


def through_gpumesh(broker: Broker, payloads: list[dict], speculate: bool) -> float:
    t0 = time.perf_counter()
    job = broker.submit(SLEEP, "sleep.py", payloads, JobOptions(speculate=speculate)).job_id
    while not broker.job_status(job).finished:
        time.sleep(0.02)
    elapsed = time.perf_counter() - t0
    assert broker.job_status(job).tasks.done == len(payloads)
    return elapsed


def through_fifo(url: str, payloads: list[dict]) -> float:
    from rq import Queue
    from rq.serializers import JSONSerializer

    q = Queue("fifo", connection=redis.Redis.from_url(url), serializer=JSONSerializer)
    t0 = time.perf_counter()
    q.enqueue_many([Queue.prepare_data("rq_noop.sleep_cost", args=(p["cost"], p["unit"])) for p in payloads])
    while q.finished_job_registry.count < len(payloads):
        assert q.failed_job_registry.count == 0
        time.sleep(0.02)
    elapsed = time.perf_counter() - t0
    q.connection.delete(q.finished_job_registry.key)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scores", default="1,2,4,8")
    ap.add_argument("--unit", type=float, default=1.0, help="seconds one unit of cost takes on a score-1 worker")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--severe", type=float, default=16, help="the severe straggler's slowdown")
    args = ap.parse_args()
    scores = [float(s) for s in args.scores.split(",")]

    def bound_of(slowdown: float) -> float:
        real = [s / slowdown if s == 4 else s for s in scores]
        return max(sum(COSTS) / sum(real), max(COSTS) / max(real)) * args.unit

    bound, slow_bound, severe_bound = bound_of(1), bound_of(4), bound_of(args.severe)

    server = PrivateRedis()
    tmp = server.tmp
    env = {"XDG_CACHE_HOME": str(tmp / "cache"), "GPUMESH_HEARTBEAT_INTERVAL": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        broker, slow = Broker(Settings(url=server.db(1))), Broker(Settings(url=server.db(3)))
        for s in scores:
            procs.append(start_worker(broker.url, s, "--warm", env=env))
            procs.append(start_worker(slow.url, s, "--warm", *(["--name", "straggler"] if s == 4 else []), env=env))
        while len(broker.live_scores()) < len(scores) or len(slow.live_scores()) < len(scores):
            time.sleep(0.1)
        time.sleep(2.5)  # two heartbeats: every worker has seen the whole fleet and knows its tier
        rq_bin = str(Path(sys.executable).parent / "rq")
        for s in scores:
            procs.append(subprocess.Popen(
                [rq_bin, "worker", "--url", server.db(2), "-w", "rq.worker.SimpleWorker", "--serializer",
                 "rq.serializers.JSONSerializer", "--path", str(Path(__file__).parent), "-q", "fifo"],
                env={**env, "BENCH_SCORE": str(s)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
            ))  # fmt: skip
        tiered, speculative, fifo, straggling, rescued, severe, severe_rescued = [], [], [], [], [], [], []
        for seed in range(1, args.repeat + 1):  # each round its own submission order, the same for all
            order = COSTS[:]
            random.Random(seed).shuffle(order)
            payloads = [{"i": i, "cost": c, "unit": args.unit, "slowdown": 4} for i, c in enumerate(order)]
            harsh = [{**p, "slowdown": args.severe} for p in payloads]
            tiered.append(through_gpumesh(broker, payloads, speculate=False))
            time.sleep(1.5)  # let the losing copies of the last round be killed
            speculative.append(through_gpumesh(broker, payloads, speculate=True))
            time.sleep(1.5)
            fifo.append(through_fifo(server.db(2), payloads))
            straggling.append(through_gpumesh(slow, payloads, speculate=False))
            time.sleep(1.5)
            rescued.append(through_gpumesh(slow, payloads, speculate=True))
            time.sleep(1.5)
            severe.append(through_gpumesh(slow, harsh, speculate=False))
            time.sleep(1.5)
            severe_rescued.append(through_gpumesh(slow, harsh, speculate=True))
            time.sleep(1.5)
        wins = sum(int(b.r.hget("gpumesh:stats", "speculative_wins") or 0) for b in (broker, slow))
        backups = sum(int(b.r.hget("gpumesh:stats", "speculated") or 0) for b in (broker, slow))
    finally:
        stop(procs)
        server.stop()
    rows = [
        ("gpumesh tiers", f"{med(tiered):.2f}", f"{med(tiered) / bound:.2f}", rounds(tiered)),
        ("gpumesh tiers + --speculate", f"{med(speculative):.2f}", f"{med(speculative) / bound:.2f}", rounds(speculative)),
        ("one FIFO queue (plain RQ)", f"{med(fifo):.2f}", f"{med(fifo) / bound:.2f}", rounds(fifo)),
        ("straggler fleet: gpumesh tiers", f"{med(straggling):.2f}", f"{med(straggling) / slow_bound:.2f}", rounds(straggling)),
        ("straggler fleet: gpumesh tiers + --speculate", f"{med(rescued):.2f}", f"{med(rescued) / slow_bound:.2f}", rounds(rescued)),
        (f"severe straggler (1/{args.severe:g} speed): gpumesh tiers", f"{med(severe):.2f}", f"{med(severe) / severe_bound:.2f}", rounds(severe)),
        (f"severe straggler (1/{args.severe:g} speed): tiers + --speculate", f"{med(severe_rescued):.2f}", f"{med(severe_rescued) / severe_bound:.2f}", rounds(severe_rescued)),
    ]  # fmt: skip
    body = (
        f"Fleet scores {args.scores}; {len(COSTS)} tasks, costs {sorted(set(COSTS))} "
        f"(Σ {sum(COSTS):.0f}); unit {args.unit} s; lower bound **{bound:.2f} s** "
        f"(straggler fleet: **{slow_bound:.2f} s**, severe straggler: **{severe_bound:.2f} s**).\n\n"
        + table(["schedule", "makespan, s (median)", "÷ lower bound (target ≤ 1.15)", "rounds"], rows)
        + f"\n\nBackup copies started over the --speculate rounds: {backups}; won: {wins}."
    )
    publish(
        "makespan", "Makespan on an uneven fleet", body,
        f"python benchmarks/makespan.py --scores {args.scores} --unit {args.unit} --repeat {args.repeat}"
        f" --severe {args.severe:g}",
    )  # fmt: skip


if __name__ == "__main__":
    main()
