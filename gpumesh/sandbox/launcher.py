"""The sandbox's first process, in one of three modes.

Fresh: ``python -m gpumesh.sandbox.launcher PARENT_PID SCRIPT CPU_S FSIZE NOFILE GRACE_S UID GID`` runs one attempt.
Spare: ``python -m gpumesh.sandbox.launcher --spare CTRL_FD PARENT_PID`` is a fresh interpreter started before its
attempt is known; it waits for the attempt on CTRL_FD (see :func:`spare`).
Warm: ``python -m gpumesh.sandbox.launcher --zygote CTRL_FD PARENT_PID PRELOAD`` imports PRELOAD once and then
forks one supervisor per attempt that the worker asks for (see :func:`zygote`).

The supervisor makes the task die with its parent (PR_SET_PDEATHSIG), adopts every orphan of the task
(PR_SET_CHILD_SUBREAPER, so a grandchild that called setsid is still found), sets the rlimits, then
forks: the child runs the script in this same interpreter (no second start-up), the parent
supervises. On SIGTERM (the worker's kill, its timeout, or the worker's death) the supervisor sends
TERM to the whole tree, KILL after the grace period, and exits the way the script did.

Standard library only, in one file: it is copied next to the task for another interpreter or user.
Imports stay minimal: in fresh mode this runs once per task attempt.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys

# Names the annotations need, for the type checker only: at run time this module imports socket and json
# where warm mode needs them, never for a fresh attempt. (A plain False, not typing's: typing is no light import.)
TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from typing import Any

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
TASK_DIR_PREFIX = "gpumesh-task-"  # the attempt's directory, made by the worker (sandbox.run)
COPY_DIR_PREFIX = "gpumesh-launcher-"  # a private copy of this file, for a helper in another interpreter


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
            source = f.read()
        exec(compile(source, script, "exec"), main.__dict__)  # the file closed: the task holds only its stdio
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException as exc:  # the script's own error: its traceback is the task's error
        import traceback

        tb = exc.__traceback__
        if tb is not None and tb.tb_frame.f_code is _run_script.__code__:
            tb = tb.tb_next  # this launcher's own frame: the script's start is the first one that matters
        traceback.print_exception(type(exc), exc, tb)
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


def _parent_gone(parent: int) -> bool:
    """Whether the worker (or the zygote) that started this supervisor has died.

    getppid() alone is not enough: when a multithreaded worker is killed, PR_SET_PDEATHSIG fires as
    the thread that started us exits, while its other threads still hold the process. Until the last
    one is gone getppid() is unchanged, but the process's leader thread is already a zombie."""
    if os.getppid() != parent:
        return True
    try:
        with open(f"/proc/{parent}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError):
        return True  # reaped in the meantime
    except (OSError, IndexError):
        return False  # unreadable (/proc mounted hidepid, another user): getppid() is the word


def remove_dir_of(path: str, prefix: str) -> None:
    """Remove the directory that holds ``path``, if it is one gpumesh made (its name starts with ``prefix``)."""
    directory = os.path.dirname(path)
    if os.path.basename(directory).startswith(prefix):
        import shutil

        shutil.rmtree(directory, ignore_errors=True)


def supervise(
    parent: str, script: str, cpu: str, fsize: str, nofile: str, grace: str, uid: str, gid: str,
    *, report: tuple[int, int] | None = None,
) -> int:  # fmt: skip
    """Run one attempt of ``script`` and return its exit code (or die by the signal that killed it).

    ``report`` (warm mode): a socket to send the outcome on, and this supervisor's own stderr. The
    script's tree then holds the attempt's stdout and stderr alone, and the outcome goes out once
    that tree is gone, so the worker does not wait for this process to exit and be reaped."""
    libc = ctypes.CDLL(None, use_errno=True)
    _set_rlimits(int(cpu), int(fsize), int(nofile))
    if uid != "-":  # --sandbox-user: drop root for good before anything of the task runs
        os.setgroups([])
        os.setgid(int(gid))
        os.setuid(int(uid))
    # After the credential change, which clears it: die with the worker.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    # The worker removes the attempt's directory when the attempt ends. Once it (or the zygote) has
    # died, nobody will: this supervisor, the last process of the attempt, removes it itself.
    if _parent_gone(int(parent)):  # the worker died before prctl took effect
        remove_dir_of(script, TASK_DIR_PREFIX)
        return 70
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    # Handlers before the fork: a TERM that lands right after it must still reach the script.
    _take_the_tree_down_on_term(grace)
    status = _wait_for(_fork_script(script, report))
    # The script is gone; nothing it started may outlive it.
    if _has_children():
        _signal_tree(signal.SIGKILL)
    _reap_all()
    orphaned = _parent_gone(int(parent))
    if orphaned:
        remove_dir_of(script, TASK_DIR_PREFIX)
    # As waitpid would tell it of this process: the script's way of ending, or 70. Not when the zygote is
    # gone: then the worker must learn that instead, from its socket closing as this process exits.
    if report is not None and not orphaned:
        # A worker that gave up on the attempt no longer reads; the zygote still reports our exit.
        _reply(report[0], {"pid": os.getpid(), "status": status if status is not None else 70 << 8})
    return _end_like(status)


def _set_rlimits(cpu: int, fsize: int, nofile: int) -> None:
    """No core dumps; the task's CPU seconds, file size and open files (0: the inherited limit), never
    above a hard limit this process was given. RLIMIT_CPU keeps its hard limit: the soft one sends SIGXCPU."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NOFILE, nofile)):
        if value > 0:
            _soft, hard = resource.getrlimit(limit)
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(limit, (value, value if limit != resource.RLIMIT_CPU else hard))


def _take_the_tree_down_on_term(grace: str) -> None:
    """On SIGTERM (the worker's kill, its timeout, or its death): TERM to the whole tree, KILL to
    whatever is left ``grace`` seconds later. SIGINT is the worker's terminal's, not ours."""
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

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _fork_script(script: str, report: tuple[int, int] | None) -> int:
    """Fork the child that runs ``script``; in this process, return its pid.

    In warm mode the script's tree then holds the attempt's stdout and stderr alone: this process
    lets go of its stdout, and its stderr becomes ``report``'s log."""
    import gc

    gc.freeze()  # fewer copy-on-write faults in the child
    child = os.fork()
    if child == 0:
        for fd in report or ():  # the task holds neither the worker's socket nor its log
            os.close(fd)
        _run_script(script)
    if report is not None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
        os.dup2(report[1], 2)  # our own errors still reach the worker's log
        os.close(report[1])
    return child


def _wait_for(child: int) -> int | None:
    """The script's wait status, reaping any orphan that ends first; None if it was never ours to wait for."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return None
        except InterruptedError:
            continue
        if pid == child:
            return status


def _reap_all() -> None:
    """Wait until no process is left below this one (as a subreaper, every orphan of the task is ours)."""
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def _end_like(status: int | None) -> int:
    """End the way the script did: by the same signal, so the worker can name it, or with its exit code (70: unknown)."""
    if status is not None and os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # these two cannot be handled, nor reset
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    return os.WEXITSTATUS(status) if status is not None else 70


def _reply(fd: int, msg: dict[str, Any]) -> None:
    """Tell the worker about one attempt, on the attempt's reply socket: the zygote's {"pid"} or {"error"}, and the
    outcome {"pid", "status"} from the supervisor and from the zygote. A worker that gave up on the attempt has
    closed its end: nobody is left to tell, and nothing else changes."""
    import json  # warm mode only: the zygote imported it before any fork

    try:
        os.write(fd, json.dumps(msg).encode())
    except OSError:
        pass


# -- warm mode ---------------------------------------------------------------------------------------


_WARM_UP = """
import json, os, sys
try:
    payload = json.load(sys.stdin)
except ValueError as exc:
    raise SystemExit(str(exc))
for key, value in sorted(payload.items()):
    print(f"{key}={value!r}", file=sys.stderr)
print(json.dumps({"ok": True, "n": len(payload)}))
"""


def zygote(ctrl_fd: int, parent: int, preload: list[str]) -> None:
    """Import ``preload`` once, then fork a fresh supervisor for each attempt the worker sends.

    The worker talks over ``ctrl_fd``, a SOCK_SEQPACKET socket. Each request is one JSON message
    {script, cwd, env, limits} with four descriptors: a socket for this attempt's replies, and the
    attempt's stdin, stdout and stderr. The zygote hands the request to a spare supervisor it forked
    in advance, answers {"pid"} at once and {"status"} (as from waitpid) when the supervisor ends; the
    supervisor, handed the same reply socket, sends {"pid", "status"} itself first, once the script's tree
    is gone (it may even come before the zygote's {"pid"}).
    The zygote never runs task code and never initialises CUDA;
    it dies with the worker, and its supervisors die with it (each takes its tree down with grace).
    """
    import json
    import socket

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if _parent_gone(parent):
        sys.exit(70)
    ctrl = socket.socket(fileno=ctrl_fd)
    _preload(ctrl, preload)
    forks = _Forks(ctrl)
    ctrl.send(json.dumps({"ready": os.getpid(), "preloaded": preload}).encode())
    forks.serve()


def _preload(ctrl: socket.socket, preload: list[str]) -> None:
    """Import ``preload`` and what every task needs, then freeze it all, to be shared with every fork.
    A failure is told to the worker on ``ctrl`` in one line, and the zygote exits."""
    import json

    for name in preload:
        try:
            __import__(name)
        except BaseException as exc:  # any failure of a user's module is a startup error, said in one line
            ctrl.send(json.dumps({"error": f"--preload {name}: {type(exc).__name__}: {exc}"}).encode())
            sys.exit(2)
    torch = sys.modules.get("torch")
    if torch is not None and getattr(getattr(torch, "cuda", None), "is_initialized", lambda: False)():
        ctrl.send(json.dumps({"error": "--preload initialised CUDA, which a forked task cannot use"}).encode())
        sys.exit(2)
    # The first compile() in a process pays a one-time set-up (~3.5 ms here); pay it once, not per task.
    compile(_WARM_UP, "<warm-up>", "exec")
    # traceback: a task's error path needs it; loaded here, it works even for a --sandbox-user who
    # cannot read the standard library the zygote was started from.
    import gc
    import traceback  # noqa: F401

    gc.collect()
    gc.freeze()  # the preloaded modules stay shared with every task instead of being copied on write


class _Forks:
    """The zygote's loop: a request from the worker goes to the spare supervisor forked for it, and a
    supervisor's end goes to the worker, on that attempt's reply socket.

    SIGCHLD wakes the loop through a pipe (signal.set_wakeup_fd), so one select() waits for both."""

    def __init__(self, ctrl: socket.socket) -> None:
        import selectors

        self.ctrl = ctrl
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda _sig, _frame: None)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker decides when tasks stop
        self.replies: dict[int, socket.socket] = {}  # a running supervisor's pid: its attempt's reply socket
        self.sel = selectors.DefaultSelector()
        self.sel.register(ctrl, selectors.EVENT_READ)
        self.sel.register(self.wake_r, selectors.EVENT_READ)
        self.spare: tuple[int, socket.socket] | None = _fork_spare(self.own())

    def own(self) -> list[int]:
        """The zygote's descriptors, which a forked supervisor closes."""
        return [
            self.sel.fileno(),
            self.ctrl.fileno(),
            self.wake_r,
            self.wake_w,
            *(r.fileno() for r in self.replies.values()),
        ]

    def serve(self) -> None:
        while True:
            for key, _ in self.sel.select():
                if key.fileobj is self.ctrl:
                    self.take_request()
                else:
                    self.reap()

    def take_request(self) -> None:
        """Hand the worker's next request to a spare, tell the worker its pid, and fork the next spare."""
        import socket

        try:
            msg, fds, _flags, _addr = socket.recv_fds(self.ctrl, 1 << 20, 4)
        except InterruptedError:
            return
        if not msg:  # the worker is gone; our supervisors get their death signal as we exit
            os._exit(0)
        reply = socket.socket(fileno=fds[0])
        pid = self.hand_to_spare(msg, fds)
        for fd in fds[1:]:
            os.close(fd)
        # If the worker gave up on this attempt, the status is reaped all the same.
        _reply(reply.fileno(), {"pid": pid} if pid else {"error": "could not fork the attempt"})
        if pid:
            self.replies[pid] = reply
        else:
            reply.close()
        self.spare = _fork_spare(self.own())  # the next attempt's supervisor, forked while this one runs

    def hand_to_spare(self, msg: bytes, fds: list[int]) -> int | None:
        """Send the request and its descriptors to the waiting spare: the pid of the supervisor that took it."""
        import socket

        for _try in range(2):  # a spare that died meanwhile is replaced once
            spare_pid, spare_sock = self.spare or _fork_spare(self.own())
            self.spare = None
            try:
                socket.send_fds(spare_sock, [msg], fds)
                return spare_pid
            except OSError:
                continue
            finally:
                spare_sock.close()
        return None

    def reap(self) -> None:
        """Reap every child that ended; tell the worker the status of each attempt's supervisor."""
        try:
            os.read(self.wake_r, 4096)
        except BlockingIOError:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.spare is not None and pid == self.spare[0]:  # the spare died before its attempt came
                self.spare[1].close()
                self.spare = None
            reply = self.replies.pop(pid, None)
            if reply is not None:
                _reply(reply.fileno(), {"pid": pid, "status": status})
                reply.close()


def spare(ctrl_fd: int, parent: int) -> int:
    """Fresh mode's head start: a new interpreter, started by the worker while the previous attempt
    runs, waits here for its one attempt. The request on ``ctrl_fd`` is the zygote's (one JSON message
    {script, cwd, env, limits}) with one descriptor, the attempt's stdin; stdout and stderr are already
    the worker's pipes. Still a fresh interpreter per attempt, never reused. EOF first: exit quietly."""
    import json
    import socket

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # in the worker's process group until the attempt's setsid
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if _parent_gone(parent):
        return 70
    ctrl = socket.socket(fileno=ctrl_fd)
    msg, fds, _flags, _addr = socket.recv_fds(ctrl, 1 << 20, 1)
    ctrl.close()
    if not msg or len(fds) != 1:
        return 0
    return _become_attempt(json.loads(msg), fds, parent)


def _fork_spare(own: list[int]) -> tuple[int, socket.socket]:
    """Fork the next attempt's supervisor ahead of time; it waits for its request on a socket.

    Forking a process that imported torch costs ~20 ms here: paid while the previous attempt runs,
    not when the next one is asked for. The spare dies with the zygote until it has an attempt."""
    import socket

    zygote_pid = os.getpid()
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid:
        theirs.close()
        return pid, mine
    code = 70
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in own:
            os.close(fd)
        mine.close()
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if _parent_gone(zygote_pid):
            os._exit(70)
        msg, fds, _flags, _addr = socket.recv_fds(theirs, 1 << 20, 4)
        theirs.close()
        if not msg:
            os._exit(0)
        code = _become_attempt(__import__("json").loads(msg), fds[1:], zygote_pid, report=fds[0])
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _become_attempt(req: dict[str, Any], fds: list[int], parent: int, report: int | None = None) -> int:
    """In a spare: take the attempt's session, stdio (``fds``: stdin[, stdout, stderr]), working
    directory and environment, then supervise it. ``parent``: the zygote, or the worker, to die with."""
    os.setsid()
    reporting = (report, os.dup(2)) if report is not None else None  # the zygote's stderr: the worker's log
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    if "tempfile" in sys.modules:  # imported already (by --preload): no cost, and no import the task did not ask for
        import tempfile

        tempfile.tempdir = None  # read TMPDIR again: the task's own directory
    nprandom = sys.modules.get("numpy.random")
    if nprandom is not None:  # Python's random reseeds itself after fork; numpy's global generator does not
        nprandom.seed()
    return supervise(str(parent), req["script"], *map(str, req["limits"]), report=reporting)


def main(argv: list[str]) -> None:
    # Started from a private copy of this file, the interpreter has read it by now: remove the copy, so
    # nothing is left behind even if the worker is killed. Run as a module: nothing to remove.
    remove_dir_of(os.path.abspath(sys.argv[0]), COPY_DIR_PREFIX)
    if argv and argv[0] == "--zygote":
        ctrl_fd, parent, preload = argv[1:]
        zygote(int(ctrl_fd), int(parent), [m for m in preload.split(",") if m])
    elif argv and argv[0] == "--spare":
        sys.exit(spare(int(argv[1]), int(argv[2])))
    else:
        # A fresh attempt starts outside its directory (so the task's files are not on sys.path while
        # this file's imports run) and moves there before the script is forked.
        os.chdir(os.path.dirname(os.path.abspath(argv[1])))
        sys.exit(supervise(*argv))


if __name__ == "__main__":
    main(sys.argv[1:])
