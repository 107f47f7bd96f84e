"""The worker's side of "the tree dies with its attempt": the worker is the subreaper of every process an
attempt starts, so one that outlives its supervisor (a task that SIGKILLs it, then double-forks out of its
session) comes back to the worker instead of init, and is killed when the attempt ends.

In fresh mode the launcher is the worker's child; in warm mode the zygote (a subreaper too) does the same
for its supervisors (gpumesh.sandbox.launcher._Forks.kill_orphans).

Where this process may manage cgroups (root, or a delegated cgroup v2 subtree), each attempt also gets a
cgroup of its own, which its supervisor is in before it forks the task (moved there while the attempt before
ran, :func:`attempt_cgroups`, or joining it itself): whatever the attempt starts is in it, wherever it is
reparented, and the worker kills every member when the attempt ends (:func:`end_cgroup`).
A task can leave it only by writing to a cgroup.procs file: not as the sandbox user, not under Landlock. One that
does (--no-isolation, as the worker's user) is still this subreaper's, found by its start time (:func:`kill_escaped`).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import ctypes
import functools
import itertools
import os
import signal
import sys
import threading
import time

from gpumesh.sandbox.launcher import _children, children_of, kill_and_reap

PR_SET_CHILD_SUBREAPER = 36

_lock = threading.RLock()
_subreaper = False
_running: set[int] = set()  # launchers of attempts running in this process now
# Children that their owner waits for, never reaped here: the warm zygote, in a session of its own, and fresh
# spares, in the worker's, until they are handed their attempt.
_helpers: set[int] = set()


def become_subreaper() -> bool:
    """Make this process the subreaper of everything it starts (once; Linux only). False where it cannot be."""
    global _subreaper
    with _lock:
        if not _subreaper and sys.platform.startswith("linux"):
            _subreaper = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        return _subreaper


def _stat(pid: int) -> tuple[int, int] | None:
    """(session id, start time in clock ticks since boot) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[3]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    st = _stat(pid)
    return st[1] if st else None


def children() -> list[int]:
    """This process's children (every thread's), from /proc: the launcher's reading, which its zygote uses too."""
    return _children()


def _likely_children() -> list[int]:
    """The children of this process's main thread and of the calling one, or every thread's where either cannot be
    read. An orphan comes to the main thread (the kernel hands it to the first live thread of its subreaper), and
    an attempt's launcher is the child of the thread that started it: two reads of /proc, not one per thread (a
    worker has seven)."""
    try:
        return [pid for tid in {os.getpid(), threading.get_native_id()} for pid in children_of(tid)]
    except (OSError, ValueError):
        return children()


class launching:  # noqa: N801 - used as a context manager, like a lock
    """Hold while starting an attempt's launcher and telling :func:`started` about it, so that a
    :func:`kill_escaped` in another thread never takes the new launcher for an orphan."""

    def __enter__(self) -> None:
        _lock.acquire()

    def __exit__(self, *exc: object) -> None:
        _lock.release()


def helper(pid: int, alive: bool = True) -> None:
    """A child of this process that its owner waits for (the zygote, a fresh spare): never reaped here, and no
    orphan of an attempt (an attempt's end then finds nothing to look into: see kill_escaped)."""
    with _lock:
        (_helpers.add if alive else _helpers.discard)(pid)


