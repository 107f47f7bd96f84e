"""The sandbox's first process, in one of its modes.

Fresh: ``python -m gpumesh.sandbox.launcher PARENT_PID SCRIPT CPU_S FSIZE NOFILE GRACE_S UID GID ISOLATION CGROUP``
runs one attempt: after the script, the attempt's limits, as :data:`LIMITS` names them and in that order (a warm or
spare request carries the same as an object by those names).
Spare: ``python -m gpumesh.sandbox.launcher --spare CTRL_FD PARENT_PID`` is a fresh interpreter started before its
attempt is known; it waits for the attempt on CTRL_FD (see :func:`spare`).
Resident: ``python -m gpumesh.sandbox.launcher --resident CTRL_FD PARENT_PID SCRIPT ...`` is a fresh attempt whose
script's process stays, loaded, and runs one task after another of a job (submit --reuse-process, :func:`_serve_tasks`).
Preloaded: ``python -m gpumesh.sandbox.launcher --preloaded CTRL_FD PARENT_PID DIR/.zygote PRELOAD ...`` is started as a
resident one, but its confined child is a job's preload zygote: it imports PRELOAD from the job's env and forks each
attempt of that job in DIR (:func:`_serve_preloaded`).
Warm: ``python -m gpumesh.sandbox.launcher --zygote CTRL_FD PARENT_PID PRELOAD`` imports PRELOAD once and then
runs the attempts the worker asks for in supervisors it forks ahead, each serving attempt after attempt (see
:func:`zygote`); there the script's process takes its own cgroup, rlimits, user and directory (:func:`_serve_attempts`).

The supervisor makes the task die with its parent (PR_SET_PDEATHSIG), adopts every orphan of the task
(PR_SET_CHILD_SUBREAPER, so a grandchild that called setsid is still found), sets the rlimits, then
forks: the child runs the script in this same interpreter (no second start-up), the parent
supervises. On SIGTERM (the worker's kill, its timeout, or the worker's death) the supervisor sends
TERM to the whole tree, KILL after the grace period, and exits the way the script did.

Standard library only, in one file: it is copied next to the task for another interpreter or user.
Imports stay minimal: in fresh mode this runs once per task attempt.

The file's sections, in order: an attempt's limits, as the worker names them (:data:`LIMITS`); the process tree
below a supervisor; Landlock; seccomp; the attempt's own namespaces; the supervisor, which every mode runs
(:func:`supervise`); reused processes; a job's preload zygote; warm mode (and the spares, which take its requests);
the entry point.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # no stubs: the C functions that signal wraps
import ctypes
import errno
import os
import resource
import signal
import struct
import sys

# Names the annotations need, for the type checker only: at run time this module imports socket and json
# where warm mode needs them, never for a fresh attempt. (A plain False, not typing's: typing is no light import.)
TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from collections.abc import Sequence
    from typing import Any

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
SPARE_DELAY = 0.005  # s: a warm attempt still running this long after it started gets its successor's spare now
TASK_DIR_PREFIX = "gpumesh-task-"  # the attempt's directory, made by the worker (sandbox.run)
COPY_DIR_PREFIX = "gpumesh-launcher-"  # a private copy of this file, for a helper in another interpreter


# -- An attempt's limits, as the worker names them ---------------------------------------------------------
# What the worker tells the launcher of each attempt: a fresh or resident launcher's arguments after PARENT_PID SCRIPT,
# in this order, and a warm or spare request's "limits" object, by these names (gpumesh.sandbox.runner.launcher_limits
# builds both). cpu: RLIMIT_CPU s, fsize: RLIMIT_FSIZE bytes, nofile: RLIMIT_NOFILE (0: the inherited limit); grace: s
# between TERM and KILL; uid, gid: the task's user ("-": this one); isolation: the Landlock rules as JSON ("-": none);
# cgroup: the attempt's cgroup directory ("-": none).
LIMITS = ("cpu", "fsize", "nofile", "grace", "uid", "gid", "isolation", "cgroup")


def limits_of(args: Sequence[str]) -> dict[str, str]:
    """A fresh launcher's arguments after PARENT_PID SCRIPT, by name (isolation and cgroup may be left out)."""
    return {"isolation": "-", "cgroup": "-", **dict(zip(LIMITS, args))}


# -- The process tree below a supervisor ---------------------------------------------------------------------


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


# -- Landlock: the task's view of the host -------------------------------------------------------------
# A small binding of the three Landlock syscalls (Linux 5.13+), applied in the forked script child only: the
# supervisor keeps its own view (its /proc walk, the attempt's directory). The worker decides the rule set
# (gpumesh.sandbox.landlock.rules) and passes it as JSON; this adds the interpreter it runs in. A spare (warm or
# fresh) builds the last attempt's set while it waits, all but the attempt's own directory: the attempt then
# adds that one rule, instead of opening some 60 paths (about 1.5 ms of a no-op attempt here).

LANDLOCK_SYSCALLS = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446), "arm64": (444, 445, 446)}
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
# ABI 6 scopes: no connect to an abstract Unix socket made outside the domain (systemd --user's, D-Bus's, X11's
# @/tmp/.X11-unix), and no signal to a process outside it (its supervisor, the worker).
LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0
LANDLOCK_SCOPE_SIGNAL = 1 << 1
LANDLOCK_SCOPES = LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_TRUNCATE, FS_IOCTL_DEV = 1 << 14, 1 << 15
# ABI 9 (Linux 7.1): connect/sendmsg to a pathname Unix socket made outside the domain needs this right on its path
# (include/uapi/linux/landlock.h, "landlock: Control pathname UNIX domain socket resolution by path", 2026-04).
FS_RESOLVE_UNIX = 1 << 16
UNIX_SOCKETS_ABI = 9  # the first ABI that confines pathname Unix sockets
FS_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV | FS_RESOLVE_UNIX
FS_READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
FS_DEVICE = FS_READ_FILE | FS_WRITE_FILE | FS_IOCTL_DEV  # /dev/null, /dev/nvidia0: opened read-write
# Every right this kernel's ABI knows: ABI 1 has bits 0-12, ABI 2 adds REFER (13), 3 TRUNCATE (14), 5 IOCTL_DEV (15),
# 9 RESOLVE_UNIX (16). A newer ABI than this file knows gets the rights of the newest it knows.
FS_ALL_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1}
FS_ALL_BEFORE_UNIX = (1 << 16) - 1  # ABI 5 to 8
FS_ALL_LATEST = (1 << 17) - 1


