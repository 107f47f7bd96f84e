"""Makespan on an emulated uneven fleet that is settled, forming, joining or changing: gpumesh's
dispatcher against one FIFO queue and against an older revision whose tiers are fixed at submit.

    python benchmarks/makespan.py [--scores 1,2,4,8] [--unit 1.0] [--repeat 2] [--baseline 8c0e58b]
                                  [--baseline-label TEXT] [--contenders dispatch,no-speculate,baseline,fifo]

Real worker processes emulate a fleet whose strengths are 1, 2, 4 and 8 (`--score S`); each task
sleeps cost × unit ÷ S, so a worker twice as strong finishes twice as fast. The same skewed mix of
costs (most light, a few heavy, in a shuffled order that is the same for every contender) runs on
four fleets, each started anew for every run:
  * settled: every worker registered, and 2.5 s more, before the submit;
  * forming: the workers are started 2 s before the submit (some may still be starting);
  * joining: the job is submitted first, then the workers start weakest first, one a second;
  * changing: settled, then the score-4 worker is stopped (SIGTERM) 3 s after the submit and a new
    score-4 worker is started at 5 s;
  * pausing: settled, the strongest worker lent with `--pause-when` and paused by its owner from 3 s to 6 s
    after the submit (its running task handed back unspent); gpumesh contenders only, in a section of its
    own. Its bound counts the paused worker's capacity lost during the pause.
  * envs: settled, each worker a machine of its own (an env cache each); two jobs of the same priority, each
    half the mix (unit ÷ 2) in an env of its own (a tiny wheel from a local folder, built by a real uv), env
    A held beforehand by the score-8 and score-1 workers, env B by the score-4 and score-2 ones; this gpumesh
    only, in a section of its own. Its bound also holds each env's work to the workers that hold it from the
    start and, on the others, from the end of one build (the median build measured beforehand).
Contenders: this gpumesh (placement at dispatch; backup copies on by default), the same with
--no-speculate, gpumesh 8c0e58b (git archive of --baseline, through PYTHONPATH, tiers bound
at submit), and four plain RQ workers on one FIFO queue with the same strengths.
The lower bound of each run is the least T at which the fleet's capacity, Σ s_i · (T − t_i) over the
workers registered at t_i (after the submit; 0 when before), covers Σ cost, and at least
min_i (t_i + c_max ÷ s_i). Each contender's workers start as fast as they start, so each
run has its own bound; the table gives the median of the per-run ratios. The changing fleet's bound
counts the stopped worker as if it stayed, so it is lower than the true one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from io import BytesIO
from pathlib import Path

import redis
from common import ROOT, PrivateRedis, med, publish, rounds, stop, table, tiny_wheel

SLEEP = """import json, os, sys, time
p = json.load(sys.stdin)
time.sleep(p["cost"] * p["unit"] / float(os.environ["GPUMESH_WORKER_SCORE"]))
print(json.dumps({"cost": p["cost"]}))
"""
COSTS = [1.0] * 40 + [4.0] * 6 + [12.0] * 3 + [30.0]  # skewed: most light, a few heavy, one very heavy
# Run with the baseline revision on PYTHONPATH. This venv's editable install of the checkout would supply a module the first
# version lacks (gpumesh.store: its layout was flat, gpumesh/broker.py), mixing two versions in one process: its finder goes.
SUBMIT_V1 = """import json, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f)]
try:
    from gpumesh.store.broker import Broker
except ImportError:
    from gpumesh.broker import Broker
