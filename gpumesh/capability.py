"""Hardware probe and matmul benchmark.

Run as ``python -m gpumesh.capability`` in a child process so the worker itself never initialises
CUDA (a process that forks after CUDA init breaks its children). Prints one JSON :class:`Capability`.
Backends in order: torch (CUDA, then MPS, then CPU), numpy, pure Python.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

from .errors import GpumeshError
from .models import Capability

BENCH_SECONDS = 0.5


def _timed(step, flops_per_step: float, seconds: float) -> float:
    if seconds <= 0:  # probe only (--score given): no measurement
        return 0.0
    step()  # warm-up: allocation, kernel selection, caches
    n, start = 0, time.perf_counter()
    while True:
        step()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and n >= 3:
            return flops_per_step * n / elapsed / 1e9


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def _bench_torch(seconds: float) -> Capability:
    import torch

    if torch.cuda.is_available():
        device, name = "cuda", torch.cuda.get_device_name(0)
        memory = torch.cuda.get_device_properties(0).total_memory
        n, sync = 4096, torch.cuda.synchronize
    elif getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        device, name, memory, n = "mps", "Apple GPU (MPS)", _memory_bytes(), 2048
        sync = torch.mps.synchronize
    else:
        device, name, memory, n, sync = "cpu", _cpu_name(), _memory_bytes(), 512, lambda: None
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)

    def step() -> None:
        (a @ b).sum().item() if device != "cpu" else a @ b
        sync()

    return Capability(
        device=device,
        device_name=name,
        memory_bytes=memory,
        score_gflops=_timed(step, 2 * n**3, seconds),
        backend="torch",
    )


def _bench_numpy(seconds: float) -> Capability:
    import numpy as np

    n = 512
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = a.T.copy()
    score = _timed(lambda: a @ b, 2 * n**3, seconds)
    return Capability(
        device="cpu", device_name=_cpu_name(), memory_bytes=_memory_bytes(), score_gflops=score, backend="numpy"
    )


def _bench_python(seconds: float) -> Capability:
    n = 48
    a = [[(i * j) % 7 + 0.5 for j in range(n)] for i in range(n)]
    bt = [list(col) for col in zip(*a)]

    def step() -> None:
        [[sum(x * y for x, y in zip(row, col)) for col in bt] for row in a]

    score = _timed(step, 2 * n**3, seconds)
    return Capability(
        device="cpu", device_name=_cpu_name(), memory_bytes=_memory_bytes(), score_gflops=score, backend="python"
    )


def benchmark(seconds: float = BENCH_SECONDS) -> Capability:
    """Probe and benchmark in this process (call it in a child: it may initialise CUDA).

    ``seconds=0`` probes the device without measuring (score 0)."""
    for bench in (_bench_torch, _bench_numpy):
        try:
            return bench(seconds)
        except ImportError:
            continue
    return _bench_python(seconds)


def _cache_file(cache_dir: Path) -> Path:
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "all").replace(",", "_") or "none"
    return cache_dir / f"capability-{socket.gethostname()}-gpu{gpus}.json"


def probe(cache_dir: Path, refresh: bool = False, score: float | None = None, timeout: float = 300) -> Capability:
    """This machine's capability: cached per host and visible GPUs, else measured in a child process.

    With ``score``, only the device is probed (no benchmark, nothing cached) and the score is taken as given."""
    if score is not None:
        cap = _run_child(["--probe-only"], timeout)
        return cap.model_copy(update={"score_gflops": score, "backend": cap.backend + "+assumed"})
    cache = _cache_file(cache_dir)
    if not refresh and cache.is_file():
        try:
            return Capability.model_validate_json(cache.read_text())
        except ValueError:
            pass  # a corrupt cache is re-measured
    cap = _run_child([], timeout)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(cap.model_dump_json())
    except OSError:
        pass  # a read-only home only costs a re-benchmark next time
    return cap


def _run_child(args: list[str], timeout: float) -> Capability:
    proc = subprocess.run(
        [sys.executable, "-m", "gpumesh.capability", *args],
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
    return Capability.model_validate_json(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(benchmark(0 if "--probe-only" in sys.argv else BENCH_SECONDS).model_dump()))
