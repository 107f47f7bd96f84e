"""The warm executor's worker side: a zygote process that has imported Python (and ``--preload``) once
and runs each attempt in a process forked for it (by a supervisor forked from the zygote, which serves attempt
after attempt), so a task no longer pays interpreter start-up.

Every attempt still gets what the fresh mode gives it: its own session, rlimits, clean environment,
temp directory, payload on stdin, timeout and memory cap, and death with the worker. The zygote is
started from a clean environment (no broker URL, no credentials) and never runs task code itself.
``sandbox.run`` drives a :class:`WarmProcess` exactly as it drives a ``subprocess.Popen``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO, Any

from gpumesh.sandbox import tree
from gpumesh.sandbox.launch import clean_env, forget_launcher_command, launcher_command
from gpumesh.sandbox.launcher import SOURCE_INLINE_MAX

log = logging.getLogger("gpumesh.worker")

ZYGOTE_LOST = "the warm zygote died"


class ZygoteError(RuntimeError):
    """The zygote could not start (a --preload failed) or stopped answering."""


def _recv_json(sock: socket.socket, timeout: float | None) -> dict[str, Any] | None:
    """One message, or None when the other side closed; raises TimeoutError past ``timeout``."""
    ready, _, _ = select.select([sock], [], [], timeout)
    if not ready:
        raise TimeoutError
    try:
        data = sock.recv(1 << 16)
    except (ConnectionResetError, BrokenPipeError):
        return None
    return json.loads(data) if data else None


class WarmProcess:
    """One attempt's supervisor, forked by the zygote, seen as the part of ``Popen`` that the sandbox uses
    (:class:`~gpumesh.sandbox.process.AttemptProcess`)."""

    def __init__(self, pid: int, reply: socket.socket, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.pid = pid
        self.args = f"<warm attempt {pid}>"
        self.stdout: IO[bytes] | None = stdout
        self.stderr: IO[bytes] | None = stderr
        self.returncode: int | None = None
        self.lost: str | None = None  # why the status will never come (the zygote died)
        self._reply = reply

    def _status(self, timeout: float | None) -> int | None:
        while self.returncode is None:
            try:
                msg = _recv_json(self._reply, timeout)
            except TimeoutError:
                return None
            self.ended(msg)
        return self.returncode

    def ended(self, msg: dict[str, Any] | None) -> None:
        """Take a message from the reply socket: the outcome ({"status"}, from the supervisor or the
        zygote, whichever comes first), or None (the zygote died). A bare {"pid"} tells nothing new."""
        if self.returncode is not None:
            return
        if msg is None:  # the zygote died: our supervisor got its death signal and is taking the tree down
            self.lost = ZYGOTE_LOST
            self.returncode = -signal.SIGKILL
        elif "status" in msg:
            self.returncode = os.waitstatus_to_exitcode(msg["status"])

    @property
    def exit_fd(self) -> socket.socket:
        """Readable when the attempt has ended (its status arrived) or the zygote died."""
        return self._reply

    def poll(self) -> int | None:
        return self._status(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def close(self) -> None:
        self._reply.close()

    def same_process(self) -> bool:
        """Whether ``pid`` still names the process it named when the attempt started (a supervisor of this worker's
        own zygote is waited for by it, and its pid is no other's until the outcome is told)."""
        return True

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


class Zygote:
    """The warm executor's process. Start it once; ``spawn`` one attempt at a time or several."""

    def __init__(
        self, preload: Sequence[str] = (), python: str = "", env: Mapping[str, str] | None = None, site: bool = False
    ) -> None:
        self.preload = [m.strip() for m in preload if m.strip()]
        self.python = python or sys.executable
        # An environment's interpreter (gpumesh.envs): started without site, so nothing of the env runs in the
        # zygote; each attempt adds the env's packages once it is confined.
        self.no_site = site
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self._ctrl: socket.socket | None = None
        self._lock = threading.Lock()
        self.started = 0  # how many times it was (re)started

    def start(self, timeout: float = 300.0) -> None:
        """Start the zygote and wait until it has imported ``preload``; ZygoteError says why not."""

        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd = launcher_command(self.python, no_site=self.no_site)
        try:
            with tree.launching():  # registered before another thread's kill_escaped could take it for an orphan
                self.proc = subprocess.Popen(
                    [*cmd, "--zygote", str(theirs.fileno()), str(os.getpid()), ",".join(self.preload)],
                    stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), env=clean_env(self.env),
                    cwd="/", start_new_session=True,  # not a shared dir: nothing there shadows an import
                )  # fmt: skip
                tree.helper(self.proc.pid)  # in a session of its own, and waited for here: never reaped as an orphan
        except OSError:
            mine.close()
            forget_launcher_command(cmd)
            raise
        finally:
            theirs.close()
        self._ctrl = mine
        self.started += 1
        try:
            msg = _recv_json(mine, timeout)
        except TimeoutError:
            self._stop()
            raise ZygoteError(f"the warm zygote did not finish importing {self.preload} in {timeout:.0f}s") from None
        finally:
            forget_launcher_command(cmd)  # removed by the zygote as it started, unless it never did
        if msg is None or "error" in msg:
            self._stop()
            raise ZygoteError(msg["error"] if msg else "the warm zygote exited at start (see the log above)")
        log.info("warm zygote %d ready%s", self.proc.pid, f", preloaded {', '.join(self.preload)}" * bool(self.preload))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def attempt_dir(self) -> tuple[str, int] | None:
        """Where an attempt of this zygote runs, made and opened (as taskdir.make_open): None, any directory the
        worker makes (a job's preload zygote makes them beneath its own, :mod:`gpumesh.sandbox.preloaded`)."""
        return None

    def spawn(
        self,
        script: str,
        cwd: str,
        env: Mapping[str, str],
        limits: Mapping[str, str],
        stdin: int,
        ahead: str | None = None,
        source: str | None = None,
        serve: int | None = None,
    ) -> WarmProcess:
        """Fork one attempt: the supervisor runs ``script`` with ``limits`` (named as launcher.LIMITS names them:
        runner.launcher_limits). ``ahead``: the next attempt's cgroup, which the zygote's next spare moves into.
        ``source``: the script's text, which the supervisor compiles once for the attempts that share it (sent
        where the request stays small; else the script's process compiles the file). ``serve``: the socket of a
        reused process (submit --reuse-process, :mod:`gpumesh.sandbox.resident`), whose script's process then
        takes task after task on it instead of running the script once."""
        with self._lock:
            if not self.alive():
                if self.started:
                    log.warning("the warm zygote is gone (exit %s); starting a new one", self.proc and self.proc.poll())
                self._stop()
                self.start()
            assert self._ctrl is not None
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            try:
                req: dict[str, Any] = {
                    "script": script, "cwd": cwd, "env": dict(env), "limits": dict(limits), "ahead": ahead or "-"
                }  # fmt: skip
                if serve is not None:
                    req["serve"] = 1
                data = json.dumps({**req, "source": source}).encode() if source is not None else b""
                inlined = 0 < len(data) <= SOURCE_INLINE_MAX
                fds = [theirs.fileno(), stdin, out_w, err_w, *([serve] if serve is not None else [])]
                try:
                    socket.send_fds(self._ctrl, [data if inlined else json.dumps(req).encode()], fds)
                except OSError as exc:  # a socket buffer smaller than the message: the script's process reads the file
                    if not inlined or exc.errno != errno.EMSGSIZE:
                        raise
                    socket.send_fds(self._ctrl, [json.dumps(req).encode()], fds)
            except OSError as exc:
                for fd in (out_r, err_r):
                    os.close(fd)
                mine.close()
                raise ZygoteError(f"the warm zygote stopped answering ({exc})") from exc
            finally:
                theirs.close()
                os.close(out_w)
                os.close(err_w)
            stdout, stderr = os.fdopen(out_r, "rb", 0), os.fdopen(err_r, "rb", 0)
            try:
                msg = _recv_json(mine, 10.0)
            except TimeoutError:
                msg = None
            if msg is None or "pid" not in msg:
                mine.close()
                stdout.close()
                stderr.close()
                raise ZygoteError(f"the warm zygote did not fork the attempt ({(msg or {}).get('error', 'no answer')})")
            proc = WarmProcess(msg["pid"], mine, stdout, stderr)
            proc.ended(msg)  # a task fast enough that its supervisor's outcome came before the zygote's answer
            return proc

    def close(self, timeout: float = 5.0) -> None:
        """Stop the zygote. Attempts still running get TERM from their death signal and end with grace."""
        self._stop(timeout)
        tree.drop_ahead(self)  # the cgroup made for its next attempt, where its spare waited

    def _stop(self, timeout: float = 5.0) -> None:
        """Stop the zygote process (as close does), keeping the cgroup made for the next attempt: a zygote
        restarted for an attempt whose own and next cgroups were made already forks a spare that joins it."""
        if self._ctrl is not None:
            self._ctrl.close()  # the zygote exits on EOF
            self._ctrl = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            tree.helper(self.proc.pid, alive=False)
            tree.reap_orphans()  # its spare, which died with it, came to this process if it is a subreaper
