"""Artifacts: 100 tasks each writing a 10 MiB file, stored in the broker or in an object store, then pulled.

    python benchmarks/artifacts.py [--tasks 100] [--mib 10] [--repeat 2] [--s3]

Two workers run the job (its wall time includes storing the files); `gpumesh pull`'s code (8 fetches at
once) writes them into an empty directory, checksums verified. Redis memory (used_memory) is read
before the job, once it is done (the files held), and after the job is pruned. The stores run side by
side in one run: the broker, a file:// object store on local disk, and with --s3 a local S3 API
server (moto, in-process Python: a floor for a real S3, not its speed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from common import PrivateRedis, med, publish, rounds, start_worker, stop, table

from gpumesh.models import JobOptions
from gpumesh.settings import Settings
from gpumesh.store import keys
from gpumesh.store.broker import Broker
from gpumesh.store.submit import delete_job

TASK = """import json, os, sys
p = json.load(sys.stdin)
with open(os.path.join(os.environ["GPUMESH_OUTPUT_DIR"], "shard.bin"), "wb") as f:
    f.write(os.urandom(p["mib"] << 20))
print(json.dumps({"i": p["i"]}))
"""
MIB = 1 << 20


def used(broker: Broker) -> float:
    return int(broker.r.info("memory")["used_memory"]) / MIB


def one(url: str, tmp: Path, store: str, tasks: int, mib: int, extra_env: dict[str, str]) -> dict[str, float]:
    env = {"XDG_CACHE_HOME": str(tmp / "cache"), "GPUMESH_ARTIFACTS": store, **extra_env}
    broker = Broker(Settings(url=url, artifacts=store))  # pull reads a file:// store only when told to trust it
    broker.r.flushall()
    base = used(broker)
    procs = [start_worker(url, 10, env=env) for _ in range(2)]
    try:
        while len(broker.live_scores()) < 2:
            time.sleep(0.05)
        t0 = time.monotonic()
        job = broker.submit(TASK, "t.py", [{"i": i, "mib": mib} for i in range(tasks)], JobOptions()).job_id
        while not broker.job_status(job).finished:
            time.sleep(0.05)
        run_s = time.monotonic() - t0
        assert broker.job_status(job).status == "done", broker.results(job)[0].error
        held = used(broker)
        dest = tmp / f"pulled-{time.monotonic_ns()}"
        t0 = time.monotonic()
        got = broker.pull(job, dest)
        pull_s = time.monotonic() - t0
        assert len(got.fetched) == tasks and got.bytes == tasks * mib * MIB
        shutil.rmtree(dest)
        delete_job(broker.r, job, keys.JOBS)
        after = used(broker)
    finally:
        stop(procs)
        broker.close()
    return {"run": run_s, "pull": pull_s, "mibs": tasks * mib / pull_s, "held": held - base, "after": after - base}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_s3(tmp: Path) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}"}  # fmt: skip
    os.environ.update(env)  # pull, in this process, reads the same store
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    import s3fs

    s3fs.S3FileSystem().mkdir("bench")
    return proc, env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=100)
    ap.add_argument("--mib", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--s3", action="store_true", help="also a local S3 API server (moto)")
    args = ap.parse_args()
    server = PrivateRedis()
    tmp = server.tmp
    moto = None
    stores: list[tuple[str, str, dict[str, str]]] = [
        ("broker (Redis)", "", {}),
        ("object store, file:// local disk", f"file://{tmp}/objects", {}),
    ]
    try:
        if args.s3:
            moto, s3env = start_s3(tmp)
            stores.append(("object store, S3 API (moto, local)", "s3://bench/runs", s3env))
        results: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in stores}
        for _ in range(args.repeat):  # the stores take turns, so the machine's noise falls on all of them
            for name, url, env in stores:
                results[name].append(one(server.url, tmp, url, args.tasks, args.mib, env))
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait()
        server.stop()
    rows = []
    for name, runs in results.items():
        rows.append((
            name,
            f"{med([r['run'] for r in runs]):.1f}",
            f"{med([r['pull'] for r in runs]):.2f}",
            f"{med([r['mibs'] for r in runs]):.0f}",
            rounds([r["mibs"] for r in runs], "{:.0f}"),
            f"{med([r['held'] for r in runs]):.0f}",
            f"{med([r['after'] for r in runs]):.1f}",
        ))  # fmt: skip
    body = table(
        ["store", "job, s (2 workers)", "pull, s", "pull MiB/s (median)", "rounds", "Redis MiB held while kept",
         "Redis MiB after prune"],
        rows,
    )  # fmt: skip
    body += (
        f"\n\n{args.tasks} tasks × {args.mib} MiB = {args.tasks * args.mib} MiB. Redis memory is `used_memory` above "
        "the empty broker's. Through the broker every byte is held in Redis until the job is pruned (or cancelled); "
        "with an object store Redis holds only the index."
    )
    command = f"python benchmarks/artifacts.py --tasks {args.tasks} --mib {args.mib} --repeat {args.repeat}"
    publish("artifacts", "Artifacts: storing and pulling task files", body, command + (" --s3" if args.s3 else ""))


if __name__ == "__main__":
    main()