from gpumesh.models import JobOptions
from gpumesh.settings import Settings
url, script, payloads = sys.argv[1], sys.argv[2], json.loads(sys.stdin.read())
print(Broker(Settings(url=url)).submit(script, "sleep.py", payloads, JobOptions()).job_id)
"""


PAUSE = (3.0, 6.0)  # the pausing fleet's pause of its strongest worker, seconds after the submit


def lower_bound(
    starts: list[tuple[float, float]], costs: list[float], pause: tuple[float, float, float] | None = None
) -> float:
    """Least T with Σ s·max(0, T − t) ≥ Σ cost, and T ≥ min (t + c_max / s); (score, start) pairs. ``pause``:
    (score, from, to) of a worker that does nothing in that span."""

    def lost(t: float) -> float:
        return pause[0] * max(0.0, min(t, pause[2]) - pause[1]) if pause else 0.0

    work, lo, hi = sum(costs), 0.0, 1e6
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(s * max(0.0, mid - t) for s, t in starts) - lost(mid) < work else (lo, mid)
    return max(hi, min(t + max(costs) / s for s, t in starts))


class Contender:
    def __init__(self, name: str, url: str, tmp: Path, env: dict[str, str], v1: Path | None = None,
                 fifo: bool = False, speculate: bool = True) -> None:  # fmt: skip
        self.name, self.url, self.tmp, self.v1, self.fifo, self.speculate = name, url, tmp, v1, fifo, speculate
        self.env = {**os.environ, **env, "GPUMESH_URL": url}
        self.cwd = str(tmp)  # not the checkout: its gpumesh/ would shadow PYTHONPATH's through sys.path[0]
        if v1 is not None:
            self.env["PYTHONPATH"] = str(v1)
        self.r = redis.Redis.from_url(url, decode_responses=True)

    def worker(self, score: float, *args: str, **env_extra: str) -> subprocess.Popen[bytes]:
        if self.fifo:
            cmd = [str(Path(sys.executable).parent / "rq"), "worker", "--url", self.url, "-w", "rq.worker.SimpleWorker",
                   "--serializer", "rq.serializers.JSONSerializer", "--path", str(Path(__file__).parent), "-q", "fifo"]  # fmt: skip
            env = {**self.env, "BENCH_SCORE": str(score)}
        else:
            cmd = [sys.executable, "-m", "gpumesh", "worker", "--score", str(score), "--warm", "--log-level",
                   "WARNING", *args]  # fmt: skip
            env = {**self.env, **env_extra}
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, cwd=self.cwd)  # fmt: skip

    def registered(self) -> int:
        if self.fifo:
            return len(self.r.smembers("rq:workers"))
        return self.r.zcard("gpumesh:workers")

    def submit(self, payloads: list[dict]) -> str:
        if self.fifo:
            from rq import Queue
            from rq.serializers import JSONSerializer

            q = Queue("fifo", connection=redis.Redis.from_url(self.url), serializer=JSONSerializer)
            q.enqueue_many([Queue.prepare_data("rq_noop.sleep_cost", args=(p["cost"], p["unit"])) for p in payloads])
            return "fifo"
        if self.v1 is not None:
            out = subprocess.run([sys.executable, "-c", SUBMIT_V1, self.url, SLEEP], input=json.dumps(payloads),
                                 env=self.env, capture_output=True, text=True, check=True, cwd=self.cwd)  # fmt: skip
            return out.stdout.strip()
        from gpumesh.models import JobOptions
        from gpumesh.settings import Settings
        from gpumesh.store.broker import Broker

        b = Broker(Settings(url=self.url))
        job = b.submit(SLEEP, "sleep.py", payloads, JobOptions(speculate=self.speculate)).job_id
        b.close()
        return job

    def done(self, job: str, n: int) -> bool:
        if self.fifo:
            return int(self.r.zcard("rq:finished:fifo")) >= n
        status = self.r.hget(f"gpumesh:job:{job}", "status")
        assert status != "failed", f"{self.name}: job {job} failed"
        return status == "done"


def owner(flag: Path, now: float) -> None:
    """The lender's owner: at the machine (the flag there) during PAUSE, away otherwise."""
    if PAUSE[0] <= now < PAUSE[1] and not flag.exists():
        flag.touch()
    elif now >= PAUSE[1] and flag.exists():
        flag.unlink()


