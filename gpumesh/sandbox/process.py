"""The process handle that the runner drives, whichever mode started the attempt.

Fresh mode (and a spare) hands it a ``subprocess.Popen``; warm mode a :class:`~gpumesh.sandbox.warm.WarmProcess`,
the zygote's supervisor seen from the worker. Both are used through these members only, so the runner has one
loop for both.
"""

from __future__ import annotations

from typing import IO, Protocol


class AttemptProcess(Protocol):
    """The part of ``Popen`` that the sandbox uses: the launcher's pid, its output pipes, its exit code, a signal."""

    pid: int
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...


def close_pipes(proc: AttemptProcess) -> None:
    """Close the attempt's stdout and stderr, once nothing more is read from them."""
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