def fs_rights(abi: int) -> int:
    """Every filesystem right the kernel's Landlock ABI ``abi`` handles."""
    return FS_ALL_BY_ABI.get(abi, FS_ALL_BEFORE_UNIX if abi < UNIX_SOCKETS_ABI else FS_ALL_LATEST)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where there is none (not Linux, an old kernel, disabled at boot)."""
    nrs = LANDLOCK_SYSCALLS.get(os.uname().machine)
    if not sys.platform.startswith("linux") or nrs is None:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = int(
        libc.syscall(ctypes.c_long(nrs[0]), None, ctypes.c_size_t(0), ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    )
    return max(abi, 0)


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _Ruleset(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]  # fmt: skip


# What this interpreter reads to run, each with its real path, and the sys.path they were read from:
# resolved once (~150 stat calls) in the zygote, whose spares inherit it, not again for every attempt.
_INTERPRETER: tuple[tuple[str, ...], list[tuple[str, str]], list[tuple[str, str]]] | None = None


def _interpreter_paths() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(path, real path) of this interpreter's executable and installation, and of its sys.path's entries."""
    global _INTERPRETER
    key = (sys.executable, *sys.path)
    if _INTERPRETER is None or _INTERPRETER[0] != key:
        exe = os.path.realpath(sys.executable)
        base = [exe, os.path.dirname(exe), sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
        if __package__ == "gpumesh.sandbox":  # run as a module: gpumesh itself (an editable checkout's package too)
            base.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        entries = [(e, os.path.realpath(e)) for e in sys.path if e and os.path.isabs(e)]
        _INTERPRETER = (key, [(p, os.path.realpath(p)) for p in base], entries)
    return _INTERPRETER[1], _INTERPRETER[2]


def _python_paths(script_dir: str | None) -> list[str]:
    """What this interpreter reads to run: its executable, its installation, the entries of its sys.path
    (never the script's own directory, ``script_dir``, which the rules grant as the attempt's)."""
    base, entries = _interpreter_paths()
    skip = ("/", os.path.realpath(script_dir) if script_dir else "/")
    # site-packages, an editable checkout; never "/" (python -m puts the cwd there)
    return [p for p, _ in base] + [e for e, real in entries if real not in skip]


def _python_path_ids() -> frozenset[tuple[int, int]]:
    """(device, inode) of each of :func:`_python_paths` (None) there is: what a script's directory must be none of."""
    base, entries = _interpreter_paths()
    ids = set()
    for real in [real for _, real in base] + [real for _, real in entries if real != "/"]:
        try:
            st = os.stat(real)
        except OSError:
            continue
        ids.add((st.st_dev, st.st_ino))
    return frozenset(ids)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


# The array type made once, here: made in each script's process, as it drops its capabilities, a new ctypes type
# costs a forked child ~60 page faults.
_CapDataV3 = _CapData * 2


def drop_capabilities() -> None:
    """A task that runs as root (a root worker without --sandbox-user) keeps uid 0 but no capability: with
    one (CAP_DAC_OVERRIDE, CAP_SYS_PTRACE...) it could still read /proc/<worker>/environ under Landlock."""
    _, libc = _syscall()
    drop_bounding_set()
    libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    if libc.capset(ctypes.byref(_CapHeader(0x20080522, 0)), ctypes.byref(_CapDataV3())) != 0:  # v3: all zero
        raise OSError(ctypes.get_errno(), "capset")


_BOUNDING_DROPPED = False  # this process's bounding set is empty already (a warm spare empties it ahead)


def drop_bounding_set() -> None:
    """Empty the bounding set, so that nothing this process runs gets a capability back at execve (uid 0
    gains its permitted set there). Harmless to the process itself: its own capabilities stay until
    :func:`drop_capabilities`. About 64 prctl calls: a warm spare makes them before its attempt comes."""
    global _BOUNDING_DROPPED
    if _BOUNDING_DROPPED:
        return
    prctl = _syscall()[1].prctl
    for cap in range(64):
        if prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP; EINVAL past the last capability
            break
    _BOUNDING_DROPPED = True


_LIBC: Any = None  # libc through ctypes, loaded once per process (a warm zygote's forks inherit it)


def _syscall() -> tuple[Any, Any]:
    """libc's syscall() (returning a long) and libc itself, made once: a new CDLL per attempt costs more than
    the rules it adds."""
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.syscall.restype = ctypes.c_long
        _LIBC.prctl, _LIBC.capset  # noqa: B018 - looked up once (CDLL keeps them): not in each forked child
    return _LIBC.syscall, _LIBC


def _is_dir(mode: int) -> bool:
    return (mode & 0o170000) == 0o040000  # stat.S_ISDIR, without importing stat


def build_ruleset(rules: dict[str, Any], script_dir: str | None) -> int:
    """A Landlock rule set (its descriptor) of what ``rules`` grants of the system (its programs and libraries,
    this interpreter, /etc's few files, the devices, /dev/shm): nothing a task's user could change, so a spare
    may build it ahead, as root, before its attempt is known. :func:`add_attempt_rules` adds the rest."""
    abi = int(rules["abi"])
    handled = fs_rights(abi)
    syscall, _libc = _syscall()
    attr = _Ruleset(handled, 0, LANDLOCK_SCOPES if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24  # the struct as this ABI knows it
    create = LANDLOCK_SYSCALLS[os.uname().machine][0]
    ruleset = int(syscall(ctypes.c_long(create), ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    try:
        _grant(ruleset, handled, ((rules["read"], FS_READ), (_python_paths(script_dir), FS_READ),
                                  (rules["write"], handled), (rules["devices"], FS_DEVICE)))  # fmt: skip
    except BaseException:
        os.close(ruleset)
        raise
    return ruleset


def add_attempt_rules(ruleset: int, rules: dict[str, Any]) -> None:
    """Grant what is the attempt's own or its owner's to share: the paths the worker's owner added
    (``--read-path``, ``--write-path``) and the attempt's directory (its files, TMPDIR, GPUMESH_OUTPUT_DIR).
    Called as the task's user: a path here is never resolved with more privilege than the task has."""
    handled = fs_rights(int(rules["abi"]))
    attempt = [rules["attempt"]] if rules.get("attempt") else []
    project = [rules["project"]] if rules.get("project") else []  # its project's tree: read only
    env = [rules["env"]] if rules.get("env") else []  # its environment (gpumesh.envs): read only, never written
    _grant(ruleset, handled, ((rules.get("owner_read", ()), FS_READ), (rules.get("owner_write", ()), handled),
                              (attempt, handled), (project, FS_READ), (env, FS_READ)))  # fmt: skip


def _grant(ruleset: int, handled: int, lists: Any) -> None:
    """Each path of ``lists`` ((paths, rights) pairs) once, with every right any of its lists grants it (the
    Python paths repeat each other). The kernel merges the rights of rules on one path across calls."""
    grants: dict[str, int] = {}
    for paths, access in lists:
        for path in paths:
            grants[path] = grants.get(path, 0) | access
    # One rule struct and one call set up for all: a warm supervisor builds ~60 rules for every attempt.
    rule = _PathBeneath()
    args = (ctypes.c_long(LANDLOCK_SYSCALLS[os.uname().machine][1]), ruleset, LANDLOCK_RULE_PATH_BENEATH,
            ctypes.byref(rule), 0)  # fmt: skip
    syscall = _syscall()[0]
    for path, access in grants.items():
        # Each path granted ``access`` beneath it (a file: its file rights only); one not on this machine is skipped.
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            rule.allowed_access = access & handled & (-1 if _is_dir(os.fstat(fd).st_mode) else FS_FILE_RIGHTS)
            rule.parent_fd = fd
            if syscall(*args) < 0:
                raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
        finally:
            os.close(fd)


def restrict_to(ruleset: int, drop: bool = False) -> None:
    """Confine this process, and all it starts, to ``ruleset``: without capabilities (uid 0, or ``drop``: those of
    a user namespace of its own) and never to gain a privilege again (no_new_privs: setuid and file capabilities do
    nothing at execve)."""
    syscall, libc = _syscall()
    if drop or os.geteuid() == 0:
        drop_capabilities()
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    restrict = LANDLOCK_SYSCALLS[os.uname().machine][2]
    if syscall(ctypes.c_long(restrict), ruleset, ctypes.c_uint32(0)) < 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")


# -- seccomp: the system calls a task never needs -------------------------------------------------------
# A seccomp filter for the task's process: the few system calls a task never needs and an attacker uses.
#
# Installed last, after the attempt's namespaces and Landlock (gpumesh.sandbox.launcher), in the process that becomes
# the task; everything the task starts inherits it. It refuses:
#
# - ``keyctl``, ``add_key``, ``request_key`` (EPERM): /proc/keys names the keyrings of the task's user, and linking
#   one into its own session keyring (KEYCTL_LINK) read the user's keys even from a namespace of its own;
# - ``unshare``, ``setns`` and ``clone`` with a CLONE_NEW* flag (EPERM): a task makes no namespace (a user namespace
#   of its own gives back every capability inside it);
# - ``clone3`` (ENOSYS): its flags are behind a pointer a filter cannot read; glibc then falls back to ``clone``
#   for threads and subprocesses, as under Docker's default profile, which refuses the same calls.
#
# A classic BPF program assembled here (no libseccomp): it checks the architecture the call was made for (x86_64 or
# aarch64; a 32-bit or x32 call on x86_64 kills the process, since its numbers differ) and the call's number.

PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000
X32_SYSCALL_BIT = 0x40000000
# every CLONE_NEW* flag clone() takes (CLONE_NEWTIME shares its bit with clone's exit signal: unshare only)
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

# machine -> (AUDIT_ARCH_*, {name: number})
ARCHES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (0xC000003E, {"keyctl": 250, "add_key": 248, "request_key": 249, "unshare": 272, "setns": 308,
                            "clone": 56, "clone3": 435, "mq_open": 240}),
    "aarch64": (0xC00000B7, {"keyctl": 219, "add_key": 217, "request_key": 218, "unshare": 97, "setns": 268,
                             "clone": 220, "clone3": 435, "mq_open": 180}),
}  # fmt: skip
REFUSED = ("keyctl", "add_key", "request_key", "unshare", "setns")  # EPERM; clone3 ENOSYS; clone by its flags
# An attempt a job's preload zygote forks shares the zygote's IPC namespace (it cannot make one: unshare is refused),
# and the zygote cannot empty its POSIX message queues between attempts (their file system cannot be mounted
# where it runs), as it empties /dev/shm and SysV IPC: so such an attempt may not open one (EPERM), and no queue is
# left for the job's next task. A second filter, stacked on the zygote's.
PRELOADED_REFUSED = ("mq_open",)

# classic BPF opcodes
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
# offsets in struct seccomp_data: nr (u32), arch (u32), instruction_pointer (u64), args[6] (u64 each)
_NR, _ARCH, _ARG0_LOW = 0, 4, 16  # args[0]'s low word on a little-endian machine (both above are)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def seccomp_described() -> str:
    """What the filter refuses, in a line (for doctor and the docs)."""
    return (
        "keyctl, add_key, request_key, unshare, setns and clone with CLONE_NEW* flags (EPERM); "
        "clone3 (ENOSYS: threads and subprocesses use clone)"
    )


def seccomp_program(machine: str) -> bytes:
    """The filter for ``machine`` (os.uname().machine), as the kernel reads it: 8-byte sock_filter rows."""
    arch, nr = ARCHES[machine]
    # (code, jump-if-true label, jump-if-false label, k); a label is a row's name, None: the next row
    rows: list[tuple[str | None, int, str | None, str | None, int]] = [
        (None, _LD_W_ABS, None, None, _ARCH),
        (None, _JEQ_K, None, "kill", arch),
        (None, _LD_W_ABS, None, None, _NR),
    ]
    if machine == "x86_64":
        rows.append((None, _JGE_K, "kill", None, X32_SYSCALL_BIT))
    rows += [(None, _JEQ_K, "eperm", None, nr[name]) for name in REFUSED]
    rows += [
        (None, _JEQ_K, "enosys", None, nr["clone3"]),
        (None, _JEQ_K, None, "allow", nr["clone"]),
        (None, _LD_W_ABS, None, None, _ARG0_LOW),
        (None, _JSET_K, "eperm", "allow", CLONE_NEW_FLAGS),
        ("allow", _RET_K, None, None, SECCOMP_RET_ALLOW),
        ("eperm", _RET_K, None, None, SECCOMP_RET_ERRNO | errno.EPERM),
        ("enosys", _RET_K, None, None, SECCOMP_RET_ERRNO | errno.ENOSYS),
        ("kill", _RET_K, None, None, SECCOMP_RET_KILL_PROCESS),
    ]
    return _assemble(rows)


def seccomp_refusing(machine: str, names: Sequence[str]) -> bytes:
    """A filter for ``machine`` that refuses ``names`` (EPERM) and lets every other call through: one stacked on the
    task's filter (which already kills a call made for another architecture)."""
    arch, nr = ARCHES[machine]
    rows: list[tuple[str | None, int, str | None, str | None, int]] = [
        (None, _LD_W_ABS, None, None, _ARCH),
        (None, _JEQ_K, None, "allow", arch),
        (None, _LD_W_ABS, None, None, _NR),
    ]
    rows += [(None, _JEQ_K, "eperm", None, nr[name]) for name in names]
    rows += [
        ("allow", _RET_K, None, None, SECCOMP_RET_ALLOW),
        ("eperm", _RET_K, None, None, SECCOMP_RET_ERRNO | errno.EPERM),
    ]
    return _assemble(rows)


def _assemble(rows: list[tuple[str | None, int, str | None, str | None, int]]) -> bytes:
    """BPF rows (label, code, jump-if-true label, jump-if-false label, k) as the kernel reads them."""
    at = {label: i for i, (label, *_rest) in enumerate(rows) if label}
    out = []
    for i, (_label, code, jt, jf, k) in enumerate(rows):
        t = at[jt] - i - 1 if jt else 0
        f = at[jf] - i - 1 if jf else 0
        out.append(struct.pack("=HBBI", code, t, f, k))
    return b"".join(out)


_PROGRAM: dict[str, ctypes.Array[ctypes.c_char]] = {}  # built once per process (a warm zygote's forks inherit it)


def prepare_seccomp() -> bool:
    """Build this machine's filter ahead (a warm zygote does, so its attempts do not); False where there is none."""
    machine = os.uname().machine
    if machine not in ARCHES:
        return False
    if machine not in _PROGRAM:
        code = seccomp_program(machine)
        _PROGRAM[machine] = ctypes.create_string_buffer(code, len(code))
    return True


def install_seccomp(libc: ctypes.CDLL, code: bytes | None = None) -> None:
    """Filter this process and all it starts (``code``: that filter, else the task's). Needs no_new_privs set already
    (Landlock's restrict sets it). Raises OSError where the kernel refuses, or where this machine's architecture has
    no filter here."""
    machine = os.uname().machine
    if not prepare_seccomp():
        raise OSError(errno.ENOSYS, f"no seccomp filter for {machine}")
    buf = _PROGRAM[machine] if code is None else ctypes.create_string_buffer(code, len(code))
    prog = _SockFprog(len(buf.raw) // 8, ctypes.addressof(buf))
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


ATTEMPTS_OWN = (
    "attempt",
    "owner_read",
    "owner_write",
    "shm",
    "project",
    "env",
)  # what of the rules is each attempt's own

# A warm spare's rule set, built before its attempt came (:func:`prepare_landlock`): the rules it was built
# from, without the attempt's directory, and its descriptor.
_PREPARED: tuple[dict[str, Any], int, frozenset[tuple[int, int]]] | None = None


def prepare_landlock(isolation: str) -> None:
    """In a spare, before its attempt comes: build the system's part of ``isolation`` (the last attempt's rules,
    which every attempt of a worker shares), so that the attempt only adds its directory and its owner's
    paths. Nothing here is final: :func:`take_prepared` uses it only for the very same system rules."""
    global _PREPARED
    if isolation == "-":
        return
    import json

    try:
        rules = json.loads(isolation)
        for attempts_own in ATTEMPTS_OWN:
            rules.pop(attempts_own, None)
        python = _python_path_ids()
        _PREPARED = (rules, build_ruleset(rules, None), python)
    except (OSError, ValueError, KeyError, TypeError):
        _PREPARED = None  # built at the attempt instead, where an error stops it
    if os.geteuid() == 0:
        drop_bounding_set()


def take_prepared(rules: dict[str, Any] | None, script_dir: str) -> int | None:
    """The prepared rule set with the attempt's directory and its owner's paths added (as the task's user: call
    it once the supervisor has dropped root), if it was built from these ``rules``; else None (the script's
    child builds its own). Any prepared set not taken is closed."""
    global _PREPARED
    prepared, _PREPARED = _PREPARED, None
    if prepared is None:
        return None
    built_from, ruleset, python = prepared
    static = {k: v for k, v in (rules or {}).items() if k not in ATTEMPTS_OWN}
    if rules is None or static != built_from:
        os.close(ruleset)
        return None
    try:
        # The interpreter's paths were taken without the script's directory excluded: only if it is none of them
        # (the very directory, by device and inode, as a real path names it).
        st = os.stat(script_dir)
        if (st.st_dev, st.st_ino) in python:
            os.close(ruleset)
            return None
        add_attempt_rules(ruleset, rules)
    except OSError:
        os.close(ruleset)
        return None
    return ruleset


# -- The attempt's own namespaces: IPC, /dev/shm, keyring, caches ------------------------------------------
# Made in the script's process, per attempt (a warm supervisor's children each make their own), as the task's user:
# a user namespace (which needs no privilege, where the kernel lets users make one) owning a mount and an IPC
# namespace. The attempt then has its own SysV segments, semaphores and message queues, a tmpfs of its own on
# /dev/shm (POSIX shared memory), a session keyring of its own (and, in its user namespace, a user keyring of its
# own), and each --cache-path as an overlay whose writes go to the attempt's directory. All of it goes when the
# attempt's last process does. The capabilities the new user namespace gives are dropped before the task runs.
# With a memory cap, the IPC namespace's SysV limits (kernel.shmmax, shmall) are the cap: a segment touched and
# detached is in no process's RSS, which is what the worker counts. Linux lets only the root of the user namespace
# that owns an IPC namespace write them, so the IPC namespace is made in a first user namespace where the task's
# user is root (0 -> its uid), the limits written, and the mount namespace in a second one inside it that maps
# the user back to itself (uid -> 0 -> uid): the task sees its own uid, as before.

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 1 << 14, 1 << 18
PR_GET_DUMPABLE, PR_SET_DUMPABLE = 3, 4
KEYCTL_SYSCALL = {"x86_64": 250, "aarch64": 219, "arm64": 219}
KEYCTL_JOIN_SESSION_KEYRING = 1
SHM = "/dev/shm"
CACHE_DIR_PREFIX = ".gpumesh-cache-"  # in the attempt's directory: a cache overlay's writes (upper) and work dirs


def enter_namespaces(private: dict[str, Any], shm_bytes: int, attempt_dir: str | None) -> list[str]:
    """Move this process into namespaces of its own (see above): ``private["caches"]``, the paths to lay an overlay
    on (their writes kept in ``attempt_dir``); ``shm_bytes``, the size of /dev/shm's tmpfs (0: the kernel's default,
    half the RAM). Returns the paths now the attempt's own to write (/dev/shm and the caches), which its Landlock
    rules must name from inside the new mount namespace. Raises OSError where the kernel refuses any step."""
    syscall, libc = _syscall()
    uid, gid = os.getuid(), os.getgid()
    # /proc/self/{uid,gid}_map belong to root while this process is not dumpable (after a change of user): dumpable
    # while it writes them, then as it was.
    dumpable = libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0)
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    try:
        if shm_bytes > 0:
            _unshare_mapped(CLONE_NEWUSER | CLONE_NEWIPC, f"0 {uid} 1", f"0 {gid} 1")
            pages = max(1, shm_bytes // os.sysconf("SC_PAGE_SIZE"))
            for name, value in (("shmmax", shm_bytes), ("shmall", pages)):
                with open(f"/proc/sys/kernel/{name}", "w") as f:
                    f.write(str(value))
            _unshare_mapped(CLONE_NEWUSER | CLONE_NEWNS, f"{uid} 0 1", f"{gid} 0 1")
        else:
            _unshare_mapped(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWIPC, f"{uid} {uid} 1", f"{gid} {gid} 1")
    finally:
        libc.prctl(PR_SET_DUMPABLE, max(dumpable, 0), 0, 0, 0)
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)  # nothing mounted here reaches the host's namespace
    own = []
    if os.path.isdir(SHM):
        size = f"size={shm_bytes}," if shm_bytes > 0 else ""
        _mount("tmpfs", SHM, "tmpfs", MS_NOSUID | MS_NODEV, f"{size}mode=1777")
        own.append(SHM)
    for i, path in enumerate(private.get("caches") or ()):
        try:
            if attempt_dir is None or not _is_dir(os.stat(path).st_mode):
                continue
        except FileNotFoundError:  # gone since the worker started: the task finds nothing there
            continue
        base = os.path.join(attempt_dir, f"{CACHE_DIR_PREFIX}{i}")
        upper, work = os.path.join(base, "upper"), os.path.join(base, "work")
        os.makedirs(upper, 0o700)
        os.mkdir(work, 0o700)
        _mount("overlay", path, "overlay", MS_NOSUID | MS_NODEV, f"lowerdir={path},upperdir={upper},workdir={work}")
        own.append(path)
    keyctl = KEYCTL_SYSCALL.get(os.uname().machine)
    if keyctl is not None and syscall(ctypes.c_long(keyctl), KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        raise OSError(ctypes.get_errno(), "keyctl(KEYCTL_JOIN_SESSION_KEYRING)")
    return own


def _unshare_mapped(flags: int, uid_map: str, gid_map: str) -> None:
    """unshare(``flags``, a new user namespace among them) and map this process's user and group in it."""
    libc = _syscall()[1]
    if libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), f"unshare({flags:#x})")
    for name, text in (("setgroups", "deny"), ("uid_map", uid_map), ("gid_map", gid_map)):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    libc = _syscall()[1]
    args = [None if v is None else os.fsencode(v) for v in (source, target, fstype)]
    if libc.mount(*args, ctypes.c_ulong(flags), None if data is None else os.fsencode(data)) != 0:
        raise OSError(ctypes.get_errno(), f"mount {fstype or 'MS_PRIVATE'} on {target}")


def private_namespaces_probe(uid: int, gid: int, caches: Sequence[str] = ()) -> str:
    """Whether an attempt can have namespaces of its own here, as the user ``uid`` (-1: this process's), with an
    overlay on each of ``caches``: "" if so, else why not. Run in a process of its own (it changes this one's
    namespaces and user)."""
    import shutil
    import tempfile

    attempt = None
    try:
        if uid >= 0 and uid != os.getuid():
            _become_user(str(uid), str(gid))
        for path in caches:  # overlayfs lays a lower dir the user cannot read: the task would find it closed
            if not os.access(path, os.R_OK | os.X_OK):
                raise OSError(errno.EACCES, "no access", path)
        attempt = tempfile.mkdtemp(prefix=TASK_DIR_PREFIX + "probe-") if caches else None
        enter_namespaces({"caches": list(caches)}, 1 << 20, attempt)
    except OSError as exc:
        return f"{exc.filename or exc.strerror}: {os.strerror(exc.errno)}" if exc.errno else str(exc)
    finally:
        if attempt is not None:
            shutil.rmtree(attempt, ignore_errors=True)  # its overlay's work dir stays 000 only while mounted
    return ""


# -- The supervisor: the script's process forked, its tree supervised (every mode) ------------------------------


def _run_script(
    script: str, rules: dict[str, Any] | None, ruleset: int | None = None, compiled: Any = None,
    serve: int | None = None, preload: list[str] | None = None,
) -> None:  # fmt: skip
    """In the forked child: confine itself (``rules``: Landlock's, or None; ``ruleset``: those rules built
    already, by a warm spare), become the script's ``__main__`` and exit with its code. ``compiled``: the script
    compiled already (by a warm supervisor, :func:`_compiled`); None: read and compile the file here.
    ``serve``: a reused process's socket (submit --reuse-process): confined the same way, it then loads the
    script once and calls its ``main(payload)`` for each task the worker sends (:func:`_serve_tasks`); with
    ``preload`` it is a job's preload zygote instead, which imports those modules and forks each attempt of the
    job (:func:`_serve_preloaded`).

    Plain compile + exec rather than runpy: in a freshly forked child runpy's imports cost ~7 ms a task."""
    _default_handlers()
    own: list[str] = []
    if rules is not None:
        try:
            if rules.get("private") is not None:  # before any rule is built: they name this namespace's paths
                own = enter_namespaces(rules["private"], int(rules.get("shm") or 0), rules.get("attempt"))
            if ruleset is None:
                ruleset = build_ruleset(rules, os.path.dirname(script))
                add_attempt_rules(ruleset, rules)
            handled = fs_rights(int(rules["abi"]))
            _grant(ruleset, handled, ((own, handled),))
            restrict_to(ruleset, drop=rules.get("private") is not None)
            os.close(ruleset)  # the task holds nothing of its confinement
            if prepare_seccomp():  # last: the namespaces above needed unshare and keyctl
                install_seccomp(_syscall()[1])
        except OSError as exc:  # never run a task less isolated than the worker said it would be
            print(f"gpumesh: the task's isolation could not be applied ({exc}); it did not run", file=sys.stderr)
            os._exit(70)
    env_site = os.environ.get("GPUMESH_ENV_SITE")
    if env_site:  # an environment's packages, their .pth files run here: confined, as the task is (gpumesh.envs)
        import site

        site.addsitedir(env_site)
    if serve is not None and preload is not None:
        if not getattr(sys.flags, "safe_path", False):
            del sys.path[0]  # the launcher copy's directory, gone: each attempt puts its script's first
        _exit_flushed(_serve_preloaded(serve, preload, own))
    _exec_script(script, compiled, serve)


def _exec_script(script: str, compiled: Any = None, serve: int | None = None, insert: bool = False) -> None:
    """Become the script's ``__main__`` (confined already) and exit with its code; ``insert``: its directory goes
    first on sys.path (else it takes the place of the launcher's own, as python does for a script)."""
    sys.argv = [script]
    if insert or getattr(sys.flags, "safe_path", False):  # -P (-m, the worker's own Python): no entry of a dir yet
        sys.path.insert(0, os.path.dirname(script))
    else:  # the launcher's private copy's directory
        sys.path[0] = os.path.dirname(script)
    project = os.environ.get("GPUMESH_PROJECT_DIR")
    if project and project != sys.path[0]:  # a script in a folder of its project: the project's top comes first
        sys.path.insert(0, project)
    if serve is not None:
        _exit_flushed(_serve_tasks(serve, script))
    main = type(sys)("__main__")
    main.__file__ = script
    sys.modules["__main__"] = main
    code = 0
    try:
        if compiled is None:
            with open(script, "rb") as f:
                source = f.read()
            # dont_inherit: not this file's own `from __future__ import annotations`, which would change the task's
            compiled = compile(source, script, "exec", dont_inherit=True)  # the file closed: it holds only its stdio
        exec(compiled, main.__dict__)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException as exc:  # the script's own error: its traceback is the task's error
        import traceback

        tb = exc.__traceback__
        if tb is not None and tb.tb_frame.f_code is _exec_script.__code__:
            tb = tb.tb_next  # this launcher's own frame: the script's start is the first one that matters
        traceback.print_exception(type(exc), exc, tb)
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _default_handlers() -> None:
    """The script's process: SIGTERM, SIGALRM and SIGINT back to their defaults (a supervisor's handlers are not the
    task's). Through _signal, the C module under signal: signal.signal makes an enum of the handler it replaces,
    and for a supervisor's bound method that means raising and formatting a ValueError, some 80 page faults in a
    forked child."""
    for sig in _HANDLED:
        _signal.signal(sig, _signal.SIG_DFL)


# Bytes: a warm request carries the script's source when the whole message fits. The supervisor compiles it outside
# the task's limits (a 128 KiB script of f-strings took 1.3 s): kept small, as task scripts are.
SOURCE_INLINE_MAX = 32 * 1024
_CODE: tuple[str, Any] | None = None  # a warm supervisor's last script: (source, code)
_UNNAMED = "<gpumesh-task>"  # what the supervisor compiles a script as: a name that is no path


def _compiled(source: str | None, script: str) -> Any:
    """The code of ``source`` (the script's text, which the worker wrote to ``script``) in a warm supervisor, for the
    script's process it forks: compiled once while attempts bring the same source, and named for each attempt's
    own file. None (the script's process compiles the file itself, as the task's user and confined, where an error
    or a warning is the task's to see) when there is no source, it declares an encoding, or it does not compile
    without a warning.

    Compiled as no file: Python reads the file a code's name names to show a syntax error's or a warning's line, and
    this process (root, unconfined) never reads what a task's user could have put in that file's place."""
    import warnings  # warm mode only: imported before any fork

    global _CODE
    if source is None or _declares_encoding(source):
        _CODE = None  # nothing of another job's script left for this one's process to find
        return None
    if _CODE is None or _CODE[0] != source:
        _CODE = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a SyntaxWarning: the task's own compile shows it, on its stderr
                _CODE = (source, compile(source, _UNNAMED, "exec", dont_inherit=True))
        except Exception:  # noqa: BLE001 - the script's own error (syntax, a null byte): raised again in the task
            return None
    return _renamed(_CODE[1], script)


def _declares_encoding(source: str) -> bool:
    """Whether ``source`` starts with a BOM or has a coding declaration (PEP 263) in its first two lines: compiling
    the text ignores it where compiling the file obeys it, so such a script's own process compiles its file."""
    if source.startswith("\ufeff"):
        return True
    for line in source.split("\n", 2)[:2]:
        text = line.lstrip(" \t\f")
        if text.startswith("#") and ("coding:" in text or "coding=" in text):
            return True
    return False


def _renamed(code: Any, filename: str) -> Any:
    """``code`` and the code objects nested in it (functions, classes, comprehensions), named for ``filename``."""
    consts = tuple(_renamed(c, filename) if isinstance(c, type(code)) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def _end_what_it_left() -> None:
    """Once the script's process is gone: nothing it started may outlive it (none left: nothing to reap either)."""
    if _has_children():
        _signal_tree(signal.SIGKILL)
        _reap_all()


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


def _in_cgroup(path: str) -> bool:
    """Whether this process is a member of the cgroup ``path`` itself (not of a child of it)."""
    with open(os.path.join(path, "cgroup.procs")) as f:
        return str(os.getpid()) in f.read().split()


def _join(path: str) -> None:
    """Move this process into the cgroup ``path``; OSError where the kernel refuses."""
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write("0")


def _join_ahead(path: str) -> str | None:
    """A spare, before its attempt comes: move into ``path``, the cgroup the worker made for the attempt it
    will most likely be handed (its supervisor joins the right one itself, checking, if that is another).
    Returns ``path`` once this process is in it, else None."""
    if path != "-":
        try:
            _join(path)
            return path
        except OSError:
            pass
    return None


def supervise(
    parent: str,
    script: str,
    limits: dict[str, str],
    *,
    cwd: str | None = None,
    serve: int | None = None,
    preload: list[str] | None = None,
) -> int:
    """Run one attempt of ``script`` (fresh mode: a new interpreter per attempt) and return its exit code (or die
    by the signal that killed it). A warm attempt's supervisor is :func:`_serve_attempts`.

    ``limits``: by the names of :data:`LIMITS`; its ``isolation`` is the Landlock rule set (JSON, from
    gpumesh.sandbox.landlock) the script runs under, or "-", and its ``cgroup`` the attempt's cgroup directory (or
    "-"), joined before anything of the task starts.
    ``cwd``: the attempt's directory (default: the script's), entered only once root is dropped.
    ``serve``: a reused process's socket (``--resident``): the child serves task after task on it; with
    ``preload`` (``--preloaded``) the child is a job's preload zygote (:func:`_serve_preloaded`)."""
    libc = _syscall()[1]
    why = _enter(limits, cwd or os.path.dirname(script))
    if why is not None:  # the worker said the attempt runs in it: never run it outside
        print(f"gpumesh: {why}; the task did not run", file=sys.stderr)
        return 70
    rules = None
    if limits["isolation"] != "-":
        import json

        rules = json.loads(limits["isolation"])
    ruleset = take_prepared(rules, os.path.dirname(script))  # a spare's, built before the attempt came
    # After the credential change, which clears it: die with the worker.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    # The worker removes the attempt's directory when the attempt ends. Once it (or the zygote) has
    # died, nobody will: this supervisor, the last process of the attempt, removes it itself.
    if _parent_gone(int(parent)):  # the worker died before prctl took effect
        remove_dir_of(script, TASK_DIR_PREFIX)
        return 70
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    # Handlers before the fork: a TERM that lands right after it must still reach the script.
    _OnTerm(limits["grace"])
    status = _wait_for(_fork_script(script, rules, ruleset, serve, preload))
    _end_what_it_left()
    if _parent_gone(int(parent)):
        remove_dir_of(script, TASK_DIR_PREFIX)
    return _end_like(status)


def _enter(limits: dict[str, str], cwd: str, join: bool = True) -> str | None:
    """Put this process where the attempt runs, in this order: into its cgroup (``limits["cgroup"]``, or "-"; not
    unless ``join``), under its rlimits, as its user (root dropped for good), into its directory (only once root is
    dropped: no path in it is ever resolved with more privilege). Returns why not, when the cgroup could not be
    joined (then nothing else was done)."""
    cgroup = limits["cgroup"] if join else "-"
    if cgroup != "-":
        try:  # this process; all it starts is born in the attempt's cgroup
            if not _in_cgroup(cgroup):  # a process moved there ahead (or born there) is in it already
                _join(cgroup)
        except OSError as exc:
            return f"could not join the attempt's cgroup ({exc})"
    _set_rlimits(int(limits["cpu"]), int(limits["fsize"]), int(limits["nofile"]))
    if limits["uid"] != "-":  # --sandbox-user: drop root for good before anything of the task runs
        _become_user(limits["uid"], limits["gid"])
    os.chdir(cwd)
    return None


def _become_user(uid: str, gid: str) -> None:
    """Become the task's user for good: no supplementary groups, its group, its uid."""
    os.setgroups([])
    os.setgid(int(gid))
    os.setuid(int(uid))


def _set_rlimits(cpu: int, fsize: int, nofile: int) -> None:
    """No core dumps; the task's CPU seconds, file size and open files (0: the inherited limit), never
    above a hard limit this process was given. RLIMIT_CPU keeps its hard limit: the soft one sends SIGXCPU."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NOFILE, nofile)):
        if value > 0:
            _soft, hard = resource.getrlimit(limit)
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(limit, (value, value if limit != resource.RLIMIT_CPU else hard))


_HANDLED = (signal.SIGTERM, signal.SIGALRM, signal.SIGINT)  # what a supervisor handles (_OnTerm), a script never


class _OnTerm:
    """A supervisor's SIGTERM (the worker's kill, its timeout, or its death): TERM to the whole tree, KILL to
    whatever is left ``grace`` seconds later. SIGINT is the worker's terminal's, not ours. Installed on creation;
    ``terminating``: a TERM came (a warm supervisor then ends with its attempt instead of serving another)."""

    def __init__(self, grace: str) -> None:
        self.grace = grace
        self.terminating = False
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGALRM, self._on_alarm)
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _on_term(self, _sig: int, _frame: object) -> None:
        if self.terminating:  # the worker's TERM and its death signal may both arrive
            return
        self.terminating = True
        _signal_tree(signal.SIGTERM)
        signal.alarm(max(1, int(float(self.grace))))

    def _on_alarm(self, _sig: int, _frame: object) -> None:
        _signal_tree(signal.SIGKILL)


def _fork_script(
    script: str,
    rules: dict[str, Any] | None,
    ruleset: int | None = None,
    serve: int | None = None,
    preload: list[str] | None = None,
) -> int:
    """Fork the child that runs ``script``; in this process, return its pid. ``serve``: a reused process's
    socket, the child's alone from here (its end tells the worker the process is gone); this process then holds
    no task's stdio either, so each task's pipes end when the child lets go of them."""
    import gc

    gc.freeze()  # fewer copy-on-write faults in the child
    child = os.fork()
    if child == 0:
        _run_script(script, rules, ruleset, serve=serve, preload=preload)
    if ruleset is not None:
        os.close(ruleset)
    if serve is not None:
        os.close(serve)
        devnull = os.open(os.devnull, os.O_RDWR)
        for target in (0, 1, 2):
            os.dup2(devnull, target)
        os.close(devnull)
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


# -- reused processes (submit --reuse-process) -------------------------------------------------------------

EXCEPTION_MARKER = "gpumesh-exception "  # gpumesh.models.EXCEPTION_MARKER: a task's exception, read back as TaskFailed
REUSED_MODULE = (
    "__gpumesh_task__"  # the name a reused script is loaded under: its `if __name__ == "__main__":` is skipped
)
MAX_MESSAGE = 2000  # characters of an exception's message in the marker line (as gpumesh.functions)


def _exit_flushed(code: int) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _serve_tasks(ctrl_fd: int, script: str) -> int:
    """A reused process: the script's process of an attempt that stays (confined, as its user, in its cgroup and
    directory, exactly as any attempt's) and runs task after task of one job on this worker. Each message on
    ``ctrl_fd`` (SOCK_SEQPACKET) is {"env"} (the task's variables) with three descriptors, the task's stdin (its
    payload), stdout and stderr. At the first task the script is loaded as a module (``REUSED_MODULE``, so its
    ``if __name__ == "__main__":`` block does not run); each task then calls its ``main(payload)`` with the payload
    as JSON and prints the JSON of its return value as the result line. The reply is {"status": a wait status,
    "leave": why the process goes after this task, or ""}. Module-level state (a model, a CUDA context) stays for
    the next task. The process leaves after a task that raised SystemExit, whose script did not load, or that
    left threads running; EOF on ``ctrl_fd`` (the job ended, the worker stops) ends it with 0."""
    import _socket
    import json

    sock = _socket.socket(fileno=ctrl_fd)
    module = type(sys)(REUSED_MODULE)
    module.__file__ = script
    sys.modules[REUSED_MODULE] = sys.modules["__main__"] = module
    loaded = False
    while True:
        try:
            msg, ancdata, _flags, _addr = sock.recvmsg(1 << 20, _socket.CMSG_LEN(3 * 4))
        except OSError:
            return 70
        fds = _fds_in(ancdata)
        if not msg or len(fds) != 3:
            return 0
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.update(json.loads(msg)["env"])
        tempfile: Any = sys.modules.get("tempfile")
        if tempfile is not None:
            tempfile.tempdir = None  # TMPDIR read again
        code, leave = _one_task(module, script, loaded)
        loaded = loaded or leave != "the script did not load"
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        devnull = os.open(os.devnull, os.O_RDWR)  # the task's pipes let go of: the worker reads them to their end
        for target in (0, 1, 2):
            os.dup2(devnull, target)
        os.close(devnull)
        try:
            sock.send(json.dumps({"status": (code & 0xFF) << 8, "leave": leave}).encode())
        except OSError:
            return 70
        if leave:
            return code


class _Tail:
    """sys.stdout during a task, remembering whether it left a line unfinished (print(..., end=""))."""

    def __init__(self, stream: Any) -> None:
        self._stream, self.ended = stream, True

    def write(self, text: str) -> int:
        if text:
            self.ended = text.endswith("\n")
        return int(self._stream.write(text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _one_task(module: Any, script: str, loaded: bool) -> tuple[int, str]:
    """Run one task in a reused process: load the script first if ``loaded`` is false, then call ``main`` with the
    payload on stdin and print the JSON of what it returns. (exit code, why the process leaves now or "")."""
    import json

    threads = _python_threads()
    stdout = sys.stdout
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - fd 0 is the task's; a fresh buffer
    sys.stdout = tail = _Tail(stdout)
    step = "load"
    try:
        if not loaded:
            with open(script, "rb") as f:
                source = f.read()
            exec(compile(source, script, "exec", dont_inherit=True), module.__dict__)
        step = "run"
        entry = module.__dict__.get("main")
        if not callable(entry):
            raise TypeError(f"{os.path.basename(script)} has no main(payload) to call for each task (--reuse-process)")
        data = b"".join(iter(lambda: os.read(0, 1 << 16), b""))
        os.lseek(0, 0, os.SEEK_SET)  # main may read stdin too, as a script run once does
        result = entry(json.loads(data))
        step = "result"
        line = json.dumps(result, allow_nan=False)
    except SystemExit as exc:
        sys.stdout = stdout
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0, "the task called sys.exit"
        print(exc.code, file=sys.stderr)
        return 1, "the task called sys.exit"
    except BaseException as exc:  # the task's own error: its traceback is the task's error
        sys.stdout = stdout
        if step == "result":
            exc = TypeError(f"main() returned a value that is not JSON ({exc}); return dicts, lists, str, numbers, "
                            "bools or None")  # fmt: skip
        _report(exc)
        return 1, "the script did not load" if step == "load" else _left_threads(threads)
    sys.stdout = stdout
    print(("" if tail.ended else "\n") + line)  # the result is a line of its own
    return 0, _left_threads(threads)


def _report(exc: BaseException) -> None:
    """A task's exception: its traceback, then the marker line gpumesh.functions.remote_exception reads."""
    import json
    import traceback

    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # this file's frames are noise: the task's own start first
    traceback.print_exception(type(exc), exc, tb)
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ in ("builtins", "__main__", REUSED_MODULE) else (
        f"{kind.__module__}.{kind.__qualname__}")  # fmt: skip
    print(EXCEPTION_MARKER + json.dumps({"type": name, "message": str(exc)[:MAX_MESSAGE]}), file=sys.stderr)


def _python_threads() -> set[int]:
    """The idents of this process's live Python threads but the main one (none when threading was never imported)."""
    threading = sys.modules.get("threading")
    if threading is None:
        return set()
    main = threading.main_thread()
    return {t.ident for t in threading.enumerate() if t is not main and t.ident is not None}


def _left_threads(before: set[int]) -> str:
    """Why a reused process must go after a task that started Python threads still running, or "": such a thread
    would run on into the next task (library threads started while the script loaded are the module's state)."""
    left = _python_threads() - before
    return f"the task left {len(left)} thread(s) running" if left else ""


# -- a job's preload zygote (warm mode, a job with an environment and a preload) ----------------------------
# Started as a reused process is (``--preloaded``): a supervisor in a cgroup of its own, as the sandbox user, whose
# child confines itself as a task is (namespaces, no capabilities, no_new_privs, Landlock with write only beneath
# the zygote's own directory, seccomp) before the env's site runs; only then it imports the job's preload. For each
# attempt it forks a child that waits until the worker has put it in the attempt's cgroup, takes the attempt's
# stdio, environment and rlimits, narrows Landlock to the attempt's own directory (beneath the zygote's) and runs
# the script. The zygote belongs to one job: nothing it imported is another job's.

PRELOAD_ERROR = "preload "  # how a preload that fails is named to the worker: "preload MOD: TypeName: message"


def _serve_preloaded(ctrl_fd: int, preload: list[str], own: list[str]) -> int:
    """A job's preload zygote, confined already: import ``preload``, say {"ready"} (or {"error"}, one line naming
    the module) on ``ctrl_fd``, then run each attempt the worker sends there: {script, cwd, env, limits, source}
    with four descriptors (the attempt's reply socket, stdin, stdout, stderr). It answers {"pid"} on the reply
    socket, the child waits there for the worker's "go" (sent once the worker has moved it into the attempt's
    cgroup), and {"pid", "status"} follows once the attempt's whole tree is gone. ``own``: the paths the zygote's
    namespaces made its own (/dev/shm, the caches; none without them): its /dev/shm and SysV IPC are emptied after
    each attempt. EOF on ``ctrl_fd``: exit 0."""
    import _socket
    import gc
    import json

    sock = _socket.socket(fileno=ctrl_fd)
    supervisor = os.getppid()
    _syscall()[1].prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # its supervisor killed: the zygote goes with it
    if os.getppid() != supervisor:
        return 70
    project = os.environ.get("GPUMESH_PROJECT_DIR")
    if project:  # the job's project tree (read only): a preload may be one of its modules
        sys.path.insert(0, project)
    failed = _import_preload(preload)
    if failed:
        sock.send(json.dumps({"error": failed}).encode())
        return 2
    compile(_WARM_UP, "<warm-up>", "exec")
    import traceback  # noqa: F401  # a task's error path needs it: imported once, shared

    _syscall()[1].prctl(PR_SET_CHILD_SUBREAPER, 1)  # what an attempt leaves behind comes here, and is killed
    devnull = os.open(os.devnull, os.O_RDWR)  # the zygote prints nothing of its own; each attempt takes its stdio
    for target in (0, 1, 2):
        os.dup2(devnull, target)
    os.close(devnull)
    gc.collect()
    gc.freeze()
    sock.send(json.dumps({"ready": os.getpid(), "preloaded": preload}).encode())
    while True:
        try:
            msg, ancdata, _flags, _addr = sock.recvmsg(1 << 20, _socket.CMSG_LEN(4 * 4))
        except InterruptedError:
            continue
        except OSError:
            return 70
        fds = _fds_in(ancdata)
        if not msg or len(fds) != 4:
            for fd in fds:
                os.close(fd)
            return 0 if not msg else 70
        req = json.loads(msg)
        source = req.get("source")
        code = _compiled(source if isinstance(source, str) else None, str(req["script"]))
        child = os.fork()
        if child == 0:
            sock.close()
            _preloaded_attempt(req, fds[0], fds[1:], own, code)  # never returns
        for fd in fds[1:]:
            os.close(fd)
        _reply(fds[0], {"pid": child})
        status = _wait_for(child)
        _end_what_it_left()
        _reply(fds[0], {"pid": child, "status": status if status is not None else 70 << 8})
        os.close(fds[0])
        if own:  # what an attempt left in the job's own /dev/shm and SysV IPC is not the next one's
            _empty_dir(SHM)
            _remove_sysv_ipc()


def _import_preload(preload: list[str]) -> str:
    """Import ``preload``: "" when all did, else one line that names the module ("preload MOD: Type: message"), or
    says that CUDA was initialised (a forked task cannot use it)."""
    for name in preload:
        try:
            __import__(name)
        except BaseException as exc:  # noqa: BLE001 - a user's module: any failure is said in one line
            message = str(exc).splitlines()[0] if str(exc) else ""
            return f"{PRELOAD_ERROR}{name}: {type(exc).__name__}: {message}"
    torch = sys.modules.get("torch")
    if torch is not None and getattr(getattr(torch, "cuda", None), "is_initialized", lambda: False)():
        return f"{PRELOAD_ERROR}{','.join(preload)}: initialised CUDA, which a forked task cannot use"
    return ""


def _remove_sysv_ipc() -> None:
    """Remove every SysV shared memory segment, semaphore set and message queue of this IPC namespace (the
    zygote's own, which its attempts share one after another)."""
    libc = _syscall()[1]
    for kind, remove in (("shm", libc.shmctl), ("sem", libc.semctl), ("msg", libc.msgctl)):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 1 and fields[1].isdigit():  # IPC_RMID (0); semctl's third argument is a semaphore's
                remove(int(fields[1]), 0, 0 if kind == "sem" else None)


def _empty_dir(path: str) -> None:
    """Remove what this process may remove in ``path`` (its own tmpfs or overlay), following no link."""
    import shutil

    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        entry = os.path.join(path, name)
        try:
            if os.path.isdir(entry) and not os.path.islink(entry):
                shutil.rmtree(entry, ignore_errors=True)
            else:
                os.unlink(entry)
        except OSError:
            pass


def _preloaded_attempt(req: dict[str, Any], reply: int, stdio: list[int], own: list[str], code: Any) -> None:
    """In the child a preload zygote forked for an attempt: its own session and stdio, then wait on ``reply`` for
    the worker's "go" (it is in the attempt's cgroup by then), then the attempt's environment, rlimits and
    directory, Landlock narrowed to what the attempt may reach (``own``: the zygote's /dev/shm and caches, which
    it may write; its caches it may only read: no write of one attempt there could reach the next), and the
    script. Never returns; exits 70 where the worker said no "go" or the rules failed."""
    os.setsid()
    _syscall()[1].prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the zygote killed: its attempt goes with it
    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
        os.close(fd)
    try:
        go = os.read(reply, 16)
    except OSError:
        go = b""
    os.close(reply)  # the attempt's outcome is the zygote's to tell, never the task's
    if go != b"go":
        os._exit(70)
    _take_env(req)
    limits = _limits(req)
    script = str(req["script"])
    try:
        _set_rlimits(int(limits["cpu"]), int(limits["fsize"]), int(limits["nofile"]))
        os.chdir(str(req["cwd"]))
        if limits["isolation"] != "-":
            import json

            rules = json.loads(limits["isolation"])
            ruleset = build_ruleset(rules, os.path.dirname(script))
            try:
                add_attempt_rules(ruleset, rules)
                handled = fs_rights(int(rules["abi"]))
                _grant(ruleset, handled, (([p for p in own if p == SHM], handled), (own, FS_READ)))
                restrict_to(ruleset)
            finally:
                os.close(ruleset)
            if prepare_seccomp():  # the zygote's filter is on already (inherited): this one stacks on it
                install_seccomp(_syscall()[1], seccomp_refusing(os.uname().machine, PRELOADED_REFUSED))
    except OSError as exc:  # never run a task less isolated than the worker said it would be
        print(f"gpumesh: the task's isolation could not be applied ({exc}); it did not run", file=sys.stderr)
        _exit_flushed(70)
    _exec_script(script, code, insert=True)


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
    """Import ``preload`` once, then run each attempt the worker sends in a process forked for it.

    The worker talks over ``ctrl_fd``, a SOCK_SEQPACKET socket. Each request is one JSON message
    {script, cwd, env, limits, ahead} with four descriptors (``ahead``: the next attempt's cgroup, which the
    supervisor that will run it moves into meanwhile): a socket for this attempt's replies, and the attempt's
    stdin, stdout and stderr. The zygote hands the request to an idle supervisor it forked in advance (which
    serves attempt after attempt, :func:`_serve_attempts`), and answers {"pid"} (the supervisor's) at once; the
    supervisor, handed the same reply socket, sends {"pid", "status"} once the script's tree is gone (it may
    even come before the zygote's {"pid"}). A supervisor that ends during an attempt (killed, or after a TERM)
    has its status (as from waitpid) sent by the zygote.
    The zygote never runs task code and never initialises CUDA;
    it dies with the worker, and its supervisors die with it (each takes its tree down with grace).
    """
    import json
    import socket

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if _parent_gone(parent):
        sys.exit(70)
    # What a task leaves behind when it kills its supervisor comes to the zygote, which kills it (_Forks.reap).
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    ctrl = socket.socket(fileno=ctrl_fd)
    if sys.flags.no_site:  # an environment's zygote: site's module only (with -S importing it adds no path and
        import site  # noqa: F401  # runs no .pth); each attempt then adds its env's packages once confined

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
    _syscall()  # libc through ctypes, for each attempt's Landlock and capabilities: loaded once, inherited
    prepare_seccomp()  # the filter each attempt installs, assembled once
    _interpreter_paths()  # resolved once, inherited by every spare that builds an attempt's rules
    # traceback: a task's error path needs it; loaded here, it works even for a --sandbox-user who
    # cannot read the standard library the zygote was started from.
    import gc
    import traceback  # noqa: F401

    gc.collect()
    gc.freeze()  # the preloaded modules stay shared with every task instead of being copied on write


class _Supervisor:
    """The zygote's view of one of its supervisors: its pid and socket, the cgroup it was prepared for (moved into,
    for the attempt that will run there; "-": none, SPENT: none, and its rules were taken by its last attempt),
    and the attempt's reply socket while it runs one."""

    SPENT = "?"

    def __init__(self, pid: int, sock: socket.socket, prepared_for: str) -> None:
        self.pid = pid
        self.sock = sock
        self.prepared_for = prepared_for
        self.reply: socket.socket | None = None


class _Forks:
    """The zygote's loop. A request from the worker goes to an idle supervisor (one that was prepared for it: moved
    into the attempt's cgroup, its Landlock rules built), which forks the script's process and serves attempt after
    attempt; the other one is prepared for the next attempt meanwhile. A supervisor that ends (killed, or after a
    TERM) is told to the worker on its attempt's reply socket, and what it left behind is killed.

    Two supervisors take turns: while one runs an attempt, the other moves into the next attempt's cgroup (a move
    waits milliseconds for the kernel) and builds its rules, so that no process is forked and no cgroup joined
    between one attempt and the next. SIGCHLD wakes the loop through a pipe (signal.set_wakeup_fd), so one
    select() waits for the worker, the supervisors and their ends."""

    IDLE_AT_MOST = 2  # supervisors waiting at once; more (after attempts ran side by side) are let go

    def __init__(self, ctrl: socket.socket) -> None:
        import selectors

        self.ctrl = ctrl
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda _sig, _frame: None)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker decides when tasks stop
        self.sel = selectors.DefaultSelector()
        self.sel.register(ctrl, selectors.EVENT_READ)
        self.sel.register(self.wake_r, selectors.EVENT_READ)
        self.idle: list[_Supervisor] = []
        self.busy: dict[int, _Supervisor] = {}  # running an attempt, by pid
        self.isolation = "-"  # the last attempt's Landlock rules, which the next attempt's supervisor builds ahead
        self.ahead = "-"  # the cgroup made for the next attempt, which its supervisor moves into
        self.fork_due: float | None = None  # when a supervisor for the next attempt is forked, at the latest
        self.fork()

    def own(self) -> list[int]:
        """The zygote's descriptors, which a forked supervisor closes."""
        return [
            self.sel.fileno(), self.ctrl.fileno(), self.wake_r, self.wake_w,
            *(sup.sock.fileno() for sup in [*self.idle, *self.busy.values()]),
            *(sup.reply.fileno() for sup in self.busy.values() if sup.reply is not None),
        ]  # fmt: skip

    def fork(self, close: Sequence[int] = (), ahead: str | None = None) -> _Supervisor:
        """Fork a supervisor, prepared for the next attempt (its cgroup, or ``ahead``; the last attempt's rules), and
        keep it idle."""
        import selectors

        ahead = self.ahead if ahead is None else ahead
        if ahead == self.ahead:
            self.fork_due = None
        pid, sock = _fork_supervisor([*self.own(), *close], self.isolation, ahead)
        sup = _Supervisor(pid, sock, ahead)
        self.sel.register(sock, selectors.EVENT_READ, sup)
        self.idle.append(sup)
        return sup

    def serve(self) -> None:
        import time

        while True:
            due = self.fork_due
            events = self.sel.select(None if due is None else max(0.0, due - time.monotonic()))
            # A supervisor's "free" before the worker's next request, when one select() returns both: a supervisor
            # says it right after the outcome, on which the worker asks for the next attempt.
            for key, _ in sorted(events, key=lambda e: e[0].fileobj is self.ctrl):
                if key.fileobj is self.ctrl:
                    self.take_request()
                elif key.fileobj == self.wake_r:
                    self.reap()
                else:
                    self.heard(key.data)
            if self.fork_due is not None and time.monotonic() >= self.fork_due:
                self.fork()

    def take_request(self) -> None:
        """Hand the worker's next request to an idle supervisor, tell the worker its pid, and prepare the next one."""
        import json
        import socket
        import time

        try:
            msg, fds, _flags, _addr = socket.recv_fds(self.ctrl, 1 << 20, 5)  # 5: a reused process's socket too
        except InterruptedError:
            return
        if not msg:  # the worker is gone; our supervisors get their death signal as we exit
            os._exit(0)
        reply = socket.socket(fileno=fds[0])
        try:
            req = json.loads(msg)
            isolation, cgroup = str(req["limits"]["isolation"]), str(req["limits"]["cgroup"])
            ahead = str(req.get("ahead") or "-")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            isolation, cgroup, ahead = "-", "-", "-"
        sup = self.choose(cgroup, fds)
        # The supervisor first, then its pid to the worker, which goes on (to RQ's delivery of the task) meanwhile: the
        # attempt is the longer way, and the worker takes an outcome that comes before the pid. If the worker gave up
        # on this attempt, the status is reaped all the same.
        try:
            socket.send_fds(sup.sock, [msg], fds)
            sup.reply = reply
            self.busy[sup.pid] = sup
            _reply(reply.fileno(), {"pid": sup.pid})
        except OSError:  # it died this very instant: the attempt ends as if it had been killed with it
            self.let_go(sup)
            _reply(reply.fileno(), {"pid": sup.pid, "status": signal.SIGKILL})
            reply.close()
        for fd in fds[1:]:
            os.close(fd)
        self.isolation, self.ahead = isolation, ahead
        if any(s.prepared_for == ahead for s in self.idle):
            return  # one is ready for the next attempt already
        waiting = [s for s in self.idle if s.prepared_for in ("-", _Supervisor.SPENT)]
        if waiting:
            self.prepare(waiting[0])
        else:
            # None idle: fork the next one as this attempt ends (while the worker reports it and asks for the next
            # task, with a core to spare), or SPARE_DELAY into it when it runs longer (a torch zygote's fork takes
            # ~20 ms). Forked at once, it took a core from the attempt it came with.
            self.fork_due = time.monotonic() + SPARE_DELAY

    def choose(self, cgroup: str, fds: list[int]) -> _Supervisor:
        """The supervisor for an attempt in ``cgroup`` (``fds``: the request's, which a new one closes), no longer
        idle: the one prepared for ``cgroup``, else one that waits in no attempt's cgroup to come (one prepared for
        another attempt's is kept for it: it must not run this attempt from there), else a new one."""
        for gone in [s for s in self.idle if _closed(s.sock)]:  # died waiting, not reaped yet
            self.let_go(gone)
        ready = [s for s in self.idle if s.prepared_for == cgroup]
        ready = ready or [s for s in self.idle if s.prepared_for in ("-", _Supervisor.SPENT)]
        sup = ready[0] if ready else self.fork(close=fds, ahead="-")
        self.idle.remove(sup)
        return sup

    def prepare(self, sup: _Supervisor) -> None:
        """Tell an idle supervisor the next attempt's cgroup and rules, to move into and build while it waits."""
        import json

        try:
            sup.sock.send(json.dumps({"prepare": True, "ahead": self.ahead, "isolation": self.isolation}).encode())
            sup.prepared_for = self.ahead
        except OSError:
            pass  # it died: reaped soon

    def heard(self, sup: _Supervisor) -> None:
        """A supervisor said its attempt is over ("free", once it has told the worker the outcome), or closed its
        socket (it exits)."""
        if sup.sock.fileno() < 0:  # let go, or reaped, earlier in this round of the loop
            return
        try:
            msg = sup.sock.recv(64)
        except OSError:
            msg = b""
        if not msg:
            self.sel.unregister(sup.sock)  # it exits: reaped, and told to the worker if it ran an attempt
            return
        if self.busy.get(sup.pid) is not sup:
            return
        del self.busy[sup.pid]
        if sup.reply is not None:
            sup.reply.close()  # the supervisor told the outcome itself
            sup.reply = None
        if len(self.idle) >= self.IDLE_AT_MOST:
            self.let_go(sup)
            return
        self.idle.append(sup)
        sup.prepared_for = _Supervisor.SPENT  # in the cgroup of the attempt it ran, which is over
        if self.fork_due is not None and not any(s.prepared_for == self.ahead for s in self.idle):
            self.fork()  # the next one's, due as this attempt ended

    def let_go(self, sup: _Supervisor) -> None:
        """Close an idle supervisor's socket: it exits (and is reaped)."""
        if sup in self.idle:
            self.idle.remove(sup)
        try:
            self.sel.unregister(sup.sock)
        except (KeyError, ValueError):
            pass
        sup.sock.close()

    def reap(self) -> None:
        """Reap every child that ended; kill what a dead supervisor left behind; then tell the worker the
        status of each attempt whose supervisor ended."""
        try:
            os.read(self.wake_r, 4096)
        except BlockingIOError:
            pass
        ended: list[tuple[_Supervisor, int]] = []
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            for waiting in [s for s in self.idle if s.pid == pid]:  # died waiting
                self.let_go(waiting)
            if pid in self.busy:
                ended.append((self.busy.pop(pid), status))
        if ended:
            self.kill_orphans()
        for sup, status in ended:
            try:
                self.sel.unregister(sup.sock)
            except (KeyError, ValueError):
                pass
            sup.sock.close()
            if sup.reply is not None:
                _reply(sup.reply.fileno(), {"pid": sup.pid, "status": status})
                sup.reply.close()
        if ended and self.fork_due is not None and not self.idle:
            self.fork()

    def kill_orphans(self) -> None:
        """KILL and reap every child that is no supervisor of ours: as a subreaper the zygote inherits what a task
        left when it killed its supervisor. Until none is left (a killed orphan's own children come to us in turn)."""
        for _round in range(10_000):
            known = set(self.busy) | {s.pid for s in self.idle}
            orphans = [pid for pid in _children() if pid not in known]
            if not orphans:
                return
            kill_and_reap(orphans)


def _closed(sock: socket.socket) -> bool:
    """Whether the other end of ``sock`` is closed (its process exited), without taking a message."""
    import socket

    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def kill_and_reap(pids: list[int]) -> int:
    """KILL each of ``pids`` (children of this process) and reap them; how many were signalled."""
    killed = 0
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except OSError:
            pass
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except (ChildProcessError, InterruptedError):
            pass
    return killed


def _children() -> list[int]:
    """This process's children (every thread's), from /proc."""
    out: list[int] = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            out += children_of(tid)
        except OSError:
            pass
    return out


def children_of(tid: int | str) -> list[int]:
    """The children of this process's thread ``tid``, from /proc; OSError where they cannot be read."""
    with open(f"/proc/self/task/{tid}/children", "rb") as f:
        return [int(pid) for pid in f.read().split()]


def spare(ctrl_fd: int, parent: int, isolation: str = "-") -> int:
    """Fresh mode's head start: a new interpreter, started by the worker while the previous attempt
    runs, waits here for its one attempt. The request on ``ctrl_fd`` is the zygote's (one JSON message
    {script, cwd, env, limits}) with one descriptor, the attempt's stdin; stdout and stderr are already
    the worker's pipes. Still a fresh interpreter per attempt, never reused. EOF first: exit quietly.
    ``isolation``: the last attempt's Landlock rules, built while it waits (:func:`prepare_landlock`)."""
    import json

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # in the worker's process group until the attempt's setsid
    _syscall()[1].prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if _parent_gone(parent):
        return 70
    prepare_landlock(isolation)
    msg, fds = _recv_with_fds(ctrl_fd, 1)
    if not msg or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        return 0
    return _become_attempt(json.loads(msg), fds, parent)


def _recv_with_fds(fd: int, maxfds: int) -> tuple[bytes, list[int]]:
    """One message and the descriptors that came with it (at most ``maxfds``) from the socket ``fd``, which is
    closed: socket.recv_fds through _socket, the C module under socket. Importing socket itself (its enums of
    constants) costs a fresh spare ~2.5 ms, each attempt's interpreter anew."""
    import _socket

    sock = _socket.socket(fileno=fd)
    try:
        msg, ancdata, _flags, _addr = sock.recvmsg(1 << 20, _socket.CMSG_LEN(maxfds * 4))
    finally:
        sock.close()
    return msg, _fds_in(ancdata)


def _fds_in(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors an SCM_RIGHTS message carried (recvmsg's ancillary data)."""
    import _socket

    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds += [int.from_bytes(data[i : i + 4], sys.byteorder, signed=True) for i in range(0, len(data) - 3, 4)]
    return fds


def _fork_supervisor(own: list[int], isolation: str = "-", ahead: str = "-") -> tuple[int, socket.socket]:
    """Fork a supervisor ahead of its first attempt (:func:`_serve_attempts`), moved into the cgroup ``ahead`` (the
    next attempt's, made for it) with the Landlock rule set of ``isolation`` (the last attempt's rules) built
    already. It closes ``own`` (the zygote's descriptors) and dies with the zygote.

    Forking a process that imported torch costs ~20 ms here: a supervisor is forked once and serves attempt after
    attempt, and a second one is forked while an attempt runs, not when the next one is asked for."""
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
        code = _serve_attempts(theirs, zygote_pid, isolation, ahead)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve_attempts(ctrl: socket.socket, zygote: int, isolation: str, ahead: str) -> int:
    """A warm supervisor: run the attempts the zygote hands it on ``ctrl``, one at a time, each in a process forked
    for it (:func:`_become_script`), which takes the attempt's session, stdio, environment, cgroup, limits, user,
    directory and Landlock rules itself. This process is the attempt's supervisor as in fresh mode (the subreaper
    of its tree, which it takes down with grace on TERM and kills once the script ends; dying with the zygote),
    except that it never becomes the task's user and never enters the task's directory, so it can serve the next
    attempt: it tells the worker the outcome {"pid", "status"}, then the zygote "free", and waits. Between
    attempts the zygote may tell it {"prepare", "ahead", "isolation"}: it moves into the cgroup made for the next
    attempt, whose script process is then born in it, and builds that attempt's rules. After a TERM, or when the
    zygote is gone, it ends with its attempt, the way the script did. Returns its exit code."""
    import json
    import socket

    libc = _syscall()[1]
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # the zygote's death: the running attempt goes down with grace
    if _parent_gone(zygote):
        return 70
    os.setsid()  # no terminal, and out of the zygote's process group (each script takes a session of its own)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1)  # what a script leaves behind comes to us
    term = _OnTerm("1")
    devnull = os.open(os.devnull, os.O_WRONLY)  # a script's tree alone holds its attempt's stdout
    os.dup2(devnull, 1)
    os.close(devnull)
    where = _join_ahead(ahead)  # the cgroup this process is in, if it joined one: its scripts are born there
    prepare_landlock(isolation)
    while not term.terminating:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(ctrl, 1 << 20, 5)
        except OSError:
            return 70
        if not msg or term.terminating:  # let go, or the zygote is gone: nothing more to run
            for fd in fds:
                os.close(fd)
            return 70 if msg else 0  # an attempt handed over that will not run is no success
        req = json.loads(msg)
        if "prepare" in req:  # the next attempt will be ours: into its cgroup, its rules built
            where = _join_ahead(str(req["ahead"])) or where
            take_prepared(None, "/")  # the last one built, if no attempt took it
            prepare_landlock(str(req["isolation"]))
            continue
        if len(fds) != (
            5 if req.get("serve") else 4
        ):  # a reused process's socket is the fifth (submit --reuse-process)
            for fd in fds:
                os.close(fd)
            return 70
        term.grace = str(req["limits"]["grace"])
        status = _run_attempt(req, fds, ctrl, born_in=where == str(req["limits"]["cgroup"]))
        if os.getppid() != zygote:  # the worker (and the zygote) died: nobody will remove the attempt's directory
            _remove_as(req, str(req["script"]))
            return 70
        # A worker that gave up on the attempt no longer reads; nothing else changes.
        _reply(fds[0], {"pid": os.getpid(), "status": status if status is not None else 70 << 8})
        os.close(fds[0])
        if term.terminating:
            return _end_like(status)
        try:  # after the outcome: killed between the two, the zygote tells the worker nothing it has not heard
            ctrl.send(b"free")
        except OSError:
            return _end_like(status)
    return 70


def _run_attempt(req: dict[str, Any], fds: list[int], ctrl: socket.socket, born_in: bool) -> int | None:
    """Fork the process that runs the attempt of ``req`` (``fds``: its reply socket and stdio) and wait until it
    and all it started are gone: its wait status (None if it was never ours). The attempt's environment is set
    here first, in this process (whose pages are warm: a fork's first touch of each costs a page fault), and
    inherited. ``born_in``: this process is in the attempt's cgroup, so the script's process is born in it."""
    import gc
    import json

    _take_env(req)
    isolation = str(req["limits"]["isolation"])
    rules = json.loads(isolation) if isolation != "-" else None
    source = req.get("source")
    code = _compiled(source if isinstance(source, str) else None, str(req["script"]))
    gc.freeze()  # fewer copy-on-write faults in the child
    # Held over the fork: a TERM (from this process's own handler, taking the tree down) that comes before the child
    # has let go of this process's handlers reaches it once it has, and ends it.
    _signal.pthread_sigmask(_signal.SIG_BLOCK, _HANDLED)  # _signal's: signal's makes a set of enums of the old mask
    child = os.fork()
    if child == 0:
        os.close(fds[0])  # the task holds neither the worker's socket nor the zygote's
        ctrl.close()
        _become_script(req, fds[1:4], rules, born_in, code, fds[4] if len(fds) > 4 else None)  # never returns
    _signal.pthread_sigmask(_signal.SIG_UNBLOCK, _HANDLED)
    for fd in fds[1:]:
        os.close(fd)
    take_prepared(None, "/")  # the child's rules: this process holds nothing of them
    status = _wait_for(child)
    _end_what_it_left()
    signal.alarm(0)
    return status


def _become_script(
    req: dict[str, Any], stdio: list[int], rules: dict[str, Any] | None, born_in: bool, code: Any = None,
    serve: int | None = None,
) -> None:  # fmt: skip
    """In the process a warm supervisor forked for an attempt: take a session of its own and the attempt's stdio,
    then its cgroup (unless ``born_in`` it), limits, user and directory (:func:`_enter`) and its Landlock
    ``rules``, and run the script (``code``: compiled already, or None). Never returns."""
    os.setsid()  # the attempt's own session and process group, as a fresh attempt's
    _default_handlers()  # the supervisor's handlers are not ours
    _signal.pthread_sigmask(_signal.SIG_UNBLOCK, _HANDLED)
    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
        os.close(fd)
    script = str(req["script"])
    why = _enter(_limits(req), str(req["cwd"]), join=not born_in)
    if why is not None:  # the worker said the attempt runs in it: never run it outside
        print(f"gpumesh: {why}; the task did not run", file=sys.stderr)
        sys.stderr.flush()
        os._exit(70)
    _run_script(script, rules, take_prepared(rules, os.path.dirname(script)), code, serve=serve)


def _remove_as(req: dict[str, Any], script: str) -> None:
    """Remove the attempt's directory as its task's user (a process of its own: this one stays who it is)."""
    uid, gid = str(req["limits"]["uid"]), str(req["limits"]["gid"])
    if uid == "-":
        remove_dir_of(script, TASK_DIR_PREFIX)
        return
    pid = os.fork()
    if pid == 0:
        try:
            _become_user(uid, gid)
            remove_dir_of(script, TASK_DIR_PREFIX)
        finally:
            os._exit(0)
    _wait_for(pid)


def _become_attempt(req: dict[str, Any], fds: list[int], parent: int) -> int:
    """In a fresh spare: take the attempt's session, stdio (``fds``: stdin) and environment, then supervise it.
    ``parent``: the worker, to die with."""
    os.setsid()
    _take_stdio(req, fds)
    return supervise(str(parent), req["script"], _limits(req), cwd=req["cwd"])


def _limits(req: dict[str, Any]) -> dict[str, str]:
    """A request's limits, by the names of :data:`LIMITS`."""
    limits = req["limits"]
    return {name: str(limits[name]) for name in LIMITS}


def _take_stdio(req: dict[str, Any], fds: list[int]) -> None:
    """Take the attempt's stdio (``fds``: stdin[, stdout, stderr]) and environment (:func:`_take_env`)."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    _take_env(req)


def _take_env(req: dict[str, Any]) -> None:
    """Take the attempt's environment, and reset what Python caches of the environment and of the process this one
    was forked from."""
    env = req["env"]
    # As clear() then update(), without unsetting what is set again at once: a warm supervisor's attempts mostly
    # share their variables.
    for key in [k for k in os.environ if k not in env]:
        del os.environ[key]
    os.environ.update(env)
    if "tempfile" in sys.modules:  # imported already (by --preload): no cost, and no import the task did not ask for
        import tempfile

        tempfile.tempdir = None  # read TMPDIR again: the task's own directory
    nprandom = sys.modules.get("numpy.random")
    if nprandom is not None:  # Python's random reseeds itself after fork; numpy's global generator does not
        nprandom.seed()


# -- The entry point ---------------------------------------------------------------------------------------


def main(argv: list[str]) -> None:
    # Started from a private copy of this file, the interpreter has read it by now: remove the copy, so
    # nothing is left behind even if the worker is killed. Run as a module: nothing to remove.
    remove_dir_of(os.path.abspath(sys.argv[0]), COPY_DIR_PREFIX)
    if argv and argv[0] == "--zygote":
        ctrl_fd, parent, preload = argv[1:]
        zygote(int(ctrl_fd), int(parent), [m for m in preload.split(",") if m])
    elif argv and argv[0] == "--resident":
        # A reused attempt process (submit --reuse-process): as a fresh attempt, but its script's process serves
        # task after task on the socket CTRL_FD (see _serve_tasks).
        sys.exit(supervise(argv[2], argv[3], limits_of(argv[4:]), serve=int(argv[1])))
    elif argv and argv[0] == "--preloaded":
        # A job's preload zygote: as a reused process, but its confined child imports PRELOAD and forks each
        # attempt of the job (see _serve_preloaded).
        modules = [m for m in argv[4].split(",") if m]
        sys.exit(supervise(argv[2], argv[3], limits_of(argv[5:]), serve=int(argv[1]), preload=modules))
    elif argv and argv[0] == "--spare":
        sys.exit(spare(int(argv[1]), int(argv[2]), *argv[3:4]))
    else:
        # A fresh attempt starts outside its directory (so the task's files are not on sys.path while
        # this file's imports run); supervise() moves there, as the task's user, before the script is forked.
        sys.exit(supervise(argv[0], argv[1], limits_of(argv[2:])))


if __name__ == "__main__":
    main(sys.argv[1:])
