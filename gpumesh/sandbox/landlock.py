"""What a task may see of the host, on Linux with Landlock (5.13+): the worker's side.

The worker builds one rule set per attempt (:func:`rules`): read only the system's programs and libraries,
a few files of /etc, /proc and /sys, the paths its owner adds (``--read-path``); write only the attempt's
own directory (its TMPDIR and GPUMESH_OUTPUT_DIR), /dev/shm and the paths its owner adds (``--write-path``);
use the ordinary character devices and the NVIDIA ones (CUDA opens /dev/nvidia*, reads the driver's
libraries under /usr and /proc/driver/nvidia). From ABI 6 on, the task can signal no process outside its
domain (not its supervisor, not the worker) and connect to no abstract Unix socket made outside it; from ABI 9 on,
to no pathname Unix socket outside its write paths. Before ABI 9 it may connect to every pathname Unix socket its
user may open (:func:`unix_socket_warnings`). The launcher applies the set in the forked script child and adds
the interpreter it runs in (gpumesh.sandbox.launcher._run_script); the network stays open.

Not readable, so: the worker's home (``~/.ssh``, the config file with the broker URL), other users' files,
``/proc/<worker>/mem`` and ``environ`` (Landlock forbids ptrace-like access to processes outside the domain).
Standard library only.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import time
from dataclasses import dataclass

from gpumesh.sandbox.launcher import UNIX_SOCKETS_ABI, landlock_abi

# The system's programs and libraries (the NVIDIA driver's user-space libraries live under /usr or /lib).
# /opt: CUDA (/opt/cuda), conda and vendors' toolkits.
SYSTEM_READ = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/opt", "/proc", "/sys")
# Of /etc only what programs read to run: the loader's cache, time zone, certificates, names and resolvers.
# Not all of /etc: gpumesh's config may live there (GPUMESH_CONFIG), and so may other secrets.
ETC_READ = (
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/ld.so.preload", "/etc/localtime",
    "/etc/timezone", "/etc/ssl", "/etc/pki", "/etc/ca-certificates", "/etc/crypto-policies", "/etc/passwd",
    "/etc/group", "/etc/nsswitch.conf", "/etc/hosts", "/etc/host.conf", "/etc/resolv.conf", "/etc/gai.conf",
    "/etc/services", "/etc/protocols", "/etc/alternatives", "/etc/mime.types", "/etc/os-release",
    "/etc/machine-id", "/etc/python3", "/etc/matplotlibrc", "/etc/OpenCL", "/etc/vulkan", "/etc/nvidia",
)  # fmt: skip
# Not /dev/ptmx and /dev/pts: with them a task could open any terminal of /dev/pts its user may, the shell
# its worker was started from included, and read what is typed there. A pseudo-terminal is refused.
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")
NVIDIA_DEVICES = ("/dev/nvidia*", "/dev/nvidia-caps/*", "/dev/dri/*")
SYSTEM_WRITE = ("/dev/shm",)  # POSIX shared memory and semaphores: multiprocessing, torch's DataLoader


@dataclass(frozen=True)
class Isolation:
    """What the worker's owner adds to the task's view (``--read-path``, ``--write-path``)."""

    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    cache: tuple[str, ...] = ()  # read by every task; each attempt's writes go to an overlay of its own
    private: bool = False  # each attempt gets its own IPC, /dev/shm and keyring (namespaces.probe said it can)


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


def unix_socket_warnings(confined: bool, root_tasks: bool, kernel_abi: int | None = None) -> list[str]:
    """What a worker says once at start about the Unix sockets its tasks can still reach. ``confined``: tasks
    run under Landlock; ``root_tasks``: they run as uid 0 (a root worker without --sandbox-user)."""
    kernel_abi = abi() if kernel_abi is None else kernel_abi
    said = []
    if root_tasks:
        said.append(
            "this worker runs as root without --sandbox-user: tasks run as uid 0"
            + (" (without capabilities) and can still" if confined else " with every capability and can")
            + " connect to root's Unix sockets (systemd's /run/systemd/private, /var/run/docker.sock),"
            + " which run commands as root outside the sandbox; start it with --sandbox-user USER"
        )
    if confined and kernel_abi < UNIX_SOCKETS_ABI:
        said.append(
            f"Landlock ABI {kernel_abi} does not confine pathname Unix sockets (ABI {UNIX_SOCKETS_ABI}, Linux 7.1+,"
            " does): tasks can connect to any its user may open (docker.sock, ssh-agent, systemd --user)"
            + ("" if kernel_abi >= 6 else ", and to abstract ones (D-Bus, X11)")
        )
    return said


DEVICES_FRESH_FOR = 30.0  # s: how long the devices found are reused (a driver loaded later is seen this late)
_devices: tuple[float, list[str]] | None = None


def devices() -> list[str]:
    """The devices a task may open: the ordinary ones and the GPUs' present now (looked up at most every
    DEVICES_FRESH_FOR seconds, not at every attempt)."""
    global _devices
    if _devices is None or time.monotonic() - _devices[0] > DEVICES_FRESH_FOR:
        found = [*DEVICES, *(p for pattern in NVIDIA_DEVICES for p in sorted(glob.glob(pattern)))]
        _devices = (time.monotonic(), found)
    return _devices[1]


def rules(
    isolation: Isolation,
    attempt_dir: str,
    kernel_abi: int | None = None,
    shm_bytes: int = 0,
    project: str = "",
    env: str = "",
) -> str:
    """The rule set for one attempt, as the JSON the launcher takes. ``shm_bytes``: the size of the attempt's own
    /dev/shm (where ``isolation.private``; 0: the kernel's default, half the RAM). ``project``: the machine's copy
    of the attempt's project tree, which it may read (and nothing else of the project cache)."""
    shared = _rules_before_attempt(isolation, kernel_abi if kernel_abi is not None else abi(), tuple(devices()))
    tail = f',"project":{json.dumps(project)}' if project else ""
    if env:  # the attempt's environment (gpumesh.envs): read only
        tail += f',"env":{json.dumps(env)}'
    return shared + json.dumps(attempt_dir) + f',"shm":{int(shm_bytes)}' + tail + "}"


@functools.lru_cache(maxsize=8)
def _rules_before_attempt(isolation: Isolation, kernel_abi: int, found_devices: tuple[str, ...]) -> str:
    """The JSON of the rules every attempt of ``isolation`` shares, up to the attempt's own directory (its last key):
    made once, not per attempt."""
    text = json.dumps(
        {
            "abi": kernel_abi,
            "read": [*SYSTEM_READ, *ETC_READ],
            # With namespaces of its own, /dev/shm and the caches are named from inside them, by the script's process.
            "write": [] if isolation.private else list(SYSTEM_WRITE),
            "devices": list(found_devices),
            "private": {"caches": [os.path.abspath(p) for p in isolation.cache]} if isolation.private else None,
            # What a task's user may be able to change (a path the owner shares with tasks, whose parent a
            # task could write), resolved only as the task's user, at its attempt: never by a spare ahead. Without
            # namespaces of its own, a task reads the caches and writes none of them.
            "owner_read": [
                os.path.abspath(p) for p in (*isolation.read, *([] if isolation.private else isolation.cache))
            ],
            "owner_write": [os.path.abspath(p) for p in isolation.write],
            "attempt": None,
        },
        separators=(",", ":"),
    )
    return text.removesuffix("null}")  # the attempt's directory and /dev/shm's size follow (:func:`rules`)


@functools.cache
def reaches(isolation: Isolation, path: str) -> bool:
    """Whether a task confined by ``isolation`` may read or write ``path`` and what is in it (its rules name
    ``path`` or a directory above it). The worker keeps its attempts' directories in its temp dir: where a task
    reaches that, one attempt could see into another's directory."""
    target = os.path.realpath(path)
    named = [*SYSTEM_READ, *ETC_READ, *SYSTEM_WRITE, *isolation.read, *isolation.write, *isolation.cache]
    for rule in named:
        rule = os.path.realpath(rule)
        if os.path.commonpath([rule, target]) == rule:
            return True
    return False


def split_paths(value: str) -> tuple[str, ...]:
    """A setting's list of paths: separated by ``os.pathsep`` (``:``) or commas."""
    return tuple(p.strip() for p in value.replace(",", os.pathsep).split(os.pathsep) if p.strip())
