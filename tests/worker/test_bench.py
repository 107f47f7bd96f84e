"""`gpumesh bench` and the capability cache: shown by default, saved only with --save, resources probed.

Real `gpumesh bench` processes (each runs the real benchmark child, 1.5 to 8 s) with HOME and
XDG_CACHE_HOME in a temp dir, so the cache they would write is private to the test."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gpumesh import capability
from gpumesh.models import Capability

from ..conftest import ROOT

FIELDS = {"device", "device_name", "memory_bytes", "score_gflops", "backend"}
NEW_FIELDS = {"cpu_cores", "ram_gb", "vram_gb", "vram_free_gb", "comparable"}


def bench_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GPUMESH_CACHE_DIR", capability.BACKEND_ENV)}
    return {
        **env, "HOME": str(home), "XDG_CACHE_HOME": str(home / "cache"), "GPUMESH_CONFIG": str(home / "config.toml"),
        **extra,
    }  # fmt: skip


def bench(home: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(
        [sys.executable, "-m", "gpumesh", "bench", *args],
        env=bench_env(home, **extra), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    return p


def cache_files(home: Path) -> list[Path]:
    return sorted((home / "cache").rglob("capability-*.json"))


@pytest.mark.processes
def test_bench_shows_without_writing_the_cache(tmp_path: Path):
    p = bench(tmp_path, "--json")
    cap = Capability.model_validate_json(p.stdout)
    assert set(json.loads(p.stdout)) == FIELDS | NEW_FIELDS
    assert cap.score_gflops > 0 and cap.backend == "numpy" and cap.comparable  # numpy is a test dependency
    assert cap.cpu_cores >= 1 and cap.ram_gb > 0 and cap.vram_gb is None and cap.vram_free_gb is None
    assert "not comparable" not in p.stderr
    assert cache_files(tmp_path) == []  # a worker's score never changes behind its back

    table = bench(tmp_path)
    assert "GFLOP/s" in table.stdout and "cores" in table.stdout and "RAM" in table.stdout
    assert "not saved" in table.stderr and cache_files(tmp_path) == []


@pytest.mark.processes
def test_bench_save_writes_the_cache_workers_read(tmp_path: Path):
    p = bench(tmp_path, "--json", "--save")
    [path] = cache_files(tmp_path)
    assert path.parent == tmp_path / "cache" / "gpumesh" and str(path) in p.stderr
    saved = Capability.model_validate_json(path.read_text())
    assert saved == Capability.model_validate_json(p.stdout)
    assert capability.probe(tmp_path / "cache" / "gpumesh") == saved  # what `gpumesh worker` gets, unmeasured


@pytest.mark.processes
def test_pure_python_backend_is_marked_not_comparable(tmp_path: Path):
    p = bench(tmp_path, "--json", **{capability.BACKEND_ENV: "python"})
    cap = json.loads(p.stdout)
    assert cap["backend"] == "python" and cap["comparable"] is False and 0 < cap["score_gflops"] < 1
    # A second warning line may follow where the machine's speed moved while it was measured (unsteady).
    [line] = [x for x in p.stderr.splitlines() if x.startswith("warning:") and "not comparable" in x]
    assert "pip install numpy" in line

    table = bench(tmp_path, **{capability.BACKEND_ENV: "python"})
    assert "not comparable" in table.stdout and "pip install numpy" in table.stderr


@pytest.mark.processes
def test_unknown_or_missing_backend_fails_and_says_which(tmp_path: Path):
    p = subprocess.run(
        [sys.executable, "-m", "gpumesh", "bench"],
        env=bench_env(tmp_path, **{capability.BACKEND_ENV: "fortran"}), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 1 and "GPUMESH_BENCH_BACKEND='fortran'" in p.stderr and "torch, numpy, python" in p.stderr


@pytest.mark.core
def test_worker_probe_measures_once_then_reads_the_cache(tmp_path: Path):
    first = capability.probe(tmp_path)  # the call `gpumesh worker` makes, in a child process
    assert capability.cache_file(tmp_path).is_file() and first.score_gflops > 0
    assert capability.probe(tmp_path) == first  # cached: same score, no second benchmark
    assumed = capability.probe(tmp_path / "other", score=5)
    assert assumed.score_gflops == 5 and assumed.backend.endswith("+assumed") and assumed.comparable
    assert not (tmp_path / "other").exists()  # an assumed score is never cached


@pytest.mark.core
def test_cache_from_before_the_resource_fields_still_loads(tmp_path: Path):
    old = {"device": "cpu", "device_name": "Some CPU", "memory_bytes": 8 * 2**30, "score_gflops": 42.0,
           "backend": "numpy"}  # fmt: skip
    cap = Capability.model_validate_json(json.dumps(old))
    assert (cap.cpu_cores, cap.ram_gb, cap.vram_gb, cap.comparable) == (0, 0.0, None, True)

    capability.cache_file(tmp_path).write_text(json.dumps(old))
    loaded = capability.probe(tmp_path)  # no benchmark: the old score is kept, the host's cores and RAM filled in
    assert loaded.score_gflops == 42.0 and loaded.cpu_cores >= 1 and loaded.ram_gb > 0

    gpu = {**old, "device": "cuda", "device_name": "NVIDIA A100", "memory_bytes": 80 * 2**30}
    capability.cache_file(tmp_path).write_text(json.dumps(gpu))
    assert capability.load(tmp_path).vram_gb == 80.0  # a cuda cache's memory is the device's


@pytest.mark.core
def test_resources_shape():
    cpu = Capability(device="cpu", device_name="Xeon", memory_bytes=2**34, score_gflops=100, backend="numpy",
                     cpu_cores=8, ram_gb=16.0)  # fmt: skip
    # a machine without a GPU offers no `gpu` (`--require gpu~…` must not match a processor's name)
    assert cpu.resources() == {"device": "cpu", "cpu": "Xeon", "cpu_cores": 8, "ram_gb": 16.0}
    gpu = cpu.model_copy(update={"device": "cuda", "device_name": "NVIDIA H100", "vram_gb": 79.1, "vram_free_gb": 78.5})
    assert gpu.resources() == {"device": "cuda", "gpu": "NVIDIA H100", "cpu_cores": 8, "ram_gb": 16.0,
                               "vram_gb": 79.1, "vram_free_gb": 78.5}  # fmt: skip


@pytest.mark.core
def test_warning_only_for_a_score_that_cannot_be_compared():
    cap = Capability(device="cpu", device_name="x", memory_bytes=1, score_gflops=0.02, backend="python")
    assert capability.warning(cap) is None
    line = capability.warning(cap.model_copy(update={"comparable": False}))
    assert line is not None and "\n" not in line and "pip install numpy" in line


@pytest.mark.core
def test_a_measurement_whose_trials_disagree_says_so_in_one_line():
    assert capability.unsteady([100.0, 98.0, 99.5, 97.0, 100.0]) is None
    assert capability.unsteady([]) is None and capability.unsteady([5.0]) is None  # nothing to compare
    moved = [100.0, 55.0, 52.0, 60.0, 99.0]  # a host's other tenant took half the CPU for most of the trials
    line = capability.unsteady(moved)
    assert line is not None and "\n" not in line and "60%" in line and "gpumesh bench --save" in line


class FakeClock:
    """The benchmark's clock, advanced by the step alone: a machine whose speed is exactly what the test says."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.core
