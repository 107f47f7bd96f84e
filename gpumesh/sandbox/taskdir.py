"""An attempt's directory on the worker's side: made with its owner in the name, removed when the attempt
ends, and swept when a worker died before it could remove it (the launcher removes its own when the
worker dies during the attempt)."""

from __future__ import annotations

import os
import shutil
import tempfile

from gpumesh.sandbox.launcher import TASK_DIR_PREFIX


def make() -> str:
    """A new, private directory for one attempt: ``gpumesh-task-<pid namespace>.<pid>-<random>``."""
    return tempfile.mkdtemp(prefix=f"{TASK_DIR_PREFIX}{_owner()}-")


def _pid_namespace() -> str:
    """This process's pid namespace (containers sharing a /tmp have different ones), or "" if unknown."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _owner() -> str:
    """Who made an attempt's directory: this worker's pid, qualified by its pid namespace."""
    return f"{_pid_namespace()}.{os.getpid()}"


def sweep_dead_workers_dirs() -> int:
    """Remove the attempt directories of workers on this machine that died (``<pid namespace>.<pid>`` is
    in the name): a worker killed just before an attempt started, or just after it ended, leaves its
    directory behind, and no launcher is left to remove it. Only directories from this pid namespace are
    considered (a pid of another container means nothing here), and those of live processes (or of
    processes this user may not signal) are left alone. Returns how many were removed."""
    base = tempfile.gettempdir()
    mine = _pid_namespace()
    removed = 0
    try:
        names = os.listdir(base)
    except OSError:
        return 0
    for name in names:
        owner, _, rest = name.removeprefix(TASK_DIR_PREFIX).partition("-")
        namespace, _, pid_text = owner.partition(".")
        if not name.startswith(TASK_DIR_PREFIX) or namespace != mine or not pid_text.isdigit() or not rest:
            continue
        try:
            os.kill(int(pid_text), 0)
            continue  # alive (perhaps a reused pid: then the directory waits for the next sweep)
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue
        path = os.path.join(base, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed += not os.path.exists(path)
    return removed


def remove(workdir: str, script: str, output_dir: str) -> None:
    """Remove the task's directory. Most tasks leave only their script and an empty output dir: three
    syscalls instead of rmtree's directory walk; anything else they left gets the full walk."""
    try:
        os.unlink(script)
        os.rmdir(output_dir)
        os.rmdir(workdir)
    except OSError:
        shutil.rmtree(workdir, ignore_errors=True)
