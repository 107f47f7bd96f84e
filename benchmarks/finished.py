"""Finished work: what a done task costs the broker, at its peak while a job runs and once it has ended,
and what reading, cancelling and pruning a big job asks of Redis and of the client.

    python benchmarks/finished.py [--real 100000] [--workers 2] [--simulated 1000000] [--sim-workers 1000]
                                  [--parts real,simulated] [--big-log-mb 1]

Part `real`: --workers real `gpumesh worker` processes (warm mode) run --real no-op tasks (the script prints
`{}`: one line of output, its result), end to end. Redis `used_memory` is read before the submit (workers
registered), every 50 ms while the job runs (the peak), and once the job has ended and the workers wait
for work (after). Then one task whose script prints --big-log-mb MB of log (lines of 100 bytes).

Part `simulated`: --sim-workers of benchmarks/scale.py's simulated workers (dispatch, the RQ delivery and its
pop, the completion with the attempt's two log lines riding in its round trip, and the deletion of the RQ
job that a real worker's record of the run's end now makes) complete --simulated tasks; memory read as
above. Then on that job: `gpumesh results JOB --format jsonl` and `gpumesh status JOB --json` as
subprocesses (their peak RSS), pruning it (the reaper's passes, each bounded in time, until its keys are
gone), and a second job of the same size cancelled while simulated workers hold some of its tasks. The
longest Redis command during pruning and cancelling is read from SLOWLOG (threshold 0.5 ms).

Bytes per finished task = (after - before) / tasks: everything the task left, the job's share included
(its hash, lists and streams), none of the fleet's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis
from common import PrivateRedis, publish, start_worker, stop, table
from scale import Delivery, register, simulate

from gpumesh.models import JobOptions
from gpumesh.settings import Settings
from gpumesh.store import keys, reaper, scripts
from gpumesh.store.broker import Broker

NOOP = "print('{}')\n"
SLOW_US = 500  # SLOWLOG threshold while pruning and cancelling


class Sampler(threading.Thread):
    """Redis used_memory every ``every`` seconds on a connection of its own, until stopped: the peak."""

    def __init__(self, url: str, every: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.r = redis.Redis.from_url(url)
        self.every, self.peak, self._halt = every, 0, threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.peak = max(self.peak, used(self.r))
            self._halt.wait(self.every)

    def stop(self) -> int:
        self._halt.set()
        self.join()
        self.peak = max(self.peak, used(self.r))
        self.r.close()
        return self.peak


def used(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def families(r: redis.Redis) -> dict[str, tuple[int, int]]:
    """Key family -> (keys, bytes by MEMORY USAGE), ids replaced by placeholders."""

    out: dict[str, list[int]] = {}
    batch: list[bytes] = []

    def flush() -> None:
        with r.pipeline(transaction=False) as p:
            for k in batch:
                p.memory_usage(k, samples=0)
            sizes = p.execute()
        for k, size in zip(batch, sizes):
            name = re.sub(r"[0-9a-f]{12}-\d+", "<task>", k.decode())
            name = re.sub(r"[0-9a-f]{12}", "<job>", name)
            name = re.sub(r"(worker:|rq:[a-z:]*?)[\w.-]+-[0-9a-f]{6}\b.*", r"\1<worker>…", name)
            name = re.sub(r"(worker:)sim-\d+$", r"\1<simulated worker>", name)
            fam = out.setdefault(name, [0, 0])
            fam[0] += 1
            fam[1] += int(size or 0)
        batch.clear()

    for k in r.scan_iter(count=10_000):
        batch.append(k)
        if len(batch) >= 5000:
            flush()
    flush()
    return {k: (v[0], v[1]) for k, v in sorted(out.items(), key=lambda kv: -kv[1][1])}


def wait_done(b: Broker, job_id: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while b.job_status(job_id).status not in ("done", "failed", "cancelled"):
        if time.monotonic() > deadline:
            raise SystemExit(f"job {job_id} not done within {timeout} s: {b.job_status(job_id)}")
        time.sleep(0.2)


def settle(r: redis.Redis, pattern: str = "rq:job:*", timeout: float = 30) -> None:
    """Until the workers' last RQ records are written (they ride the next round trip or the idle wait)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(True for _ in r.scan_iter(pattern, count=10_000)):
        time.sleep(0.2)
    time.sleep(1.0)


