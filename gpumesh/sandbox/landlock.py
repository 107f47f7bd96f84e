"""What a task may see of the host, on Linux with Landlock (5.13+): the worker's side.

The worker builds one rule set per attempt (:func:`rules`): read only the system's programs and libraries,
a few files of /etc, /proc and /sys, the paths its owner adds (``--read-path``); write only the attempt's
own directory (its TMPDIR and GPUMESH_OUTPUT_DIR), /dev/shm and the paths its owner adds (``--write-path``);
use the ordinary character devices and the NVIDIA ones (CUDA opens /dev/nvidia*, reads the driver's
libraries under /usr and /proc/driver/nvidia). From ABI 6 on, the task can signal no process outside its
domain: not its supervisor, not the worker. The launcher applies the set in the forked script child and adds
the interpreter it runs in (gpumesh.sandbox.launcher.apply_landlock); the network stays open.

Not readable, so: the worker's home (``~/.ssh``, the config file with the broker URL), other users' files,
``/proc/<worker>/mem`` and ``environ`` (Landlock forbids ptrace-like access to processes outside the domain).
Standard library only.
"""

from __future__ import annotations

import functools
import glob
import json
import os
from dataclasses import dataclass

from gpumesh.sandbox.launcher import landlock_abi

# The system's programs and libraries (the NVIDIA driver's user-space libraries live under /usr or /lib).
SYSTEM_READ = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/proc", "/sys")
# Of /etc only what programs read to run: the loader's cache, time zone, certificates, names and resolvers.
# Not all of /etc: gpumesh's config may live there (GPUMESH_CONFIG), and so may other secrets.
ETC_READ = (
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/ld.so.preload", "/etc/localtime",
    "/etc/timezone", "/etc/ssl", "/etc/pki", "/etc/ca-certificates", "/etc/crypto-policies", "/etc/passwd",
    "/etc/group", "/etc/nsswitch.conf", "/etc/hosts", "/etc/host.conf", "/etc/resolv.conf", "/etc/gai.conf",
    "/etc/services", "/etc/protocols", "/etc/alternatives", "/etc/mime.types", "/etc/os-release",
    "/etc/machine-id", "/etc/python3", "/etc/matplotlibrc", "/etc/OpenCL", "/etc/vulkan", "/etc/nvidia",
)  # fmt: skip
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")
NVIDIA_DEVICES = ("/dev/nvidia*", "/dev/nvidia-caps/*", "/dev/dri/*")
SYSTEM_WRITE = ("/dev/shm",)  # POSIX shared memory and semaphores: multiprocessing, torch's DataLoader


@dataclass(frozen=True)
class Isolation:
    """What the worker's owner adds to the task's view (``--read-path``, ``--write-path``)."""

    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()


@functools.cache
def abi() -> int:
    """This kernel's Landlock ABI version; 0 where tasks cannot be isolated."""
    try:
        return landlock_abi()
    except (OSError, AttributeError):
        return 0


def unavailable() -> str | None:
    """Why tasks on this machine run unconfined, or None when Landlock is there."""
    if not os.uname().sysname == "Linux":
        return f"not Linux ({os.uname().sysname}): Landlock is Linux-only"
    if abi() <= 0:
        return "this kernel has no usable Landlock (Linux 5.13+ with landlock in lsm=)"
    return None


def rules(isolation: Isolation, attempt_dir: str, kernel_abi: int | None = None) -> str:
    """The rule set for one attempt, as the JSON the launcher takes."""
    devices = [*DEVICES, *(p for pattern in NVIDIA_DEVICES for p in sorted(glob.glob(pattern)))]
    return json.dumps(
        {
            "abi": kernel_abi if kernel_abi is not None else abi(),
            "read": [*SYSTEM_READ, *ETC_READ, *map(os.path.abspath, isolation.read)],
            "write": [attempt_dir, *SYSTEM_WRITE, *map(os.path.abspath, isolation.write)],
            "devices": devices,
        },
        separators=(",", ":"),
    )


def split_paths(value: str) -> tuple[str, ...]:
    """A setting's list of paths: separated by ``os.pathsep`` (``:``) or commas."""
    return tuple(p.strip() for p in value.replace(",", os.pathsep).split(os.pathsep) if p.strip())
