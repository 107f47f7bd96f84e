"""A job's preload zygote (warm mode, a job with an environment and a ``preload``): the worker's side.

The job's ``preload`` modules come from its environment, so they are the job's code: the process that imports them
is confined as a task is before anything of the env runs, and it belongs to that one job. It is started as a reused
process is (the launcher's ``--preloaded`` mode): a supervisor in a cgroup of its own, as the sandbox user, dying
with the worker, whose child confines itself (its namespaces, no capabilities, no_new_privs, Landlock that lets it
read what a task of the job may read and write only beneath a directory of its own, seccomp), then adds the env's
site and imports the preload. Each attempt's directory is made in that directory, and each attempt is a child the
zygote forks, which the worker moves into the attempt's cgroup before it runs anything of the task; the child
narrows Landlock to its own directory. :class:`JobZygote` is driven by ``sandbox.run`` as a :class:`Zygote` is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import select
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import psutil

from gpumesh.sandbox import taskdir, tree
from gpumesh.sandbox.launch import clean_env, forget_launcher_command
from gpumesh.sandbox.launcher import CACHE_DIR_PREFIX, LIMITS, PRELOAD_ERROR, TASK_DIR_PREFIX
from gpumesh.sandbox.runner import Limits, _launcher, launcher_limits, tree_memory
from gpumesh.sandbox.warm import WarmProcess, Zygote, ZygoteError, _recv_json

log = logging.getLogger("gpumesh.worker")

HOME = ".zygote-home"  # in the zygote's directory: its HOME and TMPDIR, the only place it may write to itself
MAX_SAID = 1000  # characters of what a preload zygote says at start (its error, its stderr's last line) kept


class PreloadFailed(ZygoteError):
    """The job's preload did not import (its message names the module): the job's fault, not the worker's."""


class JobZygoteLost(ZygoteError):
    """The job's preload zygote died, stopped answering, or named a process that is not its attempt."""


class AttemptGroup(WarmProcess):
    """One attempt a preload zygote forked: the script's own process (its session's leader), not a supervisor, so a
    signal goes to its whole process group; the zygote takes what is left down once it ends.

    The zygote runs the job's code, so nothing it says is trusted: the pid it named was checked to be its own child
    (:func:`_child_of`), and from then on the process is known by its pidfd, so that a signal never reaches a
    process that took its pid over after it ended (even if the zygote never says so)."""

    def __init__(
        self, pid: int, pidfd: int, reply: socket.socket, stdout: Any, stderr: Any, zygote: int | None = None
    ) -> None:  # fmt: skip
        super().__init__(pid, reply, stdout, stderr)
        self.pidfd = pidfd
        self.zygote = zygote  # the zygote's supervisor (this worker's child): its tree holds the attempt's

    @property
    def memory_pid(self) -> int:
        """Whose process tree the memory cap counts: the whole zygote's, the attempt's with it. The zygote runs the
        job's code too (what its preload left running), and as the attempt runs nothing else watches it."""
        return self.zygote if self.zygote is not None else self.pid

    def same_process(self) -> bool:
        return self.pidfd >= 0 and _alive(self.pidfd)

    def _status(self, timeout: float | None) -> int | None:
        try:
            return super()._status(timeout)
        except ValueError:  # not JSON: the zygote says nothing the worker can use
            self.ended(None)
            return self.returncode

    def ended(self, msg: dict[str, Any] | None) -> None:
        """As a warm attempt's, but a status that is no wait status counts as the zygote lost."""
        if isinstance(msg, dict) and "status" in msg:
            status = msg["status"]
            if not isinstance(status, int) or isinstance(status, bool) or not 0 <= status < 1 << 16:
                msg = None
        elif msg is not None and not isinstance(msg, dict):
            msg = None
        super().ended(msg)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None and self.same_process():
            try:
                signal.pidfd_send_signal(self.pidfd, sig)
                os.killpg(self.pid, sig)  # it leads its group while it lives (a session leader cannot leave it)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        super().close()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def _alive(pidfd: int) -> bool:
    """Whether the process ``pidfd`` refers to has not exited (the pidfd is readable once it has)."""
    ready, _, _ = select.select([pidfd], [], [], 0)
    return not ready


def _parent_and_start(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks since boot) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _child_of(supervisor: int, pid: object) -> int | None:
    """The start time of ``pid`` if it is a child of the supervisor's child (the confined zygote), else None."""
    if not isinstance(pid, int) or pid <= 0:
        return None
    me = _parent_and_start(pid)
    if me is None:
        return None
    parent = _parent_and_start(me[0])
    return me[1] if parent is not None and parent[0] == supervisor else None


