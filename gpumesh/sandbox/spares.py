"""Fresh mode's spares: the next attempt's interpreter, started while the current attempt runs (see :class:`Spares`).

The worker's side; the spare itself is ``python -m gpumesh.sandbox.launcher --spare``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass

from gpumesh.sandbox import tree
from gpumesh.sandbox.launch import clean_env, forget_launcher_command, launcher_command
from gpumesh.sandbox.process import close_pipes

# What differs from one attempt to the next; every other variable must be what a spare started with.
PER_ATTEMPT_ENV = ("TMPDIR", "CUDA_VISIBLE_DEVICES")


def _startup_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables an interpreter reads as it starts (PYTHON*, locale, the loader's paths) are among these."""
    return {k: v for k, v in env.items() if not k.startswith("GPUMESH_") and k not in PER_ATTEMPT_ENV}


class Spares:
    """Fresh mode's head start: the next attempt's interpreter starts while the current attempt runs.

    Each spare is a new ``python -m gpumesh.sandbox.launcher --spare`` that runs exactly one attempt, so every
    attempt still gets an interpreter no task has touched; it only stops waiting for one to start
    (20-60 ms on the machines measured, most of a no-op task). A spare starts from the clean
    environment (no broker URL, no credentials), holds stdout and stderr pipes of its own, and waits
    for its attempt on a socket. A thread of the worker moves it into the next attempt's cgroup meanwhile
    (tree.move_ahead), and until it is handed its attempt it is one of the worker's helper children, never
    taken for an attempt's orphan.
    It dies with the thread that started it (PR_SET_PDEATHSIG): use one ``Spares`` from one thread,
    as the worker does from its main thread. An attempt it cannot serve (another user, an environment
    the spare did not start with, a spare found dead) starts cold, as without it. A spare that dies
    in the instant after it was handed an attempt fails that attempt, which is retried like any other.
    """

    def __init__(self) -> None:
        self._spare: _Spare | None = None

    def start(
        self,
        python: str,
        as_user: bool,
        script: str,
        cwd: str,
        env: Mapping[str, str],
        rlimits: Mapping[str, str],
        stdin: int,
        ahead: str | None = None,
    ) -> subprocess.Popen[bytes] | None:
        """Hand this attempt to the waiting spare and start the next one, moved into ``ahead`` (the next
        attempt's cgroup) while this one runs; None: start this one cold. ``python``: the attempt's interpreter
        ("" for the worker's); ``as_user``: it runs as a sandbox user."""
        if as_user:  # the launcher must be a copy the task's user can read: cold, always
            return None
        python = python or sys.executable
        spare, self._spare = self._spare, None
        proc = None
        if spare is not None:
            proc = spare.proc
            spare.moved()  # before anything may reap it
            try:
                if spare.python != python or spare.env != _startup_env(env) or proc.poll() is not None:
                    raise OSError("this spare cannot serve the attempt")
                req = {"script": script, "cwd": cwd, "env": dict(env), "limits": dict(rlimits)}
                socket.send_fds(spare.ctrl, [json.dumps(req).encode()], [stdin])
            except OSError:
                _discard(proc)
                proc = None
            finally:
                spare.ctrl.close()
                tree.helper(spare.proc.pid, alive=False)  # the attempt's launcher now (tree.started), or gone
        self._spare = self._launch(python, rlimits["isolation"], ahead)
        return proc

    def _launch(self, python: str, isolation: str = "-", ahead: str | None = None) -> _Spare | None:
        """Start the next spare; it builds ``isolation`` (the last attempt's Landlock rules) while it waits, and
        this process moves it into the cgroup ``ahead`` meanwhile (from the interpreter's first instant: the move
        can wait tens of ms for the kernel, more than the spare's own start)."""
        env = clean_env({})
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd = launcher_command(python)
        try:
            proc = subprocess.Popen(
                [*cmd, "--spare", str(theirs.fileno()), str(os.getpid()), isolation],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(theirs.fileno(),), cwd="/", env=env,
            )  # fmt: skip
        except OSError:
            mine.close()
            forget_launcher_command(cmd)
            return None  # the attempt's own cold start will say what is wrong
        finally:
            theirs.close()
        tree.helper(proc.pid)
        return _Spare(proc, mine, python, _startup_env(env), tree.move_ahead(ahead, proc.pid) if ahead else None)

    def close(self) -> None:
        """Stop the waiting spare, if any."""
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.ctrl.close()
            spare.moved()
            _discard(spare.proc)
            tree.helper(spare.proc.pid, alive=False)
        tree.drop_ahead(self)


@dataclass
class _Spare:
    proc: subprocess.Popen[bytes]
    ctrl: socket.socket
    python: str
    env: dict[str, str]
    move: Future[None] | None  # its move into the next attempt's cgroup, under way

    def moved(self) -> None:
        """Wait for the move (its outcome does not matter: the supervisor checks, and joins if it must). Until
        then the spare must not be reaped, or the move might take a process that was given its pid."""
        if self.move is not None:
            self.move.exception()
            self.move = None


def _discard(proc: subprocess.Popen[bytes]) -> None:
    """A spare that will run nothing: it holds no task, so KILL is safe."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    close_pipes(proc)
