"""Priorities and requirements: per-job latency of small jobs while a big job keeps the fleet busy.

    python benchmarks/priorities.py [--tasks 8] [--sleep 0.1] [--priorities 0,5,10] [--repeat 3]
                                    [--background-sleep 0.2] [--against REV]

A real fleet of three `gpumesh worker --warm` processes (scores 1, 2 and 4; heartbeat 1 s); only the
score-4 one declares `--resource vram_gb=80 --resource gpu=A100`, the others `--resource vram_gb=16`.
First each job shape runs alone on the idle fleet (its running-alone time, measured). Then a
background job of many short tasks (priority 0, --background-sleep s each) is submitted and keeps
every worker busy; while it runs, for each priority in --priorities and each of two shapes:
  * plain: --tasks tasks of --sleep s, no requirement (any of the three workers may run them);
  * requires: the same with `--require vram_gb>=40` (only the A100 worker may run them),
a small job is submitted (Broker.submit with JobOptions(priority=..., requires=...)) and waited for
(Broker.job_status) before the next. Latency is the job's own record, in server time: from the
submit to its last task's end (created_at to finished_at); "first start" is when its first task
began. A higher priority takes every worker's next dispatch, so its latency stays near its
running-alone time plus what the worker was busy with; at the background's priority, fair share
(fewest running tasks first) splits the workers. Every task of a requires job must have run on the
A100 worker (checked). The background job is cancelled at the end.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from common import PrivateRedis, med, publish, revision_tree, rounds, start_worker, stop, table

from gpumesh.models import JobOptions
from gpumesh.settings import Settings
from gpumesh.store import keys
from gpumesh.store.broker import Broker

SLEEP = "import json, sys, time\np = json.load(sys.stdin)\ntime.sleep(p['s'])\nprint(json.dumps({'i': p['i']}))\n"
FLEET = [  # (score, declared resources)
    (1.0, ("vram_gb=16",)),
    (2.0, ("vram_gb=16",)),
    (4.0, ("vram_gb=80", "gpu=A100")),
]
REQUIRE = ("vram_gb>=40",)


def run_job(b: Broker, name: str, n: int, sleep: float, priority: int, requires: tuple[str, ...]) -> dict:
    """Submit one small job and wait for its end; its latency from its own record (server time)."""
    payloads = [{"i": i, "s": sleep} for i in range(n)]
    job = b.submit(SLEEP, "sleep.py", payloads, JobOptions(name=name, priority=priority, requires=requires)).job_id
    deadline = time.monotonic() + 600
    while not (st := b.job_status(job)).finished:
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job} ({name}) not done in 600 s: {st}")
        time.sleep(0.01)
    assert st.status == "done" and st.tasks.done == n, st
    created, started, finished = (float(x) for x in b.r.hmget(keys.job(job), "created_at", "started_at", "finished_at"))
    workers = [b.task(tid).get("worker", "") for tid in b.task_ids(job)]
    return {"job": job, "latency": finished - created, "first": started - created, "workers": workers}


def measure(args: argparse.Namespace, priorities: list[int], shapes: dict, tree: Path | None) -> dict:
    """One fleet, one broker: the small jobs alone, then under the background. ``tree``: another revision's
    package, which the workers run (through PYTHONPATH); None: this checkout's."""
    server = PrivateRedis()
    env = {"XDG_CACHE_HOME": str(server.tmp / "cache"), "GPUMESH_HEARTBEAT_INTERVAL": "1", "GPUMESH_LEASE_TTL": "5"}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    procs = []
    alone: dict[str, list[float]] = {s: [] for s in shapes}
    loaded: dict[tuple[int, str], list[dict]] = {}
    try:
        b = Broker(Settings(url=server.url))
        for score, res in FLEET:
            procs.append(
                start_worker(
                    server.url,
                    score,
                    "--warm",
                    *[a for r in res for a in ("--resource", r)],
                    env=env,
                    cwd=str(server.tmp),
                )  # fmt: skip
            )
        deadline = time.monotonic() + 60
        while len(b.live_scores()) < len(FLEET):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("the workers did not all register")
            time.sleep(0.05)
        a100 = [w for w, res in b.live_resources().items() if res.get("gpu") == "A100"]
        assert len(a100) == 1, b.live_resources()
        for shape, req in shapes.items():  # warm-up: every zygote forks once before anything is timed
            run_job(b, f"warm-up {shape}", len(FLEET) * 2, 0.01, 0, req)
        for _ in range(args.repeat):
            for shape, req in shapes.items():
                alone[shape].append(run_job(b, f"alone {shape}", args.tasks, args.sleep, 0, req)["latency"])
        # The background: more tasks than the rounds can drain, so every worker stays busy to the end.
        rate = len(FLEET) / (args.background_sleep + 0.02)
        planned = args.repeat * len(priorities) * len(shapes) * (max(alone["requires"]) + 1.0)
        n_bg = max(100, math.ceil(rate * planned * 2))
        bg = b.submit(
            SLEEP, "sleep.py", [{"i": i, "s": args.background_sleep} for i in range(n_bg)],
            JobOptions(name="background", priority=0),
        ).job_id  # fmt: skip
        while b.job_status(bg).tasks.running < len(FLEET):
            time.sleep(0.01)
        for _ in range(args.repeat):
            for prio in priorities:
                for shape, req in shapes.items():
                    time.sleep(args.background_sleep * 2)  # every worker back on the background's tasks
                    assert b.job_status(bg).tasks.queued > 0, "the background job ran out; raise its size"
                    got = run_job(b, f"p{prio} {shape}", args.tasks, args.sleep, prio, req)
                    if req:
                        assert set(got["workers"]) == set(a100), f"a requires task ran elsewhere: {got['workers']}"
                    loaded.setdefault((prio, shape), []).append(got)
        bg_done = b.job_status(bg).tasks.done
        b.cancel(bg)
    finally:
        stop(procs)
        server.stop()
    return {"alone": alone, "loaded": loaded, "n_bg": n_bg, "bg_done": bg_done}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=8, help="tasks of each small job")
    ap.add_argument("--sleep", type=float, default=0.1, help="seconds each small job's task sleeps")
    ap.add_argument("--priorities", default="0,5,10")
    ap.add_argument("--repeat", type=int, default=3, help="rounds over every (priority, shape); medians reported")
    ap.add_argument("--background-sleep", type=float, default=0.2, help="seconds each background task sleeps")
    ap.add_argument("--against", metavar="REV", help="also run another git revision's workers, alternating with "
                    "this checkout's (one fleet each, --repeat times)")  # fmt: skip
    args = ap.parse_args()
    priorities = [int(p) for p in args.priorities.split(",")]
    cmd = (
        f"python benchmarks/priorities.py --tasks {args.tasks} --sleep {args.sleep:g} --priorities {args.priorities}"
        f" --repeat {args.repeat} --background-sleep {args.background_sleep:g}"
        + (f" --against {args.against}" if args.against else "")
    )
    shapes = {"plain": (), "requires": REQUIRE}
    if not args.against:
        got = measure(args, priorities, shapes, None)
        alone, loaded, n_bg, bg_done = got["alone"], got["loaded"], got["n_bg"], got["bg_done"]
    else:  # alternate the two versions, a fleet of one round each
        import tempfile

        tree = revision_tree(args.against, Path(tempfile.mkdtemp(prefix="gpumesh-rev-")))
        # this checkout's committed code through PYTHONPATH too: a worker run from the editable install starts and
        # runs slower than the same code through PYTHONPATH (benchmarks/makespan.py --committed)
        head = revision_tree("HEAD", Path(tempfile.mkdtemp(prefix="gpumesh-head-")))
        once = argparse.Namespace(**{**vars(args), "repeat": 1})
        alone, loaded, n_bg, bg_done = {}, {}, 0, 0
        for _ in range(args.repeat):
            for version, path in (("this checkout", head), (args.against, tree)):
                got = measure(once, priorities, shapes, path)
                for shape, v in got["alone"].items():
                    alone.setdefault(f"{version}|{shape}", []).extend(v)
                for key, runs in got["loaded"].items():
                    loaded.setdefault((key[0], f"{version}|{key[1]}"), []).extend(runs)
                n_bg, bg_done = max(n_bg, got["n_bg"]), bg_done + got["bg_done"]
        for version in ("this checkout", args.against):  # the shapes' own names, for the table below
            shapes.update({f"{version}|{s}": r for s, r in (("plain", ()), ("requires", REQUIRE))})
    rows = []
    for (prio, shape), runs in sorted(loaded.items(), key=lambda kv: (kv[0][0], kv[0][1].split("|")[-1], kv[0][1])):
        lat = [r["latency"] for r in runs]
        first = [r["first"] for r in runs]
        base = med(alone[shape])
        used = med([len(set(r["workers"])) for r in runs])
        rows.append((
            f"p{prio} {shape.replace('|', ': ')}", prio, " ".join(shapes[shape]) or "—", args.tasks, f"**{med(lat):.2f}**", rounds(lat),
            f"{med(first):.2f}", f"{base:.2f}", f"{med(lat) / base:.2f}", f"{used:g}",
        ))  # fmt: skip
    rows.append((
        "background", 0, "—", f"{n_bg:,} ({bg_done:,} done, then cancelled)" if not args.against
        else f"up to {n_bg:,} a fleet ({bg_done:,} done in all, then cancelled)", "", "", "", "", "", len(FLEET),
    ))  # fmt: skip
    body = (
        f"`{cmd}`\n\n"
        f"Three warm workers (scores 1, 2, 4; only the score-4 one has vram_gb=80, gpu=A100). Small jobs of "
        f"{args.tasks} tasks × {args.sleep:g} s, submitted one at a time while a priority-0 background job of "
        f"{args.background_sleep:g}-s tasks keeps every worker busy. Latency: submit to the job's last result (server "
        "time); first start: submit to its first task's start; alone: the same job on the idle fleet "
        f"(rounds: {', '.join(s.replace('|', ': ') + ' ' + rounds(v) for s, v in alone.items())}). Every task of a requires job ran on "
        "the A100 worker.\n\n"
        + table(
            [
                "job",
                "priority",
                "requires",
                "tasks",
                "latency, s (median)",
                "rounds",
                "first start, s",
                "alone, s",
                "latency ÷ alone",
                "workers used",
            ],
            rows,
        )  # fmt: skip
    )
    title = "Priorities and requirements: per-job latency under load"
    if args.against:
        publish(f"priorities-{args.against}", f"{title}, beside {args.against}", body, cmd)
    else:
        publish("priorities", title, body, cmd)


if __name__ == "__main__":
    main()
