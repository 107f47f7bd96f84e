"""What the sandbox's layers cost one warm attempt: no-op attempts forked from one zygote through ``sandbox.run``
(no Redis, no RQ), with and without Landlock, the attempt's own namespaces (IPC, /dev/shm, keyring) and the
per-attempt cgroup, alternating rounds.

    python benchmarks/attempt_cost.py [--attempts 150] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import med, publish, rounds, table  # noqa: E402

from gpumesh.sandbox import landlock, namespaces, tree  # noqa: E402
from gpumesh.sandbox import runner as sandbox  # noqa: E402
from gpumesh.sandbox.warm import Zygote  # noqa: E402

NOOP = "import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n"


GAP = 0.003  # s between two attempts, untimed and busy, as a worker is with Redis between them: the zygote prepares the
# next attempt's supervisor (its cgroup, its rules) meanwhile, to be ready by then (back to back, that would be timed too)


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def per_attempt_ms(zygote: Zygote, isolation: landlock.Isolation | None, n: int) -> float:
    limits = sandbox.Limits(timeout=20, memory_bytes=1 << 30, grace=1.0, isolation=isolation)
    total = 0.0
    for _ in range(n):
        _busy(GAP)
        t0 = time.perf_counter()
        out = sandbox.run(NOOP, "noop.py", "{}", {}, limits, lambda s, line: None, lambda: None, zygote)
        total += time.perf_counter() - t0
        assert out.returncode == 0, list(out.stderr_tail)
    return total / n * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attempts", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    has_cgroup = tree.cgroup_base() is not None
    iso = landlock.Isolation() if landlock.abi() else None
    cases: dict[str, tuple[landlock.Isolation | None, bool]] = {"neither": (None, False)}
    if iso is not None:
        cases["Landlock"] = (iso, False)
    private = landlock.Isolation(private=True) if iso is not None and namespaces.unavailable() is None else None
    if private is not None:
        cases["Landlock + namespaces"] = (private, False)
    if has_cgroup:
        cases["per-attempt cgroup"] = (None, True)
        if iso is not None:
            cases["Landlock + cgroup"] = (iso, True)
        if private is not None:
            cases["all three (the default here)"] = (private, True)
    times: dict[str, list[float]] = {name: [] for name in cases}
    zygote = Zygote()
    zygote.start()
    base = tree._cgroup_base
    try:
        for _ in range(args.rounds):
            for name, (isolation, cgroup) in cases.items():
                tree._cgroup_base = base if cgroup else None  # cgroup_base() answers from its cache
                tree.drop_ahead(zygote)  # no cgroup made for the next attempt carries over into another case
                times[name].append(per_attempt_ms(zygote, isolation, args.attempts))
    finally:
        tree._cgroup_base = base
        zygote.close()
    neither = med(times["neither"])
    rows = [[name, f"{med(xs):.2f}", rounds(xs), f"{med(xs) - neither:+.2f}"] for name, xs in times.items()]
    body = (
        f"{args.attempts} no-op attempts forked from one warm zygote per round, through `sandbox.run` (no Redis), "
        f"each timed alone, after {GAP * 1000:.0f} ms of busy work as a worker's between two attempts:\n\n"
        + table(["layers", "ms per attempt, median", "rounds", "vs neither"], rows)
    )
    publish("attempt-cost", "What the sandbox's layers cost an attempt", body,
            f"python benchmarks/attempt_cost.py --attempts {args.attempts} --rounds {args.rounds}")  # fmt: skip


if __name__ == "__main__":
    main()
