"""Throughput per worker, side by side in one run on this machine, against an older revision too.

    python benchmarks/core.py [--shards 100] [--warm-shards 500] [--repeat 3] [--baseline 8c0e58b]
                              [--versions-only]

Starts its own redis-server on a free port and measures, alternating the contenders each round:
  * gpumesh: one `gpumesh worker` draining a job of no-op shards (submit to last result), in
             fresh mode (a new interpreter per task, started while the one before runs) and warm
             mode (`--warm`, forked from a zygote);
  * baseline: the same, with the package of an older revision (git archive of --baseline, 8c0e58b by
             default, whose placement is fixed at submit; run through PYTHONPATH from a directory outside
             the checkout): its worker and its submit, same shard counts, rounds interleaved with this
             version's. The target: this version within 5 % of it (current ÷ baseline ≥ 0.95), fresh and warm;
  * floor:   a loop spawning `python -c <no-op script>` with a JSON payload on stdin (what any
             fresh-interpreter executor pays per task);
  * one core: the floor and the fresh-mode worker again, each pinned to CPU 0 (`taskset -c 0`), so the
             next interpreter's head start cannot use the other core: what fresh mode gives when
             every core has a worker of its own;
  * plain RQ: one RQ SimpleWorker (JSON serializer) whose jobs each run the same script in a fresh
             `python -c` subprocess (benchmarks/rq_noop.py), enqueue to last result;
  * RQ's ceiling: the same RQ worker running a function that returns at once (RQ's own cost per job).
--versions-only measures the two versions alone (fresh and warm), nothing else. --baseline takes any git
revision: `--baseline REV --versions-only` compares this checkout with REV, fresh and warm.
Every gpumesh round, either version's, is driven the same way: a driver process of that version
(PYTHONPATH, working directory outside the checkout) submits the job and polls it to the end, timing
inside itself. Each contender has its own Redis database, so idle workers never take another's work.
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
from common import ROOT, PrivateRedis, med, publish, revision_tree, rounds, stop, table

NOOP = "import json, sys\npayload = json.load(sys.stdin)\nprint(json.dumps({'i': payload['i']}))\n"
DRIVE = r"""
import json, sys, time
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f)]  # not this checkout's modules, for a REV's
import gpumesh
try:  # the package's layout now; 8c0e58b had gpumesh/broker.py
    from gpumesh.store.broker import Broker
except ImportError:
    from gpumesh.broker import Broker
from gpumesh.models import JobOptions
from gpumesh.settings import Settings
url, n, script = sys.argv[1], int(sys.argv[2]), sys.stdin.read()
b = Broker(Settings(url=url))
b.r.ping()
t0 = time.perf_counter()
job = b.submit(script, "noop.py", [{"i": i} for i in range(n)], JobOptions()).job_id
while not b.job_status(job).finished:
    time.sleep(0.01)
elapsed = time.perf_counter() - t0
st = b.job_status(job)
assert st.tasks.done == n, st
print(json.dumps({"rate": n / elapsed, "package": gpumesh.__file__}))
"""


class Version:
    """One version of gpumesh, run from outside the checkout with its package on PYTHONPATH."""

    def __init__(self, name: str, package_root: Path, cwd: Path, env: dict[str, str]) -> None:
        self.name, self.root, self.cwd = name, package_root, str(cwd)
        self.env = {**os.environ, **env, "PYTHONPATH": str(package_root)}

    def worker(self, url: str, *extra: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [*prefix, sys.executable, "-m", "gpumesh", "worker", "--score", "1", "--log-level", "WARNING", *extra],
            env={**self.env, "GPUMESH_URL": url}, cwd=self.cwd, start_new_session=True,
        )  # fmt: skip

    def drive(self, url: str, n: int) -> float:
        """Tasks per second from submit to the job's last result, timed by a driver of this version."""
        out = subprocess.run(
            [sys.executable, "-c", DRIVE, url, str(n)], input=NOOP, env=self.env, cwd=self.cwd,
            capture_output=True, text=True, check=True, timeout=600,
        )  # fmt: skip
        got = json.loads(out.stdout)
        if not Path(got["package"]).is_relative_to(self.root):
            raise RuntimeError(f"{self.name}: the driver imported {got['package']}, not the package under {self.root}")
        return float(got["rate"])


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


