"""When a lent machine may work, and how much of it: ``--lend`` and ``--pause-when`` probes, read by the worker.

Every probe answers "may the worker take work now?": ``None`` (yes) or the reason it may not (``owner active``,
``outside 22:00-07:00``, ``the GPU is in use by pid 4242``). A probe that fails or hangs answers "no", with the
reason, so a broken probe never lends a machine its owner meant to keep. Each one reads something it can be
pointed at, so every behaviour is testable on a machine with no desktop and no GPU:

* ``idle[=MIN]``: the seconds since the last keyboard or mouse input, from ``GPUMESH_IDLE_PROBE`` (a command
  that prints them) where set; else the smallest of what the OS reports: ``xprintidle`` under X11, the
  ``HIDIdleTime`` of ``ioreg`` on macOS, and on Linux and macOS the last input on each logged-in terminal
  (the atime of its tty, as ``w`` shows it).
* ``gpu-free``: the processes on the worker's GPU, from ``GPUMESH_GPU_PROBE`` (a command that prints
  ``PID[, USED_MIB]`` lines, as ``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits``
  does) where set; else NVML (``pynvml``) where importable; else that ``nvidia-smi`` command. Any process that
  is not the worker or one of its descendants pauses it.
* ``HH:MM-HH:MM``: local time, within any of the windows given (a window may wrap past midnight).
* ``--pause-when CMD``: paused while ``sh -c CMD`` exits 0.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from gpumesh.errors import UsageError

log = logging.getLogger("gpumesh.worker")

PAUSED = "paused: "  # the stop reason of an attempt handed back for a pause starts with it
VRAM_OVER = "over the lender's VRAM cap"  # the stop reason of an attempt that used more GPU memory than --max-vram-gb
DEFAULT_IDLE_MINUTES = 5.0


class ProbeError(Exception):
    """A probe could not answer: the worker counts that as "not allowed"."""


@dataclass(frozen=True)
class Window:
    start: int  # minutes after midnight, local time
    end: int

    def holds(self, minute: int) -> bool:
        if self.start <= self.end:
            return self.start <= minute < self.end
        return minute >= self.start or minute < self.end  # wraps past midnight

    def __str__(self) -> str:
        return f"{self.start // 60:02d}:{self.start % 60:02d}-{self.end // 60:02d}:{self.end % 60:02d}"


@dataclass(frozen=True)
class Lend:
    """The parsed ``--lend`` values (all must allow; the windows among themselves: any of them) and
    ``--pause-when`` commands (each pauses while it exits 0)."""

    idle_minutes: float | None = None
    gpu_free: bool = False
    windows: tuple[Window, ...] = ()
    pause_when: tuple[str, ...] = ()

    @property
    def always(self) -> bool:
        return self.idle_minutes is None and not self.gpu_free and not self.windows and not self.pause_when

    def describe(self) -> str:
        said = []
        if self.idle_minutes is not None:
            said.append(f"idle={self.idle_minutes:g}")
        if self.gpu_free:
            said.append("gpu-free")
        said += [str(w) for w in self.windows]
        said += [f"pause-when {c!r}" for c in self.pause_when]
        return ", ".join(said) or "always"


_WINDOW = re.compile(r"([01]?\d|2[0-3]):([0-5]\d)-([01]?\d|2[0-3]):([0-5]\d)")


def parse_lend(values: tuple[str, ...], pause_when: tuple[str, ...] = ()) -> Lend:
    """``--lend`` values as given (UsageError naming the bad one)."""
    idle: float | None = None
    gpu = False
    windows: list[Window] = []
    for value in values:
        v = value.strip()
        if v == "always":
            continue
        if v == "gpu-free":
            gpu = True
        elif v == "idle" or v.startswith("idle="):
            minutes = v.partition("=")[2] or str(DEFAULT_IDLE_MINUTES)
            try:
                idle = float(minutes)
            except ValueError:
                idle = -1.0
            if not 0 <= idle <= 10080:
                raise UsageError(f"--lend {value}: idle takes minutes from 0 to 10080, e.g. --lend idle=10")
        elif m := _WINDOW.fullmatch(v):
            h1, m1, h2, m2 = map(int, m.groups())
            if (h1, m1) == (h2, m2):
                raise UsageError(f"--lend {value}: a window must not be empty; use --lend always for all day")
            windows.append(Window(h1 * 60 + m1, h2 * 60 + m2))
        else:
            raise UsageError(
                f"--lend {value!r}: expected always, idle[=MINUTES], gpu-free or a window HH:MM-HH:MM (local time), "
                "e.g. --lend 22:00-07:00 --lend idle=10"
            )
    for cmd in pause_when:
        if not cmd.strip():
            raise UsageError("--pause-when: the command is empty; e.g. --pause-when 'pgrep -x steam'")
    return Lend(idle, gpu, tuple(windows), tuple(pause_when))


def _run(cmd: str | list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """A probe's command: its output, or ProbeError when it cannot run or does not end within ``timeout``."""
    try:
        return subprocess.run(
            cmd, shell=isinstance(cmd, str), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise ProbeError(f"it did not answer within {timeout:g} s") from None
    except OSError as exc:
        raise ProbeError(str(exc)) from None


# -- idle --------------------------------------------------------------------------------------


def idle_sources(fixture: str = "") -> list[str]:
    """Which sources of the last input the idle probe reads on this machine (for `gpumesh doctor`)."""
    found = []
    if fixture:
        found.append("GPUMESH_IDLE_PROBE")
    if (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")) and shutil.which("xprintidle"):
        found.append("xprintidle")
    if sys.platform == "darwin" and shutil.which("ioreg"):
        found.append("ioreg HIDIdleTime")
    if _tty_idle() is not None:
        found.append("logged-in terminals")
    return found


def _tty_idle() -> float | None:
    """Seconds since the last input on any logged-in terminal (its tty's atime), or None: no such terminal."""
    best = None
    try:
        users = psutil.users()
    except (psutil.Error, OSError):
        return None
    for u in users:
        if not u.terminal:
            continue
        try:
            at = os.stat(os.path.join("/dev", u.terminal)).st_atime
        except OSError:
            continue
        idle = max(0.0, time.time() - at)
        best = idle if best is None else min(best, idle)
    return best


def idle_seconds(timeout: float, fixture: str = "") -> float:
    """Seconds since anyone last used this machine's keyboard, mouse or terminals; ProbeError: no source answers.
    ``fixture``: a command that prints them instead (GPUMESH_IDLE_PROBE)."""
    if fixture:
        out = _run(fixture, timeout)
        try:
            return float(out.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise ProbeError(f"GPUMESH_IDLE_PROBE printed {out.stdout.strip()[:80]!r}, not seconds") from None
    seen: list[float] = []
    if (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")) and shutil.which("xprintidle"):
        out = _run(["xprintidle"], timeout)
        if out.returncode == 0 and out.stdout.strip().isdigit():
            seen.append(int(out.stdout.strip()) / 1000)
    if sys.platform == "darwin" and shutil.which("ioreg"):
        out = _run(["ioreg", "-c", "IOHIDSystem"], timeout)
        m = re.search(r'"HIDIdleTime" = (\d+)', out.stdout)
        if m:
            seen.append(int(m.group(1)) / 1e9)
    tty = _tty_idle()
    if tty is not None:
        seen.append(tty)
    if not seen:
        raise ProbeError("no source of the last input here (no X display with xprintidle, no logged-in terminal)")
    return min(seen)


# -- the GPU -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_mib: float = 0.0


def gpu_processes(timeout: float, device: str | None = None, fixture: str = "") -> list[GpuProcess]:
    """The processes using the GPU (``device``: the CUDA_VISIBLE_DEVICES index, else all); ProbeError when
    nothing can say. ``fixture``: a command that prints them instead (GPUMESH_GPU_PROBE)."""
    if fixture:
        return _parse_pids(_run(fixture, timeout).stdout, "GPUMESH_GPU_PROBE")
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]  # nvidia-ml-py, where installed
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
            found = []
            n = pynvml.nvmlDeviceGetCount()
            for i in range(n) if device is None else [int(device)]:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                for p in (*pynvml.nvmlDeviceGetComputeRunningProcesses(h),
                          *pynvml.nvmlDeviceGetGraphicsRunningProcesses(h)):  # fmt: skip
                    found.append(GpuProcess(int(p.pid), (p.usedGpuMemory or 0) / 2**20))
            return found
        except Exception as exc:  # noqa: BLE001 - NVML's errors are its own; nvidia-smi may still answer
            log.debug("NVML: %s", exc)
    if not shutil.which("nvidia-smi"):
        raise ProbeError("nothing here says who uses the GPU: no nvidia-smi, nor NVML (pip install nvidia-ml-py)")
    cmd = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    out = _run([*cmd, *(["-i", device] if device is not None else [])], timeout)
    if out.returncode != 0:
        raise ProbeError(f"nvidia-smi: {(out.stderr or out.stdout).strip()[:200]}")
    return _parse_pids(out.stdout, "nvidia-smi")


def _parse_pids(text: str, source: str) -> list[GpuProcess]:
    found = []
    for line in text.splitlines():
        if not line.strip():
            continue
        pid, _, used = line.partition(",")
        try:
            found.append(GpuProcess(int(pid), float(used) if used.strip() else 0.0))
        except ValueError:
            raise ProbeError(f"{source} printed {line.strip()[:80]!r}, not 'PID[, USED_MIB]'") from None
    return found


def own_pids(root: int) -> set[int]:
    """The worker's process and every process below it (its tasks)."""
    pids = {root}
    try:
        pids.update(p.pid for p in psutil.Process(root).children(recursive=True))
    except psutil.Error:
        pass
    return pids


# -- the whole check ---------------------------------------------------------------------------


@dataclass
class Monitor:
    """Asks every probe of ``lend`` whether the worker may take work: :meth:`check` answers None (yes) or the
    reason it is paused. A probe that fails says so once (and once when it answers again)."""

    lend: Lend
    timeout: float = 10.0
    device: str | None = None
    idle_probe: str = ""  # GPUMESH_IDLE_PROBE
    gpu_probe: str = ""  # GPUMESH_GPU_PROBE
    clock: Callable[[], datetime.datetime] = datetime.datetime.now
    _failing: dict[str, str] = field(default_factory=dict)

    def check(self) -> str | None:
        reasons = [self._windows(), self._probe("idle", self._idle), self._probe("gpu-free", self._gpu)]
        for cmd in self.lend.pause_when:
            reasons.append(self._probe(f"--pause-when {cmd!r}", functools.partial(self._pause_when, cmd)))
        return next((r for r in reasons if r), None)

    def _probe(self, name: str, probe: Callable[[], str | None]) -> str | None:
        try:
            said = probe()
        except ProbeError as exc:
            why = f"the {name} probe failed ({exc})"
            if self._failing.get(name) != str(exc):
                log.warning("%s: counted as not allowed until it answers", why)
            self._failing[name] = str(exc)
            return why
        if self._failing.pop(name, None) is not None:
            log.info("the %s probe answers again", name)
        return said

    def _windows(self) -> str | None:
        if not self.lend.windows:
            return None
        now = self.clock()
        minute = now.hour * 60 + now.minute
        if any(w.holds(minute) for w in self.lend.windows):
            return None
        return "outside " + ", ".join(map(str, self.lend.windows))

    def _idle(self) -> str | None:
        if self.lend.idle_minutes is None:
            return None
        idle = idle_seconds(self.timeout, self.idle_probe)
        if idle < self.lend.idle_minutes * 60:
            return f"owner active (input within the last {self.lend.idle_minutes:g} min)"
        return None

    def _gpu(self) -> str | None:
        if not self.lend.gpu_free:
            return None
        ours = own_pids(os.getpid())
        others = [p.pid for p in gpu_processes(self.timeout, self.device, self.gpu_probe) if p.pid not in ours]
        if others:
            return f"the GPU is in use by pid {', '.join(map(str, sorted(others)[:3]))}"
        return None

    def _pause_when(self, cmd: str) -> str | None:
        if _run(cmd, self.timeout).returncode == 0:
            return f"--pause-when {cmd!r} holds"
        return None

    def vram_used_mib(self, pids: set[int]) -> float:
        """The GPU memory (MiB) that the processes ``pids`` use (a running attempt's tree)."""
        return sum(p.used_mib for p in gpu_processes(self.timeout, self.device, self.gpu_probe) if p.pid in pids)
