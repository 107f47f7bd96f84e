"""Hardware probe and matmul benchmark.

Run as ``python -m gpumesh.capability`` in a child process so the worker itself never initialises
CUDA (a process that forks after CUDA init breaks its children). Prints one JSON :class:`Capability`.
Backends in order: torch (CUDA, then MPS, then CPU), numpy, pure Python; ``GPUMESH_BENCH_BACKEND``
(read by the child only) forces one. numpy is a dependency of the package, so a fresh install scores
comparably; pure Python is left for an install without it (``--no-deps``), and its score is marked
not comparable: it measures the interpreter, not the BLAS a task's numpy or torch would use.

The score must mean the same thing each time it is measured: on a shared or throttled machine a single
timed stretch scored from 11 to 262 GFLOP/s within minutes. Noise from other tenants, interrupts and frequency
dips only ever slows a stretch down, so the score is the best of many short trials of a fixed-size matmul
after a warm-up, spread over about 2.5 s so that one slow stretch of the machine cannot cover them all
(benchmarks/bench_spread.py measures the spread over separate runs). When the trials disagree, the machine's
speed moved while it was measured, and :func:`unsteady` says so: the score may not repeat.

``measure`` benchmarks without touching the cache, ``save`` writes the cache that workers read, and
``probe`` (what ``gpumesh worker`` calls) reads the cache or measures and saves on first use.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

from gpumesh.errors import GpumeshError
from gpumesh.models import Capability

# Warm-up + 30 trials: about 2.5 s of matmul, the child's imports come on top. With 7 trials (0.65 s) one slow
# stretch of about 0.6 s, invisible to the guest (no steal time), made a whole run 25 % slow; it must now last
# four times as long. Trials run back to back: a CPU that idles between them clocks down on bare metal.
TRIALS = 30
TRIAL_SECONDS = 0.08
STEADY = 0.9  # the median trial under this fraction of the best: the speed moved during the measurement
BACKENDS = ("torch", "numpy", "python")
BACKEND_ENV = "GPUMESH_BENCH_BACKEND"

Step = Callable[[], object]


def trial_rates(step: Step, flops_per_step: float, trials: int = TRIALS, seconds: float = TRIAL_SECONDS) -> list[float]:
    """GFLOP/s of each of ``trials`` back-to-back trials of at least ``seconds`` (and one step) each.

    A warm-up of one trial's length comes first: allocation, kernel selection and caches, BLAS threads
    spinning up, a CPU or GPU clocking up from idle would otherwise land in the first trial."""
    if trials <= 0:
        return []
    rates = []
    for i in range(trials + 1):
        n, start = 0, time.perf_counter()
        while True:
            step()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
        if i:  # trial 0 is the warm-up
            rates.append(flops_per_step * n / elapsed / 1e9)
    return rates


def estimate(rates: list[float]) -> float:
    """The best trial; 0 when nothing was measured (probe only). A slow trial is the machine being busy
    (other tenants, interrupts, a frequency dip), not the machine being slow. Over blocks of 10 separate
    runs on a quiet 2-core VM the best spread no more than the median of the same trials (numpy 35 % vs
    39 %, pure Python 32 % vs 52 %; benchmarks/bench_spread.py measures it)."""
    return max(rates, default=0.0)


def unsteady(rates: list[float]) -> str | None:
    """One line when the trials disagree (the median under STEADY of the best), else None.

    Trials of one fixed matmul agree within a few per cent on an idle machine. When they do not, something
    else used the CPU meanwhile (a process here, or another tenant of a VM's host, which the guest cannot
    see), and a second run may score otherwise: say so where the score is shown or first saved."""
    best = max(rates, default=0.0)
    if len(rates) < 2 or best <= 0:
        return None
    median = statistics.median(rates)
    if median >= STEADY * best:
        return None
    return (
        f"warning: this machine's speed moved while it was measured (the median trial ran at {median / best:.0%} "
        "of the best): another process, or another tenant of its host, was using the CPU, so the score may be "
        "low and may not repeat; fix: measure again when the machine is idle (gpumesh bench, then gpumesh bench --save)"
    )


def _gib(n: float) -> float:
    return round(n / 2**30, 1)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class _Host(TypedDict):
    cpu_cores: int
    ram_gb: float


def _host() -> _Host:
    """Cores and RAM, cheap to probe and never touching CUDA, so a parent process may call it too."""
    import psutil

    try:  # the cores this process may run on: a taskset or cpuset leaves fewer than the machine has
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity call
        cores = os.cpu_count() or 1
    return {"cpu_cores": cores, "ram_gb": _gib(psutil.virtual_memory().total)}


def _memory_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


# Each backend returns the device it found (score 0), one matmul step and that step's FLOPs. The sizes are
# fixed, so scores stay comparable with each other and with caches written before this version.
def _torch() -> tuple[Capability, Step, float]:
    import torch

    host = _host()
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        free, _ = torch.cuda.mem_get_info(0)  # before our own matrices take their share
        cap = Capability(
            device="cuda", device_name=torch.cuda.get_device_name(0), memory_bytes=total, score_gflops=0,
            backend="torch", vram_gb=_gib(total), vram_free_gb=_gib(free), **host,
        )  # fmt: skip
        n, sync = 4096, torch.cuda.synchronize
    elif getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        cap = Capability(
            device="mps", device_name="Apple GPU (MPS)", memory_bytes=_memory_bytes(), score_gflops=0,
            backend="torch", **host,
        )  # fmt: skip
        n, sync = 2048, torch.mps.synchronize
    else:
        cap = Capability(
            device="cpu", device_name=_cpu_name(), memory_bytes=_memory_bytes(), score_gflops=0, backend="torch",
            **host,
        )  # fmt: skip
        n, sync = 512, lambda: None
    a = torch.randn(n, n, device=cap.device)
    b = torch.randn(n, n, device=cap.device)
    c = torch.empty(n, n, device=cap.device)

    def step() -> None:
        torch.matmul(a, b, out=c)  # into one buffer: the allocator is not what is measured
        sync()  # GPU kernels are asynchronous: a step ends when the device has finished it

    return cap, step, 2 * n**3


def _numpy() -> tuple[Capability, Step, float]:
    import numpy as np

    # BLAS threads stay at their default (every core this process may use): that is what a task's numpy
    # gets. One thread is steadier while other processes compete for the cores (OpenBLAS's threads wait
    # on each other: beside a running test suite two threads fell to 11 GFLOP/s where one kept 90-140 on
    # this 2-core VM), but it would score a 64-core machine like a one-core one. So bench an idle machine:
    # `gpumesh bench` shows the score before --save keeps it.
    n = 512
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = a.T.copy()
    c = np.empty_like(a)
    cap = Capability(
        device="cpu", device_name=_cpu_name(), memory_bytes=_memory_bytes(), score_gflops=0, backend="numpy",
        **_host(),
    )  # fmt: skip
    return cap, lambda: np.matmul(a, b, out=c), 2 * n**3


def _python() -> tuple[Capability, Step, float]:
    n = 48
    a = [[(i * j) % 7 + 0.5 for j in range(n)] for i in range(n)]
    bt = [list(col) for col in zip(*a)]

    def step() -> None:
        [[sum(x * y for x, y in zip(row, col)) for col in bt] for row in a]

    cap = Capability(
        device="cpu", device_name=_cpu_name(), memory_bytes=_memory_bytes(), score_gflops=0, backend="python",
        comparable=False, **_host(),
    )  # fmt: skip
    return cap, step, 2 * n**3


_SETUP = {"torch": _torch, "numpy": _numpy, "python": _python}


def run(backend: str | None = None, trials: int = TRIALS) -> tuple[Capability, list[float]]:
    """Probe and benchmark in this process (call it in a child: it may initialise CUDA); also the trial
    rates the score is the best of. ``backend`` forces one (an ImportError if it is missing, never a
    silent fallback); ``trials=0`` probes the device without measuring (score 0)."""
    if backend is not None:
        cap, step, flops = _SETUP[backend]()
    else:
        for name in BACKENDS:
            try:
                cap, step, flops = _SETUP[name]()
                break
            except ImportError:
                continue
    rates = trial_rates(step, flops, trials)
    return cap.model_copy(update={"score_gflops": estimate(rates)}), rates


def benchmark(backend: str | None = None, trials: int = TRIALS) -> Capability:
    """:func:`run` without the trial rates."""
    return run(backend, trials)[0]


def warning(cap: Capability) -> str | None:
    """One line to show wherever a score is shown or used, when it cannot be ranked against other machines."""
    if cap.comparable:
        return None
    return (
        f"warning: the score {cap.score_gflops:.3g} GFLOP/s comes from the pure-Python matmul, not numpy or torch: "
        "it is not comparable with other machines' scores and ranks this machine far below them; "
        "fix: pip install numpy, then gpumesh bench --save (or gpumesh worker --rebench)"
    )


def cache_file(cache_dir: Path) -> Path:
    """Where the capability of this host and these visible GPUs is cached."""
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "all").replace(",", "_") or "none"
    return cache_dir / f"capability-{socket.gethostname()}-gpu{gpus}.json"


def load(cache_dir: Path) -> Capability | None:
    """The cached capability, or None when there is none or it is corrupt.

    A file from before the resource fields has no cores or RAM: those are probed here (cheap, no CUDA)
    and, for cuda, the device memory it does hold is the VRAM; the score is kept as it was."""
    try:
        cap = Capability.model_validate_json(cache_file(cache_dir).read_text())
    except (OSError, ValueError):
        return None  # missing, unreadable or corrupt: measured again
    if cap.cpu_cores == 0:
        update: dict[str, object] = {**_host()}
        if cap.device == "cuda" and cap.vram_gb is None:
            update["vram_gb"] = _gib(cap.memory_bytes)
        cap = cap.model_copy(update=update)
    return cap


def save(cache_dir: Path, cap: Capability) -> Path:
    """Write the cache workers read; raises OSError. Written whole then renamed, so a worker starting
    meanwhile reads the old file or the new one, never half of one."""
    path = cache_file(cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(cap.model_dump_json())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def measure(timeout: float = 300) -> tuple[Capability, list[float]]:
    """Benchmark this machine in a child process; caches nothing (``gpumesh bench`` without --save). Also
    the timed trials' GFLOP/s in order, the score being their best (:func:`unsteady` reads them)."""
    return _run_child([], timeout)


