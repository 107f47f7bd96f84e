"""The sandbox's first process: ``python -m gpumesh.launcher PARENT_PID SCRIPT CPU_S FSIZE NOFILE GRACE_S UID GID``.

It makes the task die with its worker (PR_SET_PDEATHSIG), adopts every orphan of the task
(PR_SET_CHILD_SUBREAPER, so a grandchild that called setsid is still found), sets the rlimits, then
forks: the child runs the script in this same interpreter (runpy: no second start-up), the parent
supervises. On SIGTERM (the worker's kill, its timeout, or the worker's death) the supervisor sends
TERM to the whole tree, KILL after the grace period, and exits the way the script did.

Imports stay minimal: this runs once per task attempt.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _descendants() -> list[int]:
    """Every process below this one, read from /proc. Plain os calls only: this runs in signal handlers,
    where importing a module (psutil) can re-enter itself. As a subreaper we keep every orphan below us."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, stack = [], [os.getpid()]
    while stack:
        for pid in children.get(stack.pop(), ()):
            out.append(pid)
            stack.append(pid)
    return out


def _signal_tree(sig: int) -> None:
    for pid in _descendants():
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _run_script(script: str) -> None:
    """In the forked child: become the script's ``__main__`` and exit with its code.

    Plain compile + exec rather than runpy: in a freshly forked child runpy's imports cost ~7 ms a task."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.argv = [script]
    sys.path[0] = os.path.dirname(script)
    main = type(sys)("__main__")
    main.__file__ = script
    sys.modules["__main__"] = main
    code = 0
    try:
        with open(script, "rb") as f:
            exec(compile(f.read(), script, "exec"), main.__dict__)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # the script's own error: its traceback is the task's error
        import traceback

        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _has_children() -> bool:
    """Cheap check before walking /proc: as a subreaper, any surviving descendant is below a child of ours."""
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return bool(f.read().strip())
    except OSError:
        return True


def main(argv: list[str]) -> None:
    parent, script, cpu, fsize, nofile, grace, uid, gid = argv
    libc = ctypes.CDLL(None, use_errno=True)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for limit, value in (
        (resource.RLIMIT_CPU, int(cpu)),
        (resource.RLIMIT_FSIZE, int(fsize)),
        (resource.RLIMIT_NOFILE, int(nofile)),
    ):
        if value > 0:
            _soft, hard = resource.getrlimit(limit)
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(limit, (value, value if limit != resource.RLIMIT_CPU else hard))
    if uid != "-":  # --sandbox-user: drop root for good before anything of the task runs
        os.setgroups([])
        os.setgid(int(gid))
        os.setuid(int(uid))
    # After the credential change, which clears it: die with the worker.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # the worker died before prctl took effect
        sys.exit(70)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1)

    terminating = False

    def on_term(_sig: int, _frame: object) -> None:
        nonlocal terminating
        if terminating:  # the worker's TERM and its death signal may both arrive
            return
        terminating = True
        _signal_tree(signal.SIGTERM)
        signal.alarm(max(1, int(float(grace))))

    def on_alarm(_sig: int, _frame: object) -> None:
        _signal_tree(signal.SIGKILL)

    # Handlers before the fork: a TERM that lands right after it must still reach the script.
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import gc

    gc.freeze()  # fewer copy-on-write faults in the child
    child = os.fork()
    if child == 0:
        _run_script(script)

    status = None
    while status is None:
        try:
            pid, st = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == child:
            status = st
    # The script is gone; nothing it started may outlive it.
    if _has_children():
        _signal_tree(signal.SIGKILL)
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
    if status is not None and os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)  # end the way the script did, so the worker can name the signal
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # these two cannot be handled, nor reset
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    sys.exit(os.WEXITSTATUS(status) if status is not None else 70)


if __name__ == "__main__":
    main(sys.argv[1:])