def run(c: Contender, fleet: str, scores: list[float], payloads: list[dict]) -> tuple[float, float]:
    """(makespan, lower bound) of one run; the bound counts each worker from when it registered."""
    c.r.flushdb()
    procs: list[subprocess.Popen[bytes]] = []
    schedule: list[tuple[float, float]] = []  # (seconds after the submit, score) of workers still to start
    flag = c.tmp / f"paused-{os.getpid()}"
    flag.unlink(missing_ok=True)
    lender = max(scores)
    try:
        if fleet == "pausing":  # the strongest worker is lent, and its owner comes back for 3 s
            procs = [c.worker(s, *(["--pause-when", f"test -e {flag}"] if s == lender else []),
                              GPUMESH_PAUSE_PROBE_INTERVAL="0.2") for s in scores]  # fmt: skip
            while c.registered() < len(scores):
                time.sleep(0.05)
            time.sleep(2.5)
        elif fleet in ("settled", "changing"):
            procs = [c.worker(s) for s in scores]
            while c.registered() < len(scores):
                time.sleep(0.05)
            time.sleep(2.5)  # the baseline's workers learn their tiers at a heartbeat (1 s here)
        elif fleet == "forming":
            procs = [c.worker(s) for s in scores]
            time.sleep(2.0)
        else:
            schedule = [(float(i), s) for i, s in enumerate(sorted(scores))]
        job = c.submit(payloads)
        t0 = time.perf_counter()
        joined = [0.0] * c.registered()  # seconds after the submit at which each worker registered
        if fleet == "changing":
            schedule = [(5.0, 4.0)]
        stopped = fleet != "changing"
        while not c.done(job, len(payloads)):
            now = time.perf_counter() - t0
            while schedule and schedule[0][0] <= now:
                procs.append(c.worker(schedule.pop(0)[1]))
            if fleet == "pausing":
                owner(flag, now)
            if not stopped and now >= 3.0:
                stopped = True
                procs[scores.index(4.0)].send_signal(signal.SIGTERM)  # leaves after its current task
            if len(joined) < len(scores) + (fleet == "changing"):
                joined += [now] * max(0, c.registered() - len(joined) + (fleet == "changing" and stopped and now > 5))
            time.sleep(0.02)
        makespan = time.perf_counter() - t0
    finally:
        stop(procs)
        flag.unlink(missing_ok=True)
    joined += [makespan] * (len(scores) + (fleet == "changing") - len(joined))
    if fleet == "joining":  # they start weakest first, a second apart: the k-th to register is the k-th started
        starts = list(zip(sorted(scores), joined))
    elif fleet == "changing":  # the stopped worker counted as if it stayed, the new one from when it registered
        starts = [(s, 0.0) for s in scores] + [(4.0, joined[-1])]
    else:  # started together: the earliest registrations credited to the strongest (the lowest bound)
        starts = list(zip(sorted(scores, reverse=True), sorted(joined)))
    pause = (lender, *PAUSE) if fleet == "pausing" else None
    return makespan, lower_bound(starts, [p["cost"] * p["unit"] for p in payloads], pause)


ENV_HOLDERS = {"a": (8.0, 1.0), "b": (4.0, 2.0)}  # the envs fleet: which workers' machines hold each env


class Envs:
    """The envs fleet's two locked envs (tiny wheels in a local folder), built once each into a template cache
    that a holder's machine copies before a run; ``build_s``: the median seconds one build took."""

    def __init__(self, tmp: Path) -> None:
        from gpumesh.envs import declare, lock
        from gpumesh.envs.cache import EnvCache

        self.tmp, links = tmp, tmp / "wheels"
        self.uv_env = {"UV_FIND_LINKS": str(links), "UV_NO_INDEX": "1", "UV_CACHE_DIR": str(tmp / "uv-cache")}
        os.environ.update(self.uv_env)  # the submitter's resolution reads the same folder
        self.locks, self.templates, built = {}, {}, []
        for name in ENV_HOLDERS:
            tiny_wheel(links, f"gmbench_{name}", "1.0", {f"gmbench_{name}.py": "VALUE = 1\n"})
            self.locks[name] = lk = lock(declare(with_=[f"gmbench_{name}"]))
            for i in range(3):  # the first fills uv's cache, as a lender's machine that built anything before
                cache = EnvCache(tmp / f"template-{name}-{i}")
                cache.ensure(lk.digest, lk.text)
                built.append(float(json.loads((cache.root / "builds.jsonl").read_text())["seconds"]))
            self.templates[name] = tmp / f"template-{name}-0"
        self.build_s = med(built[1:])

    def machine(self, score: float, run: int) -> str:
        """A fresh env cache for the worker of ``score``, holding the envs ENV_HOLDERS gives it."""
        root = self.tmp / f"machine-{run}-{score:g}"
        root.mkdir()
        for name, holders in ENV_HOLDERS.items():
            if score in holders:
                folder = self.locks[name].digest[:32]
                shutil.copytree(self.templates[name] / folder, root / folder, symlinks=True)
        return str(root)

    def builds(self, run: int) -> int:
        return sum(len((p / "builds.jsonl").read_text().splitlines()) for p in self.tmp.glob(f"machine-{run}-*")
                   if (p / "builds.jsonl").exists())  # fmt: skip


