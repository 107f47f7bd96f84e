"""``gpumesh worker --gpus all|0,1|none``: one worker process per GPU, each pinned with
CUDA_VISIBLE_DEVICES and benchmarked on its own device, under a supervisor that restarts a crashed
child (with backoff) and stops them all on SIGTERM or Ctrl-C.

The supervisor never imports torch or initialises CUDA; it lists GPUs with nvidia-smi.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from gpumesh.errors import UsageError

log = logging.getLogger("gpumesh.supervisor")


def list_gpus() -> list[str]:
    """Indices of the NVIDIA GPUs this machine has (respecting CUDA_VISIBLE_DEVICES), without CUDA init."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip().isdigit()]


def parse_gpus(spec: str) -> list[str | None]:
    """Device list for each worker process: a GPU index, or None for one CPU-only worker."""
    if spec == "none":
        return [None]
    if spec == "all":
        gpus = list_gpus()
        if not gpus:
            log.warning("--gpus all: no NVIDIA GPU found (nvidia-smi); running one CPU worker")
            return [None]
        return list(gpus)
    ids = [g.strip() for g in spec.split(",")]
    if not ids or not all(g.isdigit() for g in ids) or len(set(ids)) != len(ids):
        raise UsageError(f"--gpus takes all, none or distinct GPU indices like 0,1; got {spec!r}")
    return list(ids)


@dataclass
class Child:
    gpu: str | None
    args: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    backoff: float = 1.0
    next_start: float = 0.0


class Supervisor:
    """Keeps one worker process per device alive until told to stop."""

    HEALTHY_AFTER = 60.0  # a child that ran this long gets its backoff reset
    MAX_BACKOFF = 30.0

    def __init__(
        self, gpus: list[str | None], worker_args: list[str], name: str, restart: bool = True, url: str | None = None
    ) -> None:
        """``url``: the broker, handed to each child in its environment (a command line is readable by all)."""
        self.restart = restart
        extra = {"GPUMESH_URL": url} if url else {}
        self.children = [
            Child(
                gpu,
                [*worker_args, "--name", name if gpu is None else f"{name}-gpu{gpu}"],
                {**os.environ, **extra, "CUDA_VISIBLE_DEVICES": "" if gpu is None else gpu},
            )
            for gpu in gpus
        ]
        self.stopping = 0

    def _spawn(self, child: Child) -> None:
        cmd = [sys.executable, "-P", "-m", "gpumesh", "worker", *child.args, "--exit-with-parent", str(os.getpid())]
        child.proc = subprocess.Popen(cmd, env=child.env)
        child.started = time.monotonic()
        log.info("worker for %s started (pid %d)", _label(child), child.proc.pid)

    def _on_signal(self, _signum: int, _frame: object) -> None:
        self.stopping += 1
        for c in self.children:
            if c.proc and c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)  # first: finish the task; second: hand it back now
        log.info(
            "stopping %d worker(s)%s", len(self.children), " now" if self.stopping > 1 else " after their current task"
        )

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        for c in self.children:
            self._spawn(c)
        while True:
            for c in self.children:
                assert c.proc is not None
                if self.stopping or c.proc.poll() is None:
                    continue
                if not self.restart and c.proc.returncode == 0:  # --burst: the queues ran dry
                    continue
                now = time.monotonic()
                if not c.next_start:  # just noticed the exit: schedule a restart with backoff
                    c.backoff = 1.0 if now - c.started > self.HEALTHY_AFTER else min(c.backoff * 2, self.MAX_BACKOFF)
                    c.next_start = now + c.backoff
                    log.warning(
                        "worker for %s exited with %s; restarting in %.0fs", _label(c), c.proc.returncode, c.backoff
                    )
                elif now >= c.next_start:
                    c.next_start = 0.0
                    self._spawn(c)
            ended = all(c.proc is not None and c.proc.poll() is not None for c in self.children)
            if ended and (self.stopping or not self.restart):
                return 0
            time.sleep(0.2)


def _label(child: Child) -> str:
    return f"GPU {child.gpu}" if child.gpu is not None else "the CPU"
