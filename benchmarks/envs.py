"""Environments: what gpumesh adds to uv for a job's packages, cold and warm.

    python benchmarks/envs.py [--packages numpy,scikit-learn] [--rounds 3] [--tasks 100]

The packages are locked once (``gpumesh.envs.lock``, uv's universal resolution against the real index) and
uv's own download cache is filled first, so both sides below install the same files from the same cache.

1. Cold, each round: ``uv venv`` + ``uv pip install`` of the lock alone (the flags the worker uses), against
   a fresh ``gpumesh worker`` with an empty env cache: submit (the lock made already, as the CLI's submit
   makes it) to the first result of a job that imports the packages. Alternating, ``--rounds`` rounds.
2. Warm, per task: one ``gpumesh worker --warm`` runs ``--tasks`` no-op tasks of a job without an env, then
   of a job in the env (built before timing), alternately for ``--rounds`` rounds.
3. One machine, four workers, an env none of them holds: how many uv builds run, and how long after the build's
   end each worker leases its first task (the build's end as the env cache records it, each task's start as the
   broker records it), each round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import PrivateRedis, med, publish, rounds, start_worker, stop, table

import gpumesh
from gpumesh.envs import declare, lock, uv_binary

NOOP = "import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n"


def uv_alone(text: str, where: Path, imports: str = "") -> tuple[float, float]:
    """``uv venv`` + ``uv pip install`` of the lock (the worker's flags, the bytecode compiled by uv), then (``imports``) that script run
    once in it: (seconds to install, seconds to run)."""
    uv = uv_binary()
    req = where.with_suffix(".txt")
    req.write_text(text)
    t0 = time.perf_counter()
    subprocess.run([uv, "venv", "--quiet", "--relocatable", "--no-python-downloads", "--python", sys.executable,
                    str(where)], check=True)  # fmt: skip
    subprocess.run([uv, "pip", "install", "--quiet", "--require-hashes", "--no-deps", "--link-mode", "copy",
                    "--compile-bytecode", "--only-binary", ":all:", "--python", str(where / "bin" / "python"),
                    "-r", str(req)], check=True)  # fmt: skip
    built = time.perf_counter() - t0
    if not imports:
        return built, 0.0
    t1 = time.perf_counter()
    subprocess.run(
        [str(where / "bin" / "python"), "-c", imports], input="{}", text=True, capture_output=True, check=True
    )
    return built, time.perf_counter() - t1


def first_result(mesh: gpumesh.Mesh, source: str, env: object) -> float:
    t0 = time.perf_counter()
    job = mesh.submit_checked(source, "imports.py", [{"i": 0}], gpumesh.JobOptions(timeout=600), env=env)  # type: ignore[arg-type]
    for res in job.as_completed(timeout=600):
        assert res.status == "done", res.error
        break
    return time.perf_counter() - t0


def per_task_ms(mesh: gpumesh.Mesh, tasks: int, env: object) -> float:
    t0 = time.perf_counter()
    job = mesh.submit_checked(NOOP, "noop.py", [{"i": i} for i in range(tasks)], gpumesh.JobOptions(), env=env)  # type: ignore[arg-type]
    st = job.wait(timeout=600)
    assert st.status == "done", job.results()[0].error
    return (time.perf_counter() - t0) / tasks * 1000


def four_workers(mesh: gpumesh.Mesh, url: str, cache: Path, env: object) -> tuple[int, float]:
    """(uv builds, seconds from the build's end to the last of the four workers' first task)."""
    procs = [start_worker(url, 10, "--warm", env={"GPUMESH_ENV_CACHE": str(cache)}) for _ in range(4)]
    try:
        while len(mesh.workers()) < 4:
            time.sleep(0.05)
        job = mesh.submit_checked(NOOP, "noop.py", [{"i": i} for i in range(40)], gpumesh.JobOptions(), env=env)  # type: ignore[arg-type]
        assert job.wait(timeout=600).status == "done"
        r = mesh.broker.r
        first: dict[str, float] = {}
        for i in range(40):
            t = r.hmget(f"gpumesh:task:{job.id}-{i}", "worker", "started_at")
            first[t[0]] = min(first.get(t[0], float("inf")), float(t[1]))
        built = [json.loads(line) for line in (cache / "builds.jsonl").read_text().splitlines()]
        assert len(first) == 4, first
        return len(built), max(first.values()) - float(built[-1]["at"])
    finally:
        stop(procs)
        mesh.broker.r.flushall()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--packages", default="numpy,scikit-learn")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=100)
    args = ap.parse_args()
    packages = [p for p in args.packages.split(",") if p]
    server = PrivateRedis()
    tmp = Path(tempfile.mkdtemp(prefix="gpumesh-bench-envs-"))
    os.environ.update(GPUMESH_URL=server.url, XDG_CACHE_HOME=str(tmp / "cache"), GPUMESH_CONFIG=str(tmp / "c.toml"),
                      UV_CACHE_DIR=str(tmp / "uv-cache"))  # fmt: skip
    procs = []
    imports = "import json, sys\n" + "".join(f"import {p.replace('-', '_').replace('scikit_learn', 'sklearn')}\n"
                                             for p in packages) + "print(json.dumps(json.load(sys.stdin)))\n"  # fmt: skip
    try:
        t0 = time.perf_counter()
        env = lock(declare(with_=packages))
        assert env is not None
        lock_s = time.perf_counter() - t0
        uv_alone(env.text, tmp / "warm-uv-cache")  # fills uv's download cache: both sides install from it
        mesh = gpumesh.connect()
        alone, alone_run, ours = [], [], []
        for i in range(args.rounds):
            built, ran = uv_alone(env.text, tmp / f"alone-{i}", imports)
            alone.append(built)
            alone_run.append(built + ran)
            cache = tmp / f"envs-{i}"
            procs.append(start_worker(server.url, 10, "--fresh", env={"GPUMESH_ENV_CACHE": str(cache)}))
            while not mesh.workers():
                time.sleep(0.05)
            ours.append(first_result(mesh, imports, env))
            stop(procs)
            procs.clear()
            mesh.broker.r.flushall()
        together = [four_workers(mesh, server.url, tmp / f"machine-{i}", env) for i in range(args.rounds)]
        procs.append(start_worker(server.url, 10, "--warm", env={"GPUMESH_ENV_CACHE": str(tmp / "envs-0")}))
        while not mesh.workers():
            time.sleep(0.05)
        per_task_ms(mesh, 20, None)
        per_task_ms(mesh, 20, env)
        plain, inside = [], []
        for _ in range(args.rounds):
            plain.append(per_task_ms(mesh, args.tasks, None))
            inside.append(per_task_ms(mesh, args.tasks, env))
        mesh.close()
    finally:
        stop(procs)
        server.stop()
        for dirpath, _dirs, _files in os.walk(tmp):
            os.chmod(dirpath, 0o755)
        shutil.rmtree(tmp, ignore_errors=True)
    cold, warm = med(ours) / med(alone), med(inside) / med(plain)
    names = " + ".join(packages)
    body = "\n\n".join(
        [
            f"{names}: {len(env.packages)} locked packages ({', '.join(env.packages)}); locking at submit "
            f"(`uv pip compile --universal --generate-hashes`) took {lock_s:.2f} s. uv's download cache was filled "
            "first, so both sides install the same files from it.",
            table(
                ["cold", "seconds (median)", "rounds"],
                [
                    ["`uv venv` + `uv pip install` of the lock alone", f"{med(alone):.2f}", rounds(alone)],
                    [
                        "the same, then the task's script run once in it (its imports)",
                        f"{med(alone_run):.2f}",
                        rounds(alone_run),
                    ],
                    ["gpumesh: submit to first result on a fresh worker", f"{med(ours):.2f}", rounds(ours)],
                ],
            ),
            f"First result / uv alone and the script run once: **{med(ours) / med(alone_run):.2f}×** (target ≤ "
            f"1.2×); / uv alone: {cold:.2f}×. The first result is the worker's build, then one fresh task that "
            f"imports {names}: that import is most of what uv alone does not do, and no scheduler can take it "
            "out. Both sides compile the packages' bytecode (uv alone with `--compile-bytecode`; the worker with "
            "`python -I -S -m compileall`, as uv's starts the env's interpreter with its site, where a wheel's "
            "`.pth` would run unconfined): a task cannot write into its read-only env, so without it every "
            "attempt compiled scipy and scikit-learn again.",
            f"Warm, one worker, {args.tasks} no-op tasks a job, {args.rounds} rounds alternating:",
            table(
                ["job", "ms per task (median)", "rounds"],
                [
                    ["no env", f"{med(plain):.2f}", rounds(plain)],
                    [f"in the {names} env", f"{med(inside):.2f}", rounds(inside)],
                ],
            ),  # fmt: skip
            f"One machine, four `--warm` workers sharing its env cache, a 40-task job in the env none holds, "
            f"{args.rounds} rounds: uv builds per round {rounds([b for b, _ in together], '{:.0f}')}; from the "
            "build's end to the last worker's first task, s: "
            f"{rounds([g for _, g in together])} (median **{med([g for _, g in together]):.2f} s**; target ≤ 1 s).",
            f"In the env / without: **{warm:.2f}×**. Ray's `runtime_env` beside gpumesh: the next section "
            "(benchmarks/envs_ray.py). A torch CUDA job in an env was not run (no GPU on this machine).",
            "Measured on a machine shared with other work: a round can move by a fifth either way.",
        ]
    )
    command = f"python benchmarks/envs.py --packages {args.packages} --rounds {args.rounds} --tasks {args.tasks}"
    publish("envs", "Environments: cold build and warm tasks against uv alone", body, command)
    json.dump(
        {
            "alone": alone,
            "alone_run": alone_run,
            "ours": ours,
            "plain_ms": plain,
            "inside_ms": inside,
            "lock_s": lock_s,
            "four_workers": together,
        },
        sys.stderr,
    )


if __name__ == "__main__":
    main()