def run_envs(c: Contender, scores: list[float], payloads: list[dict], envs: Envs, run: int) -> tuple[float, float]:
    """(makespan, lower bound) of the envs fleet: two jobs, one per env, submitted together."""
    from gpumesh.models import JobOptions
    from gpumesh.settings import Settings
    from gpumesh.store.broker import Broker

    c.r.flushdb()
    procs = [c.worker(s, GPUMESH_ENV_CACHE=envs.machine(s, run), **envs.uv_env) for s in scores]
    try:
        while c.registered() < len(scores):
            time.sleep(0.05)
        time.sleep(2.5)
        b = Broker(Settings(url=c.url))
        t0 = time.perf_counter()
        jobs = [
            b.submit(
                f"import gmbench_{name}\n" + SLEEP, "sleep.py", payloads, JobOptions(), env=envs.locks[name]
            ).job_id
            for name in ENV_HOLDERS
        ]
        while not all(c.done(j, len(payloads)) for j in jobs):
            time.sleep(0.02)
        makespan = time.perf_counter() - t0
        b.close()
    finally:
        stop(procs)
    costs = [p["cost"] * p["unit"] for p in payloads]
    bound = lower_bound([(s, 0.0) for s in scores], costs + costs)
    for holders in ENV_HOLDERS.values():  # each env's work: its holders from the start, the others after a build
        bound = max(bound, lower_bound([(s, 0.0 if s in holders else envs.build_s) for s in scores], costs))
    return makespan, bound


