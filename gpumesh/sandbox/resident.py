"""Load once, run many (``submit --reuse-process``): a job's tasks on one worker run one after another in one
long-lived attempt process, so what the script loads at module level (a model, a CUDA context) stays loaded.

The process is started as a fresh attempt is (the launcher's ``--resident`` mode): its own directory, cgroup,
rlimits, sandbox user, Landlock rules, a supervisor that is the subreaper of its tree and takes it down with grace,
death with the worker, a clean environment without the broker's URL. Only its life is longer: it takes task after
task over a socket (each task's stdin, stdout and stderr passed with it), and the runner supervises each task as it
supervises any attempt (its own timeout, the memory cap of the whole process, the worker's stop reasons, its
output streamed and capped). What a task leaves in memory and in the directory, the job's next task there sees.

A task killed (timeout, memory, cancel, lease lost), one whose process died (a crash, ``os._exit``, SIGKILL), one
that called ``sys.exit``, left threads running or a child process behind, or replaced its output directory, takes
the process down with it: its outcome is its own, and the next task gets a new process. :class:`Pool` keeps a
worker's idle processes, one per job (and interpreter, user); they end when their job ends, when the worker stops,
and after ``idle_s`` without a task.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Generator, Mapping
from typing import Any

from gpumesh.sandbox import outputs, projectview, taskdir, tree
from gpumesh.sandbox.launch import forget_launcher_command
from gpumesh.sandbox.launcher import LIMITS
from gpumesh.sandbox.process import close_pipes
from gpumesh.sandbox.runner import (
    Attempt,
    AttemptSpec,
    Limits,
    Started,
    _launcher,
    _payload_file,
    _prepare,
    _watch,
    launcher_limits,
)  # fmt: skip
from gpumesh.sandbox.warm import WarmProcess, Zygote

log = logging.getLogger("gpumesh.worker")

Key = tuple[str, str, str, str]  # (job id, script digest, interpreter, user): what one process may serve


class Resident:
    """One reused attempt process: its supervisor (``proc``), the socket its script's process takes tasks on, and
    its directory (whose ``output`` dir each task writes its files to, emptied between tasks)."""

    def __init__(
        self, key: Key, proc: subprocess.Popen[bytes] | WarmProcess, ctrl: socket.socket, workdir: str, dir_fd: int,
        script: str, cgroup: str | None, since: int | None,
    ) -> None:  # fmt: skip
        self.key = key
        self.proc = proc
        self.ctrl = ctrl
        self.workdir, self.dir_fd, self.script = workdir, dir_fd, script
        self.cgroup, self.since = cgroup, since
        self.tasks = 0  # how many tasks it was handed
        self.leave = ""  # why it must not take another task ("" while it may)
        self.idle_since = time.monotonic()
        self._stopped = False
        self._removed = False

    @property
    def job_id(self) -> str:
        return self.key[0]

    @classmethod
    def start(
        cls, key: Key, source: str, script_name: str, env: Mapping[str, str], limits: Limits,
        stdio: tuple[int, int, int], zygote: Zygote | None = None, project: projectview.View | None = None,
    ) -> Resident:  # fmt: skip
        """Start the process: forked by the warm ``zygote`` where there is one (its --preload imported already),
        else a new interpreter (its supervisor with ``stdio``, the first task's, until it has forked the script's
        process, so that what stops it there is that task's to read). Nothing is left behind when this raises."""
        tree.become_subreaper()
        workdir, dir_fd = taskdir.make_open()
        # With a project the directory shows its files (projectview), the script at its path among them.
        script_rel = script_name if project is not None else os.path.basename(script_name) or "task.py"
        script = os.path.join(workdir, script_rel)
        output_dir = os.path.join(workdir, taskdir.OUTPUT)
        cgroup: str | None = None
        mine = theirs = None
        try:
            full_env = _prepare(source, dir_fd, script, output_dir, env, limits, project, script_rel, project)
            ahead = None
            if zygote is not None:  # as a warm attempt: its supervisor waits in the cgroup made for it last time
                cgroup, ahead = tree.attempt_cgroups(zygote)
            else:
                cgroup = tree.new_cgroup()
            rlimits = launcher_limits(limits, workdir, project.tree if project is not None else "", cgroup)
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            proc: subprocess.Popen[bytes] | WarmProcess
            if zygote is not None:
                try:
                    with tree.launching():
                        proc = zygote.spawn(script, workdir, full_env, rlimits, stdio[0], ahead, serve=theirs.fileno())
                        tree.started(proc.pid)
                finally:
                    theirs.close()
                    if ahead is not None:
                        tree.attempt_ended(zygote)  # its next attempt's supervisor waits in ``ahead`` from now on
                close_pipes(proc)  # the script's process takes each task's stdio from the socket
            else:
                cmd = _launcher(limits)
                try:
                    with tree.launching():
                        proc = subprocess.Popen(
                            [*cmd, "--resident", str(theirs.fileno()), str(os.getpid()), script, *(rlimits[name] for name in LIMITS)],
                            stdin=stdio[0], stdout=stdio[1], stderr=stdio[2], pass_fds=(theirs.fileno(),),
                            cwd="/", env=full_env, start_new_session=True,
                        )  # fmt: skip
                        tree.started(proc.pid)
                except BaseException:
                    forget_launcher_command(cmd)
                    raise
                finally:
                    theirs.close()
        except BaseException:
            if mine is not None:
                mine.close()
            tree.end_cgroup(cgroup)
            taskdir.remove(workdir, script, output_dir, dir_fd=dir_fd)
            os.close(dir_fd)
            raise
        log.info("reused process %d started for job %s", proc.pid, key[0])
        return cls(key, proc, mine, workdir, dir_fd, script, cgroup, tree.start_time(proc.pid))

    def alive(self) -> bool:
        return not self.leave and not self._stopped and self.proc.poll() is None

    def hand(self, env: Mapping[str, str], stdio: tuple[int, int, int]) -> None:
        """Give the process its next task: the task's variables and its stdin, stdout and stderr."""
        import json

        self.tasks += 1
        socket.send_fds(self.ctrl, [json.dumps({"env": dict(env)}).encode()], list(stdio))

    def check_after_task(self) -> None:
        """Once a task's outcome came: whether what it left lets the process take another (``leave`` says why not).
        A child process left running (the supervisor has another child than the script's process, or the
        script's process has one) would run on into the next task."""
        if self.leave or self.proc.poll() is not None:
            self.leave = self.leave or "it ended"
            return
        try:
            below = _children_of(self.proc.pid)
            extra = len(below) != 1 or any(_children_of(pid) for pid in below)
        except OSError:
            extra = True
        if extra:
            self.leave = "the task left a process running"

    def empty_output(self) -> None:
        """Remove what the last task left in the output dir (collected already, or a failed task's), through its
        descriptor: a task that put something else in the output dir's place ends the process."""
        try:
            out = os.open(taskdir.OUTPUT, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=self.dir_fd)
        except OSError:
            self.leave = self.leave or "the task replaced its output directory"
            return
        try:
            taskdir.empty(out)
        finally:
            os.close(out)

    def stop(self, grace: float = 5.0) -> int | None:
        """End the process and everything in its cgroup (EOF first: the script's process returns; TERM and KILL
        past ``grace``); its exit code."""
        if self._stopped:
            return self.proc.returncode
        self._stopped = True
        self.leave = self.leave or "stopped"
        self.ctrl.close()
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait()
        warm = self.proc if isinstance(self.proc, WarmProcess) else None
        # A warm supervisor that said its process is over serves the zygote's next attempts: it is spared.
        spared = (self.proc.pid, self.since) if warm is not None and not warm.lost and self.since else None
        tree.end_cgroup(self.cgroup, supervisor=spared)
        tree.kill_escaped(self.proc.pid, self.since)
        if warm is not None:
            warm.close()
        log.info("reused process %d of job %s ended after %d task(s)", self.proc.pid, self.job_id, self.tasks)
        return self.proc.returncode

    def close(self) -> None:
        """:meth:`stop`, then remove its directory."""
        self.stop()
        if not self._removed:
            self._removed = True
            try:
                taskdir.remove(self.workdir, self.script, os.path.join(self.workdir, taskdir.OUTPUT), self.dir_fd)
            finally:
                os.close(self.dir_fd)


def _children_of(pid: int) -> list[int]:
    """The children of every thread of the process ``pid``, from /proc; OSError where they cannot be read."""
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
            out += [int(child) for child in f.read().split()]
    return out


class ResidentTask(WarmProcess):
    """One task in a :class:`Resident`, seen by the runner as an attempt's process: it ends when the process's
    reply comes (the process stays), or when the process dies (its exit is the task's). A signal goes to the
    supervisor: killing a task takes its process down."""

    def __init__(self, resident: Resident, stdout: Any, stderr: Any) -> None:
        super().__init__(resident.proc.pid, resident.ctrl, stdout, stderr)
        self.args = f"<reused process {resident.proc.pid}>"
        self.resident = resident

    def ended(self, msg: dict[str, Any] | None) -> None:
        if self.returncode is not None:
            return
        if msg is None:  # the script's process is gone: its supervisor ends as it did
            self.resident.leave = self.resident.leave or "it ended"
            try:
                self.returncode = self.resident.proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                self.resident.proc.send_signal(signal.SIGKILL)
                self.returncode = self.resident.proc.wait()
        elif "status" in msg:
            self.returncode = os.waitstatus_to_exitcode(msg["status"])
            self.resident.leave = self.resident.leave or str(msg.get("leave") or "")

    def close(self) -> None:
        """The socket is the process's, kept for its next task."""


class Pool:
    """A worker's idle reused processes, at most ``keep`` (the least recently used goes first), each ended after
    ``idle_s`` without a task or once its job has ended (:meth:`prune`). Thread-safe: the worker's heartbeat
    thread prunes while its main thread takes and gives back."""

    def __init__(self, idle_s: float, keep: int = 2) -> None:
        self.idle_s, self.keep = idle_s, keep
        self._idle: dict[Key, Resident] = {}
        self._lock = threading.Lock()

    def take(self, key: Key) -> Resident | None:
        """The idle process for ``key``, now the caller's, if one is alive."""
        with self._lock:
            res = self._idle.pop(key, None)
        if res is not None and not res.alive():
            res.close()
            return None
        return res

    def give_back(self, res: Resident) -> None:
        """Keep ``res`` for the next task of its job (or end it, if it must not take one)."""
        if not res.alive():
            res.close()
            return
        res.idle_since = time.monotonic()
        with self._lock:
            old = self._idle.pop(res.key, None)
            self._idle[res.key] = res
            over = list(self._idle.values())[: max(0, len(self._idle) - self.keep)]
            for r in over:
                del self._idle[r.key]
        for r in [*over, *([old] if old is not None and old is not res else [])]:
            r.close()

    def jobs(self) -> list[str]:
        with self._lock:
            return [res.job_id for res in self._idle.values()]

    def prune(self, ended: Callable[[list[str]], set[str]] | None = None) -> int:
        """End the idle processes idle for ``idle_s`` or more, or dead, or whose job is among ``ended(job ids)``;
        how many were ended."""
        gone_jobs = ended(self.jobs()) if ended is not None else set()
        now = time.monotonic()
        with self._lock:
            victims = [
                r for r in self._idle.values()
                if r.job_id in gone_jobs or now - r.idle_since >= self.idle_s or not r.alive()
            ]  # fmt: skip
            for r in victims:
                del self._idle[r.key]
        for r in victims:
            r.close()
        return len(victims)

    def close(self) -> None:
        with self._lock:
            victims, self._idle = list(self._idle.values()), {}
        for r in victims:
            r.close()


def start(pool: Pool, key: Key, spec: AttemptSpec) -> Started:
    """Hand the task to its job's reused process on this worker (started now if there is none) and return at once,
    as :func:`gpumesh.sandbox.runner.start` does; ``finish`` supervises it to its end. ``spec.project``: the tree
    the process's directory shows (its job's, the same for all its tasks). The process keeps its own directory,
    so ``spec``'s spares, meanwhile, output globs and checkpoint are not this path's."""
    steps = _steps(pool, key, spec)
    next(steps)
    return Started(steps)


def _steps(pool: Pool, key: Key, spec: AttemptSpec) -> Generator[None, None, Attempt]:
    env, limits, on_line = spec.env, spec.limits, spec.on_line
    out = Attempt()
    started = time.monotonic()
    res = pool.take(key)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        with _payload_file(spec.payload) as stdin:
            stdio = (stdin.fileno(), out_w, err_w)
            if res is None:
                res = Resident.start(key, spec.source, spec.script_name, env, limits, stdio, spec.zygote, spec.project)
                on_line("gpumesh", f"started the job's reused process {res.proc.pid} on this worker (--reuse-process)")
            res.hand(env, stdio)
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        if res is not None:
            res.close()
        raise
    finally:
        os.close(out_w)
        os.close(err_w)
    proc = ResidentTask(res, os.fdopen(out_r, "rb", 0), os.fdopen(err_r, "rb", 0))
    keep = False
    try:
        try:
            yield  # handed over: start() returns, and finish() goes on from here
        except BaseException:
            close_pipes(proc)
            raise
        _watch(proc, out, limits, on_line, spec.should_stop, started)
        out.duration = time.monotonic() - started
        if out.killed:
            res.leave = res.leave or f"the task was killed ({out.killed})"
        res.check_after_task()
        if out.killed or res.leave:
            res.stop(limits.grace)  # nothing of it runs while its files are read
        if spec.collect is not None and out.returncode == 0 and not out.killed:
            out.collected = spec.collect(outputs.walk(taskdir.OUTPUT, dir_fd=res.dir_fd))
        if not res.leave:
            res.empty_output()
        keep = not res.leave
    finally:
        if keep:
            pool.give_back(res)
        else:
            if res.leave and res.leave != "stopped":
                on_line("gpumesh", f"the job's reused process {res.proc.pid} ends here: {res.leave}")
                log.info("reused process %d of job %s goes: %s", res.proc.pid, res.job_id, res.leave)
            res.close()
    return out
