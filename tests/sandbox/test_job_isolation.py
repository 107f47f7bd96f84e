"""What jobs share with each other and with the worker's user's other programs, each shown by performing the attack.

1. A cache: a job that writes into a path other jobs read plants code the next one imports. With --cache-path
   each attempt writes to an overlay of its own, and no write reaches the cache or another job.
2. Shared memory, SysV IPC and keyrings: a task reads and overwrites the segments of the worker's user's other
   programs, and leaves files, segments and keys a later job reads; /dev/shm is RAM outside its memory cap. Each
   attempt now has its own IPC namespace, /dev/shm (within its memory cap) and keyrings.

Real processes throughout: `gpumesh worker`, sandbox.run's launcher, spares and warm zygote, and segments made by
this test's own process standing in for the user's other programs (X11's MIT-SHM images, a browser's buffers).
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumesh.sandbox import landlock, namespaces
from gpumesh.sandbox import runner as sandbox
from gpumesh.sandbox.warm import Zygote

from ..conftest import Workers, gpumesh, wait_until

pytestmark = pytest.mark.security

SYSTEM_PYTHON = "/usr/bin/python3"  # one the sandbox user can read (this machine's venv is root's alone)
needs_landlock = pytest.mark.skipif(landlock.abi() < 1, reason="this kernel has no Landlock")
needs_namespaces = pytest.mark.skipif(
    namespaces.unavailable() is not None, reason=f"no namespaces for attempts here: {namespaces.unavailable()}"
)
needs_keyctl = pytest.mark.skipif(platform.machine() != "x86_64", reason="the tasks call keyctl by its x86_64 number")
IPC_KEY = 0x676D7368  # the SysV key of the segment the test's process makes


def _user_params() -> list[Any]:
    root_only = pytest.mark.skipif(
        os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON), reason="--sandbox-user needs a root worker"
    )
    return [pytest.param(None, id="worker-user"), pytest.param("nobody", id="sandbox-user", marks=root_only)]


@pytest.fixture(params=["fresh", "cold", "warm"])
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    return request.param  # type: ignore[no-any-return]


def _limits(user: str | None, **more: Any) -> sandbox.Limits:
    who = None
    if user is not None:
        entry = pwd.getpwnam(user)
        who = (entry.pw_uid, entry.pw_gid)
    iso = landlock.Isolation(private=namespaces.unavailable(*(who or (-1, -1))) is None)
    python = SYSTEM_PYTHON if user else ""
    return sandbox.Limits(**{"timeout": 30, "memory_bytes": 0, "grace": 1.0, "isolation": iso, "user": who,
                             "python": python, **more})  # fmt: skip


class Runner:
    """Attempts run one after the other as a worker runs them (``mode``: fresh spares, a cold launcher, a warm
    zygote), each another job's."""

    def __init__(self, mode: str, python: str) -> None:
        self.zygote = Zygote(python=python) if mode == "warm" else None
        self.spares = sandbox.Spares() if mode == "fresh" else None
        if self.zygote is not None:
            self.zygote.start()

    def run(self, source: str, payload: Any, limits: sandbox.Limits) -> tuple[sandbox.Attempt, dict[str, Any]]:
        lines: list[tuple[str, str]] = []
        out = sandbox.run(
            textwrap.dedent(source), "task.py", json.dumps(payload), {}, limits,
            lambda s, line: lines.append((s, line)), lambda: None, zygote=self.zygote, spares=self.spares,
        )  # fmt: skip
        assert out.returncode == 0 or out.killed, (out.describe_exit(), lines)
        return out, json.loads(out.last_line) if out.last_line else {}

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.close()
        if self.spares is not None:
            self.spares.close()


# -- 2. shared memory, SysV IPC and keyrings -------------------------------------------------------------

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.shmat.restype = ctypes.c_void_p
_LIBC.syscall.restype = ctypes.c_long