def baseline_tree(rev: str, dest: Path) -> Path:
    """The baseline revision's package, from git, to run through PYTHONPATH."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "gpumesh"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scores", default="1,2,4,8")
    ap.add_argument("--unit", type=float, default=1.0, help="seconds one unit of cost takes on a score-1 worker")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument(
        "--baseline",
        "--first-version",
        dest="first_version",
        default="8c0e58b",
        help="git revision to compare with (tiers)",
    )
    ap.add_argument("--baseline-label", default="tiers fixed at submit", help="what the baseline revision is")
    ap.add_argument("--contenders", default="dispatch,no-speculate,baseline,fifo", help="which contenders run")
    ap.add_argument(
        "--committed", action="store_true",
        help="run this checkout's committed code (git archive HEAD) through PYTHONPATH too, as the baseline runs: "
        "a worker run from an editable install started and ran slower here (9.07 against 8.95 s settled, same code)",
    )  # fmt: skip
    ap.add_argument("--fleets", default="settled,forming,joining,changing,pausing")
    args = ap.parse_args()
    scores = [float(s) for s in args.scores.split(",")]
    fleets = args.fleets.split(",")
    server = PrivateRedis()
    env = {"XDG_CACHE_HOME": str(server.tmp / "cache"), "GPUMESH_HEARTBEAT_INTERVAL": "1", "GPUMESH_LEASE_TTL": "5"}
    v1 = baseline_tree(args.first_version, server.tmp / "v1")
    chosen = args.contenders.split(",")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    this = baseline_tree("HEAD", server.tmp / "this") if args.committed else None
    contenders = [
        c
        for key, c in (
            (
                "dispatch",
                Contender(
                    "gpumesh (dispatch, backups on)" if this is None else f"gpumesh {head} (dispatch, backups on)",
                    server.db(1),
                    server.tmp,
                    env,
                    v1=this,
                ),
            ),
            ("no-speculate", Contender("gpumesh --no-speculate", server.db(2), server.tmp, env, speculate=False)),
            (
                "baseline",
                Contender(
                    f"gpumesh {args.first_version} ({args.baseline_label})", server.db(3), server.tmp, env, v1=v1
                ),
            ),  # fmt: skip
            ("fifo", Contender("one FIFO queue (plain RQ)", server.db(4), server.tmp, env, fifo=True)),
        )
        if key in chosen
    ]
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    envs = Envs(server.tmp / "envs") if "envs" in fleets else None
    runs = 0
    try:
        for seed in range(1, args.repeat + 1):
            order = COSTS[:]
            random.Random(seed).shuffle(order)
            payloads = [{"i": i, "cost": c, "unit": args.unit} for i, c in enumerate(order)]
            for fleet in fleets:
                for c in contenders:
                    if fleet == "pausing" and (c.v1 is not None or c.fifo):
                        continue  # --pause-when is this version's
                    if fleet == "envs":
                        if c is not contenders[0] or envs is None:
                            continue  # this version's, with its defaults
                        runs += 1
                        half = [{**p, "unit": args.unit / 2} for p in payloads]
                        t, bound = run_envs(c, scores, half, envs, runs)
                        print(f"round {seed} envs: {envs.builds(runs)} builds (at most one per machine and env it lacked)",
                              file=sys.stderr)  # fmt: skip
                    else:
                        t, bound = run(c, fleet, scores, payloads)
                    results.setdefault((fleet, c.name), []).append((t, bound))
                    print(f"round {seed} {fleet:9s} {c.name:40s} {t:6.2f} s, bound {bound:.2f}", file=sys.stderr)
    finally:
        server.stop()
    for name, title, shown, target in (
        ("makespan", "Makespan on settled, forming, joining and changing fleets",
         [f for f in fleets if f not in ("pausing", "envs")],
         "Targets: settled and forming ≤ 1.15 × the bound, joining ≤ 1.25 ×."),
        ("makespan-pause", "Makespan when a lender pauses its worker mid-job", [f for f in fleets if f == "pausing"],
         f"The score-{max(scores):g} worker is paused (`--pause-when`) from {PAUSE[0]:g} s to {PAUSE[1]:g} s after "
         "the submit; the bound counts its capacity lost meanwhile. Target: ≤ 1.25 × that bound."),
        ("makespan-envs", "Makespan when two jobs' envs are held by some workers only", [f for f in fleets if f == "envs"],
         "Two jobs of one priority, each half the mix in an env of its own; env A held beforehand by the score-8 and "
         "score-1 workers' machines, env B by the score-4 and score-2 ones (a cache each). The bound counts one build "
         f"per machine that lacks an env ({envs.build_s if envs else 0:.2f} s, the median measured beforehand). "
         "Target: ≤ 1.15 × that bound."),
    ):  # fmt: skip
        rows = []
        for fleet in shown:
            for c in contenders:
                runs = results.get((fleet, c.name))
                if not runs:
                    continue
                ratios = [t / b for t, b in runs]
                rows.append((fleet, c.name, f"{med([t for t, _ in runs]):.2f}", f"{med([b for _, b in runs]):.2f}",
                             f"**{med(ratios):.2f}**", rounds(ratios)))  # fmt: skip
        if not rows:
            continue
        body = (
            f"Fleet scores {args.scores}; {len(COSTS)} tasks, costs {sorted(set(COSTS))} (Σ {sum(COSTS):.0f}); "
            f"unit {args.unit} s; heartbeat 1 s. {target}\n\n"
            + table(
                [
                    "fleet",
                    "schedule",
                    "makespan, s (median)",
                    "lower bound, s",
                    "÷ lower bound (median)",
                    "÷ bound, rounds",
                ],
                rows,
            )
        )
        default = (
            ap.get_default("first_version") == args.first_version and ap.get_default("contenders") == args.contenders
        )
        publish(
            name if default else f"{name}-{args.first_version}",
            title if default else f"{title}: against {args.first_version} ({args.baseline_label})", body,
            f"python benchmarks/makespan.py --scores {args.scores} --unit {args.unit} --repeat {args.repeat}"
            f" --baseline {args.first_version} --fleets {','.join(shown)}"
            + ("" if default else f" --baseline-label '{args.baseline_label}' --contenders {args.contenders}")
            + (" --committed" if args.committed else ""),
        )  # fmt: skip


if __name__ == "__main__":
    main()
