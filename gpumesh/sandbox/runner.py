"""Run one attempt of a task script in a fresh interpreter, under limits, and collect its output.

The worker's side of the sandbox: a temp working directory removed afterwards, payload on stdin, a
cleaned environment, stdout/stderr streamed line by line to a sink with a byte cap, the wall-clock
timeout and the RSS cap enforced by killing the whole tree (TERM, grace, KILL), and the result taken
from the last non-empty stdout line.
"""

from __future__ import annotations

import fcntl
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

import psutil

from gpumesh.sandbox import landlock, outputs, projectview, taskdir, tree
from gpumesh.sandbox.launch import clean_env, copy_launcher, forget_launcher_command
from gpumesh.sandbox.launcher import COPY_DIR_PREFIX, LIMITS, SHM
from gpumesh.sandbox.process import AttemptProcess, close_pipes
from gpumesh.sandbox.spares import Spares
from gpumesh.sandbox.taskdir import CHECKPOINT
from gpumesh.sandbox.warm import WarmProcess, Zygote

TRUNCATED = "[gpumesh] output truncated: the log cap of {cap} bytes was reached"
STDERR_TAIL_LINES = 20


@dataclass(frozen=True)
class Limits:
    timeout: float  # wall-clock seconds
    memory_bytes: int  # RSS of the whole tree; 0 = none
    cpu_seconds: int = 0  # RLIMIT_CPU; 0 = none
    file_bytes: int = 64 << 30  # RLIMIT_FSIZE; 0 = none
    open_files: int = 4096
    grace: float = 3.0  # between TERM and KILL
    log_bytes: int = 1_000_000
    result_bytes: int = 1_000_000
    user: tuple[int, int] | None = None  # (uid, gid) to run the task as; the worker must be root
    python: str = ""  # the interpreter for the task; default: the worker's
    # An environment's site-packages (gpumesh.envs): the interpreter starts without site (-S) and the task's
    # process adds this folder only once it is confined, so no .pth file of the env runs outside the sandbox.
    site: str = ""
    isolation: landlock.Isolation | None = None  # confine the task with Landlock (the worker checked it is there)


@dataclass
class Attempt:
    """What one attempt did."""

    returncode: int | None = None
    killed: str | None = None  # 'timeout', 'memory', or the reason the worker gave (cancelled, lease lost, ...)
    last_line: str | None = None
    result_too_large: bool = False
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_TAIL_LINES))
    log_truncated: bool = False
    collected: Any = None  # what ``collect`` made of the output dir after a clean exit
    duration: float = 0.0
    kernel_oom: bool = False  # the kernel's out-of-memory killer ran during the attempt (set by the executor)

    def describe_exit(self) -> str:
        if self.killed == "timeout":
            return "timed out"
        if self.killed == "memory":
            return "killed: over its memory cap"
        if self.killed:
            return f"killed: {self.killed}"
        rc = self.returncode
        if rc is not None and rc < 0:
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = f"signal {-rc}"
            return f"killed by {name}"
        return f"exit code {rc}"


def _launcher(limits: Limits) -> list[str]:
    """How to start the launcher: as a module of the worker's own interpreter, or, for another
    interpreter or user (which may not see the worker's site-packages), from a private copy in a
    directory of the worker's own that the launcher removes as it starts. Never from the task's
    directory: the task's user owns it, and whatever sits there must not be what the worker runs."""
    python = limits.python or sys.executable
    if limits.site:  # an env's interpreter: no site at start-up; the confined task adds the env's (launcher)
        return [python, "-u", "-S", "-E", copy_launcher(tempfile.mkdtemp(prefix=COPY_DIR_PREFIX))]
    if python == sys.executable and limits.user is None:
        return [python, "-u", "-P", "-m", "gpumesh.sandbox.launcher"]  # -P: not the cwd's modules
    # -s: the interpreter starts as root with HOME set to the task's directory; the user site-packages there
    # (a .pth file runs code) must not be read before the launcher drops root.
    return [python, "-u", *(["-s"] if limits.user else []), copy_launcher(tempfile.mkdtemp(prefix=COPY_DIR_PREFIX))]