def probe(
    cache_dir: Path,
    refresh: bool = False,
    score: float | None = None,
    timeout: float = 300,
    warn: Callable[[str], object] | None = None,
) -> Capability:
    """This machine's capability: cached per host and visible GPUs, else measured in a child process and
    cached, so a worker's score stays what it was until someone re-measures on purpose. ``warn`` gets the
    :func:`unsteady` line of a measurement whose trials disagreed (the score is cached all the same).

    With ``score``, only the device is probed (no benchmark, nothing cached) and the score is taken as given."""
    if score is not None:
        cap, _ = _run_child(["--probe-only"], timeout)
        # The operator vouches for an assumed score, whatever backend would have measured it.
        return cap.model_copy(update={"score_gflops": score, "backend": cap.backend + "+assumed", "comparable": True})
    if not refresh and (cached := load(cache_dir)) is not None:
        return cached
    cap, rates = measure(timeout)
    if warn is not None and (line := unsteady(rates)) is not None:
        warn(line)
    try:
        save(cache_dir, cap)
    except OSError:
        pass  # a read-only home only costs a re-benchmark next time
    return cap


def _run_child(args: list[str], timeout: float) -> tuple[Capability, list[float]]:
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "gpumesh.capability", "--rates", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise GpumeshError(
            f"the hardware probe failed (exit {proc.returncode}: {tail[0]}); pass --score to skip the benchmark"
        )
    try:  # the last two lines: a library may print before them
        *_, rates, cap = proc.stdout.strip().splitlines()
        return Capability.model_validate_json(cap), [float(r) for r in json.loads(rates)["rates"]]
    except (ValueError, KeyError, TypeError) as e:  # pydantic's ValidationError is a ValueError
        raise GpumeshError(
            f"the hardware probe printed no result ({type(e).__name__}); pass --score to skip the benchmark"
        ) from e


def main(argv: list[str]) -> int:
    """The child: ``[--probe-only] [--rates]``; prints the capability as the last line of stdout, after
    the trial rates as ``{"rates": [...]}`` with --rates (the parent and benchmarks/bench_spread.py read them)."""
    backend = os.environ.get(BACKEND_ENV) or None  # the only place the variable is read
    if backend is not None and backend not in BACKENDS:
        print(f"{BACKEND_ENV}={backend!r}: expected one of {', '.join(BACKENDS)}", file=sys.stderr)
        return 2
    try:
        cap, rates = run(backend, 0 if "--probe-only" in argv else TRIALS)
    except ImportError as e:  # only a forced backend gets here: the default falls back to the next one
        print(f"{BACKEND_ENV}={backend}: {e}", file=sys.stderr)
        return 2
    if "--rates" in argv:
        print(json.dumps({"rates": rates}))
    print(json.dumps(cap.model_dump()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