class HostSegments:
    """What the worker's user's other programs hold: a 0600 file in /dev/shm and a 0600 SysV segment, each with a
    secret; and a key in this user's keyring."""

    def __init__(self) -> None:
        self.secret = secrets.token_hex(8).encode()
        self.shm = Path(f"/dev/shm/gpumesh-test-{secrets.token_hex(4)}")
        fd = os.open(self.shm, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.write(fd, self.secret)
        os.close(fd)
        self.shmid = _LIBC.shmget(IPC_KEY, 4096, 0o1000 | 0o600)  # IPC_CREAT
        assert self.shmid >= 0, os.strerror(ctypes.get_errno())
        addr = _LIBC.shmat(self.shmid, None, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        self.addr = addr
        ctypes.memmove(addr, self.secret, len(self.secret))

    def sysv(self) -> bytes:
        return ctypes.string_at(self.addr, len(self.secret))

    def close(self) -> None:
        _LIBC.shmdt(ctypes.c_void_p(self.addr))
        _LIBC.shmctl(self.shmid, 0, None)  # IPC_RMID
        self.shm.unlink(missing_ok=True)


@pytest.fixture
def host() -> Iterator[HostSegments]:
    h = HostSegments()
    yield h
    h.close()


PRY_SHM = """
import ctypes, json, os, sys
p = json.load(sys.stdin)
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
seen = {}
try:
    with open(p["shm"], "r+b") as f:
        seen["posix_read"] = f.read().decode()
        f.seek(0)
        f.write(b"overwritten!!!!!")
except OSError as exc:
    seen["posix_read"] = type(exc).__name__
seen["listed"] = sorted(os.listdir("/dev/shm"))
seen["sysv_by_key"] = libc.shmget(p["key"], 0, 0)
addr = libc.shmat(p["shmid"], None, 0)  # by the id the host's segment has
if addr not in (None, ctypes.c_void_p(-1).value):
    seen["sysv_read"] = ctypes.string_at(addr, 16).decode(errors="replace")
    ctypes.memmove(addr, b"overwritten!!!!!", 16)
else:
    seen["sysv_read"] = os.strerror(ctypes.get_errno())
seen["sysv_listed"] = len(open("/proc/sysvipc/shm").read().splitlines()) - 1
print(json.dumps(seen))
"""


@needs_landlock
@needs_namespaces
@pytest.mark.parametrize("user", _user_params())
def test_a_task_cannot_see_or_touch_the_shared_memory_of_the_worker_s_user(mode, user, host: HostSegments):
    """A 0600 /dev/shm file and a SysV segment of the user's other programs (an X11 MIT-SHM image): a task finds
    neither by name, key or id, and changes neither. Without namespaces of its own (the contrast, as before) the
    task of the worker's own user read and overwrote both."""
    runner = Runner(mode, SYSTEM_PYTHON if user else sys.executable)
    payload = {"shm": str(host.shm), "key": IPC_KEY, "shmid": host.shmid}
    try:
        _, seen = runner.run(PRY_SHM, payload, _limits(user))
        assert seen["posix_read"] == "FileNotFoundError" and seen["listed"] == [], seen
        assert seen["sysv_by_key"] == -1 and seen["sysv_read"] != host.secret.decode(), seen
        assert seen["sysv_listed"] == 0, seen
        assert host.shm.read_bytes() == host.secret and host.sysv() == host.secret
        if user is None and os.geteuid() == 0:  # what shows this test can fail: the shared view, as before
            shared = _limits(user)
            shared = sandbox.Limits(**{**shared.__dict__, "isolation": landlock.Isolation()})
            _, seen = runner.run(PRY_SHM, payload, shared)
            assert seen["posix_read"] == host.secret.decode() and seen["sysv_read"] == host.secret.decode(), seen
            assert host.shm.read_bytes().startswith(b"overwritten") and host.sysv().startswith(b"overwritten")
    finally:
        runner.close()


LEAVE = """
import ctypes, json, os, sys
p = json.load(sys.stdin)
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
open("/dev/shm/" + p["name"], "w").write("left by job A")
shmid = libc.shmget(p["key"] + 1, 4096, 0o1000 | 0o666)
ids = {}
for ring in (-4, -3):  # the user keyring, the session keyring
    ids[ring] = libc.syscall(248, b"user", p["name"].encode(), b"left by job A", 13, ctypes.c_int(ring))
print(json.dumps({"shmid": shmid, "keys": list(ids.values())}))
"""
FIND = """
import ctypes, json, os, sys
p = json.load(sys.stdin)
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
seen = {"shm": os.path.exists("/dev/shm/" + p["name"]), "sysv": libc.shmget(p["key"] + 1, 0, 0) >= 0}
for ring, name in ((-4, "user_key"), (-3, "session_key")):
    seen[name] = libc.syscall(250, 10, ctypes.c_int(ring), b"user", p["name"].encode(), 0) >= 0  # KEYCTL_SEARCH
seen["host_key"] = libc.syscall(250, 10, ctypes.c_int(-4), b"user", p["host_key"].encode(), 0) >= 0
print(json.dumps(seen))
"""


@needs_landlock
@needs_namespaces
@needs_keyctl
@pytest.mark.parametrize("user", _user_params())
def test_what_a_task_leaves_in_shm_ipc_and_keyrings_is_gone_for_the_next_job(mode, user):
    """Job A leaves a /dev/shm file, a SysV segment and a key in its user and session keyrings; job B, next on the
    same worker, finds none of them, nor a key of the worker's user; and none is left on the host."""
    name = f"gpumesh-test-{secrets.token_hex(4)}"
    host_key = f"gpumesh-host-{secrets.token_hex(4)}"
    mine = _LIBC.syscall(248, b"user", host_key.encode(), b"the user's own", 14, ctypes.c_int(-4))
    assert mine >= 0, os.strerror(ctypes.get_errno())
    key = secrets.randbelow(1 << 30) + (1 << 20)  # no segment of another run's
    payload = {"name": name, "key": key, "host_key": host_key}
    runner = Runner(mode, SYSTEM_PYTHON if user else sys.executable)
    try:
        _, left = runner.run(LEAVE, payload, _limits(user))
        assert left["shmid"] >= 0, left  # it could make a segment: in its own IPC namespace
        assert left["keys"] == [-1, -1], left  # and no key at all: add_key is refused by its seccomp filter
        _, seen = runner.run(FIND, payload, _limits(user))
        assert seen == {"shm": False, "sysv": False, "user_key": False, "session_key": False, "host_key": False}
        assert not Path("/dev/shm", name).exists()
        assert _LIBC.shmget(key + 1, 0, 0) == -1
        found = _LIBC.syscall(250, 10, ctypes.c_int(-4), b"user", name.encode(), 0)
        assert found < 0, "job A's key is in the worker user's keyring"
    finally:
        runner.close()
        _LIBC.syscall(250, 3, ctypes.c_long(mine))  # KEYCTL_REVOKE


LINK_USER_KEYRING = """
import ctypes, json, sys
p = json.load(sys.stdin)
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
keys = {l.split()[8].rstrip(":"): int(l.split()[0], 16) for l in open("/proc/keys")}
rings = [v for k, v in keys.items() if k.startswith("_uid.") and not k.startswith("_uid_ses")]
seen = {"rings": len(rings), "linked": [], "read": None}
for ring in rings:  # KEYCTL_LINK the host's user keyring into the task's own session keyring
    seen["linked"].append(libc.syscall(250, 8, ctypes.c_int(ring), ctypes.c_int(-3)))
if p["name"] in keys:
    buf = ctypes.create_string_buffer(64)
    n = libc.syscall(250, 11, ctypes.c_long(keys[p["name"]]), buf, 64)  # KEYCTL_READ
    seen["read"] = buf.raw[:n].decode() if n > 0 else -ctypes.get_errno()
found = libc.syscall(250, 10, ctypes.c_int(-3), b"user", p["name"].encode(), 0)  # KEYCTL_SEARCH, after the link
seen["searched"] = found if found < 0 else libc.syscall(250, 11, ctypes.c_long(found), None, 0)
print(json.dumps(seen))
"""


@needs_landlock
@needs_namespaces
@needs_keyctl
@pytest.mark.parametrize("user", _user_params())
def test_a_task_cannot_link_its_user_s_keyring_and_read_its_keys(mode, user):
    """/proc/keys names the host's ``_uid.N`` keyring of the task's user; a task linked it into its own session
    keyring and read the user's keys from it (as --sandbox-user too). The attempt's seccomp filter refuses
    keyctl: no link, no read, no search."""
    name = f"gpumesh-host-{secrets.token_hex(4)}"
    who = pwd.getpwnam(user).pw_uid if user else os.getuid()
    # the key in the keyring of the user the task runs as (for nobody: made by a child that becomes nobody)
    mine = -1
    if user is None:
        mine = _LIBC.syscall(248, b"user", name.encode(), b"hunter2", 7, ctypes.c_int(-4))
        assert mine >= 0, os.strerror(ctypes.get_errno())
    else:
        import subprocess

        made = subprocess.run(
            [SYSTEM_PYTHON, "-c", textwrap.dedent(f"""
                import ctypes, os
                os.setgid({pwd.getpwnam(user).pw_gid}); os.setuid({who})
                libc = ctypes.CDLL(None, use_errno=True); libc.syscall.restype = ctypes.c_long
                # 0x3f3f0000: the possessor and the user may view, read, write, search, link and set attributes
                k = libc.syscall(248, b"user", b"{name}", b"hunter2", 7, ctypes.c_int(-4))
                assert k >= 0, os.strerror(ctypes.get_errno())
                assert libc.syscall(250, 5, ctypes.c_long(k), 0x3f3f0000) == 0  # KEYCTL_SETPERM
                print(k)
            """)], capture_output=True, text=True, check=True,
        )  # fmt: skip
        mine = int(made.stdout)
    runner = Runner(mode, SYSTEM_PYTHON if user else sys.executable)
    try:
        _, seen = runner.run(LINK_USER_KEYRING, {"name": name}, _limits(user))
        assert seen["rings"] >= 1, seen  # the attack is there to make: the user's keyring is listed
        assert all(r < 0 for r in seen["linked"]) and seen["searched"] < 0, seen
        assert seen["read"] != "hunter2", seen
    finally:
        runner.close()
        _LIBC.syscall(250, 3, ctypes.c_long(mine))  # KEYCTL_REVOKE (root may revoke nobody's key too)


NESTED = """
import ctypes, json, multiprocessing, os, subprocess, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
seen = {}
seen["unshare"] = (libc.unshare(0x10000000 | 0x00020000), ctypes.get_errno())  # CLONE_NEWUSER|CLONE_NEWNS
seen["setns"] = (libc.setns(os.open("/proc/self/ns/ipc", os.O_RDONLY), 0), ctypes.get_errno())
# raw clone(CLONE_NEWUSER|SIGCHLD): the child, if it were made, exits at once
pid = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)
if pid == 0:
    os._exit(0)
seen["clone_newuser"] = (min(pid, 0), ctypes.get_errno())
if pid > 0:
    os.waitpid(pid, 0)
box = []
t = threading.Thread(target=box.append, args=(1,))
t.start()
t.join()
seen["thread"] = box == [1]
seen["subprocess"] = subprocess.run([sys.executable, "-c", "print(6*7)"], capture_output=True, text=True).stdout
child = os.fork()
if child == 0:
    os._exit(7)
seen["fork"] = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
with multiprocessing.get_context("fork").Pool(2) as pool:
    seen["pool"] = pool.map(abs, [-1, -2, -3])
print(json.dumps(seen))
"""


@needs_landlock
@needs_namespaces
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the task calls clone by its x86_64 number")
@pytest.mark.parametrize("user", _user_params())
def test_a_task_makes_no_namespace_of_its_own_yet_threads_and_processes_work(mode, user):
    """A task made a user namespace of its own (unshare returned 0: every capability inside it), from which the
    kernel's namespaced code is open to it. Now unshare, setns and clone with CLONE_NEWUSER are refused (EPERM),
    and threads, subprocess, os.fork and a multiprocessing pool still work (glibc's clone3 falls back to clone)."""
    runner = Runner(mode, SYSTEM_PYTHON if user else sys.executable)
    try:
        _, seen = runner.run(NESTED, {}, _limits(user, memory_bytes=0))
        assert seen["unshare"] == [-1, 1] and seen["setns"] == [-1, 1] and seen["clone_newuser"] == [-1, 1], seen
        assert seen["thread"] and seen["subprocess"] == "42\n" and seen["fork"] == 7, seen
        assert seen["pool"] == [1, 2, 3], seen
    finally:
        runner.close()


FILL_SHM = """
import json, os
written = 0
try:
    with open("/dev/shm/fill", "wb") as f:
        chunk = b"x" * (4 << 20)
        while written < (400 << 20):
            f.write(chunk)
            f.flush()
            written += len(chunk)
    why = "wrote it all"
except OSError as exc:
    why = type(exc).__name__
print(json.dumps({"written": written, "why": why}))
import time
time.sleep(3)  # held while the worker measures
"""


@needs_landlock
@needs_namespaces
def test_what_a_task_puts_in_dev_shm_counts_against_its_memory_cap_and_goes_with_it(mode):
    """A task under a 100 MiB cap tried to leave 400 MiB in /dev/shm: it gets at most its cap there (a tmpfs of
    that size), the worker counts it against the cap, and nothing stays behind."""
    before = set(os.listdir("/dev/shm"))
    runner = Runner(mode, sys.executable)
    try:
        out, said = runner.run(FILL_SHM, {}, _limits(None, memory_bytes=100 << 20))
    finally:
        runner.close()
    assert out.killed == "memory", ("what it keeps in /dev/shm counts against its cap", said)
    assert said.get("written", 0) <= 100 << 20, said  # and /dev/shm holds no more than the cap
    assert set(os.listdir("/dev/shm")) <= before


# -- 1. caches ---------------------------------------------------------------------------------------------

PLANT = """
import json, os, sys
cache = json.load(sys.stdin)["cache"]
seen = {"prefilled": open(os.path.join(cache, "weights.txt")).read()}
try:
    os.makedirs(os.path.join(cache, "modules"), exist_ok=True)
    with open(os.path.join(cache, "modules", "model_code.py"), "w") as f:
        f.write("import sys, json\\nCHOSEN = 'planted by job A, read ' + sys.stdin.read()\\n")
    seen["planted"] = True
    sys.path.insert(0, os.path.join(cache, "modules"))
    import model_code  # what the attempt wrote it reads back itself
    seen["own_write_read"] = True
except OSError as exc:
    seen["planted"] = type(exc).__name__
print(json.dumps(seen))
"""
IMPORT = """
import json, os, sys
cache = json.loads(sys.stdin.readline())["cache"]
sys.path.insert(0, os.path.join(cache, "modules"))  # what transformers does with trust_remote_code
try:
    import model_code
    result = model_code.CHOSEN
except ImportError:
    result = "honest: " + open(os.path.join(cache, "weights.txt")).read()
print(json.dumps(result))
"""


@needs_landlock
@needs_namespaces
@pytest.mark.usefixtures("both_modes")
def test_a_job_cannot_plant_code_in_a_cache_that_another_job_imports(env, workers: Workers, tmp_path: Path):
    """Job A writes "cached model code" into the cache; job B, next on the same worker, imports it if it is there.
    With --cache-path, A's write is its attempt's alone (it reads it back itself), never the cache's: B's result
    is its own, and the cache is as its owner filled it. The worker says at start that a --write-path is shared."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    (cache / "weights.txt").write_text("filled by the owner")
    (tmp_path / "outputs-of-one-submitter").mkdir()
    workers.start("--cache-path", str(cache), "--write-path", str(tmp_path / "outputs-of-one-submitter"),
                  GPUMESH_WRITE_PATHS="")  # fmt: skip
    payload = json.dumps([{"cache": str(cache)}])
    for name, source in (("plant.py", PLANT), ("import.py", IMPORT)):
        (tmp_path / name).write_text(source)
    rows = []
    for name in ("plant.py", "import.py"):
        job = gpumesh("submit", str(tmp_path / name), "--payloads", "-", env=env, input=payload).stdout.strip()
        wait_until(
            lambda job=job: (
                json.loads(gpumesh("status", job, "--json", env=env).stdout)["status"] in ("done", "failed")
            ),
            timeout=60,
        )
        (row,) = json.loads(gpumesh("results", job, "--format", "json", env=env).stdout)
        assert row["status"] == "done", (row, workers.log(0))
        rows.append(row["result"])
    planted, imported = rows
    assert planted == {"prefilled": "filled by the owner", "planted": True, "own_write_read": True}, planted
    assert imported == "honest: filled by the owner", imported
    assert sorted(p.name for p in cache.iterdir()) == ["weights.txt"]
    log = workers.log(0)
    assert "its own overlay of the cache " + str(cache) in log, log
    assert "every job's tasks write there" in log and "use --cache-path" in log, log


def test_doctor_says_whether_attempts_get_namespaces_of_their_own(env):
    """`gpumesh doctor` says what holds on this machine: here (Linux with user namespaces), every attempt's own
    IPC, /dev/shm and keyrings, as root and as an unprivileged user."""
    p = gpumesh("doctor", "--json", env=env, timeout=120)
    (row,) = [row for row in json.loads(p.stdout) if row["check"] == "namespaces"]
    if namespaces.unavailable() is None:
        assert row["status"] == "ok" and "/dev/shm (within its memory cap)" in row["detail"], row
    else:
        assert row["status"] == "warn" and "tasks share /dev/shm" in row["detail"] and row["fix"], row


@needs_landlock
@needs_namespaces
@pytest.mark.skipif(os.geteuid() != 0, reason="--sandbox-user needs a root worker")
@pytest.mark.parametrize("closed", ["parent", "cache"])
def test_a_cache_the_sandbox_user_cannot_read_is_refused_at_start(closed, env, tmp_path: Path):
    """Each attempt would fail to lay its overlay, or lay one the task cannot read (the cache itself 0700 root's
    was accepted): the worker says so in one line and does not start."""
    reachable = Path(tempfile.mkdtemp(prefix="gpumesh-test-"))  # not under tmp_path, which nobody cannot enter
    reachable.chmod(0o755)
    private = reachable / "root-only"
    try:
        (private / "cache").mkdir(parents=True)
        (private if closed == "parent" else private / "cache").chmod(0o700)
        p = gpumesh("worker", "--score", "1", "--burst", "--sandbox-user", "nobody", "--cache-path",
                    str(private / "cache"), env={**env, "GPUMESH_SANDBOX_PYTHON": SYSTEM_PYTHON}, timeout=60)  # fmt: skip
        assert p.returncode == 2, p.stderr
        assert "--cache-path: an attempt could not lay its overlay" in p.stderr and "Traceback" not in p.stderr
        assert [line for line in p.stderr.splitlines() if "error" in line.lower()] == [
            p.stderr.strip().splitlines()[-1]
        ]
    finally:
        shutil.rmtree(reachable)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="a filter for x86_64 and aarch64 only")
def test_doctor_says_what_the_seccomp_filter_refuses(env):
    """`gpumesh doctor` names the calls a task's seccomp filter refuses."""
    p = gpumesh("doctor", "--json", env=env, timeout=120)
    (row,) = [row for row in json.loads(p.stdout) if row["check"] == "seccomp"]
    assert row["status"] == "ok" and "keyctl" in row["detail"] and "unshare" in row["detail"], row


READ_TOKEN = """
import json, sys
p = json.load(sys.stdin)
try:
    print(json.dumps({"token": open(p["token"]).read()}))
except OSError as exc:
    print(json.dumps({"token": type(exc).__name__}))
"""


@needs_landlock
@pytest.mark.parametrize("flag", ["--cache-path", "--read-path"])
def test_a_path_that_holds_a_credential_is_refused_at_start(flag, env, workers: Workers, tmp_path: Path):
    """`huggingface-cli login` keeps its token in ~/.cache/huggingface/token: a worker given that folder gave every
    task the owner's login. It now refuses it in one line (exit 2); given the hub folder, as the docs say, it
    starts, and a task reads the model but not the token."""
    hf = tmp_path / "huggingface"
    (hf / "hub" / "models--bert").mkdir(parents=True)
    (hf / "hub" / "models--bert" / "config.json").write_text("{}")
    (hf / "token").write_text("hf_ownerssecret")
    p = gpumesh("worker", "--score", "1", "--burst", flag, str(hf), env=env, timeout=60)
    assert p.returncode == 2, p.stderr
    assert f"{flag} {hf}: holds token, which looks like a credential" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "huggingface/hub" in p.stderr.strip().splitlines()[-1]
    workers.start(flag, str(hf / "hub"), GPUMESH_WRITE_PATHS="")  # not the test's directory, which holds hf
    (tmp_path / "read.py").write_text(READ_TOKEN)
    payload = json.dumps([{"token": str(hf / "token")}])
    job = gpumesh("submit", str(tmp_path / "read.py"), "--payloads", "-", "--wait", env=env, input=payload)
    (row,) = json.loads(gpumesh("results", job.stdout.split()[0], "--format", "json", env=env).stdout)
    assert row["result"] == {"token": "PermissionError"}, (row, workers.log(0))


PLANTED = """
import importlib, os, sys
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "ran-%d" % os.getpid()), "w") as f:
    f.write(" ".join(sys.argv))
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
del sys.modules[__name__]
sys.modules[__name__] = importlib.import_module(__name__)  # the real one, so that what imported it works on
"""


def test_a_module_in_the_working_directory_runs_in_no_gpumesh_process(env, tmp_path: Path):
    """`gpumesh run --local` in a folder that holds a csv.py (a download, a clone) started its workers and their
    launchers as `python -m …`, which puts the working directory first on sys.path: the planted module ran in
    each of them, outside any sandbox. Every child gpumesh starts now runs with -P: `run --local` (warm workers)
    and a `worker --fresh` started there run nothing of the folder."""
    cwd = tmp_path / "downloads"
    cwd.mkdir()
    for name in ("csv", "json", "socket", "ctypes", "signal"):
        (cwd / f"{name}.py").write_text(PLANTED)
    (tmp_path / "task.py").write_text("import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n")
    (tmp_path / "p.json").write_text('[{"a": 1}, {"a": 2}]')
    console = str(Path(sys.executable).parent / "gpumesh")  # as a user runs it: the console script
    task, payloads = str(tmp_path / "task.py"), str(tmp_path / "p.json")
    p = subprocess.run([console, "run", task, "--payloads", payloads, "--local", "2", "--json"], env=env, cwd=cwd,
                       capture_output=True, text=True, timeout=180)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert [row["result"] for row in json.loads(p.stdout)] == [{"a": 1}, {"a": 2}]
    job = gpumesh("submit", task, "--payloads", payloads, env=env).stdout.strip()
    w = subprocess.run([console, "worker", "--fresh", "--burst", "--score", "1"], env=env, cwd=cwd,
                       capture_output=True, text=True, timeout=180)  # fmt: skip
    assert w.returncode == 0, w.stderr
    assert json.loads(gpumesh("status", job, "--json", env=env).stdout)["status"] == "done"
    ran = [f.read_text() for f in cwd.glob("ran-*")]
    assert ran == [], ran


SYSV_HOARD = """
import ctypes, json, os, time
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
size, made, refused = 50 << 20, 0, None
for _ in range(6):  # 300 MB in SysV segments, each touched and detached: in no process's RSS
    shmid = libc.shmget(0, ctypes.c_size_t(size), 0o1000 | 0o600)
    if shmid < 0:
        refused = os.strerror(ctypes.get_errno())
        break
    addr = libc.shmat(shmid, None, 0)
    ctypes.memset(addr, 1, size)
    libc.shmdt(ctypes.c_void_p(addr))
    made += 1
limits = {n: int(open("/proc/sys/kernel/" + n).read()) for n in ("shmmax", "shmall")}
print(json.dumps({"made": made, "refused": refused, "uid": os.getuid(), "limits": limits}))
time.sleep(2)  # held while the worker measures
"""


@needs_landlock
@needs_namespaces
@pytest.mark.parametrize("user", _user_params())
def test_sysv_segments_a_task_detaches_stay_within_its_memory_cap(mode, user):
    """Six 50 MB SysV segments, touched then detached, are in no process's RSS: under a 100 MiB cap a task held
    300 MB and was not killed. The attempt's IPC namespace now caps SysV memory at its memory cap (shmmax, shmall,
    written as root of a user namespace that owns it); the task still sees its own uid."""
    runner = Runner(mode, SYSTEM_PYTHON if user else sys.executable)
    try:
        out, seen = runner.run(SYSV_HOARD, {}, _limits(user, memory_bytes=100 << 20))
        assert out.killed or (seen["made"] * 50 << 20) <= 100 << 20, (seen, out.describe_exit())
        if not out.killed:
            assert seen["refused"] == "No space left on device", seen  # shmget's ENOSPC past shmall
            assert seen["uid"] == (pwd.getpwnam(user).pw_uid if user else os.getuid()), seen
    finally:
        runner.close()


MEMFD_HOARD = """
import json, os, sys, time
p = json.load(sys.stdin)
fd = os.memfd_create("hoard")
chunk = b"y" * (4 << 20)
for _ in range(75):  # 300 MB written, never mapped: in no process's RSS
    os.write(fd, chunk)
if p["how"] == "mapped, closed, untouched":  # in RSS only as its pages are touched, which these never are
    import mmap
    held = mmap.mmap(fd, 300 << 20)
    os.close(fd)
print(json.dumps({"how": p["how"]}))
time.sleep(5)  # held while the worker measures
"""


@needs_landlock
@pytest.mark.parametrize("user", _user_params())
@pytest.mark.parametrize("how", ["open", "mapped, closed, untouched"])
def test_a_memfd_a_task_fills_without_mapping_it_counts_against_its_memory_cap(mode, user, how):
    """A memfd filled with write() is RAM in no process's RSS: 300 MB under a 100 MiB cap, and the task was not
    killed; nor when it mapped the memfd, closed it and never touched the pages. The worker now counts the memfds an
    attempt's processes hold open or map: it is killed for memory."""
    runner = Runner(mode, SYSTEM_PYTHON if user else sys.executable)
    try:
        if how != "open" and os.geteuid() != 0:
            pytest.skip("a mapping is looked up through /proc/PID/map_files, which only a root worker reads")
        out, _ = runner.run(MEMFD_HOARD, {"how": how}, _limits(user, memory_bytes=100 << 20))
        assert out.killed == "memory", out.describe_exit()
    finally:
        runner.close()
