"""Where a warm worker's time per no-op task goes, sampled with py-spy (wall clock, idle included).

    pip install py-spy && python benchmarks/profile_worker.py [--tasks 1000] [--mode warm|fresh]

Runs one `gpumesh worker` under `py-spy record --idle`, drains a job of no-op shards, then sorts every
sample of the worker's main thread into the part of the task's life it belongs to: dispatch.lua
picks and leases the next task, the worker delivers it to its own RQ queue and pops it in the same
transaction (Broker.deliver), RQ runs gpumesh's executor, which ends with complete.lua, and records the run
(RQ's bookkeeping: RQ's code, and the worker's own transactions in its place). What the worker does beside a
running attempt (sandbox.Meanwhile: RQ's records of the runs, the last attempt's directory, the next one's) is its own row:
that time overlaps the attempt's processes, which run on the other core.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from common import PrivateRedis, publish, table

from gpumesh.models import JobOptions
from gpumesh.settings import Settings
from gpumesh.store.broker import Broker

RATE_HZ = 200
NOOP = "import json, sys\npayload = json.load(sys.stdin)\nprint(json.dumps({'i': payload['i']}))\n"

# (part of the task's life, frame substrings), checked leaf first: the innermost match names the sample.
PARTS = [
    (
        "sandbox: the attempt runs (worker waits for its output and exit)",
        ["EpollSelector.select", "_recv_json", "wait ("],
    ),
    ("sandbox: fork from the zygote / start the interpreter", ["Zygote.spawn", "Popen.__init__", "_execute_child"]),
    (
        "sandbox: temp dir, script file, payload, clean-up",
        ["mkdtemp", "taskdir.py", "_prepare", "_payload_file", "clean_env"],
    ),
    ("gpumesh: dispatch.lua alone (the worker had no completion to send it with)", ["dispatch (gpumesh"]),
    (
        "gpumesh: deliver it to the worker's own RQ queue and pop it (one transaction)",
        ["deliver (gpumesh", "_deliver (gpumesh"],
    ),
    ("gpumesh: backup-copy scan (speculate)", ["_speculate (gpumesh", "speculate (gpumesh"]),
    ("gpumesh: complete.lua (with dispatch.lua for the next task: one round trip)", ["complete (gpumesh"]),
    ("gpumesh: ship the log lines", ["LogShipper"]),
    ("RQ: pop the delivery from the worker's own queue", ["dequeue_any", "dequeue_job_and_maintain_ttl (rq"]),
    (
        "RQ: per-job bookkeeping (state, registries, result)",
        ["_record_success (gpumesh", "prepare_execution (gpumesh", "send_records (gpumesh"],
    ),
]
# Only when no frame of the stack names one of PARTS: the deliver step runs RQ's enqueue code, and
# must not count as RQ's bookkeeping because its innermost frames are RQ's.
GENERIC = [
    ("gpumesh: other (executor, sandbox loop)", ["gpumesh/"]),
    ("RQ: per-job bookkeeping (state, registries, result)", ["rq/"]),
]


# Done once the next attempt was handed over, beside it (sandbox.Meanwhile): RQ's records of the runs and the last
# attempt's directory. Counted apart, whatever runs inside: it overlaps the attempt instead of preceding it.
MEANWHILE = (
    "sandbox: beside the running attempt (RQ's records, removing the last attempt's directory, making the next one's)"
)


def classify(frames: list[str]) -> str:
    if any("Meanwhile.run" in f for f in frames):
        return MEANWHILE
    for parts in (PARTS, GENERIC):
        for frame in reversed(frames):
            for part, needles in parts:
                if any(n in frame for n in needles):
                    return part
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=1000)
    ap.add_argument("--mode", choices=["warm", "fresh"], default="warm")
    ap.add_argument("--raw", type=Path, help="also keep py-spy's raw samples (folded stacks) in this file")
    args = ap.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.path.exists(spy):
        sys.exit("py-spy is not installed: pip install py-spy")
    server = PrivateRedis()
    tmp = server.tmp
    raw = tmp / "worker.raw"
    try:
        broker = Broker(Settings(url=server.url))
        env = {**os.environ, "GPUMESH_URL": server.url, "XDG_CACHE_HOME": str(tmp / "cache")}
        worker = [sys.executable, "-m", "gpumesh", "worker", "--score", "1", "--log-level", "WARNING"]
        worker += ["--warm"] if args.mode == "warm" else ["--fresh"]
        proc = subprocess.Popen(
            [spy, "record", "--idle", "-r", str(RATE_HZ), "--format", "raw", "-o", str(raw), "--", *worker],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        while not broker.live_scores():
            time.sleep(0.1)
        t0 = time.perf_counter()
        job = broker.submit(NOOP, "noop.py", [{"i": i} for i in range(args.tasks)], JobOptions()).job_id
        while not broker.job_status(job).finished:
            time.sleep(0.05)
        rate = args.tasks / (time.perf_counter() - t0)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        if args.raw:
            shutil.copyfile(raw, args.raw)
        parts: collections.Counter[str] = collections.Counter()
        for line in raw.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            frames = stack.split(";")
            in_loop = any("execute_job" in f or "dequeue_job_and_maintain_ttl" in f for f in frames)
            if in_loop and not any("blpop" in f.lower() for f in frames):  # blocking pops: mostly idle time
                parts[classify(frames)] += int(n)
    finally:
        server.stop()
    total = sum(parts.values())
    per_task_ms = 1000 / rate
    ms = 1000 / RATE_HZ / args.tasks  # one sample's share of one task, in ms
    rows = [(p, f"{100 * c / total:.0f} %", f"{c * ms:.2f}") for p, c in parts.most_common()]
    rows.append(("total sampled", "100 %", f"{total * ms:.2f}"))
    body = (
        f"`gpumesh worker{' --warm' if args.mode == 'warm' else ''}`, {args.tasks} no-op shards, {rate:.1f} tasks/s "
        f"under the profiler ({per_task_ms:.1f} ms a task). Samples of the worker's main thread while a job was "
        "in hand (its blocking pops, mostly idle waits, left out):\n\n"
        + table(["part of a task's life", "share of samples", "ms per task"], rows)
    )
    publish(f"profile-{args.mode}", f"Where the time goes ({args.mode} mode)", body,
            f"python benchmarks/profile_worker.py --tasks {args.tasks} --mode {args.mode}")  # fmt: skip


if __name__ == "__main__":
    main()