def wait_registered(url: str, n: int = 1) -> None:
    r = redis.Redis.from_url(url)
    deadline = time.monotonic() + 60
    while r.zcard("gpumesh:workers") < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no worker registered on {url} within 60 s")
        time.sleep(0.05)
    r.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=100, help="no-op shards per fresh-interpreter round")
    ap.add_argument("--warm-shards", type=int, default=500, help="no-op shards per warm and RQ-ceiling round")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; medians are reported")
    ap.add_argument(
        "--baseline", "--first-version", dest="first_version", default="8c0e58b", help="git revision to compare with"
    )
    ap.add_argument("--versions-only", action="store_true", help="only this version against the first, fresh and warm")
    args = ap.parse_args()

    server = PrivateRedis()
    tmp = server.tmp
    env = {"XDG_CACHE_HOME": str(tmp / "cache")}
    run_dir = tmp / "run"  # the versions' working directory: not the checkout
    run_dir.mkdir()
    current = Version("this version", ROOT, run_dir, env)
    v1 = Version(
        f"gpumesh {args.first_version} (placement at submit)",
        revision_tree(args.first_version, tmp / "v1"),
        run_dir,
        env,
    )
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # (version, mode) -> its own database; every one of them gets a worker of its own
        dbs = {("current", "fresh"): 1, ("current", "warm"): 2, ("v1", "fresh"): 4, ("v1", "warm"): 5}
        if not args.versions_only:
            dbs[("current", "pinned")] = 3
        versions = {"current": current, "v1": v1}
        # 8c0e58b ran fresh by default and knows no --fresh; a later revision (--baseline REV, to
        # compare with any) runs warm by default, and is told --fresh as this one is.
        knows_fresh = {"current": True, "v1": any("--fresh" in f.read_text() for f in v1.root.rglob("*.py"))}
        for (ver, mode), db in dbs.items():
            extra = ("--warm",) if mode == "warm" else ("--fresh",) if knows_fresh[ver] else ()
            prefix = ("taskset", "-c", "0") if mode == "pinned" else ()
            procs.append(versions[ver].worker(server.db(db), *extra, prefix=prefix))
        for db in dbs.values():
            wait_registered(server.db(db))
        if not args.versions_only:
            rq_bin = str(Path(sys.executable).parent / "rq")
            procs.append(subprocess.Popen(
                [rq_bin, "worker", "--url", server.url, "-w", "rq.worker.SimpleWorker", "--serializer",
                 "rq.serializers.JSONSerializer", "--path", str(Path(__file__).parent), "-q", "plain-rq-bench"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            ))  # fmt: skip
            through_plain_rq(server.url, 20)
        for (ver, _mode), db in dbs.items():
            versions[ver].drive(server.db(db), 20)  # warm-up: script cache, connections, the zygote
        x: dict[str, list[float]] = {}

        def add(key: str, value: float) -> None:
            x.setdefault(key, []).append(value)

        for i in range(args.repeat):
            pairs = [("v1", "current"), ("current", "v1")][i % 2]  # which version goes first alternates too
            for ver in pairs:
                add(f"{ver} fresh", versions[ver].drive(server.db(dbs[(ver, "fresh")]), args.shards))
            for ver in pairs:
                add(f"{ver} warm", versions[ver].drive(server.db(dbs[(ver, "warm")]), args.warm_shards))
            if args.versions_only:
                continue
            add("floor", floor(args.shards))
            add("floor1", floor(args.shards, {0}))
            add("pinned", current.drive(server.db(dbs[("current", "pinned")]), args.shards))
            add("plain", through_plain_rq(server.url, args.shards))
            add("ceiling", through_plain_rq(server.url, args.warm_shards, "rq_noop.nothing"))
        m = {k: med(v) for k, v in x.items()}
        rev = args.first_version

        def row(label: str, key: str) -> tuple[str, str, str]:
            return (label, f"{m[key]:.1f}", rounds(x[key], "{:.1f}"))

        rows = [
            row("**gpumesh worker** (fresh interpreter per task, started ahead)", "current fresh"),
            row(f"gpumesh {rev} (placement at submit), fresh", "v1 fresh"),
            row("**gpumesh worker --warm** (forked from a zygote)", "current warm"),
            row(f"gpumesh {rev} (placement at submit), --warm", "v1 warm"),
        ]
        fresh_ratio, warm_ratio = m["current fresh"] / m["v1 fresh"], m["current warm"] / m["v1 warm"]
        ratios = [
            (f"gpumesh fresh ÷ {rev} fresh (target ≥ 0.95)", f"**{fresh_ratio:.2f}**"),
            (f"gpumesh --warm ÷ {rev} --warm (target ≥ 0.95)", f"**{warm_ratio:.2f}**"),
        ]
        if not args.versions_only:
            rows = [
                row("floor: `python -c` spawn loop", "floor"),
                row("plain RQ, a `python -c` subprocess per job", "plain"),
                *rows[:2],
                row("floor, on one core (CPU 0)", "floor1"),
                row("**gpumesh worker**, on one core (`taskset -c 0`)", "pinned"),
                *rows[2:],
                row("RQ's ceiling: a no-op function, no subprocess", "ceiling"),
            ]
            f, w = m["floor"], m["current warm"]
            ratios += [
                ("gpumesh fresh ÷ floor (target ≥ 0.80)", f"{m['current fresh'] / f:.2f}"),
                ("gpumesh fresh ÷ floor, both on one core", f"{m['pinned'] / m['floor1']:.2f}"),
                ("gpumesh fresh ÷ plain RQ", f"{m['current fresh'] / m['plain']:.2f}"),
                ("gpumesh --warm ÷ floor", f"{w / f:.2f}"),
                ("gpumesh --warm ÷ RQ's ceiling", f"{w / m['ceiling']:.2f}"),
            ]
        body = (
            f"One worker, no-op shards: {args.shards} per fresh round, {args.warm_shards} per warm round; "
            f"{args.repeat} rounds, {rev}'s and this version's interleaved (which goes first alternates).\n\n"
            + table(["contender (one worker, no-op shards)", "tasks/s, median", "rounds"], rows)
            + "\n\n"
            + table(["ratio", "value"], ratios)
        )
        cmd = (
            f"python benchmarks/core.py --shards {args.shards} --warm-shards {args.warm_shards} --repeat {args.repeat}"
            f" --baseline {rev}" + (" --versions-only" if args.versions_only else "")
        )
        publish("core", "Throughput per worker", body, cmd)
    finally:
        stop(procs)
        server.stop()


if __name__ == "__main__":
    main()
