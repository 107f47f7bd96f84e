"""Scale: 1,000 simulated workers (asyncio coroutines, not processes) against one Redis.

    python benchmarks/scale.py [--workers 1000] [--tasks 20000] [--seconds 20] [--connections 64]

Each simulated worker registers, heartbeats every --heartbeat seconds (heartbeat.lua, lease renewal
included), takes deliveries from the tier queues a real submit filled, and runs acquire.lua then
complete.lua for each: exactly the broker traffic of a real worker, minus RQ's own bookkeeping and
minus the task. Reports completions/s, acquire latency as a worker sees it (p50/p99, including
waiting for a pooled connection), and Redis CPU (INFO cpu) per second of wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import redis
import redis.asyncio as aredis
from common import PrivateRedis, publish, table

from gpumesh import keys, scripts
from gpumesh.broker import Broker
from gpumesh.models import JobOptions
from gpumesh.settings import Settings

LEASE_MS = 30_000


class Sim:
    def __init__(self, url: str, connections: int, heartbeat: float, epoch: str, deadline: float, total: int) -> None:
        self.total = total
        self.pool_wait = aredis.BlockingConnectionPool.from_url(url, max_connections=connections, decode_responses=True)
        self.r = aredis.Redis(connection_pool=self.pool_wait)
        self.s = {name: self.r.register_script(scripts._source(name)) for name in ("acquire", "complete", "heartbeat")}
        self.heartbeat, self.epoch, self.deadline = heartbeat, epoch, deadline
        self.queues = [f"rq:queue:{keys.queue_name(t)}" for t in (2, 1, 0)]
        self.acquire_ms: list[float] = []
        self.done = 0
        self.beats = 0
        self.started = time.monotonic()
        self.last_done = self.started

    async def worker(self, wid: str) -> None:
        r = self.r
        await r.hset(keys.worker(wid), mapping={"name": wid, "score": 1, "device": "cpu", "current_task": ""})
        await r.zadd(keys.SCORES, {wid: 1.0})
        next_beat = 0.0
        lease_token, lease_task = "", ""
        while time.monotonic() < self.deadline:
            now = time.monotonic()
            if now >= next_beat:
                await self.s["heartbeat"](
                    keys=[keys.worker(wid), keys.WORKERS, keys.lease(lease_task), keys.LEASES, keys.task(lease_task),
                          keys.EPOCH],
                    args=[wid, 60_000, lease_token, LEASE_MS, lease_task, self.epoch],
                )  # fmt: skip
                self.beats += 1
                next_beat = now + self.heartbeat
            rq_id = None
            for q in self.queues:
                rq_id = await r.lpop(q)
                if rq_id:
                    break
            if not rq_id:
                if self.done >= self.total:
                    return  # the job is done: stop, so Redis CPU is measured over the busy time only
                await asyncio.sleep(0.05)
                continue
            tid = rq_id.rsplit("_", 1)[0]
            task_keys = [keys.task(tid), keys.lease(tid), keys.LEASES, keys.job(keys.job_of_task(tid)), keys.EVENTS]
            t0 = time.perf_counter()
            res = await self.s["acquire"](keys=[*task_keys, keys.worker(wid), keys.QUEUED], args=[tid, wid, LEASE_MS])
            self.acquire_ms.append((time.perf_counter() - t0) * 1000)
            if int(res[0]) != 1:
                continue
            lease_token, lease_task = res[1], tid
            await self.s["complete"](
                keys=[*task_keys, keys.worker(wid), keys.STATS, keys.STATS_DURATION],
                args=[tid, lease_token, "{}", "0.001"],
            )
            lease_token, lease_task = "", ""
            self.done += 1
            self.last_done = time.monotonic()


async def simulate(url: str, n: int, connections: int, heartbeat: float, epoch: str, seconds: float, total: int) -> Sim:
    sim = Sim(url, connections, heartbeat, epoch, time.monotonic() + seconds, total)
    await asyncio.gather(*(sim.worker(f"sim-{i}") for i in range(n)))
    await sim.r.aclose()
    await sim.pool_wait.aclose()
    return sim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--tasks", type=int, default=20_000)
    ap.add_argument("--seconds", type=float, default=60.0, help="the longest the simulated fleet runs")
    ap.add_argument("--heartbeat", type=float, default=5.0, help="seconds between one worker's heartbeats")
    ap.add_argument("--connections", type=int, default=64, help="connection pool shared by the coroutines")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpumesh-bench-"))
    server = PrivateRedis(tmp)
    try:
        broker = Broker(Settings(url=server.url))
        job = broker.submit("print('{}')", "noop.py", [{"i": i} for i in range(args.tasks)], JobOptions()).job_id
        epoch = broker.r.get(keys.EPOCH) or ""
        cpu0 = _redis_cpu(broker.r)
        sim = asyncio.run(
            simulate(server.url, args.workers, args.connections, args.heartbeat, epoch, args.seconds, args.tasks)
        )
        wall = (
            sim.last_done - sim.started
        )  # up to the last completion: idle time after the queue ran dry is not counted
        cpu = (_redis_cpu(broker.r) - cpu0) / (time.monotonic() - sim.started)
        done = broker.job_status(job).tasks.done
        assert done == sim.done, (done, sim.done)
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    lat = sorted(sim.acquire_ms)
    p50, p99 = statistics.median(lat), lat[int(len(lat) * 0.99)]
    rows = [(
        f"{args.workers:,}", f"{sim.done:,} in {wall:.1f} s", f"**{sim.done / wall:,.0f}**", "≥ 2,000",
        f"{p50:.2f}", f"{p99:.2f}", f"{sim.beats / wall:,.0f}", f"{100 * cpu:.0f} %",
    )]  # fmt: skip
    body = table(
        ["simulated workers", "completions", "completions/s", "target", "acquire p50, ms", "acquire p99, ms",
         "heartbeats/s", "Redis CPU (of one core)"],
        rows,
    )  # fmt: skip
    body += (
        f"\n\nOne Python process runs the {args.workers:,} coroutines over a pool of {args.connections} connections; "
        "each completion is LPOP + acquire.lua + complete.lua, each heartbeat heartbeat.lua. On a 2-core machine "
        "the client and Redis share the cores, so the client side is part of what limits the rate."
    )
    publish(
        "scale", "1,000 simulated workers", body,
        f"python benchmarks/scale.py --workers {args.workers} --tasks {args.tasks} --seconds {args.seconds:g} "
        f"--heartbeat {args.heartbeat:g} --connections {args.connections}",
    )  # fmt: skip


def _redis_cpu(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


if __name__ == "__main__":
    main()
