"""A job's preload zygote against the env's site-less zygote, both in warm mode.

1. What a no-op attempt costs forked from each (the preload zygote confined, each attempt narrowing Landlock to its
   own directory), through ``sandbox.run`` (no Redis): medians and 90th percentiles of 100 attempts, three rounds,
   after 10 to warm up. The env is a venv uv makes on this Python, with one small module to preload.
2. End to end: one ``gpumesh worker --warm`` (a private Redis), jobs of 20 tasks that each import numpy (locked with
   uv against the index this machine's uv is set to), without and with ``preload=["numpy"]``, alternately, three
   rounds; wall time from submit to the job's end / 20 (a preload job's time includes starting its zygote).

    python benchmarks/preload_zygote.py
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import PrivateRedis, start_worker, stop

import gpumesh
from gpumesh.envs import declare, lock
from gpumesh.sandbox import landlock, namespaces
from gpumesh.sandbox import runner as sandbox
from gpumesh.sandbox.preloaded import JobZygote
from gpumesh.sandbox.warm import Zygote


def rounds(zygote: Zygote, limits: sandbox.Limits, n: int = 100) -> tuple[float, float]:
    took = []
    for _ in range(n):
        t = time.perf_counter()
        out = sandbox.run("print('{}')\n", "task.py", "{}", {}, limits, lambda s, line: None, lambda: None, zygote)
        took.append((time.perf_counter() - t) * 1000)
        assert out.returncode == 0, list(out.stderr_tail)
    return statistics.median(took), statistics.quantiles(took, n=10)[-1]


NUMPY = "import json, sys\nimport numpy\nprint(json.dumps({'v': int(numpy.ones(3).sum())}))\n"


def end_to_end(tasks: int = 20) -> None:
    env = lock(declare(NUMPY, "imports.py", dependencies=["numpy"]), None)
    red = PrivateRedis()
    worker = start_worker(red.url, 10, "--warm", env={"GPUMESH_ENV_CACHE": str(red.tmp / "envs")})
    try:
        with gpumesh.connect(red.url) as mesh:
            job = mesh.submit_checked(NUMPY, "imports.py", [{"i": 0}], gpumesh.JobOptions(timeout=600), env=env)
            assert job.wait(timeout=600).status == "done", job.results()[0].error  # the env built, not timed
            took: dict[str, list[float]] = {"none": [], "numpy": []}
            for _ in range(3):
                for preload in ((), ("numpy",)):
                    t = time.perf_counter()
                    job = mesh.submit_checked(NUMPY, "imports.py", [{"i": i} for i in range(tasks)],
                                              gpumesh.JobOptions(timeout=600, preload=preload), env=env)  # fmt: skip
                    assert job.wait(timeout=600).status == "done", job.results()[0].error
                    took[",".join(preload) or "none"].append((time.perf_counter() - t) / tasks * 1000)
    finally:
        stop([worker])
        red.stop()
    for name, ms in took.items():
        print(f"preload {name}: ms per task {', '.join(f'{m:.1f}' for m in ms)} (median {statistics.median(ms):.1f})")


def main() -> None:
    per_attempt()
    end_to_end()


def per_attempt() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "env"
        subprocess.run([str(Path(sys.executable).with_name("uv")), "venv", "-q", str(root), "--python", sys.executable],
                       check=True)  # fmt: skip
        (site,) = root.glob("lib/python3*/site-packages")
        (site / "gmbench.py").write_text("import os\nPID = os.getpid()\n")
        isolation = landlock.Isolation(private=namespaces.unavailable() is None) if landlock.abi() > 0 else None
        limits = sandbox.Limits(timeout=20, memory_bytes=0, grace=1.0, python=str(root / "bin" / "python"),
                                site=str(site), isolation=isolation)  # fmt: skip
        for name, z in (
            ("env zygote (site-less)", Zygote(python=limits.python, site=True)),
            ("job preload zygote", JobZygote("bench", ["gmbench"], limits)),
        ):
            z.start()
            try:
                rounds(z, limits, 10)
                got = [rounds(z, limits) for _ in range(3)]
            finally:
                z.close()
            medians = ", ".join(f"{m:.1f}" for m, _ in got)
            p90 = ", ".join(f"{p:.1f}" for _, p in got)
            print(f"{name}: median ms per attempt {medians}; p90 {p90}")


if __name__ == "__main__":
    main()