def _state(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return b"?"


def reap_orphans() -> None:
    """Reap the children that came to this subreaper and ended (a dead zygote's spares, say): zombies in a
    session other than this process's, none of them a running launcher or a helper that is waited for."""
    own_session = os.getsid(0)
    with _lock:
        for pid in children():
            if pid in _running or pid in _helpers:
                continue
            st = _stat(pid)
            if st is None or st[0] == own_session or _state(pid) != b"Z":
                continue
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def started(pid: int) -> None:
    """An attempt's launcher is running (call it inside :class:`launching`): it is no orphan."""
    _running.add(pid)


def kill_escaped(launcher: int, since: int | None) -> int:
    """After an attempt whose launcher was ``launcher`` (started at ``since``, clock ticks; None when its start
    time could not be read: then only reap what ended), its cgroup (if any) emptied already: KILL and reap every
    child of this process that the attempt left behind, until none is left. An orphan is a child in a session
    other than the worker's, started no earlier than the attempt, that is no running attempt's launcher (the
    worker's own helpers, spares and the benchmark, share its session; the zygote started before). Returns how
    many were killed."""
    with _lock:
        _running.discard(launcher)
        if not _subreaper:
            return 0
        if all(pid in _running or pid in _helpers for pid in _likely_children()):
            return 0  # the usual end: no child but the zygote and running attempts, nothing to reap or kill
    reap_orphans()
    if since is None:
        return 0
    own_session = os.getsid(0)
    killed = 0
    for _round in range(10_000):
        orphans = []
        with _lock:
            for pid in children():
                if pid in _running or pid in _helpers:
                    continue
                st = _stat(pid)
                if st is None:
                    continue
                if st[0] != own_session and st[1] >= since:
                    orphans.append(pid)
        if not orphans:
            break
        killed += kill_and_reap(orphans)
    return killed


# -- a cgroup per attempt, where one is delegated ------------------------------------------------------------

CGROUP_ROOT = "/sys/fs/cgroup"
CGROUP_PREFIX = "gpumesh-attempt-"
_cgroup_base: str | None = None
_cgroup_looked = False
_cgroup_counter = itertools.count()
# Attempt cgroups emptied (every member killed and gone) that the kernel had not let go of yet when their
# attempt ended: v1 refuses the rmdir for a few ms after the last member exits, which every attempt would
# otherwise wait. Removed by release_cgroups: at the next attempt, from the worker's heartbeat, at its exit.
_emptied: list[str] = []
_emptied_lock = threading.Lock()
# The cgroup made for the next attempt of a zygote or spares (by id), and those with an attempt running now.
_ahead: dict[int, str] = {}
_busy: set[int] = set()


def cgroup_base() -> str | None:
    """The cgroup directory this process may make attempt cgroups in (:func:`probe_cgroup_base`), looked up once;
    the attempt cgroups that workers which died here left behind are removed from it then."""
    global _cgroup_base, _cgroup_looked
    with _lock:
        if _cgroup_looked:
            return _cgroup_base
        _cgroup_looked = True
        _cgroup_base = probe_cgroup_base()
        if _cgroup_base is not None:
            _sweep_cgroups(_cgroup_base)
        return _cgroup_base


def cgroup_v2() -> bool:
    return os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers"))


def own_cgroup(proc_cgroup: str, v2: bool) -> str | None:
    """This process's own cgroup directory, as ``/proc/self/cgroup`` says: the v2 one, or its own in v1's pids
    hierarchy (any v1 hierarchy tracks membership; pids is the lightest). None where it has none."""
    for row in proc_cgroup.splitlines():
        if row.count(":") < 2:
            continue
        _id, controllers, path = row.split(":", 2)
        if v2 and controllers == "":
            return os.path.join(CGROUP_ROOT, path.lstrip("/"))
        if not v2 and "pids" in controllers.split(","):
            return os.path.join(CGROUP_ROOT, controllers, path.lstrip("/"))
    return None


def probe_cgroup_base() -> str | None:
    """Where this process may make attempt cgroups: its own cgroup (:func:`own_cgroup`), where a probe cgroup can
    be made there and a process it starts can move into it. None where it may not (attempts then run without)."""
    try:
        with open("/proc/self/cgroup") as f:
            base = own_cgroup(f.read(), cgroup_v2())
    except OSError:
        return None
    if base is None:
        return None
    probe = os.path.join(base, f"{CGROUP_PREFIX}{os.getpid()}-probe")
    try:
        os.mkdir(probe)
    except OSError:
        return None
    joinable = _can_join(probe)
    _remove_empty(probe)
    return base if joinable else None  # a supervisor that cannot join its attempt's cgroup runs nothing (exit 70)


def _can_join(path: str) -> bool:
    """Whether a process this one starts may move itself into the cgroup ``path`` (as a supervisor does): a
    directory may be made where moving into it is refused (a v2 subtree whose common ancestor is not ours)."""
    import subprocess

    try:
        done = subprocess.run(
            ["/bin/sh", "-c", 'echo 0 > "$1/cgroup.procs"', "sh", path],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _remove_empty(path: str, reap: bool = False) -> None:
    """Remove a cgroup once it is empty: a process that has exited leaves the group a moment later
    (``reap``: reap our orphans meanwhile, a killed member among them)."""
    # The kernel lets go of a cgroup a moment after its last member exits (v1: typically well under a
    # millisecond, EBUSY until then): poll from 0.2 ms up, not in 5 ms steps that each attempt would wait.
    delay, deadline = 0.0002, time.monotonic() + 1.0
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            if reap:
                reap_orphans()
            time.sleep(delay)
            delay = min(delay * 2, 0.005)


def _sweep_cgroups(base: str) -> None:
    """Remove the attempt cgroups that workers which died here left behind (empty once their tasks died)."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        owner = name.removeprefix(CGROUP_PREFIX).partition("-")[0]
        if not name.startswith(CGROUP_PREFIX) or not owner.isdigit() or int(owner) == os.getpid():
            continue
        try:
            os.kill(int(owner), 0)
            continue
        except ProcessLookupError:
            pass
        except OSError:
            continue
        path = os.path.join(base, name)
        for pid in cgroup_members(path):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.rmdir(path)
        except OSError:
            pass


def new_cgroup() -> str | None:
    """A new, empty cgroup for one attempt, or None where none can be made."""
    base = cgroup_base()
    if base is None:
        return None
    release_cgroups()
    path = os.path.join(base, f"{CGROUP_PREFIX}{os.getpid()}-{next(_cgroup_counter)}")
    try:
        os.mkdir(path)
    except OSError:
        return None
    return path


def attempt_cgroups(owner: object | None = None) -> tuple[str | None, str | None]:
    """The cgroup of the attempt that starts now, and the one of the attempt after it, for ``owner`` (the
    zygote or the spares that will run both): (None, None) where none can be made.

    The next one is made now so that the spare which will run that attempt moves into it while this one
    runs (:func:`move_ahead`; a warm spare moves itself as it is forked). Moving a process into a cgroup
    waits for an RCU grace period unless another move happened a moment before: on cgroup v1 here, a mean of
    6 ms and 15 ms at the 90th percentile, which every attempt paid when its supervisor moved itself. This
    attempt's is the one made for it last time, if any. While an attempt of ``owner`` that made one ahead
    runs, another that starts alongside it gets a cgroup of its own and none ahead (a spare sits in the one
    reserved). When one was made ahead, call :func:`attempt_ended` once the attempt is over."""
    if owner is None:
        return new_cgroup(), None
    key = id(owner)
    with _lock:
        if key in _busy:
            return new_cgroup(), None
        _busy.add(key)
        path = _ahead.pop(key, None)
    ahead = None
    try:
        path = path or new_cgroup()
        ahead = new_cgroup() if path else None
    finally:  # even if interrupted (RQ's job timeout, a cold shutdown): nothing stays reserved or busy
        with _lock:
            if ahead is None:
                _busy.discard(key)
            else:
                _ahead[key] = ahead
    if ahead is not None:
        _release_at_exit()
    return path, ahead


def attempt_not_started(owner: object, path: str, ahead: str) -> None:
    """The attempt that :func:`attempt_cgroups` gave ``path`` and ``ahead`` stopped before anything was handed
    to a spare (its stdin could not be written, say): the spare that waits in ``path`` is the next attempt's
    again, and ``ahead``, still empty, goes."""
    key = id(owner)
    with _lock:
        mine = _ahead.get(key) == ahead
        if mine:
            _ahead[key] = path
        _busy.discard(key)
    if not mine:  # the owner was closed meanwhile (drop_ahead): neither is anyone's
        end_cgroup(path)
    end_cgroup(ahead)


def attempt_ended(owner: object) -> None:
    """The attempt of ``owner`` for which :func:`attempt_cgroups` made one ahead is over."""
    with _lock:
        _busy.discard(id(owner))


def drop_ahead(owner: object) -> None:
    """``owner`` (a zygote, spares) is closed: remove the cgroup made for its next attempt, KILLing the spare that
    may still wait there (it holds no task)."""
    with _lock:
        path = _ahead.pop(id(owner), None)
    end_cgroup(path, timeout=1.0)


def join_cgroup(path: str, pid: int = 0) -> None:
    """Move ``pid`` (0: this process) into the cgroup ``path``; OSError where the kernel refuses."""
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(pid))


@functools.cache
def _mover() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gpumesh-cgroup")


def move_ahead(path: str, pid: int) -> concurrent.futures.Future[None]:
    """Move ``pid``, a child of this process that has not been waited for (so its pid is no other's), into
    ``path`` from a thread of this process: the move's wait overlaps the running attempt. Wait for the future
    before the child may be reaped. Its supervisor joins ``path`` itself if this failed (it checks)."""
    return _mover().submit(join_cgroup, path, pid)


def cgroup_members(path: str) -> list[int]:
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(pid) for pid in f.read().split()]
    except (OSError, ValueError):
        return []


def end_cgroup(path: str | None, timeout: float = 10.0, supervisor: tuple[int, int] | None = None) -> None:
    """KILL every process left in an attempt's cgroup until it is empty, then remove it.

    ``supervisor``: (pid, start time) of the attempt's warm supervisor, once it has said the attempt is over (its
    script's tree is gone, reaped by it). It serves the next attempts, and leaves this group when it moves into
    the cgroup of one of them: it is spared, and the group, once it holds nothing else, is removed later. Only
    if its pidfd names that very process (same start time): a pid a task's process took over after its
    supervisor died gets the full treatment."""
    if path is None:
        return
    verified = None
    if supervisor is not None:
        verified = _pidfd(supervisor[0])  # opened first, then checked: the pid cannot become another's meanwhile
        if verified is not None and start_time(supervisor[0]) != supervisor[1]:
            os.close(verified)
            verified = None
    try:
        ended = _kill_members(path, time.monotonic() + timeout, supervisor[0] if supervisor else None, verified)
    finally:
        if verified is not None:
            os.close(verified)
    if ended == "killed":  # what was KILLed here and came to this subreaper (a lone supervisor is not ours)
        reap_orphans()
    if ended == "supervisor":  # it leaves as it moves on to a next attempt's: removed later, not tried now
        _release_later(path)
        return
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        if not cgroup_members(path):  # about to be empty: removed later, not waited for
            _release_later(path)
        # else members outlived 10 s of KILL (stuck in the kernel): the next worker here sweeps it


def _release_later(path: str) -> None:
    """Remove the emptied (or emptying) cgroup ``path`` at the next release_cgroups."""
    with _emptied_lock:
        if not _emptied:
            _release_at_exit()
        _emptied.append(path)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _kill_members(path: str, deadline: float, supervisor: int | None, verified: int | None) -> str:
    """KILL the members of ``path`` until none is left ("empty": none there at all; "killed": all KILLed and
    gone), or only the ``supervisor`` ("supervisor": spared, when ``verified``, its pidfd, says it is that very
    process)."""
    delay, killed = 0.0002, False
    spared = supervisor if verified is not None else None
    while time.monotonic() < deadline:
        members = cgroup_members(path)
        if not members:
            return "killed" if killed else "empty"
        if spared is not None and members == [spared]:
            return "supervisor"
        killed = True
        try:
            if spared in members:  # cgroup.kill would take it too: one by one
                raise OSError
            with open(os.path.join(path, "cgroup.kill"), "w") as f:  # v2, Linux 5.14+: the whole group at once
                f.write("1")
        except OSError:
            for pid in (m for m in members if m != spared):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        reap_orphans()
        time.sleep(delay)
        delay = min(delay * 2, 0.005)
    return "killed"


@functools.cache
def _release_at_exit() -> None:
    """Once per process: what is still to be removed goes when it exits (a worker removes it itself on its
    way out; anything else that ran attempts, such as a benchmark, leaves no empty cgroup behind)."""
    atexit.register(release_cgroups, True)


def release_cgroups(wait: bool = False) -> None:
    """Remove the emptied attempt cgroups the kernel has let go of (see _emptied); with ``wait`` (a worker that
    exits), wait a moment for each of the others, and remove those made for a next attempt, KILLing a spare that
    still waits in one (it holds no task)."""
    if wait:
        with _lock:
            ahead = list(_ahead.values())
            _ahead.clear()
        for path in ahead:
            end_cgroup(path, timeout=1.0)
    with _emptied_lock:
        paths = list(_emptied)
    for path in paths:
        if wait:
            _remove_empty(path, reap=True)
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError:
            continue
        with _emptied_lock:  # another thread may have released it meanwhile
            if path in _emptied:
                _emptied.remove(path)
