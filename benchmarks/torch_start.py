"""Per-task cost of a script that imports torch: a fresh interpreter vs. the warm executor.

    pip install torch && python benchmarks/torch_start.py [--tasks 20]

One worker at a time drains a job of shards whose script imports torch and does a tiny tensor op:
  * gpumesh worker (fresh): every task starts Python and imports torch;
  * gpumesh worker --warm: forked from a zygote, the task still imports torch itself;
  * gpumesh worker --warm --preload torch: torch is already imported when the task starts.
Per-task overhead = ms per task minus the script's own work (the op itself, measured in-process).
"""

from __future__ import annotations

import argparse
import time

from common import PrivateRedis, med, publish, rounds, start_worker, stop, table

from gpumesh.models import JobOptions
from gpumesh.settings import Settings
from gpumesh.store.broker import Broker

SCRIPT = """import json, sys
import torch
p = json.load(sys.stdin)
x = torch.full((64, 64), float(p["i"]))
print(json.dumps({"i": p["i"], "sum": float((x @ x).sum())}))
"""


def per_task_ms(broker: Broker, n: int) -> float:
    t0 = time.perf_counter()
    job = broker.submit(SCRIPT, "t.py", [{"i": i} for i in range(n)], JobOptions()).job_id
    while not broker.job_status(job).finished:
        time.sleep(0.01)
    assert broker.job_status(job).tasks.done == n, broker.job_status(job)
    return (time.perf_counter() - t0) * 1000 / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        raise SystemExit("torch is not installed: pip install torch (or gpumesh[gpu])") from None
    t0 = time.perf_counter()
    for i in range(100):
        x = torch.full((64, 64), float(i))
        float((x @ x).sum())
    work_ms = (time.perf_counter() - t0) * 10
    server = PrivateRedis()
    tmp = server.tmp
    modes = {"fresh": ["--fresh"], "warm": ["--warm"], "warm + preload": ["--warm", "--preload", "torch"]}
    results: dict[str, list[float]] = {m: [] for m in modes}
    procs = []
    try:
        brokers = {m: Broker(Settings(url=server.db(i + 1))) for i, m in enumerate(modes)}
        for m, flags in modes.items():
            procs.append(start_worker(brokers[m].url, 1, *flags, env={"XDG_CACHE_HOME": str(tmp / "cache")}))
            while not brokers[m].live_scores():
                time.sleep(0.1)
            per_task_ms(brokers[m], 2)  # warm-up
        for _ in range(args.repeat):
            for m in modes:
                results[m].append(per_task_ms(brokers[m], args.tasks))
    finally:
        stop(procs)
        server.stop()
    rows = [
        (f"gpumesh worker {' '.join(flags) or '(fresh)'}", f"{med(xs):.0f}", f"{med(xs) - work_ms:.0f}", rounds(xs, "{:.0f}"))
        for (m, flags), xs in zip(modes.items(), results.values())
    ]  # fmt: skip
    body = (
        f"torch {torch.__version__}; the script's own work (a 64×64 matmul) takes {work_ms:.2f} ms in-process.\n\n"
        + table(
            ["worker", "ms per task (median)", "overhead per task, ms (target < 50 with --preload)", "rounds"], rows
        )
    )
    publish(
        "torch",
        "A script that imports torch",
        body,
        f"python benchmarks/torch_start.py --tasks {args.tasks} --repeat {args.repeat}",
    )


if __name__ == "__main__":
    main()