def real(server: PrivateRedis, n: int, workers: int, big_log_mb: float) -> dict:
    r = redis.Redis.from_url(server.url)
    r.flushall()
    b = Broker(Settings(url=server.url))
    procs = [start_worker(server.url, 10.0, "--warm") for _ in range(workers)]
    try:
        deadline = time.monotonic() + 60
        while r.zcard(keys.WORKERS) < workers:
            if time.monotonic() > deadline:
                raise SystemExit("workers did not register")
            time.sleep(0.2)
        warm = b.submit(NOOP, "noop.py", [{} for _ in range(workers * 4)], JobOptions())  # zygotes started
        wait_done(b, warm.job_id, 120)
        settle(r)
        before = used(r)
        sampler = Sampler(server.url)
        sampler.start()
        t0 = time.monotonic()
        job = b.submit(NOOP, "noop.py", [{"i": i} for i in range(n)], JobOptions())
        wait_done(b, job.job_id, 3 * 3600)
        wall = time.monotonic() - t0
        settle(r)
        peak = sampler.stop()
        after = used(r)
        fam = families(r)
        lines = int(big_log_mb * 1e6 / 100)
        big_before = used(r)
        big = b.submit(f"for i in range({lines}):\n    print('x' * 99)\nprint('{{}}')\n", "big.py", [{}], JobOptions())
        wait_done(b, big.job_id, 600)
        settle(r)
        big_after = used(r)
        logged = sum(1 for _ in b.logs(big.job_id))
    finally:
        stop(procs)
    b.close()
    r.close()
    return {"n": n, "wall": wall, "before": before, "peak": peak, "after": after, "families": fam,
            "big": big_after - big_before, "big_lines": logged}  # fmt: skip


def slowest(r: redis.Redis) -> tuple[float, str, int]:
    """(longest command in ms, its name, commands over the threshold) from SLOWLOG, which is then reset."""
    entries = r.slowlog_get(100_000)
    r.slowlog_reset()
    if not entries:
        return 0.0, "", 0
    top = max(entries, key=lambda e: e["duration"])
    cmd = top["command"].decode(errors="replace") if isinstance(top["command"], bytes) else str(top["command"])
    return top["duration"] / 1000, " ".join(cmd.split()[:2])[:60], len(entries)


def redis_cpu(r: redis.Redis) -> float:
    """Seconds of CPU the Redis server has used: what a step costs it, whatever else the VM runs meanwhile."""
    info = r.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def per_call(r: redis.Redis, *names: str) -> tuple[int, float]:
    """(calls, mean µs a call) of these commands since the last CONFIG RESETSTAT (INFO commandstats)."""
    stats = r.info("commandstats")
    calls = sum(int(stats.get(f"cmdstat_{n}", {}).get("calls", 0)) for n in names)
    usec = sum(int(stats.get(f"cmdstat_{n}", {}).get("usec", 0)) for n in names)
    return calls, usec / calls if calls else 0.0


def child_rss(url: str, *argv: str, out: Path | None = None) -> tuple[float, int, float]:
    """(wall s, peak RSS in MiB, output MB) of a `gpumesh` CLI command run as its own process (its output
    written to ``out`` when given, by the command's own -o)."""
    code = (
        "import atexit, runpy, sys\n"
        # VmHWM: the peak of this program's own memory (ru_maxrss would count the forked parent's, kept across exec)
        "atexit.register(lambda: sys.stderr.write('RSS %s\\n' % [l.split()[1] for l in open('/proc/self/status')"
        " if l.startswith('VmHWM')][0]))\n"
        "sys.argv = ['gpumesh'] + sys.argv[1:]\n"
        "runpy.run_module('gpumesh', run_name='__main__')\n"
    )
    t0 = time.monotonic()
    to = ["-o", str(out)] if out else []
    ran = subprocess.run([sys.executable, "-c", code, *argv, *to, "--url", url], capture_output=True, check=True)
    wall = time.monotonic() - t0
    rss = int(ran.stderr.decode().rsplit("RSS ", 1)[1].split()[0]) / 1024
    size = out.stat().st_size if out else len(ran.stdout)
    if out:
        out.unlink()
    return wall, rss, size / 1e6