class Meanwhile:
    """What a worker does while its next attempt runs rather than between two attempts: remove ended attempts'
    directories, then ``also`` (the worker's: send RQ's records of the runs), then make the directory of the
    attempt after this one (taskdir.make_open). Making and removing a directory are a few syscalls each, but
    on ext4 each updates its journal: 0.1-0.4 ms apiece on the machines measured. ``run`` is called by
    ``sandbox.run`` once the attempt was handed over (with ``ahead`` where the attempt cannot reach the directory
    made ahead), and by the worker when it has nothing to run or stops: then the directory made ahead goes too.
    A directory is removed exactly as ``taskdir.remove`` removes it, through the descriptor held since before its
    attempt ran; a worker killed meanwhile leaves it to the sweep of dead workers' directories
    (``taskdir.sweep_dead_workers_dirs``)."""

    def __init__(self, also: Callable[[], None] | None = None) -> None:
        self._dirs: list[tuple[str, str | None, str, int]] = []
        # ended attempts' directories that showed a project (its view and script): reset for a later attempt
        # of the same view instead of removed (projectview.reset), when one comes
        self._reusable: list[tuple[str, str | None, str, int, tuple[projectview.View, str]]] = []
        self._also = also
        self._ready: tuple[str, int] | None = None  # the next attempt's directory and its descriptor, made ahead
        # the project view the directory made ahead shows already (its links made off the attempt's path), and
        # the script's path it left for the runner to write; None: it holds only its output dir
        self._ready_view: tuple[projectview.View, str] | None = None

    def remove(
        self, workdir: str, script: str | None, output_dir: str, dir_fd: int,
        shown: tuple[projectview.View, str] | None = None,
    ) -> None:  # fmt: skip
        """Remove ``workdir`` at the next ``run``; ``dir_fd`` is this object's to close. ``shown``: the project
        view (and script) it shows, with nothing to expand: it may be reset for a later attempt instead."""
        if shown is not None and not shown[0].expand:
            self._reusable.append((workdir, script, output_dir, dir_fd, shown))
        else:
            self._dirs.append((workdir, script, output_dir, dir_fd))

    def take_dir(self) -> tuple[str, int] | None:
        """The directory made ahead for the next attempt (as taskdir.make_open), now the caller's; None: none, or
        one that is not as it was made (then it goes: the caller makes another)."""
        got = self.take_dir_for(None, "")
        return got[:2] if got is not None else None

    def take_dir_for(self, view: projectview.View | None, script: str) -> tuple[str, int, bool] | None:
        """:meth:`take_dir` for an attempt that shows ``view`` (its script at ``script``): with whether the
        directory shows it already (made ahead for the same view and script, and still exactly as made)."""
        ready, self._ready = self._ready, None
        shown, self._ready_view = self._ready_view, None
        if ready is None:
            return None
        links = projectview.links(*shown) if shown is not None else None
        if not taskdir.untouched(*ready, links=links):
            self._drop(*ready)
            return None
        if shown is not None and shown != (view, script):  # another project's: not for this attempt
            self._drop(*ready)
            return None
        return (*ready, shown is not None)

    def _reuse(self, view: projectview.View, script: str) -> bool:
        """Make an ended attempt's directory that showed ``view`` the next attempt's, reset; whether one was."""
        for i, (workdir, _script, _out, fd, shown) in enumerate(self._reusable):
            if shown == (view, script) and projectview.reset(workdir, fd, projectview.links(view, script), script):
                del self._reusable[i]
                self._ready, self._ready_view = (workdir, fd), shown
                return True
        return False

    def _drop(self, workdir: str, fd: int) -> None:
        """Remove a directory made ahead that no attempt will run in, with the others (it holds no script)."""
        self.remove(workdir, None, os.path.join(workdir, taskdir.OUTPUT), fd)

    def run(self, ahead: bool = False, view: projectview.View | None = None, view_script: str = "") -> None:
        """``ahead``: make the next attempt's directory (showing ``view``, the project of the attempt that runs
        now, when its links alone make it: the next attempt is most often of the same job)."""
        if not ahead and self._ready is not None:  # nothing to run: no directory waits in /tmp for it
            ready, self._ready = self._ready, None
            self._ready_view = None
            self._drop(*ready)
        reused = self._reuse(view, view_script) if ahead and self._ready is None and view is not None else False
        self._dirs += [entry[:4] for entry in self._reusable]  # one is kept at most: the rest go
        self._reusable.clear()
        while self._dirs:
            workdir, script, output_dir, dir_fd = self._dirs.pop()
            try:
                taskdir.remove(workdir, script, output_dir, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
        if self._also is not None:
            self._also()
        if ahead and self._ready is None and not reused:
            try:
                self._ready = taskdir.make_open()
                if view is not None and not view.expand:
                    projectview.populate(view, self._ready[1], view_script, None)
                    self._ready_view = (view, view_script)
            except OSError:
                pass  # the next attempt makes its own (or shows its project itself), and says what fails


def tree_memory(pid: int, cap: int) -> int:
    """The memory of a process tree, for the memory cap. The sum of its processes' RSS when that is within
    ``cap``; past it, the sum of their proportional set sizes (PSS), so that pages forked processes share
    (a script's DataLoader workers; what a warm zygote imported, shared by every attempt it forks) count
    once, not once per process. PSS (smaps_rollup) walks a process's page tables, so it is read only when
    RSS alone says the cap may be passed; where it is refused (another user's process), RSS counts. Both with
    what the attempt keeps in a /dev/shm of its own (:func:`private_shm_bytes`) and in memfds it holds open but
    maps nowhere (:func:`memfd_bytes`): RAM that no process's RSS shows."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    rss: dict[psutil.Process, int] = {}
    for p in procs:
        try:
            rss[p] = p.memory_info().rss
        except psutil.Error:
            pass
    shm = private_shm_bytes([p.pid for p in procs[1:]]) + memfd_bytes([p.pid for p in procs[1:]])
    total = sum(rss.values()) + shm
    if total <= cap:
        return total
    total = shm
    for p, resident in rss.items():
        try:
            total += p.memory_full_info().pss
        except (psutil.Error, AttributeError):  # refused, gone, or no pss on this platform
            total += resident
    return total


def private_shm_bytes(pids: list[int]) -> int:
    """The bytes in the /dev/shm of the attempt whose processes are ``pids`` (the script's and below; its
    supervisor is in the worker's namespaces), where it has one of its own; else 0 (the host's /dev/shm is no
    attempt's to count)."""
    try:
        host = os.stat(SHM).st_dev
    except OSError:
        return 0
    for pid in pids:
        path = f"/proc/{pid}/root{SHM}"
        try:
            if os.stat(path).st_dev == host:
                continue
            st = os.statvfs(path)
        except OSError:  # gone, or not ours to look into
            continue
        return (st.f_blocks - st.f_bfree) * st.f_frsize
    return 0


def memfd_bytes(pids: list[int]) -> int:
    """The bytes of the memfds (memfd_create) that the processes ``pids`` hold open or map: a memfd filled with
    write() is RAM in no process's RSS. Each file once, by its inode, however many descriptors or mappings name it;
    one both mapped and touched counts in RSS too (as a mapped file of /dev/shm does). A mapping is looked up
    through /proc/PID/map_files, which only a root worker may read: a non-root worker counts the open ones."""
    held: dict[tuple[int, int], int] = {}
    for pid in pids:
        paths: list[str] = []
        try:
            fds = f"/proc/{pid}/fd"
            paths += [f"{fds}/{n}" for n in os.listdir(fds) if os.readlink(f"{fds}/{n}").startswith("/memfd:")]
        except OSError:  # gone, or not ours to look into
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                paths += [f"/proc/{pid}/map_files/{row.split()[0]}" for row in f if "/memfd:" in row]
        except (OSError, IndexError):
            pass
        for path in paths:
            try:
                st = os.stat(path)
            except OSError:
                continue
            held[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return sum(held.values())


def _kill_hard(proc: AttemptProcess) -> None:
    """Last resort when the launcher did not end in time: KILL it and every descendant we can see (not where its pid
    may name another process by now: its cgroup, where it has one, is killed all the same)."""
    if isinstance(proc, WarmProcess) and not proc.same_process():
        return
    try:
        victims = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        victims = []
    for p in victims:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


@dataclass(frozen=True, kw_only=True)
class AttemptSpec:
    """One attempt as the worker hands it to the sandbox (:func:`start`): what runs, under which limits, and
    which of the worker's parts it uses. ``on_line(stream, line)`` gets output lines (capped); ``should_stop()``
    returning a reason kills the attempt (cancel, lease lost, worker shutdown). With a ``zygote`` (warm mode)
    the attempt is forked from it instead of started as a new interpreter; with ``spares`` (fresh mode in a
    worker) it takes an interpreter that started while the last one ran. ``collect`` gets the files of the
    output dir (sandbox.outputs.walk) after a clean exit, once the attempt's whole tree is gone and before its
    directory is removed; its answer is ``collected``. With ``meanwhile`` (a worker's), what it holds is done as
    soon as this attempt runs, and a confined attempt that ended as it should leaves its directory to it.
    ``project``: the attempt's directory shows that tree's files (projectview), and ``script_name`` is the
    script's path in it; ``output_globs``: files of the directory ``collect`` gets too; ``checkpoint``: where
    the attempt's checkpoint directory is restored from and saved to."""

    source: str
    script_name: str
    payload: str
    env: Mapping[str, str]
    limits: Limits
    on_line: Callable[[str, str], None]
    should_stop: Callable[[], str | None]
    zygote: Zygote | None = None
    spares: Spares | None = None
    collect: Callable[[Iterator[outputs.Found | outputs.Skipped]], Any] | None = None
    meanwhile: Meanwhile | None = None
    project: projectview.View | None = None
    output_globs: tuple[str, ...] = ()
    checkpoint: Checkpoint | None = None


def run(
    source: str,
    script_name: str,
    payload: str,
    env: Mapping[str, str],
    limits: Limits,
    on_line: Callable[[str, str], None],
    should_stop: Callable[[], str | None],
    zygote: Zygote | None = None,
    spares: Spares | None = None,
    collect: Callable[[Iterator[outputs.Found | outputs.Skipped]], Any] | None = None,
    meanwhile: Meanwhile | None = None,
    checkpoint: Checkpoint | None = None,
) -> Attempt:
    """Run ``source`` with ``payload`` on stdin, to its end: :func:`start` then ``finish``, for a caller that
    holds the parts of an :class:`AttemptSpec` rather than one (scripts, benchmarks)."""
    spec = AttemptSpec(
        source=source,
        script_name=script_name,
        payload=payload,
        env=env,
        limits=limits,
        on_line=on_line,
        should_stop=should_stop,
        zygote=zygote,
        spares=spares,
        collect=collect,
        meanwhile=meanwhile,
        checkpoint=checkpoint,
    )
    return start(spec).finish()


class Started:
    """An attempt handed over to what runs it (the zygote, a spare, a new launcher), not yet supervised: what
    the worker does between handing it over and :meth:`finish` runs beside it (the pipes buffer its output).
    ``finish`` must follow, even for an attempt that will not be reported: with ``should_stop`` saying why,
    it is killed and cleaned up as any stopped attempt is."""

    def __init__(self, steps: Generator[None, None, Attempt]) -> None:
        self._steps = steps

    def finish(self) -> Attempt:
        """Supervise the attempt to its end (see :func:`run`) and clean up after it."""
        try:
            next(self._steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        raise RuntimeError("an attempt's steps went on past their end")


def start(spec: AttemptSpec) -> Started:
    """Hand the attempt over to what runs it and return at once (see :class:`Started`): nothing of it is left
    behind when this raises."""
    steps = _steps(spec)
    next(steps)  # to the hand-over; an error before it has cleaned up already
    return Started(steps)


def _steps(spec: AttemptSpec) -> Generator[None, None, Attempt]:
    """:func:`run`, in two steps: up to the hand-over (a ``yield``), then the rest."""
    limits, meanwhile, project, checkpoint = spec.limits, spec.meanwhile, spec.project, spec.checkpoint
    out = Attempt()
    tree.become_subreaper()  # what outlives its supervisor comes back to us, to be killed with its attempt
    # Its descriptor held from before the task may touch the directory: the output files are read through it.
    script_rel = spec.script_name if project is not None else os.path.basename(spec.script_name) or "task.py"
    # A directory made ahead may show the project already (made by the worker for the same view and script).
    own_dir = spec.zygote.attempt_dir() if spec.zygote is not None else None  # a job's preload zygote's
    workdir, workdir_fd, shown = _attempt_dir(own_dir, meanwhile, limits, project, script_rel)
    started = time.monotonic()
    script = os.path.join(workdir, script_rel)
    output_dir = os.path.join(workdir, taskdir.OUTPUT)
    proc: AttemptProcess | None = None
    since = None
    cgroup = ahead = owner = None
    handing: list[bool] = []  # set once the attempt is handed to the zygote, a spare or a new launcher
    swept = False  # what escaped the attempt was killed already
    ckpt_fd = None  # the checkpoint directory's, opened before the task could touch it
    try:
        full_env = _prepare(
            spec.source, workdir_fd, script, output_dir, spec.env, limits, None if shown else project, script_rel,
            project,
        )  # fmt: skip
        ckpt_fd = _checkpoint_dir(checkpoint, workdir, workdir_fd, limits, full_env)
        # And the next attempt's, which the spare that will run it moves into meanwhile (a fresh spare: not for
        # a --sandbox-user, whose attempts start cold).
        owner = spec.zygote if spec.zygote is not None else spec.spares if limits.user is None else None
        if own_dir is not None:  # its attempts are forked when asked for: no spare waits in a cgroup ahead
            owner = None
        cgroup, ahead = tree.attempt_cgroups(owner)
        with tree.launching():
            proc = _start(spec, workdir, script, full_env, cgroup, ahead, handing)
            tree.started(proc.pid)
        since = tree.start_time(proc.pid)
        if checkpoint is not None and ckpt_fd is not None:
            checkpoint.started(ckpt_fd)
        try:
            yield  # handed over: start() returns, and finish() goes on from here
        except BaseException:  # never finished (a bug, or the interpreter going down): it dies with its tree
            _kill_hard(proc)
            proc.wait()
            close_pipes(proc)
            raise
        if meanwhile is not None:
            # Off the path between the last attempt and this one. The next attempt's directory too, unless this
            # attempt could write into it: neither confined to its own directory nor another user.
            meanwhile.run(
                ahead=_confined(limits) or limits.user is not None,
                view=project if limits.user is None else None, view_script=script_rel,
            )  # fmt: skip
        _watch(proc, out, limits, spec.on_line, spec.should_stop, started)
        # Nothing of the attempt runs on: not even what escaped its supervisor. Its cgroup, where it had one,
        # holds what it started; and what left it (a task with no Landlock may write a cgroup.procs) came back
        # to this subreaper since the attempt began: both are killed.
        if cgroup is not None:
            # A warm supervisor says the attempt is over before it exits (a fresh one was reaped already:
            # its pid may be another's). end_cgroup checks that the pid is still this very supervisor.
            reported = isinstance(proc, WarmProcess) and proc.poll() is not None
            tree.end_cgroup(cgroup, supervisor=(proc.pid, since) if reported and since is not None else None)
            cgroup = None
        tree.kill_escaped(proc.pid, since)
        swept = True
        out.duration = time.monotonic() - started
        if checkpoint is not None and ckpt_fd is not None:
            checkpoint.ended(ckpt_fd, out)  # what the task left there, saved before its directory goes
        if spec.collect is not None and out.returncode == 0 and not out.killed:
            found = outputs.walk_with_globs(
                os.path.basename(output_dir), workdir_fd, spec.output_globs, frozenset({script_rel})
            )
            out.collected = spec.collect(found)
    finally:
        _close_checkpoint(checkpoint, ckpt_fd)
        if ahead is not None and cgroup is not None and owner is not None and not handing:
            tree.attempt_not_started(owner, cgroup, ahead)  # its spare waits in it still: keep it for the next
            cgroup = None
        elif ahead is not None:
            tree.attempt_ended(owner)
        if cgroup is not None:
            tree.end_cgroup(cgroup)
        if proc is not None and not swept:
            tree.kill_escaped(proc.pid, since)
        if not out.duration:
            out.duration = time.monotonic() - started
        # Left for later only when it ended as it should and the next attempt cannot read it (Landlock gives each
        # its own directory alone): an unconfined task could read the last one's output files meanwhile.
        if meanwhile is not None and swept and _confined(limits):
            reusable = (project, script_rel) if project is not None and limits.user is None and not own_dir else None
            meanwhile.remove(workdir, script, output_dir, workdir_fd, reusable)
        else:
            try:
                taskdir.remove(workdir, script, output_dir, dir_fd=workdir_fd)
            finally:
                os.close(workdir_fd)
    return out


def _attempt_dir(
    own: tuple[str, int] | None, meanwhile: Meanwhile | None, limits: Limits, project: projectview.View | None,
    script_rel: str,
) -> tuple[str, int, bool]:  # fmt: skip
    """The attempt's directory, its descriptor and whether it shows ``project`` already: ``own``, where its zygote
    made it; else one made ahead (``meanwhile``), else a new one."""
    if own is not None:
        return (*own, False)
    made = None
    if meanwhile is not None:
        if limits.user is None:
            made = meanwhile.take_dir_for(project, script_rel)
        elif (got := meanwhile.take_dir()) is not None:
            made = (*got, False)
    return made or (*taskdir.make_open(), False)


class Checkpoint(Protocol):
    """What saves and restores an attempt's checkpoint directory (the worker's executor): ``restore`` fills it
    before the task starts, ``started`` as it runs, ``ended`` once its whole tree is gone (``closed`` always
    follows, the descriptor about to be closed)."""

    def restore(self, dir_fd: int, owner: tuple[int, int] | None) -> None: ...
    def started(self, dir_fd: int) -> None: ...
    def ended(self, dir_fd: int, out: Attempt) -> None: ...
    def closed(self) -> None: ...


def _checkpoint_dir(
    checkpoint: Checkpoint | None, workdir: str, workdir_fd: int, limits: Limits, env: dict[str, str]
) -> int | None:
    """Make the attempt's checkpoint directory (the task's user owns it), open it, name it in ``env`` and restore
    the task's newest checkpoint into it, before the task runs; its descriptor (None: no ``checkpoint``)."""
    if checkpoint is None:
        return None
    os.mkdir(CHECKPOINT, 0o700, dir_fd=workdir_fd)
    if limits.user is not None:
        os.chown(CHECKPOINT, *limits.user, dir_fd=workdir_fd, follow_symlinks=False)
    fd = os.open(CHECKPOINT, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=workdir_fd)
    env["GPUMESH_CHECKPOINT_DIR"] = os.path.join(workdir, CHECKPOINT)
    try:
        checkpoint.restore(fd, limits.user)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _close_checkpoint(checkpoint: Checkpoint | None, fd: int | None) -> None:
    if fd is not None:
        if checkpoint is not None:
            checkpoint.closed()
        os.close(fd)


def _confined(limits: Limits) -> bool:
    """Whether Landlock keeps the attempt to its own directory among the worker's attempts' directories: not where
    its rules reach the worker's temp dir (a --write-path /tmp, a TMPDIR under /dev/shm)."""
    return limits.isolation is not None and not landlock.reaches(limits.isolation, tempfile.gettempdir())


def _prepare(
    source: str, workdir_fd: int, script: str, output_dir: str, env: Mapping[str, str], limits: Limits,
    project: projectview.View | None = None, script_rel: str = "", shows: projectview.View | None = None,
) -> dict[str, str]:  # fmt: skip
    """Write the script into the attempt's directory, and return the attempt's environment. With ``limits.user``
    the task's user owns its directory and output dir, and nothing of the worker's. With ``project`` the
    directory shows the project's files first (projectview), and GPUMESH_PROJECT_DIR names it; ``shows``: the
    project the directory shows, made ahead already or here.

    Everything through the directory's descriptor, and the directory itself handed over last: until then it
    is the worker's (0700), so no process of the task's user can swap a name in it for a symlink that a
    chown as root would follow."""
    name, out_name = script_rel or os.path.basename(script), os.path.basename(output_dir)
    workdir = script.removesuffix("/" + name)
    if project is not None:
        projectview.populate(project, workdir_fd, name, limits.user)
    # The script's folder inside the directory was made just now (projectview), by the worker: nothing to follow.
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=workdir_fd)
    with open(fd, "w", encoding="utf-8") as f:
        f.write(source)
        if limits.user is not None:
            os.fchown(f.fileno(), *limits.user)
    extra = {"GPUMESH_PROJECT_DIR": workdir} if shows is not None else {}
    if limits.site:
        extra["GPUMESH_ENV_SITE"] = limits.site
    full_env = clean_env({**env, "GPUMESH_OUTPUT_DIR": output_dir, "TMPDIR": workdir, **extra})
    if limits.user is not None:
        os.chown(out_name, *limits.user, dir_fd=workdir_fd, follow_symlinks=False)
        os.fchown(workdir_fd, *limits.user)
        for var in ("USER", "LOGNAME"):
            full_env.pop(var, None)
        full_env["HOME"] = workdir
    return full_env


def _start(
    spec: AttemptSpec,
    workdir: str,
    script: str,
    env: dict[str, str],
    cgroup: str | None,
    ahead: str | None,
    handing: list[bool],
) -> AttemptProcess:
    """Start the attempt with its payload on its stdin: forked by the zygote, handed to a waiting spare, or cold.
    ``cgroup``: the attempt's own, which its supervisor joins; ``ahead``: the next attempt's, which the next
    spare moves into. ``handing`` gets an item once something may run the attempt. The zygote's supervisor gets
    the script's text too (it compiles it once for the attempts that share it)."""
    limits, zygote, spares = spec.limits, spec.zygote, spec.spares
    project_tree = spec.project.tree if spec.project is not None else ""
    with _payload_file(spec.payload) as stdin:
        rlimits = launcher_limits(limits, workdir, project_tree, cgroup)
        proc: AttemptProcess | None = None
        handing.append(True)
        if zygote is not None:
            proc = zygote.spawn(script, workdir, env, rlimits, stdin.fileno(), ahead, spec.source)
        elif spares is not None and not limits.site:  # a spare runs the worker's interpreter, with its site
            proc = spares.start(
                limits.python, limits.user is not None, script, workdir, env, rlimits, stdin.fileno(), ahead
            )
        if proc is None:
            # Started outside the task's directory (the launcher moves there itself), so that nothing the
            # task's files are named (signal.py, gpumesh.py) is found first on the launcher's sys.path.
            cmd = _launcher(limits)
            try:
                proc = subprocess.Popen(
                    [*cmd, str(os.getpid()), script, *(rlimits[name] for name in LIMITS)],
                    stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    cwd="/", env=env, start_new_session=True, close_fds=True,
                )  # fmt: skip
            except BaseException:
                forget_launcher_command(cmd)
                raise
        return proc


def launcher_limits(limits: Limits, workdir: str, project_tree: str, cgroup: str | None) -> dict[str, str]:
    """What the launcher is told of an attempt's limits, by the names of launcher.LIMITS: a warm or spare request's
    ``limits``, and, in that order, a fresh launcher's arguments. "-": none (no user, no Landlock, no cgroup)."""
    uid, gid = limits.user if limits.user else ("-", "-")
    rules = "-"
    if limits.isolation is not None:
        env_root = os.path.dirname(os.path.dirname(os.path.dirname(limits.site))) if limits.site else ""
        rules = landlock.rules(
            limits.isolation, workdir, shm_bytes=limits.memory_bytes, project=project_tree, env=env_root
        )
    named = {
        "cpu": limits.cpu_seconds,
        "fsize": limits.file_bytes,
        "nofile": limits.open_files,
        "grace": limits.grace,
        "uid": uid,
        "gid": gid,
        "isolation": rules,
        "cgroup": cgroup or "-",
    }
    return {name: str(named[name]) for name in LIMITS}


def _payload_file(payload: str) -> IO[bytes]:
    """The attempt's stdin: a file that holds ``payload``, read from its start. In memory (memfd) where Linux
    has it; else (or where a seccomp filter refuses it) an unlinked temp file, which on ext4 costs a journal
    update per attempt."""
    data = payload.encode()
    sealed = False
    try:
        fd = os.memfd_create("gpumesh-payload", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        f: IO[bytes] = open(fd, "w+b")  # noqa: SIM115 - the caller's to close
        sealed = True
    except (AttributeError, OSError):
        f = tempfile.TemporaryFile()  # noqa: SIM115 - the caller's to close
    try:
        f.write(data)
        f.flush()
        if sealed:  # the task reads its payload: it may neither change nor grow it (memory no cap counts)
            fcntl.fcntl(f.fileno(), fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK)
        f.seek(0)
    except BaseException:
        f.close()
        raise
    return f


def _watch(
    proc: AttemptProcess,
    out: Attempt,
    limits: Limits,
    on_line: Callable[[str, str], None],
    should_stop: Callable[[], str | None],
    started: float,
) -> None:
    """Supervise the attempt to its end, woken the moment it ends: by a warm attempt's reply socket, or
    by a pidfd instead of Popen.wait's sleep-and-poll (milliseconds a task)."""
    warm = proc if isinstance(proc, WarmProcess) else None
    pidfd = None if warm is not None else _pidfd(proc.pid)
    try:
        _Supervision(
            proc, warm.exit_fd if warm is not None else pidfd, out, limits, on_line, should_stop, started
        ).run()
    except BaseException:  # the worker is going down (cold shutdown, backstop timeout): take the task with it
        _kill_hard(proc)
        proc.wait()
        close_pipes(proc)
        raise
    finally:
        if warm is not None:
            warm.close()
        if pidfd is not None:
            os.close(pidfd)
    if warm is not None and warm.lost:
        out.killed = out.killed or warm.lost


class _Supervision:
    """The worker's side of one running attempt: its output streamed to ``on_line`` line by line (capped),
    the last stdout line kept as the result, and the attempt killed (TERM to the launcher, which takes its
    tree down; KILL past the grace) on the worker's stop reason, the timeout or the memory cap.

    One loop step at a time: read what is ready, see whether the attempt is over, enforce the limits."""

    def __init__(
        self,
        proc: AttemptProcess,
        exit_fd: int | socket.socket | None,
        out: Attempt,
        limits: Limits,
        on_line: Callable[[str, str], None],
        should_stop: Callable[[], str | None],
        started: float,
    ) -> None:
        self.proc = proc
        self.out = out
        self.limits = limits
        self.on_line = on_line
        self.should_stop = should_stop
        self.sel = selectors.DefaultSelector()
        assert proc.stdout and proc.stderr
        self.sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
        self.sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
        if exit_fd is not None:  # readable the moment the attempt ends
            self.sel.register(exit_fd, selectors.EVENT_READ, "exit")
        self.partial = {"stdout": b"", "stderr": b""}  # each stream's line so far, not yet ended by a newline
        self.logged = 0  # bytes passed to on_line
        self.deadline = started + limits.timeout
        self.term_sent_at: float | None = None
        self.next_rss = started + 0.2
        self.pipes_closed_at: float | None = None  # when the launcher was found gone with a pipe still open

    def run(self) -> None:
        """Supervise until the attempt has ended and its output is read; then take its exit code."""
        while True:
            now = time.monotonic()
            self._read_ready()
            if self.proc.poll() is not None and self._over(now):
                break
            self._enforce(now)
        close_pipes(self.proc)
        self.out.returncode = self.proc.wait()

    def _read_ready(self) -> None:
        """Wait up to 0.1 s for output or the attempt's end, and take what came."""
        if not self.sel.get_map():
            try:
                self.proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
            return
        for key, _ in self.sel.select(timeout=0.1):
            if key.data == "exit":
                self.sel.unregister(key.fileobj)
                self.proc.poll()
            else:
                self._read(key)

    def _read(self, key: selectors.SelectorKey) -> None:
        """Read one chunk of a stream: emit each line it ends, and at EOF the unfinished last one."""
        stream = key.data
        chunk = os.read(key.fd, 65536)
        if not chunk:
            self.sel.unregister(key.fileobj)
            if self.partial[stream]:
                self._emit(stream, self.partial[stream])
                self.partial[stream] = b""
            return
        lines = (self.partial[stream] + chunk).split(b"\n")
        self.partial[stream] = lines.pop()
        if (
            len(self.partial[stream]) > self.limits.result_bytes + self.limits.log_bytes
        ):  # a runaway line with no newline
            lines.append(self.partial[stream])
            self.partial[stream] = b""
        for raw in lines:
            self._emit(stream, raw)

    def _emit(self, stream: str, raw: bytes) -> None:
        """One line: the result (stdout's last non-empty one) or the stderr tail, and the log up to its cap."""
        out, limits = self.out, self.limits
        line = raw.decode("utf-8", "replace").rstrip("\r")
        if stream == "stdout" and line.strip():
            if len(raw) > limits.result_bytes:
                out.last_line, out.result_too_large = None, True
            else:
                out.last_line, out.result_too_large = line, False
        elif stream == "stderr":
            out.stderr_tail.append(line)
        if out.log_truncated:
            return
        self.logged += len(raw) + 1
        if self.logged > limits.log_bytes:
            out.log_truncated = True
            self.on_line("stderr", TRUNCATED.format(cap=limits.log_bytes))
        else:
            self.on_line(stream, line)

    def _over(self, now: float) -> bool:
        """The launcher has ended: over once its pipes are closed too. A descendant that escaped it and still
        holds one gets a second to finish writing, then KILL."""
        if not any(k.data != "exit" for k in self.sel.get_map().values()):
            return True
        self.pipes_closed_at = self.pipes_closed_at or now
        if now - self.pipes_closed_at > 1.0:
            _kill_hard(self.proc)
            return True
        return False

    def _enforce(self, now: float) -> None:
        """Kill the attempt for the worker's reason, the timeout or the memory cap; KILL it if TERM was not enough."""
        if self.term_sent_at is not None:
            if now - self.term_sent_at > self.limits.grace + 2.0 and self.proc.poll() is None:
                _kill_hard(self.proc)
            return
        reason = self.should_stop()
        if reason:
            self._kill(reason)
        elif now > self.deadline:
            self._kill("timeout")
        elif self.limits.memory_bytes and now >= self.next_rss:
            self.next_rss = now + 0.25
            # a preload zygote's attempt: the zygote's tree with it (AttemptGroup.memory_pid)
            counted = getattr(self.proc, "memory_pid", self.proc.pid)
            if tree_memory(counted, self.limits.memory_bytes) > self.limits.memory_bytes:
                self._kill("memory")

    def _kill(self, reason: str) -> None:
        """TERM to the launcher, once: it takes the tree down, with grace. The first reason is the one reported."""
        if self.term_sent_at is None:
            self.out.killed = self.out.killed or reason
            self.term_sent_at = time.monotonic()
            try:
                self.proc.send_signal(signal.SIGTERM)
            except OSError:
                pass


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # before Linux 5.3: fall back to polling
        return None
