"""Does the capability score agree with itself? Its spread over separate runs on one machine.

    .venv/bin/python benchmarks/bench_spread.py [--runs 10] [--blocks 1] [--backends numpy,python] [--against HEAD]

Runs the benchmark child that `gpumesh bench` and `gpumesh worker` run (`python -m gpumesh.capability`,
here with --rates) --runs times per backend, each a separate process with GPUMESH_BENCH_BACKEND set, and
prints per backend and estimator min, median, max and spread = (max - min) / median:
  * best trial:   the score as shipped, the best of the child's timed trials;
  * median trial: the median of the same trials, the estimator it was chosen over;
  * REV:         with --against REV, gpumesh/capability.py as of that git revision, run in alternation
                 with the current one so that drift on the machine hits both alike (numpy and torch are
                 hidden from it by import, as it has no backend switch).
A machine that is busy while this runs measures its load, not itself: on Linux each run also reports how
many cores' worth of CPU other processes used meanwhile, and "busy" counts the runs where that passed 0.1.
"unsteady" counts the runs whose trials disagreed, where `gpumesh bench` warns (its median trial under
capability.STEADY of its best): the speed of the machine moved while it was measured, which a VM's guest
sees no other way. With --blocks K the whole comparison runs K times in a row, a table row per block.

With --trace SECONDS it measures the machine instead of the benchmark: each backend's matmul step runs
back to back for SECONDS in windows of 20 ms, and a table gives, per second, the median and the best window
against the best of all, and the longest stretch of windows under 90 % of that best. An idle machine holds
near 100 % throughout; a VM whose host lends its CPU to other tenants shows where its speed went.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, machine, table

from gpumesh import capability

# Runs a capability.py of another revision as the child would: as gpumesh.capability's __main__, with the
# backends it must not pick hidden from its imports (None in sys.modules makes `import x` raise ImportError).
OLD_CHILD = """import sys
for name in {hidden!r}:
    sys.modules[name] = None
path = {path!r}
exec(compile(open(path).read(), path, "exec"), {{"__name__": "__main__", "__package__": "gpumesh"}})
"""
HIDE = {"numpy": ["torch"], "python": ["torch", "numpy"], "torch": []}
BUSY = 0.1  # cores' worth of CPU used by other processes during a run


def _busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy (Linux), to tell a quiet run from one with company."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def child(args: list[str], env: dict[str, str]) -> tuple[list[str], float | None]:
    """One child's stdout lines, and the cores' worth of CPU that other processes used while it ran."""
    busy0, own0, t0 = _busy_seconds(), _children_cpu(), time.monotonic()
    proc = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    busy1, own1, wall = _busy_seconds(), _children_cpu(), time.monotonic() - t0
    others = None if busy0 is None or busy1 is None else max(0.0, (busy1 - busy0) - (own1 - own0)) / wall
    return proc.stdout.strip().splitlines(), others


def current(backend: str) -> tuple[float, list[float], float | None]:
    """The shipped score, the trial rates it is the best of, and the others' CPU, from one child process."""
    env = {**os.environ, "GPUMESH_BENCH_BACKEND": backend}
    lines, others = child([sys.executable, "-m", "gpumesh.capability", "--rates"], env)
    cap = json.loads(lines[-1])
    assert cap["backend"] == backend, cap
    return cap["score_gflops"], json.loads(lines[0])["rates"], others


def old(path: Path, backend: str) -> tuple[float, float | None]:
    code = OLD_CHILD.format(hidden=HIDE[backend], path=str(path))
    env = {k: v for k, v in os.environ.items() if k != "GPUMESH_BENCH_BACKEND"}
    lines, others = child([sys.executable, "-c", code], env)
    cap = json.loads(lines[-1])
    assert cap["backend"] == backend, cap
    return cap["score_gflops"], others


