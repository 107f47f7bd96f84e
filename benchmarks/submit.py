"""Submit cost: seconds and Redis memory per queued task, for 10,000 and 100,000 shards.

    python benchmarks/submit.py [--sizes 10000,100000] [--repeat 3]

Each round starts from an empty private Redis. Side by side in the same run: RQ's own
`enqueue_many` of the same number of jobs (what any RQ-based submit pays at least). Client peak
memory is read in a child process per round (ru_maxrss), so rounds do not share a high-water mark.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from common import PrivateRedis, med, publish, rounds, table

ROUND = r"""
import json, resource, sys, time
import redis
from rq import Queue
from rq.serializers import JSONSerializer
from gpumesh.broker import Broker
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
else:
    q = Queue("plain", connection=redis.Redis.from_url(url), serializer=JSONSerializer)
    for start in range(0, n, 5000):
        q.enqueue_many([Queue.prepare_data("rq_noop.nothing", args=("", p)) for p in payloads[start:start + 5000]])
elapsed = time.perf_counter() - t0
mem = b.r.info("memory")
print(json.dumps({"s": elapsed, "bytes_per_task": (mem["used_memory"] - base) / n,
                  "redis_peak_mib": mem["used_memory_peak"] / 2**20,
                  "client_extra_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024}))
"""


def one(url: str, n: int, what: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", ROUND, url, str(n), what], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    server = PrivateRedis()
    rows = []
    try:
        for n in map(int, args.sizes.split(",")):
            mesh, plain = [], []
            for _ in range(args.repeat):
                mesh.append(one(server.url, n, "gpumesh"))
                plain.append(one(server.url, n, "rq"))
            ms, ps = [r["s"] for r in mesh], [r["s"] for r in plain]
            target = "< 1.5 s" if n == 10_000 else "< 15 s" if n == 100_000 else ""
            rows.append((
                f"{n:,}", f"{med(ms):.2f}", rounds(ms), target, f"{med(ps):.2f}", f"{med(ms) / med(ps):.2f}",
                f"{med([r['bytes_per_task'] for r in mesh]):,.0f}",
                f"{med([r['redis_peak_mib'] for r in mesh]):.0f}",
                f"{med([r['client_extra_mib'] for r in mesh]):.0f}",
            ))  # fmt: skip
    finally:
        server.stop()
    body = table(
        ["shards", "gpumesh submit, s (median)", "rounds", "target", "RQ enqueue_many alone, s", "gpumesh ÷ RQ",
         "Redis bytes per queued task", "Redis peak, MiB", "client peak growth, MiB"],
        rows,
    )  # fmt: skip
    body += (
        "\n\nA job above 10,000 tasks is written in stages (5,000 tasks per round trip, one MULTI/EXEC to make it"
        " visible, deliveries in chunks), so neither the client nor Redis's MULTI buffer holds it whole twice."
    )
    publish("submit", "Submit", body, f"python benchmarks/submit.py --sizes {args.sizes} --repeat {args.repeat}")


if __name__ == "__main__":
    main()
