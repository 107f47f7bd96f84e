"""Scale: 1,000 simulated workers against one Redis, each with a real worker's broker traffic.

    python benchmarks/scale.py [--workers 1000] [--tasks 30000] [--heartbeat 5]

The workers are plain state machines in one process, not processes: each registers, heartbeats
(heartbeat.lua, lease renewal included) every --heartbeat seconds, pops a delivery from the tier
queues a real submit filled, then runs acquire.lua and complete.lua. A real worker adds RQ's own
bookkeeping and the task itself; this measures what the broker can carry.

The harness advances all workers one step per round and sends the round's commands as one
pipeline, as if 1,000 clients' commands arrived interleaved: a Python client sending one command
at a time cannot produce this load on a 2-core machine (it peaked near 760 completions/s with Redis
at 23 % of a core). Acquire latency is measured apart, by one real client in its own process doing
acquire.lua then complete.lua on its own tasks, one call at a time, while the fleet runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import redis
from common import PrivateRedis, publish, table

from gpumesh import keys, scripts
from gpumesh.broker import Broker
from gpumesh.models import JobOptions
from gpumesh.settings import Settings

LEASE_MS = 30_000
PROBE = r"""
import json, os, sys, time
from gpumesh import keys, scripts
from gpumesh.broker import Broker
from gpumesh.settings import Settings
url, job, stop = sys.argv[1], sys.argv[2], sys.argv[3]
b = Broker(Settings(url=url))
lat, i = [], 0
while not os.path.exists(stop):
    tid = keys.task_id(job, i)
    t0 = time.perf_counter()
    lease = scripts.acquire(b.scripts, b.r, tid, "probe", 30000)
    lat.append((time.perf_counter() - t0) * 1000)
    scripts.complete(b.scripts, b.r, lease, "probe", "{}", 0.001)
    i += 1
    time.sleep(0.002)
