"""Keep a broker password off the command line of a command that runs for long.

``/proc/<pid>/cmdline`` is readable by every process on the machine, a task confined by Landlock
included (only ``mem`` and ``environ`` need ptrace rights). serve's worker line and ``gpumesh join
--token`` put the password there, as does ``--url redis://submitter:PASSWORD@…`` given to a dashboard,
``metrics``, ``top``, ``status --watch``, ``submit --wait`` or ``logs --follow`` on a worker's machine. So a
long-lived command started so (a worker for hours, a dashboard for days) re-executes
itself at once, before it connects or runs anything, with the password replaced by a placeholder in its
arguments and carried in its environment instead, which only the worker's own user (and, under
Landlock, not even its tasks) can read. The task's environment is built from an allow-list and never
holds it.
"""

from __future__ import annotations

import os
import sys
from urllib.parse import urlsplit

PLACEHOLDER = "@gpumesh-password-from-environment@"
ENV = "GPUMESH_ARGV_SECRET"
_COMMANDS = ("worker", "join", "dashboard", "metrics", "top")  # the commands that run for hours next to tasks
_WHILE = {"status": ("--watch",), "submit": ("--wait",), "logs": ("--follow", "-f")}  # and these, following a job


def _command(args: list[str]) -> str | None:
    """The subcommand ``args`` run (the first word that is not a global option)."""
    for a in args:
        if not a.startswith("-"):
            return a
    return None


def _password_of(arg: str) -> str | None:
    """The password a broker URL in ``arg`` carries, as written (percent-encoded), or None."""
    if "://" not in arg:
        return None
    try:
        parts = urlsplit(arg)
        password = parts.password if parts.scheme.startswith(("redis", "rediss")) else None
    except ValueError:
        return None
    return password or None


def _secret(args: list[str]) -> str | None:
    """The password on this command line: in a broker URL (a worker's argument, ``--url``), or join's ``--token``."""
    for i, a in enumerate(args):
        token = a.removeprefix("--token=") if a.startswith("--token=") else None
        if a == "--token" and i + 1 < len(args):
            token = args[i + 1]
        if token:
            return token.rpartition(":")[2] or token
        found = _password_of(a.removeprefix("--url="))
        if found:
            return found
    return None


def restore() -> None:
    """In the re-executed worker: put the password back into ``sys.argv`` (this process's copy, not the
    kernel's) and take it out of the environment that child processes would inherit."""
    secret = os.environ.pop(ENV, None)
    if secret is not None:
        sys.argv[1:] = [a.replace(PLACEHOLDER, secret) for a in sys.argv[1:]]


def hide_password() -> None:
    """Re-execute a long-running command whose arguments hold a broker password without it (see the module)."""
    if ENV in os.environ:
        restore()
        return
    args = sys.argv[1:]
    command = _command(args)
    following = any(a in _WHILE.get(command or "", ()) for a in args)
    if (command not in _COMMANDS and not following) or os.name != "posix":
        return
    secret = _secret(args)
    if not secret or PLACEHOLDER in secret:
        return
    env = {**os.environ, ENV: secret}
    hidden = [a.replace(secret, PLACEHOLDER) for a in args]
    sys.stdout.flush()
    sys.stderr.flush()
    # -P: the working directory stays off sys.path, as for the `gpumesh` console script
    os.execve(sys.executable, [sys.executable, "-P", "-m", "gpumesh", *hidden], env)
