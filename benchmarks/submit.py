"""Submit cost: seconds and Redis memory per queued task, for 10,000, 100,000 and 1,000,000 shards.

    python benchmarks/submit.py [--sizes 10000,100000,1000000] [--repeat 3] [--rq-max 100000] [--against REV]

Each round starts from an empty private Redis and submits one job of no-op shards through
Broker.submit; Redis's used_memory is read before and after, and the RQ job hashes present after
the submit are counted (none: a queued gpumesh task is a slim hash plus a member of its job's
pending zset, and an RQ job exists only for a task a worker has taken). Side by side in the same
run: RQ's own `enqueue_many` of the same number of jobs, one RQ job per task (what an RQ-based
submit pays at least); it is skipped above --rq-max shards (a million RQ jobs take minutes to write
and several hundred MB of Redis), and the table shows instead what the largest size measured
extrapolates to. Client peak memory is read in a
child process per round (ru_maxrss), so rounds do not share a high-water mark. With --against REV, each
round also submits with the package as of that git revision (alternating with this checkout's), and the
table gains its median and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from common import PrivateRedis, med, publish, revision_tree, rounds, table

from gpumesh.store.submit import STAGE_ABOVE, STAGE_CHUNK

ROUND = r"""
import json, resource, sys, time
import redis
from rq import Queue
from rq.serializers import JSONSerializer
from gpumesh.store.broker import Broker
from gpumesh.models import JobOptions
from gpumesh.settings import Settings

url, n, what = sys.argv[1], int(sys.argv[2]), sys.argv[3]
b = Broker(Settings(url=url))
b.r.flushall()
base = b.r.info("memory")["used_memory"]
payloads = [{"i": i, "cost": 1 + i % 5} for i in range(n)]
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
if what == "gpumesh":
    b.submit("import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n", "noop.py", payloads, JobOptions())
    b.r.ping()  # the submit's last reply is in: everything is written
else:
    q = Queue("plain", connection=redis.Redis.from_url(url), serializer=JSONSerializer)
    for start in range(0, n, 5000):
        q.enqueue_many([Queue.prepare_data("rq_noop.nothing", args=("", p)) for p in payloads[start:start + 5000]])
elapsed = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
mem = b.r.info("memory")
rq_jobs = sum(1 for _ in b.r.scan_iter("rq:job:*", count=10000))
print(json.dumps({"s": elapsed, "bytes_per_task": (mem["used_memory"] - base) / n,
                  "redis_peak_mib": mem["used_memory_peak"] / 2**20, "rq_jobs": rq_jobs,
                  "client_extra_mib": (rss - rss0) / 1024}))
"""


def one(url: str, n: int, what: str, tree: Path | None = None) -> dict[str, float]:
    """One round in a child process; with ``tree``, the package extracted there (run from outside the checkout)."""
    env = {**os.environ, "PYTHONPATH": str(tree)} if tree else None
    out = subprocess.run(
        [sys.executable, "-c", ROUND, url, str(n), what], capture_output=True, text=True, check=True, env=env,
        cwd=tree.parent if tree else None,
    )  # fmt: skip
    return json.loads(out.stdout)


TARGETS = {10_000: ("< 1.5 s", 1.5, None), 100_000: ("< 15 s", 15.0, None), 1_000_000: ("< 30 s", 30.0, 600)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rq-max", type=int, default=100_000, help="skip the RQ contender above this many shards")
    ap.add_argument("--against", metavar="REV", help="also submit with gpumesh as of this git revision")
    args = ap.parse_args()
    server = PrivateRedis()
    tree = revision_tree(args.against, server.tmp / "against") if args.against else None
    rows = []
    rq_rate: tuple[float, float] | None = None
    try:
        for n in sorted(map(int, args.sizes.split(","))):
            mesh, plain, before = [], [], []
            for i in range(args.repeat):
                if tree is not None and i % 2:  # which goes first alternates
                    before.append(one(server.url, n, "gpumesh", tree))
                mesh.append(one(server.url, n, "gpumesh"))
                if tree is not None and not i % 2:
                    before.append(one(server.url, n, "gpumesh", tree))
                if n <= args.rq_max:
                    plain.append(one(server.url, n, "rq"))
            ms = [r["s"] for r in mesh]
            per_task = med([r["bytes_per_task"] for r in mesh])
            target, limit, mem_limit = TARGETS.get(n, ("", None, None))
            met = [] if limit is None else [med(ms) < limit]
            if mem_limit is not None:
                target += f", < {mem_limit} B/task"
                met.append(per_task < mem_limit)
            if plain:
                ps = [r["s"] for r in plain]
                rq_b = med([r["bytes_per_task"] for r in plain])
                rq_rate = (med(ps) / n, rq_b)  # seconds and bytes per job, for the sizes skipped
                rq_s, ratio, rq_bytes = f"{med(ps):.2f}", f"{med(ms) / med(ps):.2f}", f"{rq_b:,.0f}"
            elif rq_rate is not None:
                rq_s = f"skipped (> --rq-max); ~{n * rq_rate[0]:,.0f} extrapolated"
                ratio, rq_bytes = (
                    f"~{med(ms) / (n * rq_rate[0]):.2f}",
                    f"~{rq_rate[1]:,.0f} (~{n * rq_rate[1] / 2**20:,.0f} MiB)",
                )
            else:
                rq_s, ratio, rq_bytes = "skipped (> --rq-max)", "", ""
            rows.append((
                f"{n:,}", f"{med(ms):.2f}", rounds(ms), target or "", ("yes" if all(met) else "**no**") if met else "",
                f"{per_task:,.0f}", f"{max(r['rq_jobs'] for r in mesh):,}",
                f"{med([r['redis_peak_mib'] for r in mesh]):.0f}", f"{med([r['client_extra_mib'] for r in mesh]):.0f}",
                rq_s, ratio, rq_bytes,
            ))  # fmt: skip
            if before:
                bs = [r["s"] for r in before]
                rows[-1] += (f"{med(bs):.2f} ({rounds(bs)})", f"{med(ms) / med(bs):.2f}")
    finally:
        server.stop()
    body = table(
        ["shards", "gpumesh submit, s (median)", "rounds", "target", "met", "Redis bytes per queued task",
         "RQ job hashes after the submit", "Redis peak, MiB", "client peak growth, MiB",
         "RQ enqueue_many alone, s", "gpumesh ÷ RQ", "RQ: Redis bytes per job",
         *([f"{args.against}, s (rounds)", f"÷ {args.against}"] if tree else [])],
        rows,
    )  # fmt: skip
    body += (
        f"\n\nA queued task is a slim hash (its index, payload and status; a cost or requirement class only when not "
        f"the default) plus one member of its job's pending zset; the job hash holds what all its tasks share. No RQ "
        f"job is written at submit: a worker enqueues one to its tier's queue when dispatch.lua gives it a task, "
        f"and each tier's queue shows at most 20 waiting tasks (a window), whatever the backlog. A job "
        f"above {STAGE_ABOVE:,} tasks is written in stages ({STAGE_CHUNK:,} tasks per round trip, invisible), then "
        "one MULTI/EXEC makes it visible at once, so neither the client nor Redis's MULTI buffer holds it whole. "
        "The RQ contender writes one RQ job per task, as 8c0e58b's submit did (placement fixed at submit)."
    )
    publish(
        "submit", "Submit", body,
        f"python benchmarks/submit.py --sizes {args.sizes} --repeat {args.repeat} --rq-max {args.rq_max}"
        + (f" --against {args.against}" if args.against else ""),
    )  # fmt: skip


if __name__ == "__main__":
    main()
