"""Load once, run many: per-task cost with and without --reuse-process, side by side with Ray, in one run.

    python benchmarks/reuse.py [--rounds 3] [--model-tasks 100] [--no-ray]

Starts its own redis-server on a free port and two `gpumesh worker --warm`, and (when Ray is installed:
`pip install -e '.[bench]'`, Ray is pinned there and is no dependency of gpumesh) a local Ray with 2 CPUs. All
stay up for the whole run; each round measures every contender in turn, from a connected Python client:

  * no-op tasks (benchmarks/reuse_tasks.py ``noop``): one task, submit to result (median of 10 in a round);
    20 tasks; 1,000 tasks (``mesh.map`` / ``ray.get``), gpumesh with and without ``reuse_process=True``;
  * a task whose module "loads a model" for 2 s on first use in its process, then answers in 10 ms
    (``infer``): ``--model-tasks`` tasks with reuse on 2 workers, against its bound
    2 × 2 s + N × 10 ms / 2 + 0.5 s; Ray's figure beside it, with the load (a new model key each round, as a new
    job's process loads anew) and once loaded (the same key again). Without reuse every task pays the load:
    4 tasks are run, and the per-task time is shown.

Without Ray the Ray rows say "not run". Medians of the rounds, every round shown; the machine is a shared VM, so
compare the ratios of one run, not figures across runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from common import PrivateRedis, med, publish, rounds, start_worker, stop, table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import reuse_tasks  # noqa: E402 - the tasks, from this directory

import gpumesh  # noqa: E402

NOOP_SIZES = (1, 20, 1000)


def _timed(call: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


class GpumeshSide:
    def __init__(self, url: str) -> None:
        self.procs = [start_worker(url, 10, "--warm") for _ in range(2)]
        r = redis.Redis.from_url(url)
        deadline = time.monotonic() + 60
        while r.zcard("gpumesh:workers") < 2:
            assert time.monotonic() < deadline, "the workers did not register"
            time.sleep(0.1)
        r.close()
        self.mesh = gpumesh.connect(url)
        for reuse in (False, True):  # each worker's first tasks (the zygote's first forks) before any clock
            self.mesh.map(reuse_tasks.noop, [{"i": i} for i in range(20)], reuse_process=reuse, progress=False)

    def noop(self, n: int, reuse: bool) -> float:
        payloads = [{"i": i} for i in range(n)]
        if n == 1:
            return med([_timed(lambda: self.mesh.map(reuse_tasks.noop, payloads, reuse_process=reuse,
                                                     progress=False)) for _ in range(10)])  # fmt: skip
        return _timed(lambda: self.mesh.map(reuse_tasks.noop, payloads, reuse_process=reuse, progress=False))

    def model(self, n: int, reuse: bool, key: str) -> float:
        payloads = [{"i": i, "model": key} for i in range(n)]
        return _timed(lambda: self.mesh.map(reuse_tasks.infer, payloads, reuse_process=reuse, progress=False))

    def close(self) -> None:
        self.mesh.close()
        stop(self.procs)


class RaySide:
    def __init__(self) -> None:
        import ray

        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")]))
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        self.ray = ray
        self.noop_f = ray.remote(reuse_tasks.noop)
        self.infer_f = ray.remote(reuse_tasks.infer)
        ray.get([self.noop_f.remote({"i": i}) for i in range(20)])  # its workers started before any clock

    def noop(self, n: int) -> float:
        ray, f = self.ray, self.noop_f
        if n == 1:
            return med([_timed(lambda: ray.get(f.remote({"i": 0}))) for _ in range(10)])
        return _timed(lambda: ray.get([f.remote({"i": i}) for i in range(n)]))

    def model(self, n: int, key: str) -> float:
        ray, f = self.ray, self.infer_f
        return _timed(lambda: ray.get([f.remote({"i": i, "model": key}) for i in range(n)]))

    def close(self) -> None:
        self.ray.shutdown()


def _ray() -> RaySide | None:
    try:
        import ray  # noqa: F401
    except ImportError:
        return None
    return RaySide()


def _fmt(xs: list[float], unit: str) -> str:
    if not xs:
        return "not run"
    scale, fmt = (1000.0, "{:.1f}") if unit == "ms" else (1.0, "{:.2f}")
    return f"**{fmt.format(med(xs) * scale)} {unit}** ({rounds([x * scale for x in xs], fmt)})"


def _ratio(a: list[float], b: list[float]) -> str:
    return f"{med(a) / med(b):.1f} ×" if a and b else "—"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model-tasks", type=int, default=100)
    ap.add_argument("--no-ray", action="store_true", help="leave Ray out even where it is installed")
    ap.add_argument("--no-publish", action="store_true", help="print the tables, do not write docs/benchmarks.md")
    args = ap.parse_args()
    server = PrivateRedis()
    gm = ray_side = None
    noop: dict[tuple[str, int], list[float]] = {}
    model: dict[str, list[float]] = {}
    try:
        gm = GpumeshSide(server.url)
        ray_side = None if args.no_ray else _ray()
        for rnd in range(args.rounds):
            for n in NOOP_SIZES:
                noop.setdefault(("gpumesh", n), []).append(gm.noop(n, reuse=False))
                noop.setdefault(("reuse", n), []).append(gm.noop(n, reuse=True))
                if ray_side is not None:
                    noop.setdefault(("ray", n), []).append(ray_side.noop(n))
            model.setdefault("reuse", []).append(gm.model(args.model_tasks, True, f"r{rnd}"))
            if ray_side is not None:
                model.setdefault("ray", []).append(ray_side.model(args.model_tasks, f"r{rnd}"))
                model.setdefault("ray loaded", []).append(ray_side.model(args.model_tasks, f"r{rnd}"))
            if rnd == 0:
                model["no reuse, per task"] = [gm.model(4, False, "n0") / 2]  # 4 tasks on 2 workers: 2 each
            print(f"round {rnd + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    finally:
        if ray_side is not None:
            ray_side.close()
        if gm is not None:
            gm.close()
        server.stop()
    rows = []
    for n in NOOP_SIZES:
        what = "one task, submit to result" if n == 1 else f"{n:,} tasks (`mesh.map` / `ray.get`)"
        unit = "ms" if n < 1000 else "s"
        ray_x, reuse_x, plain_x = noop.get(("ray", n), []), noop[("reuse", n)], noop[("gpumesh", n)]
        rows.append([what, _fmt(ray_x, unit), _fmt(reuse_x, unit), _fmt(plain_x, unit), _ratio(reuse_x, ray_x),
                     _ratio(plain_x, ray_x)])  # fmt: skip
    bound = 2 * reuse_tasks.LOAD_S + args.model_tasks * reuse_tasks.ANSWER_S / 2 + 0.5
    per_task = model["no reuse, per task"][0]
    rows.append([
        f"{args.model_tasks} tasks loading a 2 s model, answering in 10 ms (bound with reuse: {bound:.1f} s)",
        _fmt(model.get("ray", []), "s") + (f"; loaded already: {_fmt(model['ray loaded'], 's')}" if "ray" in model
                                           else ""),
        _fmt(model["reuse"], "s"),
        f"{per_task:.2f} s a task (4 run): {per_task * args.model_tasks / 2:.0f} s for {args.model_tasks}",
        _ratio(model["reuse"], model.get("ray", [])),
        "—",
    ])  # fmt: skip
    header = ["2 workers / 2 CPUs", "Ray", "gpumesh --reuse-process", "gpumesh (warm)", "reuse ÷ Ray", "warm ÷ Ray"]
    verdict = "met" if med(model["reuse"]) <= bound else "not met"
    body = (
        table(header, rows)
        + f"\n\nThe model row's bound {bound:.1f} s with reuse: {verdict} (median {med(model['reuse']):.2f} s). "
        "Each gpumesh job's process is its own, so every round's reused job loads its model once per worker; Ray's "
        "first figure loads a new model key once per worker too, its second reuses the loaded one. Two warm workers "
        "and a 2-CPU Ray side by side on a shared 2-core VM (other work ran on it): medians of the rounds, each round "
        "shown; compare ratios within this table."
    )
    if args.no_publish:
        print(body)
    else:
        publish("reuse", "Load once, run many (--reuse-process) beside Ray", body,
                f"python benchmarks/reuse.py --rounds {args.rounds} --model-tasks {args.model_tasks}")  # fmt: skip
    print(f"ratio spread: {statistics.pstdev(noop[('reuse', 1)]):.4f}", file=sys.stderr)


if __name__ == "__main__":
    main()