def trace(backend: str, seconds: float, window: float = 0.02) -> list[list[str]]:
    """Rows of the machine's speed over ``seconds`` of back-to-back steps, in this process."""
    _, step, flops = capability._SETUP[backend]()  # the benchmark's own step, no child: nothing in between
    capability.trial_rates(step, flops, trials=1, seconds=0.1)  # warm-up
    rates: list[tuple[float, float]] = []  # (start, GFLOP/s) of each window, back to back
    t0 = start = time.perf_counter()
    while start - t0 < seconds:
        n = 0
        while not n or (now := time.perf_counter()) - start < window:
            step()
            n += 1
        rates.append((start - t0, flops * n / (now - start) / 1e9))
        start = now
    best = max(r for _, r in rates)
    longest, slow_since = 0.0, None  # the longest run of windows under 90 % of the best, in seconds
    for (t, r), t_next in zip(rates, [t for t, _ in rates[1:]] + [start - t0]):
        slow_since = (t if slow_since is None else slow_since) if r < 0.9 * best else None
        if slow_since is not None:
            longest = max(longest, t_next - slow_since)
    per_second: dict[int, list[float]] = {}
    for t, r in rates:
        per_second.setdefault(int(t), []).append(r / best)
    medians = " ".join(f"{statistics.median(v):.0%}" for _, v in sorted(per_second.items()))
    bests = " ".join(f"{max(v):.0%}" for _, v in sorted(per_second.items()))
    overall = statistics.median(r for _, r in rates) / best
    return [
        [backend, "median window, per second", medians, f"{overall:.0%}", f"{longest:.1f} s"],
        [backend, "best window, per second", bests, "", ""],
    ]


def row(
    block: int, backend: str, estimator: str, xs: list[float], others: list[float | None], unsteady: str
) -> list[str]:
    med = statistics.median(xs)
    fmt = "{:.3g}".format
    busy = "?" if None in others else str(sum(o > BUSY for o in others if o is not None))
    spread = f"{(max(xs) - min(xs)) / med:.1%}"
    return [str(block), backend, estimator, str(len(xs)), fmt(min(xs)), fmt(med), fmt(max(xs)), spread, busy, unsteady]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--blocks", type=int, default=1, help="repeat the whole comparison this many times in a row")
    ap.add_argument("--backends", default="numpy,python", help="comma-separated: torch, numpy, python")
    ap.add_argument("--against", metavar="REV", help="also run gpumesh/capability.py of this git revision")
    ap.add_argument("--trace", type=float, metavar="SECONDS", help="measure the machine's speed over time instead")
    args = ap.parse_args()
    command = " ".join([".venv/bin/python", "benchmarks/bench_spread.py", *sys.argv[1:]])
    print(f"rerun: {command}")
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.2f} at start")
    if args.trace:
        rows = [r for backend in args.backends.split(",") for r in trace(backend, args.trace)]
        headers = ["backend", "of the best window of all", "each second in turn", "median", "longest under 90 %"]
        print(table(headers, rows))
        return

    rows = []
    with tempfile.TemporaryDirectory(prefix="gpumesh-spread-") as tmp:
        old_path: Path | None = None
        if args.against:
            source = subprocess.run(
                ["git", "show", f"{args.against}:gpumesh/capability.py"], cwd=ROOT, capture_output=True,
                text=True, check=True,
            ).stdout  # fmt: skip
            old_path = Path(tmp) / "capability_old.py"
            old_path.write_text(source)
        for block in range(1, args.blocks + 1):
            for backend in args.backends.split(","):
                best, median, others, before, others_before, unsteady = [], [], [], [], [], 0
                for i in range(args.runs):
                    score, rates, busy = current(backend)
                    best.append(score)
                    median.append(statistics.median(rates))
                    others.append(busy)
                    unsteady += capability.unsteady(rates) is not None
                    line = (
                        f"  block {block} {backend} run {i + 1}/{args.runs}: best {score:.3g} of {len(rates)} trials, "
                    )
                    line += f"median trial {median[-1] / score:.0%} of it (others {busy or 0:.2f} cores)"
                    if old_path:
                        score, busy = old(old_path, backend)
                        before.append(score)
                        others_before.append(busy)
                        line += f", {args.against} {score:.3g} (others {busy or 0:.2f} cores)"
                    print(line, flush=True)
                rows += [row(block, backend, "best trial (shipped)", best, others, str(unsteady))]
                rows += [row(block, backend, "median trial", median, others, "")]
                if before:
                    rows.append(row(block, backend, f"{args.against} (old)", before, others_before, ""))
    print(f"load average {os.getloadavg()[0]:.2f} at end\n")
    headers = ["block", "backend", "estimator", "runs", "min GFLOP/s", "median", "max", "spread", "busy", "unsteady"]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
