"""Whether each attempt can have namespaces of its own on this machine: the worker's side.

With them (gpumesh.sandbox.launcher.enter_namespaces) an attempt has its own SysV IPC and POSIX message queues,
its own /dev/shm (a tmpfs the size of its memory cap, gone with it), its own session and user keyrings, and
each ``--cache-path`` as an overlay whose writes are the attempt's alone. They need a user namespace, which Linux
lets any user make unless the machine forbids it (``kernel.unprivileged_userns_clone=0``, ``user.max_user_namespaces
=0``, an AppArmor or SELinux policy, a container's seccomp profile), and overlayfs in a user namespace (Linux 5.11+)
for the caches. The worker asks once, at start, as the user its tasks run as.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile

PROBE = "from gpumesh.sandbox.launcher import private_namespaces_probe as p; print(p({}, {}, {!r}))"


@functools.cache
def unavailable(uid: int = -1, gid: int = -1, caches: tuple[str, ...] = ()) -> str | None:
    """Why an attempt run as ``uid`` (-1: this process's user) cannot have namespaces of its own here (with an
    overlay on each of ``caches``), or None when it can. Asked of a process of its own (the probe changes its
    namespaces and user)."""
    if not sys.platform.startswith("linux"):
        return f"not Linux ({sys.platform})"
    if os.path.commonpath([os.path.realpath(tempfile.gettempdir()), "/dev/shm"]) == "/dev/shm":
        return "the worker's temp dir is under /dev/shm, which each attempt's own /dev/shm would hide"
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROBE.format(int(uid), int(gid), list(caches))],
            capture_output=True, text=True, timeout=30, cwd="/", env={"PATH": os.environ.get("PATH", "")},
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the probe did not run ({exc})"
    said = done.stdout.strip()
    if done.returncode != 0:
        return f"the probe failed ({(done.stderr.strip().splitlines() or ['?'])[-1]})"
    return said or None