print(json.dumps(lat))
"""


def simulate(r: redis.Redis, s: scripts.Scripts, n: int, total: int, heartbeat: float, epoch: str) -> dict:
    queues = [f"rq:queue:{keys.queue_name(t)}" for t in (2, 1, 0)]
    ids = [f"sim-{i}" for i in range(n)]
    with r.pipeline(transaction=False) as p:
        for wid in ids:
            p.hset(keys.worker(wid), mapping={"name": wid, "score": 1, "device": "cpu", "current_task": ""})
            p.zadd(keys.SCORES, {wid: 1.0})
        p.execute()
    phase: dict[str, tuple] = {wid: ("pop",) for wid in ids}
    next_beat = {wid: time.monotonic() + heartbeat * i / n for i, wid in enumerate(ids)}  # spread, as in life
    done = beats = rounds = 0
    acquire_ms: list[float] = []
    started = time.monotonic()
    while done < total:
        now = time.monotonic()
        steps = []
        with r.pipeline(transaction=False) as p:
            for wid in ids:
                if now >= next_beat[wid]:
                    ph = phase[wid]
                    tid, token = (ph[1], ph[2]) if ph[0] == "complete" else ("", "")
                    s["heartbeat"](
                        keys=[keys.worker(wid), keys.WORKERS, keys.lease(tid), keys.LEASES, keys.task(tid), keys.EPOCH],
                        args=[wid, 60_000, token, LEASE_MS, tid, epoch], client=p,
                    )  # fmt: skip
                    steps.append((wid, "beat"))
                    next_beat[wid] = now + heartbeat
                ph = phase[wid]
                if ph[0] == "pop":
                    p.execute_command("LMPOP", len(queues), *queues, "LEFT")
                elif ph[0] == "acquire":
                    s["acquire"](keys=[*_task_keys(ph[1]), keys.worker(wid), keys.QUEUED], args=[ph[1], wid, LEASE_MS],
                                 client=p)  # fmt: skip
                else:
                    s["complete"](keys=[*_task_keys(ph[1]), keys.worker(wid), keys.STATS, keys.STATS_DURATION],
                                  args=[ph[1], ph[2], "{}", "0.001"], client=p)  # fmt: skip
                steps.append((wid, ph[0]))
            t0 = time.perf_counter()
            replies = p.execute()
            rtt = (time.perf_counter() - t0) * 1000
        rounds += 1
        for (wid, step), reply in zip(steps, replies):
            if step == "beat":
                beats += 1
            elif step == "pop":
                if reply:  # [queue, [rq job id]]
                    phase[wid] = ("acquire", reply[1][0].rsplit("_", 1)[0])
            elif step == "acquire":
                acquire_ms.append(rtt)
                phase[wid] = ("complete", phase[wid][1], reply[1]) if int(reply[0]) == 1 else ("pop",)
            else:
                done += int(reply[0]) == 1
                phase[wid] = ("pop",)
    wall = time.monotonic() - started
    return {"done": done, "wall": wall, "beats": beats, "rounds": rounds, "acquire_ms": acquire_ms}


def _task_keys(tid: str) -> list[str]:
    return [keys.task(tid), keys.lease(tid), keys.LEASES, keys.job(keys.job_of_task(tid)), keys.EVENTS]


def _redis_cpu(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--tasks", type=int, default=30_000)
    ap.add_argument("--heartbeat", type=float, default=5.0, help="seconds between one worker's heartbeats")
    args = ap.parse_args()
    server = PrivateRedis()
    tmp = server.tmp
    try:
        broker = Broker(Settings(url=server.url))
        # The probe's own tasks, without deliveries: the fleet never pops them.
        probe_job = broker.submit("print('{}')", "noop.py", [{"i": i} for i in range(20_000)], JobOptions()).job_id
        broker.r.delete(*[f"rq:queue:{keys.queue_name(t)}" for t in range(broker.settings.tiers)])
        job = broker.submit("print('{}')", "noop.py", [{"i": i} for i in range(args.tasks)], JobOptions()).job_id
        epoch = broker.r.get(keys.EPOCH) or ""
        stop_file = tmp / "stop"
        probe = subprocess.Popen(
            [sys.executable, "-c", PROBE, server.url, probe_job, str(stop_file)], stdout=subprocess.PIPE, text=True
        )
        cpu0 = _redis_cpu(broker.r)
        sim = simulate(broker.r, broker.scripts, args.workers, args.tasks, args.heartbeat, epoch)
        cpu = (_redis_cpu(broker.r) - cpu0) / sim["wall"]
        stop_file.touch()
        probe_ms = sorted(json.loads(probe.communicate(timeout=60)[0]))
        st = broker.job_status(job)
        assert st.tasks.done == args.tasks == sim["done"] and st.status == "done", st
    finally:
        server.stop()
    p50, p99 = statistics.median(probe_ms), probe_ms[int(len(probe_ms) * 0.99)]
    lat = sorted(sim["acquire_ms"])
    round_p50 = statistics.median(lat)
    rows = [(
        f"{args.workers:,}", f"{sim['done']:,} in {sim['wall']:.1f} s", f"**{sim['done'] / sim['wall']:,.0f}**",
        "≥ 2,000", f"{p50:.2f}", f"{p99:.2f}", f"{sim['beats'] / sim['wall']:,.0f}", f"{100 * cpu:.0f} %",
    )]  # fmt: skip
    body = table(
        ["simulated workers", "completions", "completions/s", "target", "acquire p50, ms", "acquire p99, ms",
         "heartbeats/s", "Redis CPU (share of one core)"],
        rows,
    )  # fmt: skip
    body += (
        f"\n\n{sim['rounds']:,} rounds of up to {args.workers:,} workers' next commands each (LMPOP of a delivery, "
        "acquire.lua, complete.lua, heartbeat.lua when due); the job's counters ended exact, every task done once. "
        f"Acquire latency: {len(probe_ms):,} calls of the probe client during the run. A whole round of "
        f"{args.workers:,} commands took {round_p50:.0f} ms (median), client packing and parsing included."
    )
    publish(
        "scale", "1,000 simulated workers", body,
        f"python benchmarks/scale.py --workers {args.workers} --tasks {args.tasks} --heartbeat {args.heartbeat:g}",
    )  # fmt: skip


if __name__ == "__main__":
    main()