def simulated(server: PrivateRedis, n: int, n_workers: int) -> dict:
    b = Broker(Settings(url=server.url, job_retention=1.0))
    r = redis.Redis.from_url(server.url)
    r.flushall()
    ids = [f"sim-{i}" for i in range(n_workers)]
    register(b.r, ids)
    dl = Delivery(b)
    b.scripts.ensure(force=True)
    epoch = b.epoch()
    before = used(r)
    sampler = Sampler(server.url, every=0.25)
    sampler.start()
    t0 = time.monotonic()
    job = b.submit(NOOP, "noop.py", [{"i": i} for i in range(n)], JobOptions())
    submitted = time.monotonic() - t0
    sim = simulate(server.url, b.scripts, ids, 5.0, epoch, dl, logs=True)
    load = f"{os.getloadavg()[0]:.1f}"
    peak = sampler.stop()
    wall = time.monotonic() - t0
    after = used(r)
    assert sim["done"] == n, sim["done"]
    assert not any(True for _ in r.scan_iter("rq:job:*", count=10_000)), "RQ job hashes left"
    fam = families(r)
    res_wall, res_rss, res_mb = child_rss(server.url, "results", job.job_id, "--format", "jsonl",
                                          out=server.tmp / "results.jsonl")  # fmt: skip
    st_wall, st_rss, _ = child_rss(server.url, "status", job.job_id, "--json")

    # pruning: the reaper's passes until the job's keys are gone
    r.config_set("slowlog-log-slower-than", SLOW_US)
    r.config_set("slowlog-max-len", 100_000)
    register(b.r, ids)  # heartbeats now: the reaper's passes below prune, they do not drop the simulated fleet
    time.sleep(1.1)  # past the 1 s retention
    r.slowlog_reset()
    r.config_resetstat()
    t0, passes, cpu0 = time.monotonic(), 0, redis_cpu(r)
    while r.exists(keys.job(job.job_id)) or r.zcard(keys.PRUNING):
        reaper.reap_once(b, prune_budget=reaper.SERVE_PRUNE_BUDGET_S)  # as `gpumesh serve`'s reaper does
        passes += 1
    prune_wall, prune_cpu = time.monotonic() - t0, redis_cpu(r) - cpu0
    prune_slow = slowest(r)
    prune_stats = per_call(r, "del", "unlink")
    while int(r.info("memory").get("lazyfree_pending_objects", 0)):  # UNLINK frees big keys in the background
        time.sleep(0.2)
    time.sleep(1.0)  # and Redis's cron shrinks the keyspace's table
    pruned = used(r)

    # cancel: a second job of the same size, some of its tasks held by simulated workers
    big = b.submit(NOOP, "noop.py", [{"i": i} for i in range(n)], JobOptions())
    for wid in ids[:100]:
        scripts.dispatch(b.scripts, b.r, wid, 600_000, 1.0)
    r.slowlog_reset()
    r.config_resetstat()
    t0, cpu0 = time.monotonic(), redis_cpu(r)
    st = b.cancel(big.job_id)
    cancel_wall, cancel_cpu = time.monotonic() - t0, redis_cpu(r) - cpu0
    cancel_slow = slowest(r)
    cancel_stats = per_call(r, "fcall")
    assert st.status == "cancelled" and st.tasks.cancelled == n, st
    r.config_set("slowlog-log-slower-than", 10_000)
    b.close()
    r.close()
    return {"n": n, "workers": n_workers, "submitted": submitted, "wall": wall, "before": before, "peak": peak,
            "after": after, "families": fam, "done": sim["done"], "results": (res_wall, res_rss, res_mb),
            "status": (st_wall, st_rss), "prune": (prune_wall, passes, prune_slow), "pruned": pruned,
            "cancel": (cancel_wall, cancel_slow), "prune_per_call": prune_stats,
            "cancel_per_call": cancel_stats, "load": load, "prune_cpu": prune_cpu,
            "cancel_cpu": cancel_cpu}  # fmt: skip


def previous() -> dict[str, dict]:
    """The parts' figures as docs/benchmarks.md last published them (kept in the section, as JSON)."""
    from common import DOC

    found = re.search(r"<!-- finished:data (.*?) -->", DOC.read_text() if DOC.exists() else "")
    return json.loads(found.group(1)) if found else {}


def mb(x: float) -> str:
    return f"{x / 1e6:,.1f} MB"


