"""Environments against Ray's ``runtime_env``: the same job, time to all results cold, and per task warm.

    python benchmarks/envs_ray.py --ray-python /path/to/venv-with-ray/bin/python [--packages numpy,scikit-learn]

A job of 20 tasks, each importing the packages, on one and on two workers of this machine: gpumesh (submit,
which locks, to the last result; fresh workers, an empty env cache) and Ray (``ray.init`` with
``runtime_env={"pip": [...]}`` and ``{"uv": [...]}``, then the 20 tasks; a fresh Ray session each time, its
runtime-env cache empty). Both sides start from an empty uv download cache; Ray's pip uses pip's own cache.
Warm: 20 more tasks on the same workers, per task (wall time / 20).
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

from common import PrivateRedis, publish, start_worker, stop, table

import gpumesh

RAY_JOB = """
import json, sys, time
import ray
mode, workers, packages = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
t0 = time.perf_counter()
ray.init(num_cpus=workers, include_dashboard=False, runtime_env={mode: packages}, log_to_driver=False)

@ray.remote(num_cpus=1)
def task(x):
    import numpy, sklearn
    return x

assert ray.get([task.remote(i) for i in range(20)]) == list(range(20))
cold = time.perf_counter() - t0
t1 = time.perf_counter()
ray.get([task.remote(i) for i in range(20)])
print(json.dumps({"cold_s": cold, "per_task_ms": (time.perf_counter() - t1) / 20 * 1000}))
ray.shutdown()
"""

TASK = "import json, sys\nimport numpy, sklearn\nprint(json.dumps(json.load(sys.stdin)))\n"
# the same task in --reuse-process form: the imports at module level, once per process; main(payload) per task
TASK_REUSED = "import numpy, sklearn\n\n\ndef main(payload):\n    return payload\n"


def ours(
    mesh: gpumesh.Mesh,
    url: str,
    workers: int,
    packages: list[str],
    tmp: Path,
    reuse: bool = False,
    preload: list[str] | None = None,
) -> tuple[float, float]:
    """``reuse``: the job's tasks on a worker run one after another in one process (``submit --reuse-process``),
    as Ray's worker processes run theirs. ``preload``: each task a fresh fork of a process that imported these
    (``submit --preload``)."""
    task = TASK_REUSED if reuse else TASK
    cache = Path(tempfile.mkdtemp(dir=tmp))
    os.environ["UV_CACHE_DIR"] = str(cache / "uv")
    procs = [start_worker(url, 10, "--warm", env={"GPUMESH_ENV_CACHE": str(cache / "envs")}) for _ in range(workers)]
    try:
        while len(mesh.workers()) < workers:
            time.sleep(0.05)
        t0 = time.perf_counter()
        job = mesh.submit(
            task, [{"i": i} for i in range(20)], dependencies=packages, reuse_process=reuse, preload=preload or ()
        )
        st = job.wait(timeout=900)
        cold = time.perf_counter() - t0
        assert st.status == "done", job.results()[0].error
        t1 = time.perf_counter()
        job = mesh.submit(
            task, [{"i": i} for i in range(20)], dependencies=packages, reuse_process=reuse, preload=preload or ()
        )
        assert job.wait(timeout=900).status == "done"
        return cold, (time.perf_counter() - t1) / 20 * 1000
    finally:
        stop(procs)
        mesh.broker.r.flushall()


def ray(python: str, mode: str, workers: int, packages: list[str], tmp: Path) -> tuple[float, float] | str:
    home = Path(tempfile.mkdtemp(dir=tmp))
    short = tempfile.mkdtemp(prefix="r", dir="/tmp")  # Ray's sockets live there: a Unix socket path is short
    env = {**os.environ, "UV_CACHE_DIR": str(home / "uv"), "RAY_TMPDIR": short}
    t0 = time.perf_counter()
    ran = subprocess.run([python, "-c", RAY_JOB, mode, str(workers), ",".join(packages)], env=env,
                         capture_output=True, text=True, timeout=900, cwd=home)  # fmt: skip
    if ran.returncode != 0:
        said = [line for line in ran.stderr.splitlines() if "Error" in line] or ran.stderr.splitlines() or ["?"]
        shutil.rmtree(short, ignore_errors=True)
        return f"failed after {time.perf_counter() - t0:.1f} s: {said[-1].strip()[:120]}"
    shutil.rmtree(short, ignore_errors=True)
    got = json.loads(ran.stdout.strip().splitlines()[-1])
    return float(got["cold_s"]), float(got["per_task_ms"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ray-python", required=True, help="an interpreter with ray, pip and uv installed")
    ap.add_argument("--packages", default="numpy,scikit-learn")
    ap.add_argument("--workers", default="1,2", help="the fleet sizes to run, comma-separated")
    args = ap.parse_args()
    packages = args.packages.split(",")
    ray_version = subprocess.run([args.ray_python, "-c", "import ray; print(ray.__version__)"],
                                 capture_output=True, text=True).stdout.strip()  # fmt: skip
    server = PrivateRedis()
    tmp = Path(tempfile.mkdtemp(prefix="gpumesh-bench-envs-ray-"))
    os.environ.update(GPUMESH_URL=server.url, XDG_CACHE_HOME=str(tmp / "cache"), GPUMESH_CONFIG=str(tmp / "c.toml"))
    rows = []
    try:
        mesh = gpumesh.connect()
        for workers in [int(n) for n in args.workers.split(",")]:
            cold, per = ours(mesh, server.url, workers, packages, tmp)
            rows.append(["gpumesh (uv, locked at submit)", workers, f"{cold:.1f}", f"{per:.1f}"])
            modules = [p.replace("-", "_").replace("scikit_learn", "sklearn") for p in packages]
            cold, per = ours(mesh, server.url, workers, packages, tmp, preload=modules)
            rows.append([f"gpumesh, `--preload {','.join(modules)}`", workers, f"{cold:.1f}", f"{per:.1f}"])
            cold, per = ours(mesh, server.url, workers, packages, tmp, reuse=True)
            rows.append(
                ["gpumesh, `--reuse-process` (as Ray reuses its workers)", workers, f"{cold:.1f}", f"{per:.1f}"]
            )
            for mode in ("pip", "uv"):
                got = ray(args.ray_python, mode, workers, packages, tmp)
                if isinstance(got, str):
                    rows.append([f"Ray {ray_version} runtime_env {mode}", workers, got, "—"])
                else:
                    rows.append([f"Ray {ray_version} runtime_env {mode}", workers, f"{got[0]:.1f}", f"{got[1]:.1f}"])
        mesh.close()
    finally:
        server.stop()
        for dirpath, _dirs, _files in os.walk(tmp):
            os.chmod(dirpath, 0o755)
        shutil.rmtree(tmp, ignore_errors=True)
    names = " + ".join(packages)
    body = "\n\n".join(
        [
            f"20 tasks, each importing {names}, from an empty uv cache and empty env caches, on workers of this "
            "machine; then 20 more tasks on the same workers (warm; wall time / 20). gpumesh's workers run warm (a zygote per "
            "env); Ray's worker processes are reused between tasks.",
            table(["system", "workers", "seconds to all 20 results, cold", "ms per task, warm"], rows),
            "Ray's per-task time is that of a reused worker process, which keeps what a task imported; a plain gpumesh "
            "task is a fresh fork of the env's zygote, which imports the packages again; with `--preload` it is a "
            "fresh fork of a process that imported them once for the job (its own, sandboxed). With `submit --reuse-process` "
            "(load once, run many) a worker's tasks of the job run one after another in one process, as Ray's do: the "
            "second job there is a new job, so each worker starts one new process for it.",
        ]
    )
    command = f"python benchmarks/envs_ray.py --ray-python PYTHON_WITH_RAY --packages {args.packages} --workers {args.workers}"
    publish("envs-ray", "Environments against Ray's runtime_env", body, command)
    json.dump(rows, sys.stderr)


if __name__ == "__main__":
    main()