def test_a_slow_stretch_of_the_machine_does_not_set_the_score_and_a_moving_speed_is_reported(
    monkeypatch: pytest.MonkeyPatch,
):
    clock = FakeClock()
    monkeypatch.setattr(capability, "time", clock)
    span = (capability.TRIALS + 1) * capability.TRIAL_SECONDS  # the warm-up, then the timed trials

    def slow_second() -> None:  # 1 GFLOP a step; a neighbour halves the speed for the first second
        clock.now += 0.002 if clock.now < 1 else 0.001

    rates = capability.trial_rates(slow_second, 1e9)
    assert capability.estimate(rates) == pytest.approx(1000)  # with 7 trials (0.65 s) it was 500
    assert capability.unsteady(rates) is None and span <= clock.now < span + 0.1  # steps overshoot a trial

    clock.now = 0.0

    def moving() -> None:  # full speed for 0.3 s in every 1.3 s, half speed in between
        clock.now += 0.001 if 0.5 <= clock.now % 1.3 < 0.8 else 0.002

    rates = capability.trial_rates(moving, 1e9)
    assert capability.estimate(rates) == pytest.approx(1000)
    assert capability.unsteady(rates) is not None  # the score may not repeat: the user is told


@pytest.mark.core
def test_numpy_is_a_dependency_of_the_package_so_a_fresh_install_scores_comparably() -> None:
    # Without numpy, a fresh install's first benchmark was pure Python: a score doctor calls not comparable.
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    assert any(re.match(r"numpy\b", dep) for dep in project["dependencies"]), project["dependencies"]