class JobZygote(Zygote):
    """The preload zygote of one job on this worker, for the env whose interpreter and site ``limits`` name
    (``limits.python``, ``limits.site``), confined by ``limits`` (its user, Landlock rules, file sizes) and able to
    read ``project_tree``. ``env``: variables of its own (CUDA_VISIBLE_DEVICES), never a credential."""

    def __init__(
        self, job_id: str, preload: Sequence[str], limits: Limits, env: Mapping[str, str] | None = None,
        project_tree: str = "",
    ) -> None:  # fmt: skip
        super().__init__(preload, limits.python, env)
        self.job_id = job_id
        self.limits = limits
        self.project_tree = project_tree
        self.dir = ""
        self._dir_fd: int | None = None
        self._cgroup: str | None = None
        self._stderr: Any = None
        self._paused = False

    def attempt_dir(self) -> tuple[str, int] | None:
        """A new directory for an attempt, beneath this zygote's own (the only place its Landlock lets it write),
        with its output dir, opened: as taskdir.make_open makes one."""
        self._make_dir()
        workdir = tempfile.mkdtemp(prefix=TASK_DIR_PREFIX, dir=self.dir)
        fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.mkdir(taskdir.OUTPUT, dir_fd=fd)
        except OSError:
            os.close(fd)
            os.rmdir(workdir)
            raise
        return workdir, fd

    def _make_dir(self) -> None:
        """The zygote's own directory, made once (a zygote started again keeps it: its attempts' are in it)."""
        if self._dir_fd is None:
            self.dir, self._dir_fd = taskdir.make_open()
            # root's: the zygote (the sandbox user) reaches its attempts' directories through it and makes nothing in
            # it, so no name the worker makes or removes there can be swapped by the job's code.
            os.fchmod(self._dir_fd, 0o711)
            # its own HOME and TMPDIR, for what a preload writes as it imports (a cache, a temp file)
            os.mkdir(HOME, 0o700, dir_fd=self._dir_fd)
            if self.limits.user is not None:
                os.chown(HOME, *self.limits.user, dir_fd=self._dir_fd, follow_symlinks=False)
            isolation = self.limits.isolation
            if isolation is not None and isolation.private:  # where its caches' overlays keep what it writes
                for i, _path in enumerate(isolation.cache):
                    os.mkdir(f"{CACHE_DIR_PREFIX}{i}", 0o700, dir_fd=self._dir_fd)
                    if self.limits.user is not None:
                        os.chown(
                            f"{CACHE_DIR_PREFIX}{i}", *self.limits.user, dir_fd=self._dir_fd, follow_symlinks=False
                        )

    def start(self, timeout: float = 300.0) -> None:
        """Start it and wait until it has imported the preload: PreloadFailed naming the module that did not
        import, ZygoteError for anything else."""
        tree.become_subreaper()
        self._make_dir()
        self._cgroup = tree.new_cgroup()
        own = dataclasses.replace(self.limits, cpu_seconds=0)  # each attempt takes its own CPU limit
        named = launcher_limits(own, self.dir, self.project_tree, self._cgroup)
        home = os.path.join(self.dir, HOME)
        extra = {"TMPDIR": home, "HOME": home, **({"GPUMESH_ENV_SITE": own.site} if own.site else {})}
        if self.project_tree:  # first on its sys.path: a preload may be a module of the job's project
            extra["GPUMESH_PROJECT_DIR"] = self.project_tree
        env = clean_env({**self.env, **extra})
        if own.user is not None:
            for var in ("USER", "LOGNAME"):
                env.pop(var, None)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd = _launcher(own)
        marker = os.path.join(self.dir, ".zygote")  # no file: the zygote's directory, where it starts
        try:
            with tree.launching():
                self.proc = subprocess.Popen(
                    [*cmd, "--preloaded", str(theirs.fileno()), str(os.getpid()), marker, ",".join(self.preload),
                     *(named[name] for name in LIMITS)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                    pass_fds=(theirs.fileno(),), env=env, cwd="/", start_new_session=True,
                )  # fmt: skip
                tree.helper(self.proc.pid)
        except OSError:
            mine.close()
            forget_launcher_command(cmd)
            self._end()
            raise
        finally:
            theirs.close()
        self._ctrl = mine
        self._stderr = self.proc.stderr
        self.started += 1
        try:
            msg, said = self._await_ready(mine, timeout)
        except TimeoutError:
            self._end()
            raise PreloadFailed(f"{PRELOAD_ERROR}{','.join(self.preload)}: not imported in {timeout:.0f}s") from None
        finally:
            forget_launcher_command(cmd)
        if msg is None or "error" in msg:
            self._end()
            error = str(msg["error"])[:MAX_SAID] if msg is not None else ""
            if error.startswith(PRELOAD_ERROR):
                raise PreloadFailed(error)
            raise ZygoteError(error or f"the job's preload zygote exited at start ({said or 'no message'})")
        self._drop_stderr()
        over = self._over_cap()
        if over:
            self._end()
            raise PreloadFailed(over)
        log.info("preload zygote %s of job %s ready, preloaded %s", msg["ready"], self.job_id, ", ".join(self.preload))

    def _over_cap(self) -> str:
        """Why the zygote may not serve the job: what its preload holds is over the job's memory cap ("": it is not).
        Its pages count in each attempt only where the attempt touches them: counted here, once it has imported."""
        cap = self.limits.memory_bytes
        if not cap or self.proc is None:
            return ""
        held = tree_memory(self.proc.pid, cap)
        if held <= cap:
            return ""
        return (f"{PRELOAD_ERROR}{','.join(self.preload)}: the zygote holds {held >> 20} MiB, over the job's memory "
                f"cap of {cap >> 20} MiB")  # fmt: skip

    def _await_ready(self, ctrl: socket.socket, timeout: float) -> tuple[dict[str, Any] | None, str]:
        """({"ready"} or {"error"}, or None when it exited or said nothing usable; the last line it wrote on its
        stderr meanwhile), its stderr read as it comes (a preload that writes much must not fill the pipe and
        stall). TimeoutError past ``timeout``."""
        deadline = time.monotonic() + timeout
        tail = b""
        streams: list[Any] = [ctrl, *([self._stderr] if self._stderr is not None else [])]
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select(streams, [], [], left)
            if self._stderr is not None and self._stderr in ready:
                chunk = os.read(self._stderr.fileno(), 1 << 16)
                if chunk:
                    tail = (tail + chunk)[-MAX_SAID:]
                else:
                    streams.remove(self._stderr)
            if ctrl in ready:
                break
        lines = [line for line in tail.decode(errors="replace").splitlines() if line.strip()]
        try:
            msg = _recv_json(ctrl, 0)
        except (TimeoutError, ValueError):
            msg = None
        usable = isinstance(msg, dict) and ("ready" in msg or "error" in msg)
        return (msg if usable else None), (lines[-1] if lines else "")

    def _drop_stderr(self) -> None:
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def spawn(
        self, script: str, cwd: str, env: Mapping[str, str], limits: Mapping[str, str], stdin: int,
        ahead: str | None = None, source: str | None = None, serve: int | None = None,
    ) -> WarmProcess:  # fmt: skip
        """Fork one attempt; it runs once this worker has moved it into the attempt's cgroup (``limits["cgroup"]``).
        ``ahead`` and ``serve`` are not this zygote's (no spare waits ahead, no reused process)."""
        if serve is not None:
            raise ZygoteError("a job's preload zygote runs no reused process")
        with self._lock:
            self._resume()
            if not self.alive():
                if self.started:
                    log.warning("the preload zygote of job %s is gone; starting a new one", self.job_id)
                self._end()
                try:
                    self.start()
                except PreloadFailed:
                    raise
                except (OSError, ZygoteError) as exc:
                    raise JobZygoteLost(f"the job's preload zygote did not start again ({exc})") from exc
            assert self._ctrl is not None
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            try:
                req = {"script": script, "cwd": cwd, "env": dict(env), "limits": dict(limits), "source": source}
                socket.send_fds(self._ctrl, [json.dumps(req).encode()], [theirs.fileno(), stdin, out_w, err_w])
            except OSError as exc:
                for fd in (out_r, err_r):
                    os.close(fd)
                mine.close()
                self._end()
                raise JobZygoteLost(f"the job's preload zygote stopped answering ({exc})") from exc
            finally:
                theirs.close()
                os.close(out_w)
                os.close(err_w)
            stdout, stderr = os.fdopen(out_r, "rb", 0), os.fdopen(err_r, "rb", 0)
            try:
                msg = _recv_json(mine, 10.0)
            except (TimeoutError, ValueError):
                msg = None
            pidfd, why = self._verified(msg if isinstance(msg, dict) else None, limits.get("cgroup", "-"))
            if pidfd < 0:
                mine.close()
                stdout.close()
                stderr.close()
                self._end()  # it does not say what it did: a new one starts for the next attempt
                raise JobZygoteLost(f"the job's preload zygote {why}")
            proc = AttemptGroup(
                int((msg or {})["pid"]), pidfd, mine, stdout, stderr, self.proc.pid if self.proc is not None else None
            )
            try:
                mine.send(b"go")  # in its cgroup now: it may run the task
            except OSError:
                proc.send_signal(signal.SIGKILL)
            return proc

    def _verified(self, msg: dict[str, Any] | None, cgroup: str) -> tuple[int, str]:
        """(a pidfd of the attempt's process, "") once the pid the zygote named is its own child, held open, and in
        the attempt's cgroup (``cgroup``, "-": none); else (-1, why not)."""
        pid = (msg or {}).get("pid")
        started = _child_of(self.proc.pid, pid) if self.proc is not None else None
        if started is None or not isinstance(pid, int):
            return (
                -1,
                "did not fork the attempt" if not msg or "pid" not in msg else f"named {pid!r}, no child of its own",
            )
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return -1, "named a process that is gone"
        if tree.start_time(pid) != started or not _alive(pidfd):
            os.close(pidfd)
            return -1, "named a process that is gone"
        try:
            if cgroup != "-":  # before anything of the task runs: it waits for the word
                tree.join_cgroup(cgroup, pid)
        except OSError as exc:
            os.close(pidfd)
            return -1, f"forked an attempt that could not join its cgroup ({exc})"
        if not _alive(pidfd):  # it ended meanwhile: the pid written may name another process by now
            base = tree.cgroup_base()
            if cgroup != "-" and base is not None:
                with contextlib.suppress(OSError):
                    tree.join_cgroup(base, pid)  # out of the attempt's cgroup, which is killed: it is no one we know
            os.close(pidfd)
            return -1, "named a process that ended before it ran"
        return pidfd, ""

    def close(self, timeout: float = 5.0) -> None:
        """Stop the zygote and everything in its cgroup, and remove its directory."""
        self._end(timeout)
        self._remove()

    def pause(self) -> None:
        """Between its job's attempts (another job's may run now): stop every process of the zygote but its
        supervisor (SIGSTOP, which no code of the job can catch or ignore), so that nothing its preload left running
        (a thread, a process) uses this machine until the job's next attempt; and check what it holds against the
        job's memory cap (over it, the zygote goes: the next attempt starts a new one, which the cap refuses)."""
        with self._lock:
            if self.proc is None or not self.alive() or self._paused:
                return
            over = self._over_cap()
            if over:
                log.warning("job %s: its preload zygote goes (%s)", self.job_id, over)
                self._end()
                return
            self._paused = True
            self._signal_all(signal.SIGSTOP)

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            self._signal_all(signal.SIGCONT)

    def _members(self) -> set[int]:
        """The processes of the zygote but its supervisor: its cgroup's (the kernel's list), else its descendants."""
        if self.proc is None:
            return set()
        if self._cgroup is not None:
            try:
                with open(os.path.join(self._cgroup, "cgroup.procs")) as f:
                    pids = {int(line) for line in f if line.strip()}
            except (OSError, ValueError):
                pids = set()
        else:
            try:
                pids = {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
            except psutil.Error:
                pids = set()
        pids.discard(self.proc.pid)
        return pids

    def _signal_all(self, sig: int) -> None:
        """Send ``sig`` to each of :meth:`_members`, again until no new one appears (one that forks meanwhile): each
        held by a pidfd and found a member still once held, so that a pid taken over by another process is never
        signalled."""
        done: set[int] = set()
        for _ in range(50):
            pids = self._members() - done
            if not pids:
                return
            for pid in pids:
                done.add(pid)
                try:
                    pidfd = os.pidfd_open(pid)
                except OSError:
                    continue
                try:
                    if pid in self._members():
                        signal.pidfd_send_signal(pidfd, sig)
                except OSError:
                    pass
                finally:
                    os.close(pidfd)

    def _end(self, timeout: float = 5.0) -> None:
        """Stop the zygote and everything in its cgroup, keeping its directory (a new one may start in it)."""
        self._resume()  # a stopped zygote would not see its socket close, nor end with grace
        self._stop(timeout)
        self._drop_stderr()
        tree.end_cgroup(self._cgroup)
        self._cgroup = None

    def _remove(self) -> None:
        if self._dir_fd is not None:
            try:
                taskdir.remove(self.dir, None, os.path.join(self.dir, taskdir.OUTPUT), self._dir_fd)
            finally:
                os.close(self._dir_fd)
                self._dir_fd = None
