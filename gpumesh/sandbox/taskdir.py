"""An attempt's directory on the worker's side: made with its owner in the name, removed when the attempt
ends, and swept when a worker died before it could remove it (the launcher removes its own when the
worker dies during the attempt)."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import stat
import tempfile
from collections.abc import Mapping

from gpumesh.sandbox.launcher import CACHE_DIR_PREFIX, TASK_DIR_PREFIX

OUTPUT = "output"  # the task's output directory, inside its own (GPUMESH_OUTPUT_DIR)
CHECKPOINT = "checkpoint"  # the task's checkpoint directory, inside its own (GPUMESH_CHECKPOINT_DIR)


def make() -> str:
    """A new, private directory for one attempt: ``gpumesh-task-<pid namespace>.<pid>-<random>``."""
    return tempfile.mkdtemp(prefix=f"{TASK_DIR_PREFIX}{_owner()}-")


def make_open() -> tuple[str, int]:
    """:func:`make`, with its empty output directory (OUTPUT) in it, and opened (the descriptor is the caller's)
    before any task may touch it. Both are the worker's alone (0700) until an attempt is handed the directory."""
    workdir = make()
    try:
        fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        os.rmdir(workdir)
        raise
    try:
        os.mkdir(OUTPUT, dir_fd=fd)
    except OSError:
        os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return workdir, fd


@functools.cache
def _pid_namespace() -> str:
    """This process's pid namespace (containers sharing a /tmp have different ones), or "" if unknown. A
    process never changes its own (unshare and setns move only the children it makes after): read once."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _owner() -> str:
    """Who made an attempt's directory: this worker's pid, qualified by its pid namespace."""
    return f"{_pid_namespace()}.{os.getpid()}"


def untouched(workdir: str, fd: int, links: Mapping[str, str] | None = None) -> bool:
    """Whether a directory made by :func:`make_open` is still as it was made: the same directory at its path (not
    renamed nor replaced), this process's alone (0700), holding only its empty output directory (and ``links``,
    name -> target, each a symbolic link leading there: a project shown ahead, gpumesh.sandbox.projectview)."""
    try:
        st = os.fstat(fd)
        if not os.path.samestat(os.stat(workdir, follow_symlinks=False), st):
            return False
        expected = sorted([OUTPUT, *(links or {})])
        if stat.S_IMODE(st.st_mode) != 0o700 or st.st_uid != os.geteuid() or sorted(os.listdir(fd)) != expected:
            return False
        for name, target in (links or {}).items():
            if os.readlink(name, dir_fd=fd) != target:
                return False
        out = os.open(OUTPUT, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        try:
            mode = os.fstat(out)
            return mode.st_uid == os.geteuid() and not os.listdir(out)
        finally:
            os.close(out)
    except OSError:
        return False


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
            _rmtree(path)
            removed += not os.path.exists(path)
    return removed


def remove(workdir: str, script: str | None, output_dir: str, dir_fd: int | None = None) -> None:
    """Remove the task's directory. Most tasks leave only their script and an empty output dir: three
    syscalls instead of rmtree's directory walk; anything else they left gets the full walk. ``script``
    None: a directory made ahead that no attempt ran in (it holds only its output dir).

    ``dir_fd``: the directory, opened before the task ran. With a sandbox user the task's user owns the
    directory and may have renamed it and left a symlink in its place (to /etc, say): names inside it are then
    removed through the descriptor, never through a path that the worker (root) would resolve."""
    if dir_fd is None:
        try:
            if script is not None:
                os.unlink(script)
            os.rmdir(output_dir)
            os.rmdir(workdir)
        except OSError:
            _rmtree(workdir)
        return
    try:
        if script is not None:
            os.unlink(os.path.basename(script), dir_fd=dir_fd)
        os.rmdir(os.path.basename(output_dir), dir_fd=dir_fd)
        with contextlib.suppress(FileNotFoundError):  # GPUMESH_CHECKPOINT_DIR, left empty by most tasks
            os.rmdir(CHECKPOINT, dir_fd=dir_fd)
        if _rmdir_made(workdir, dir_fd):
            return
    except OSError:
        pass
    # What else the task left there (its temp files: TMPDIR is this directory), then the directory itself.
    _open_overlay_work_dirs(dir_fd)
    empty(dir_fd)
    _rmdir_made(workdir, dir_fd)


def empty(dir_fd: int) -> None:
    """Remove everything in the directory ``dir_fd`` holds, following no link (rmtree through a descriptor opens
    each entry with O_NOFOLLOW); what cannot be removed stays."""
    for name in os.listdir(dir_fd):
        try:
            if _is_dir(name, dir_fd):
                shutil.rmtree(name, dir_fd=dir_fd, ignore_errors=True)
            else:
                os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass


def _rmdir_made(workdir: str, dir_fd: int) -> bool:
    """Remove ``workdir`` if it is still the directory ``dir_fd`` holds (not a symlink put in its place) and
    empty; whether it is gone."""
    try:
        if os.path.samestat(os.stat(workdir, follow_symlinks=False), os.fstat(dir_fd)):
            os.rmdir(workdir)
            return True
    except OSError:
        pass
    return False


def _is_dir(name: str, dir_fd: int) -> bool:
    return stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)


def _rmtree(path: str) -> None:
    """shutil.rmtree of an attempt's directory ``path``, its cache overlays' work directories included."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        _open_overlay_work_dirs(fd)
    finally:
        os.close(fd)
    shutil.rmtree(path, ignore_errors=True)


def _open_overlay_work_dirs(dir_fd: int) -> None:
    """Make the work directories that an attempt's cache overlays left (``.gpumesh-cache-N/work/work``, which the
    kernel makes mode 000) removable by a worker that is not root: 0700 again, each reached through descriptors
    opened without following a symlink."""
    for name in os.listdir(dir_fd):
        if not name.startswith(CACHE_DIR_PREFIX):
            continue
        fds: list[int] = []
        try:
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            fds.append(os.open(name, flags, dir_fd=dir_fd))
            fds.append(os.open("work", flags, dir_fd=fds[-1]))
            fds.append(os.open("work", os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fds[-1]))
            os.chmod(f"/proc/self/fd/{fds[-1]}", 0o700)  # that very directory: an O_PATH descriptor has no fchmod
        except OSError:
            pass
        finally:
            for fd in fds:
                os.close(fd)
