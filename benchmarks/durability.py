"""Durability: what `appendfsync always` costs against `everysec`, side by side on this disk.

    python benchmarks/durability.py [--tasks 200] [--writes 2000] [--repeat 3]

For each setting, a private redis-server with an append-only file in a temp dir on this machine's disk
(the settings take turns each round, so the machine's noise falls on both; medians of the rounds):

- writes/s: one client sending small write scripts one after the other (a transition's shape: an HSET,
  an HINCRBY and an XADD in one EVAL), each waiting for its reply: the fsync is on every round trip;
- writes/s, 8 clients: the same from 8 threads at once: Redis fsyncs once per event-loop pass, so
  concurrent writers share an fsync;
- job: N no-op tasks through 2 real `gpumesh worker` processes, submit to the last result (wall time).

Prints a Markdown table and the command that reruns it; writes nothing else.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import redis
from common import med, rounds, start_worker, stop, table

from gpumesh.models import JobOptions
from gpumesh.server.broker_server import find_binary, free_port
from gpumesh.settings import Settings
from gpumesh.store.broker import Broker

NOOP = "import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n"
WRITE = "redis.call('HSET', KEYS[1], 'status', 'done', 'result', ARGV[1]); redis.call('HINCRBY', KEYS[2], 'done', 1); return redis.call('XADD', KEYS[3], 'MAXLEN', '~', 10000, '*', 'id', ARGV[1])"  # noqa: E501
SETTINGS = ("always", "everysec")


class AofRedis:
    """A redis-server with an append-only file at ``fsync`` in a fresh temp dir on this machine's disk."""

    def __init__(self, fsync: str, base: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"aof-{fsync}-", dir=base))
        self.port = free_port()
        self.proc = subprocess.Popen(
            [find_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", fsync, "--maxmemory-policy", "noeviction"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.url = f"redis://127.0.0.1:{self.port}/0"
        client = redis.Redis.from_url(self.url, decode_responses=True)
        for _ in range(200):
            try:
                client.ping()
                break
            except (redis.ConnectionError, redis.BusyLoadingError):
                time.sleep(0.05)
        try:
            assert client.config_get("appendfsync")["appendfsync"] == fsync
        except BaseException:
            self.stop()
            raise
        finally:
            client.close()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def writes_per_s(url: str, n: int, clients: int) -> float:
    def one(i: int) -> None:
        r = redis.Redis.from_url(url)
        script = r.register_script(WRITE)
        for k in range(n // clients):
            script(keys=[f"t:{i}:{k}", "job", "events"], args=[f"{i}-{k}"])
        r.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (n // clients) * clients / (time.perf_counter() - t0)


def job_seconds(url: str, tmp: Path, tasks: int) -> float:
    env = {"XDG_CACHE_HOME": str(tmp / "cache")}
    broker = Broker(Settings(url=url))
    procs = [start_worker(url, 10, env=env) for _ in range(2)]
    try:
        while len(broker.live_scores()) < 2:
            time.sleep(0.05)
        t0 = time.monotonic()
        job = broker.submit(NOOP, "noop.py", [{"i": i} for i in range(tasks)], JobOptions()).job_id
        while not broker.job_status(job).finished:
            time.sleep(0.02)
        took = time.monotonic() - t0
        assert broker.job_status(job).status == "done"
    finally:
        stop(procs)
        broker.close()
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=200)
    ap.add_argument("--writes", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="gpumesh-durability-", dir=os.environ.get("DURABILITY_DIR")))
    figures: dict[str, dict[str, list[float]]] = {s: {"w1": [], "w8": [], "job": []} for s in SETTINGS}
    try:
        for _ in range(args.repeat):
            for fsync in SETTINGS:
                server = AofRedis(fsync, base)
                try:
                    figures[fsync]["w1"].append(writes_per_s(server.url, args.writes, 1))
                    figures[fsync]["w8"].append(writes_per_s(server.url, args.writes, 8))
                    figures[fsync]["job"].append(job_seconds(server.url, base, args.tasks))
                finally:
                    server.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = []
    for fsync, f in figures.items():
        rows.append((
            f"appendfsync {fsync}",
            f"{med(f['w1']):,.0f} ({rounds(f['w1'], '{:,.0f}')})",
            f"{med(f['w8']):,.0f} ({rounds(f['w8'], '{:,.0f}')})",
            f"{med(f['job']):.2f} ({rounds(f['job'])})",
            f"{args.tasks / med(f['job']):.1f}",
        ))  # fmt: skip
    print(table(
        ["broker", "writes/s, 1 client", "writes/s, 8 clients", f"job of {args.tasks} no-op tasks, s (2 workers)",
         "tasks/s"],
        rows,
    ))  # fmt: skip
    print(f"\nmedians of {args.repeat} rounds (each round's figure in brackets), on the disk of {base.parent}")
    print(f"rerun: python benchmarks/durability.py --tasks {args.tasks} --writes {args.writes} "
          f"--repeat {args.repeat}")  # fmt: skip


if __name__ == "__main__":
    main()