def fam_table(fam: dict[str, tuple[int, int]], n: int) -> str:
    rows = [(f"`{k}`", f"{c:,}", f"{size:,}", f"{size / n:,.1f}") for k, (c, size) in list(fam.items())[:12]]
    return table(["key (family)", "keys", "bytes (MEMORY USAGE)", "bytes per finished task"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", type=int, default=100_000, help="no-op tasks run by real workers")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--simulated", type=int, default=1_000_000, help="completions by simulated workers")
    ap.add_argument("--sim-workers", type=int, default=1000)
    ap.add_argument("--big-log-mb", type=float, default=1.0)
    ap.add_argument("--parts", default="real,simulated")
    args = ap.parse_args()
    parts = args.parts.split(",")
    server = PrivateRedis()
    out: dict[str, dict] = {}
    try:
        if "real" in parts:
            out["real"] = real(server, args.real, args.workers, args.big_log_mb)
        if "simulated" in parts:
            out["simulated"] = simulated(server, args.simulated, args.sim_workers)
    finally:
        server.stop()
    kept = previous()
    for name in ("real", "simulated"):  # a part not run this time: as the last run published it
        if name not in out and name in kept:
            out[name] = kept[name]
    rows, body = [], ""
    for name, m in out.items():
        what = (f"{m['n']:,} no-op tasks, {args.workers} real warm workers" if name == "real"
                else f"{m['n']:,} completions, {m['workers']:,} simulated workers")  # fmt: skip
        rows.append((what, f"{m['wall']:.0f} s", mb(m["before"]), f"**{mb(m['peak'])}**", mb(m["after"]),
                     f"**{(m['after'] - m['before']) / m['n']:,.0f}**"))  # fmt: skip
    body += table(["run", "wall", "used_memory before", "peak while running", "after", "bytes per finished task"],
                  rows)  # fmt: skip
    if "real" in out:
        m = out["real"]
        body += (f"\n\nWhere a finished task's bytes are, after the real run (`MEMORY USAGE` of every key, exact "
                 f"for streams):\n\n{fam_table(m['families'], m['n'])}\n\n"
                 f"A task that printed {args.big_log_mb:g} MB of log ({m['big_lines'] - 2:,} lines of 100 bytes, "
                 f"with the worker's note and the result line {m['big_lines']:,} entries) cost "
                 f"**{mb(m['big'])}** of Redis, job included.")  # fmt: skip
    if "simulated" in out:
        m = out["simulated"]
        (rw, rrss, rmb), (sw, srss) = m["results"], m["status"]
        (pw, passes, (pms, pcmd, pn)), (cw, (cms, ccmd, cn)) = m["prune"], m["cancel"]
        (pcalls, pmean), (ccalls, cmean) = m.get("prune_per_call", (0, 0.0)), m.get("cancel_per_call", (0, 0.0))
        body += (
            f"\n\nWhere a finished task's bytes are, after the simulated run:\n\n{fam_table(m['families'], m['n'])}\n\n"
            f"On that job of {m['n']:,} done tasks: `gpumesh results JOB --format jsonl` wrote {rmb:,.0f} MB in "
            f"{rw:.1f} s with a peak RSS of **{rrss:,.0f} MiB**; `gpumesh status JOB --json` {sw:.2f} s, "
            f"{srss:,.0f} MiB. Pruning it took {passes} pass(es) of `gpumesh serve`'s reaper "
            f"({reaper.SERVE_PRUNE_BUDGET_S:g} s of steps each at most), {pw:.1f} s, and left "
            f"{mb(m['pruned'])} (before the submit: {mb(m['before'])}); its {pcalls:,} steps (DEL, and the UNLINK of the "
            f"job's own keys) took **{pmean / 1000:.2f} ms** each on average (`INFO commandstats`, wall time "
            f"in Redis) and {1000 * m.get('prune_cpu', 0) / max(pcalls, 1):.2f} ms of Redis CPU, the longest Redis command "
            f"meanwhile {pms:.2f} ms ({pcmd or 'none over the threshold'}; {pn} commands over {SLOW_US} µs). "
            f"Cancelling a second job of {m['n']:,} tasks, 100 of them running: {cw:.1f} s, {ccalls:,} calls of "
            f"**{cmean:.0f} µs** on average ({1e6 * m.get('cancel_cpu', 0) / max(ccalls, 1):.0f} µs of Redis CPU), "
            f"the longest {cms:.2f} ms ({ccmd or 'none over the threshold'}; {cn} "
            f"over {SLOW_US} µs). The longest commands are where the VM's scheduler paused Redis mid-command "
            f"(the load average was {m.get('load', '?')} during the run: other work shared the 2 cores; a scratch "
            "run of 200,000 cancels logged plain HSETs of 16 ms and a run of calls of 12.1 ms each, a time slice)."
        )  # fmt: skip
    body += f"\n\n<!-- finished:data {json.dumps(out)} -->"
    sizes = {"real": args.real, "simulated": args.simulated} | {k: v["n"] for k, v in out.items()}
    cmd = (f"python benchmarks/finished.py --real {sizes['real']} --workers {args.workers} --simulated "
           f"{sizes['simulated']} --sim-workers {args.sim_workers}")  # fmt: skip
    if set(parts) != set(out):
        cmd += f" (this time --parts {args.parts}; the other rows as published before, at the time they give)"
    publish("finished", "Finished work: what a done task costs the broker", body, cmd)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "families"} for k, v in out.items()}, default=str))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
