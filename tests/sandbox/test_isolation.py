"""Isolation of a task from the worker and the host, each shown by performing the attack.

1. No escalation: nothing a task's user can write is run, or followed, by the root worker (--sandbox-user).
2. The tree dies with its attempt, even when the task SIGKILLs its supervisor and double-forks out of its session.
3. Landlock: a task reads only the system, Python and its own directory; not the worker's home, its config
   file, /proc/<worker>/mem or environ; and it cannot signal the worker.

Real processes throughout: sandbox.run, the warm zygote, `gpumesh worker`, and a real attacker process
running as ``nobody``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumesh.sandbox import landlock, tree
from gpumesh.sandbox import runner as sandbox
from gpumesh.sandbox.launcher import SOURCE_INLINE_MAX
from gpumesh.sandbox.warm import Zygote

from ..conftest import Workers, gpumesh, pid_alive, wait_until

pytestmark = pytest.mark.security

SYSTEM_PYTHON = "/usr/bin/python3"  # one that nobody can read: this machine's venv lives under /root (0700)
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON) or sys.platform != "linux",
    reason="--sandbox-user needs a root worker on Linux and a Python the task user can read; CI here runs as root",
)
needs_landlock = pytest.mark.skipif(landlock.abi() < 1, reason="this kernel has no Landlock")
needs_scoped_signals = pytest.mark.skipif(landlock.abi() < 6, reason="scoped signals need Landlock ABI 6")


def nobody() -> tuple[int, int]:
    entry = pwd.getpwnam("nobody")
    return entry.pw_uid, entry.pw_gid


def attempt(
    source: str, mode: Any, env: dict[str, str] | None = None, **limits: Any
) -> tuple[sandbox.Attempt, list[tuple[str, str]]]:
    lines: list[tuple[str, str]] = []
    lim = sandbox.Limits(**{"timeout": 30, "memory_bytes": 0, "grace": 1.0, **limits})
    out = sandbox.run(
        textwrap.dedent(source), "task.py", "{}", env or {}, lim, lambda s, line: lines.append((s, line)), lambda: None,
        zygote=mode.get("zygote"), spares=mode.get("spares"),
    )  # fmt: skip
    return out, lines


@pytest.fixture(params=["fresh", "cold", "warm"])
def mode(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """fresh: as a worker runs it (a spare interpreter per attempt); cold: a new interpreter started for the
    attempt; warm: forked from a zygote."""
    if request.param == "warm":
        z = Zygote()
        z.start()
        held = {"zygote": z}
        yield held
        held["zygote"].close()  # the one the test left there
    elif request.param == "fresh":
        s = sandbox.Spares()
        yield {"spares": s}
        s.close()
    else:
        yield {}


# -- 2. the tree dies with its attempt --------------------------------------------------------------------

# The task starts a daemon that leaves its session (fork, setsid, fork) and lets go of the attempt's output,
# says both pids, then SIGKILLs its own supervisor and lingers: everything the supervisor would have taken
# down with it is now out of its reach.
ESCAPE = """
import json, os, signal, sys, time
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(r)
        os.write(w, str(os.getpid()).encode())
        os.close(w)
        while True:
            time.sleep(1)
    os._exit(0)
os.close(w)
daemon = int(os.read(r, 32))
print(json.dumps({"daemon": daemon, "task": os.getpid(), "supervisor": os.getppid()}), flush=True)
try:
    os.kill(os.getppid(), signal.SIGKILL)
    print(json.dumps({"killed": True}), flush=True)
except PermissionError:
    print(json.dumps({"killed": False}), flush=True)
time.sleep(60)
"""


# An attempt whose task cannot kill its supervisor ends at its timeout; the task must have said so by then (an
# interpreter's start, two forks and a line), which a loaded machine may take seconds for. There is no earlier
# event to end it on: the timeout is what is shown.
REFUSED_KILL_TIMEOUT = 8


def _escaped(lines: list[tuple[str, str]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for stream, line in lines:
        if stream == "stdout" and line.startswith("{"):
            seen.update(json.loads(line))
    return seen


def test_each_attempt_runs_in_a_session_and_process_group_of_its_own(mode):
    """Not the worker's, not the zygote's, and not the attempt's before it (a warm supervisor serves attempt after
    attempt: each script's process takes a session of its own)."""
    source = "import json, os\nprint(json.dumps([os.getsid(0), os.getpgid(0)]))"
    seen = []
    for _ in range(4):
        out, lines = attempt(source, mode)
        assert out.returncode == 0, lines
        seen.append(tuple(json.loads(out.last_line or "")))
    sessions = [sid for sid, _ in seen]
    assert len(set(sessions)) == 4, seen
    assert len({pgid for _, pgid in seen}) == 4, seen
    theirs = {os.getsid(0)} | ({os.getsid(mode["zygote"].proc.pid)} if "zygote" in mode else set())
    assert not theirs & set(sessions), (seen, theirs)


@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup", "subreaper-only"])
@pytest.mark.parametrize("user", [None, "nobody"])
def test_a_task_that_kills_its_supervisor_leaves_nothing_running(mode, user, cgroup, monkeypatch):
    if user and (os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON)):
        pytest.skip("--sandbox-user needs a root worker and a Python nobody can read")
    if cgroup and tree.cgroup_base() is None:
        pytest.skip("this process may not make cgroups here")
    if not cgroup:  # as where no cgroup is delegated: the worker, as subreaper, must find what escaped
        monkeypatch.setattr(tree, "attempt_cgroups", lambda owner=None: (None, None))
    extra: dict[str, Any] = {"user": nobody(), "python": SYSTEM_PYTHON} if user else {}
    if user and "zygote" in mode:  # the zygote must run the interpreter the task user can read
        mode["zygote"].close()
        mode["zygote"] = Zygote(python=SYSTEM_PYTHON)
        mode["zygote"].start()
    if user and "spares" in mode:
        mode = {}  # --sandbox-user attempts always start cold
    # A warm supervisor serves attempt after attempt and never becomes the task's user: a task of another user
    # cannot signal it, and the attempt goes at its timeout. Every other supervisor is the task's user.
    out_of_reach = bool(user and "zygote" in mode)
    started = time.monotonic()
    out, lines = attempt(ESCAPE, mode, timeout=REFUSED_KILL_TIMEOUT if out_of_reach else 30, **extra)  # no isolation
    seen = _escaped(lines)
    if out_of_reach:
        assert seen.get("killed") is False and out.killed == "timeout", (lines, out.describe_exit())
    else:
        # The supervisor's death may take the task down before it says it killed it: the attempt's SIGKILL, well
        # before its timeout, says so too.
        killed = seen.get("killed") is True or (seen.get("killed") is None and out.returncode == -signal.SIGKILL)
        assert killed, (lines, out.describe_exit())
        assert time.monotonic() - started < 20, "the attempt ended when its supervisor died, not at its timeout"
    for what in ("task", "daemon"):
        assert not pid_alive(seen[what]), f"the {what} outlived its attempt ({seen[what]})"


@needs_landlock
@needs_scoped_signals
def test_under_isolation_a_task_cannot_even_signal_its_supervisor(mode):
    out, lines = attempt(ESCAPE, mode, timeout=REFUSED_KILL_TIMEOUT, isolation=landlock.Isolation())
    seen = _escaped(lines)
    assert seen.get("killed") is False, lines
    assert out.killed == "timeout"
    for what in ("task", "daemon"):
        assert not pid_alive(seen[what]), f"the {what} outlived its attempt ({seen[what]})"


def _own_cgroups(base: str) -> set[str]:
    return {n for n in os.listdir(base) if n.startswith(f"{tree.CGROUP_PREFIX}{os.getpid()}-")}


@pytest.mark.skipif(tree.cgroup_base() is None, reason="this process may not make cgroups here")
def test_where_a_cgroup_is_delegated_each_attempt_runs_in_its_own_and_it_goes_with_it(mode):
    """One cgroup per attempt, shared with nothing (the next attempt's spare waits in the next one), each
    removed once its attempt is over (a warm one once its supervisor, which serves the next attempts, has moved
    on: by the time the attempt after it runs), and nothing left once the executor stops."""
    base = tree.cgroup_base()
    assert base is not None
    before = _own_cgroups(base)
    source = """
        import os
        cg = [row.split(":", 2)[2] for row in open("/proc/self/cgroup").read().split() if "gpumesh-attempt-" in row][0]
        print(cg + " " + open(f"{os.environ['BASE']}/{cg}/cgroup.procs").read().replace(chr(10), ",")
              + f" {os.getpid()},{os.getppid()}")
        """

    def gone(path: str) -> bool:
        tree.release_cgroups()  # removed at once, or (the kernel lets go of an emptied cgroup a few ms late) now
        return not os.path.exists(path)

    seen = []
    for _ in range(3):
        out, lines = attempt(source, mode, env={"BASE": base})
        assert out.returncode == 0, lines
        own, members, script_and_supervisor = (out.last_line or "").split(" ")
        seen.append(own)
        _alone_in(members, script_and_supervisor)
        # A warm attempt's cgroup goes once its supervisor moved on, by the time the next attempt runs.
        done = seen[-2:-1] if "zygote" in mode else [own]
        for path in done:
            wait_until(
                functools.partial(gone, os.path.join(base, os.path.basename(path))), timeout=5, what="its cgroup to go"
            )
    assert len(set(seen)) == 3, seen
    (mode.get("zygote") or mode.get("spares") or sandbox.Spares()).close()
    wait_until(lambda: (tree.release_cgroups(), _own_cgroups(base) <= before)[1], timeout=5, what="no cgroup left")


def _alone_in(members: str, script_and_supervisor: str) -> None:
    """An attempt's cgroup (its members, as cgroup.procs lists them) holds its script and perhaps the script's
    supervisor (a warm one serves attempt after attempt: it is in the cgroup of the attempt it was prepared for,
    else the script's process joined it alone), and nothing else: no supervisor waiting for another attempt, nothing
    of another attempt."""
    script, _supervisor = script_and_supervisor.split(",")
    in_it = {m for m in members.split(",") if m}
    assert script in in_it and in_it <= set(script_and_supervisor.split(",")), (members, script_and_supervisor)


WHERE = """
import os
cg = [row.split(":", 2)[2] for row in open("/proc/self/cgroup").read().split() if "gpumesh-attempt-" in row][0]
print(f"{os.getppid()} {cg}")
"""


def _waiting_spare(held: dict[str, Any], ran_in: set[str]) -> tuple[int, str]:
    """The process waiting for the next attempt (warm: the zygote's idle supervisor prepared for it; fresh: the
    worker's --spare child), once it is in the cgroup of an attempt that has not run yet (none of ``ran_in``): its
    pid and that cgroup (as /proc/PID/cgroup names it)."""
    import psutil

    def spare() -> tuple[int, str] | None:
        z = held.get("zygote")
        if z is not None:
            kids = psutil.Process(z.proc.pid).children()
        else:
            kids = [p for p in psutil.Process().children() if "--spare" in p.cmdline()]
        found = []
        for kid in kids:
            rows = Path(f"/proc/{kid.pid}/cgroup").read_text().split()
            cgs = [row.split(":", 2)[2] for row in rows if tree.CGROUP_PREFIX in row]
            found += [(kid.pid, cg) for cg in cgs if cg not in ran_in]
        return found[0] if len(found) == 1 else None

    wait_until(lambda: spare() is not None, timeout=10, what="the spare to wait in the next attempt's cgroup")
    found = spare()
    assert found is not None
    return found


@pytest.mark.skipif(tree.cgroup_base() is None, reason="this process may not make cgroups here")
@pytest.mark.parametrize("kind", ["fresh", "warm"])
def test_the_spare_waits_in_the_next_attempt_s_cgroup_and_runs_that_attempt_there(kind):
    """The point of making the next attempt's cgroup early: its spare is in it before the attempt comes (the
    move can wait tens of ms in the kernel), and that spare supervises the attempt there. A zygote restarted
    in between, or an attempt that failed before anything was handed over, does not undo it."""
    held: dict[str, Any] = {}
    if kind == "warm":
        held["zygote"] = Zygote()
        held["zygote"].start()
    else:
        held["spares"] = sandbox.Spares()
    ran_in: set[str] = set()
    try:
        for step in ("first", "next", "after a failed start", "after a zygote restart", "again"):
            if step == "after a failed start":

                def no_stdin(*_a: Any, **_k: Any) -> Any:
                    raise OSError(28, "No space left on device")

                real = sandbox._payload_file
                sandbox._payload_file = no_stdin  # type: ignore[assignment]
                try:
                    with pytest.raises(OSError):
                        attempt(WHERE, held)
                finally:
                    sandbox._payload_file = real  # type: ignore[assignment]
            if step == "after a zygote restart":
                if kind != "warm":
                    continue
                os.kill(held["zygote"].proc.pid, signal.SIGKILL)
                wait_until(lambda: not held["zygote"].alive(), what="the zygote to die")
                out, lines = attempt(WHERE, held)  # restarts it; this attempt joins its cgroup itself
                assert out.returncode == 0, lines
                ran_in.add((out.last_line or "").split(" ")[1])
            spare = _waiting_spare(held, ran_in) if step != "first" else None
            out, lines = attempt(WHERE, held)
            assert out.returncode == 0, lines
            supervisor, cgroup = (out.last_line or "").split(" ")
            ran_in.add(cgroup)
            if spare is not None:
                assert (int(supervisor), cgroup) == spare, f"{step}: not run by the spare where it waited"
    finally:
        (held.get("zygote") or held["spares"]).close()


@pytest.mark.skipif(tree.cgroup_base() is None, reason="this process may not make cgroups here")
def test_attempts_forked_side_by_side_from_one_zygote_each_run_alone_in_a_cgroup_of_their_own():
    """The cgroup made ahead for a zygote's next attempt is one attempt's: attempts that overlap get their own."""
    import threading

    base = tree.cgroup_base()
    assert base is not None
    source = textwrap.dedent(
        """
        import os, time
        cg = [row.split(":", 2)[2] for row in open("/proc/self/cgroup").read().split() if "gpumesh-attempt-" in row][0]
        time.sleep(0.3)
        print(cg + " " + open(f"{os.environ['BASE']}/{cg}/cgroup.procs").read().replace(chr(10), ",")
              + f" {os.getpid()},{os.getppid()}")
        """
    )
    z = Zygote()
    z.start()
    results: list[sandbox.Attempt] = []

    def one() -> None:
        lim = sandbox.Limits(timeout=30, memory_bytes=0, grace=1.0)
        for _ in range(3):
            results.append(
                sandbox.run(source, "task.py", "{}", {"BASE": base}, lim, lambda s, line: None, lambda: None, z)
            )

    try:
        threads = [threading.Thread(target=one) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        z.close()
    assert len(results) == 9 and all(out.returncode == 0 for out in results), [r.stderr_tail for r in results]
    rows = [(out.last_line or "").split(" ") for out in results]
    assert len({own for own, _, _ in rows}) == 9, rows
    for _own, members, script_and_supervisor in rows:
        _alone_in(members, script_and_supervisor)


# -- 1. no escalation ---------------------------------------------------------------------------------------

ATTACKER = r"""
# Runs as the sandbox user for as long as it is let, as a daemon a task left behind would (or another worker's
# task, as the same user, on the same machine): it tries to get code run by root, and a root-owned file handed over.
# It attacks the attempts of the test process that started it (their directories name its pid), not those of tests
# running beside it, which it would only make fail.
import os, sys, time, site
marks, victim = sys.argv[1], sys.argv[2]
ours = f".{sys.argv[4]}-"
pth = "import os; open(os.path.join(%r, 'ran-as-%%d' %% os.getuid()), 'w')\n" % marks
userdir = os.path.relpath(site.getusersitepackages(), os.path.expanduser("~"))
hits = set()
deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    for name in os.listdir("/tmp"):
        path = os.path.join("/tmp", name)
        try:
            if name.startswith("gpumesh-launcher-"):  # replace the copy of the launcher that root runs
                with open(os.path.join(path, "_gpumesh_launcher.py"), "w") as f:
                    f.write("import os; open(os.path.join(%r, 'ran-as-%%d' %% os.getuid()), 'w')\n" % marks)
                hits.add("launcher")
            elif name.startswith("gpumesh-task-") and ours in name and os.access(path, os.W_OK):
                if (path, "pth") not in hits:  # user site-packages: a .pth file runs as the interpreter starts
                    os.makedirs(os.path.join(path, userdir), exist_ok=True)
                    with open(os.path.join(path, userdir, "zz.pth"), "w") as f:
                        f.write(pth)
                    hits.add((path, "pth"))
                for inner in ("task.py", "output"):  # names root may chown or remove: now symlinks to the victim
                    p = os.path.join(path, inner)
                    if not os.path.islink(p):
                        try:
                            os.rename(p, p + ".moved")
                        except OSError:
                            pass
                        os.symlink(victim, p)
        except OSError:
            pass
    time.sleep(0.0005)
"""

# The task itself swaps its directory for a symlink to a root-owned one just before it ends: the worker's
# clean-up, as root, must not remove the file of the same name in there.
SWAP = """
import os
here = os.getcwd()
os.rename(here, here + ".moved")
os.symlink({victim_dir!r}, here)
print("swapped")
"""


@pytest.fixture
def trap() -> Iterator[dict[str, Path]]:
    """Root-owned things an attacker running as nobody must never change, and where root running its code shows.
    In a directory of /tmp that nobody may traverse (pytest's own is 0700) but never write."""
    base = Path(tempfile.mkdtemp(prefix="gpumesh-test-trap-"))
    base.chmod(0o755)
    marks = base / "marks"
    marks.mkdir(mode=0o755)
    victim = base / "victim"
    victim.write_text("root's file\n")
    victim.chmod(0o600)
    victim_dir = base / "victim-dir"
    victim_dir.mkdir(mode=0o755)
    (victim_dir / "task.py").write_text("root's file, named like a task's\n")
    attacker = base / "attacker.py"
    attacker.write_text(ATTACKER)
    attacker.chmod(0o644)
    yield {"marks": marks, "victim": victim, "victim_dir": victim_dir, "attacker": attacker}
    shutil.rmtree(base, ignore_errors=True)
    # What the attacks left of this process's attempts: planted symlinks, renamed directories, and directories
    # the attacker refilled after the worker had emptied them (the worker never follows a name in there).
    for left in Path("/tmp").glob(f"gpumesh-task-*.{os.getpid()}-*"):
        if left.is_symlink():
            left.unlink()
        else:
            shutil.rmtree(left, ignore_errors=True)


def _attack(trap: dict[str, Path], seconds: float) -> subprocess.Popen[bytes]:
    uid, gid = nobody()
    return subprocess.Popen(
        [SYSTEM_PYTHON, str(trap["attacker"]), str(trap["marks"]), str(trap["victim"]), str(seconds), str(os.getpid())],
        user=uid, group=gid, extra_groups=[], cwd="/", env={"HOME": "/nonexistent", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip


def _untouched(trap: dict[str, Path]) -> None:
    assert sorted(os.listdir(trap["marks"])) == [], "code the task's user wrote ran in a process of the worker's"
    st = os.stat(trap["victim"])
    assert (st.st_uid, st.st_gid) == (0, 0), "a root-owned file was handed to the task's user"
    assert trap["victim"].read_text() == "root's file\n"
    assert (trap["victim_dir"] / "task.py").exists(), "root removed a file through a symlink the task planted"


@needs_root
@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "warm"])
def test_nothing_the_task_user_can_write_is_run_or_followed_by_root(trap, warm):
    zygote = Zygote(python=SYSTEM_PYTHON) if warm else None
    if zygote is not None:
        zygote.start()
    mode = {"zygote": zygote}
    user = {"user": nobody(), "python": SYSTEM_PYTHON}
    attacker = None
    try:
        # A first task leaves the attacker behind as a setsid daemon, as an attacker would: it must die with its attempt.
        left = f"""
            import os, subprocess, sys
            p = subprocess.Popen([sys.executable, {str(trap["attacker"])!r}, {str(trap["marks"])!r},
                                  {str(trap["victim"])!r}, "60", {str(os.getpid())!r}], start_new_session=True,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            print(p.pid)
        """
        out, _ = attempt(left, mode, **user)
        assert out.returncode == 0, out.stderr_tail
        assert not pid_alive(int(out.last_line or 0)), "the daemon a task left outlived its attempt"
        # A daemon of the same user that does run on (another worker's task) attacks every launch that follows.
        attacker = _attack(trap, 60)
        time.sleep(0.5)
        for _ in range(15):
            attempt("import os; print(os.getuid())", mode, **user)  # most fail: the attacker swaps their script
            assert attacker.poll() is None
        attacker.kill()
        attacker.wait()
        # The task swaps its own directory for a symlink to a root-owned one.
        out, lines = attempt(SWAP.format(victim_dir=str(trap["victim_dir"])), mode, **user)
        assert out.last_line == "swapped", lines
    finally:
        if attacker is not None and attacker.poll() is None:
            attacker.kill()
            attacker.wait()
        if zygote is not None:
            zygote.close()
    _untouched(trap)


# -- 3. Landlock: the task cannot read the host -----------------------------------------------------------

PEEK = """
import json, os, signal, sys
payload = json.load(sys.stdin)
def ppid(pid):
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
def cmdline(pid):
    return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
worker = os.getppid()
while "gpumesh worker" not in cmdline(worker):
    worker = ppid(worker)
seen = {}
def attempt(name, fn):
    try:
        seen[name] = fn()
    except OSError as exc:
        seen[name] = type(exc).__name__
def read(path, n=-1):
    with open(path, "rb") as f:
        return "read " + str(len(f.read(n)))
attempt("ssh_key", lambda: read(payload["key"]))
attempt("config", lambda: read(payload["config"]))
attempt("dataset", lambda: read(payload["dataset"]))
attempt("home", lambda: len(os.listdir(payload["home"])))
attempt("mem", lambda: read(f"/proc/{worker}/mem", 1))
attempt("environ", lambda: read(f"/proc/{worker}/environ"))
attempt("signal_worker", lambda: os.kill(worker, 0) or "sent")
attempt("write_outside", lambda: open(payload["outside"], "w").write("x"))
attempt("write_output", lambda: open(os.path.join(os.environ["GPUMESH_OUTPUT_DIR"], "ok.txt"), "w").write("ok"))
attempt("write_tmp", lambda: __import__("tempfile").NamedTemporaryFile(dir=None).name.startswith(os.getcwd()))
import decimal, numpy  # the standard library and site-packages stay readable
seen["numpy"] = int(numpy.arange(4).sum())
print(json.dumps(seen))
"""


@pytest.fixture
def host(tmp_path: Path, env: dict[str, str]) -> dict[str, Any]:
    """A worker home with a private key and the config file that holds the broker URL, and a dataset dir."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    key = home / ".ssh" / "id_ed25519"
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY----- stand-in\n")
    key.chmod(0o600)
    config = home / ".config" / "gpumesh" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f'url = "{env["GPUMESH_URL"]}"\n')
    config.chmod(0o600)
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    (dataset / "train.csv").write_text("x,y\n1,2\n")
    payload = {
        "key": str(key), "config": str(config), "home": str(home), "dataset": str(dataset / "train.csv"),
        "outside": str(tmp_path / "written-by-a-task"),
    }  # fmt: skip
    return {"home": home, "config": config, "dataset": dataset, "payload": payload}


def _peek(env: dict[str, str], workers: Workers, host: dict[str, Any], tmp_path: Path, *args: str) -> dict[str, Any]:
    script = tmp_path / "peek.py"
    script.write_text(PEEK)
    # Nothing more readable than the defaults, whatever the suite's environment lets other tests' tasks write.
    no_extra = {"GPUMESH_READ_PATHS": "", "GPUMESH_WRITE_PATHS": ""}
    workers.start(*args, HOME=str(host["home"]), GPUMESH_CONFIG=str(host["config"]), **no_extra)
    payloads = json.dumps([host["payload"]])
    job = gpumesh("submit", str(script), "--payloads", "-", env=env, input=payloads).stdout.strip()
    wait_until(lambda: json.loads(gpumesh("status", job, "--json", env=env).stdout)["status"] in ("done", "failed"))
    (row,) = json.loads(gpumesh("results", job, "--format", "json", env=env).stdout)
    assert row["status"] == "done", (row, workers.log(len(workers.procs) - 1))
    return dict(row["result"])


# A task that leaves a file in its output directory and says where; the next one tries to read it.
LEAVE = """
import json, os
path = os.path.join(os.environ["GPUMESH_OUTPUT_DIR"], "secret.txt")
open(path, "w").write("another job's output")
print(json.dumps({"path": path}))
"""
PRY = """
import json, sys
path = json.load(sys.stdin)["path"]
try:
    seen = open(path).read()
except OSError as exc:
    seen = type(exc).__name__
print(json.dumps({"seen": seen}))
"""


@needs_landlock
def test_a_confined_attempt_cannot_read_the_directory_of_the_attempt_before_and_it_goes_as_this_one_runs(mode):
    """A worker removes an ended attempt's directory while the next attempt runs (off the path between the
    two), and only where Landlock confines that next attempt to its own directory: it must not read the
    output files of the attempt before it (another job's, perhaps). Unconfined, the directory goes at once."""
    lim = sandbox.Limits(timeout=30, memory_bytes=0, grace=1.0, isolation=landlock.Isolation())

    def run(source: str, payload: str, later: sandbox.Meanwhile, limits: sandbox.Limits = lim) -> sandbox.Attempt:
        out = sandbox.run(textwrap.dedent(source), "task.py", payload, {}, limits, lambda s, line: None,
                          lambda: None, zygote=mode.get("zygote"), spares=mode.get("spares"), meanwhile=later)  # fmt: skip
        assert out.returncode == 0, list(out.stderr_tail)
        return out

    held, other = sandbox.Meanwhile(), sandbox.Meanwhile()
    left = Path(json.loads(run(LEAVE, "{}", held).last_line or "")["path"])
    assert left.exists(), "left for later"
    # Another attempt while it is still there (another worker's, say: nothing removes it meanwhile).
    pried = run(PRY, json.dumps({"path": str(left)}), other)
    assert json.loads(pried.last_line or "")["seen"] == "PermissionError"
    assert left.exists()
    run(PRY, json.dumps({"path": str(left)}), held)  # the next attempt of the same worker: it goes meanwhile
    assert not left.parent.parent.exists(), "removed while the next attempt ran"
    for later in (held, other):
        later.run()  # what the worker does when it has no task: nothing of any attempt is left
    assert not list(Path(tempfile.gettempdir()).glob(f"gpumesh-task-*.{os.getpid()}-*"))

    unconfined = Path(
        json.loads(run(LEAVE, "{}", held, dataclasses.replace(lim, isolation=None)).last_line or "")["path"]
    )
    assert not unconfined.parent.parent.exists(), "an unconfined attempt's directory goes at once"


HERE = "import json, os\nprint(json.dumps({'cwd': os.getcwd()}))\n"
PLANT = """
import json, os, sys
where = json.load(sys.stdin)["dir"]
seen = {}
for what, act in [("list", lambda: os.listdir(where)), ("write", lambda: open(os.path.join(where, "json.py"), "w")),
                  ("plant_output", lambda: open(os.path.join(where, "output", "planted.txt"), "w"))]:
    try:
        act()
        seen[what] = "done"
    except OSError as exc:
        seen[what] = type(exc).__name__
print(json.dumps(seen))
"""


@needs_landlock
def test_the_next_attempt_s_directory_is_made_beside_this_one_out_of_its_reach(mode):
    """While an attempt runs, the worker makes the next attempt's directory (off the path between the two):
    the next attempt runs in it, no confined attempt can reach into it, an unconfined attempt gets none made
    beside it, and a worker with nothing to run keeps none."""
    lim = sandbox.Limits(timeout=30, memory_bytes=0, grace=1.0, isolation=landlock.Isolation())

    def run(source: str, payload: str, later: sandbox.Meanwhile, limits: sandbox.Limits = lim) -> dict[str, Any]:
        out = sandbox.run(source, "task.py", payload, {}, limits, lambda s, line: None, lambda: None,
                          zygote=mode.get("zygote"), spares=mode.get("spares"), meanwhile=later)  # fmt: skip
        assert out.returncode == 0, list(out.stderr_tail)
        return dict(json.loads(out.last_line or ""))

    held, other = sandbox.Meanwhile(), sandbox.Meanwhile()
    first = run(HERE, "{}", held)["cwd"]
    assert held._ready is not None, "made while the attempt ran"
    ahead = held._ready[0]
    assert ahead != first and os.listdir(ahead) == ["output"] and not os.listdir(os.path.join(ahead, "output"))
    assert stat.S_IMODE(os.stat(ahead).st_mode) == 0o700
    seen = run(PLANT, json.dumps({"dir": ahead}), other)  # a confined attempt reaching for it
    assert seen == {"list": "PermissionError", "write": "PermissionError", "plant_output": "PermissionError"}, seen
    assert run(HERE, "{}", held)["cwd"] == ahead, "the next attempt runs in it"
    for later in (held, other):
        later.run()  # what the worker does when it has no task
    assert held._ready is None and not list(Path(tempfile.gettempdir()).glob(f"gpumesh-task-*.{os.getpid()}-*"))

    unconfined = sandbox.Meanwhile()
    run(HERE, "{}", unconfined, dataclasses.replace(lim, isolation=None))
    assert unconfined._ready is None, "an unconfined attempt could write into it: none is made beside it"

    # Confined, but its rules reach the worker's temp dir (here a --write-path of it): neither made ahead nor left.
    reaching = sandbox.Meanwhile()
    where = run(
        HERE, "{}", reaching, dataclasses.replace(lim, isolation=landlock.Isolation(write=(tempfile.gettempdir(),)))
    )
    assert reaching._ready is None and not os.path.exists(where["cwd"])


@needs_landlock
@pytest.mark.parametrize("touch", ["chmod", "plant", "swap"])
def test_a_directory_made_ahead_that_was_touched_is_not_used(touch):
    """Whatever changed the next attempt's directory since it was made (another process of the worker's user: Landlock
    does not stop a chmod), the next attempt runs in a new one, and the touched one goes."""
    lim = sandbox.Limits(timeout=30, memory_bytes=0, grace=1.0, isolation=landlock.Isolation())
    held = sandbox.Meanwhile()

    def cwd() -> str:
        out = sandbox.run(HERE, "task.py", "{}", {}, lim, lambda s, line: None, lambda: None, meanwhile=held)
        assert out.returncode == 0, list(out.stderr_tail)
        return str(json.loads(out.last_line or "")["cwd"])

    cwd()
    assert held._ready is not None
    ahead = held._ready[0]
    if touch == "chmod":
        os.chmod(ahead, 0o777)
    elif touch == "plant":
        Path(ahead, "output", "planted.txt").write_text("not this attempt's")
    else:
        os.rename(ahead, ahead + ".away")
        os.mkdir(ahead, 0o700)
        os.mkdir(os.path.join(ahead, "output"), 0o700)
    assert cwd() != ahead
    held.run()
    assert not os.path.exists(ahead) or touch == "swap"
    if touch == "swap":  # emptied through its descriptor where it went; what was put at its name is left alone
        assert os.listdir(ahead + ".away") == [] and os.path.isdir(os.path.join(ahead, "output"))
        os.rmdir(ahead + ".away")
        shutil.rmtree(ahead)


@needs_landlock
@pytest.mark.usefixtures("both_modes")
def test_a_task_cannot_read_the_worker_s_home_config_or_memory_nor_signal_it(env, workers, host, tmp_path: Path):
    seen = _peek(env, workers, host, tmp_path, "--read-path", str(host["dataset"]))
    assert seen["ssh_key"] == "PermissionError", seen
    assert seen["config"] == "PermissionError", seen
    assert seen["home"] == "PermissionError", seen
    assert seen["mem"] == "PermissionError" and seen["environ"] == "PermissionError", seen
    if landlock.abi() >= 6:
        assert seen["signal_worker"] == "PermissionError", seen
    assert seen["write_outside"] == "PermissionError" and not Path(host["payload"]["outside"]).exists()
    assert seen["dataset"] == "read 8", "a --read-path is readable"
    assert seen["write_output"] == 2 and seen["write_tmp"] is True and seen["numpy"] == 6, seen
    log = workers.log(0)
    assert log.count("tasks isolated with Landlock") == 1, log


@pytest.mark.usefixtures("both_modes")
def test_no_isolation_is_said_once_and_then_the_host_is_readable(env, workers, host, tmp_path: Path):
    """What --no-isolation gives up (and what shows the test above can fail)."""
    seen = _peek(env, workers, host, tmp_path, "--no-isolation")
    assert seen["ssh_key"].startswith("read") and seen["config"].startswith("read"), seen
    assert seen["signal_worker"] == "sent", seen
    log = workers.log(0)
    assert log.count("isolation off (--no-isolation)") == 1, log


def test_a_read_path_that_does_not_exist_is_one_line_and_exit_2(env, tmp_path: Path):
    p = gpumesh("worker", "--read-path", str(tmp_path / "no-such-dataset"), env=env, timeout=30)
    assert p.returncode == 2, p.stderr
    assert "no-such-dataset" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


@needs_root
def test_an_interpreter_the_sandbox_user_could_replace_is_refused_at_start(env):
    """Root runs the sandbox interpreter before it drops to the sandbox user: not one that user may swap."""
    uid, gid = nobody()
    theirs = Path(tempfile.mkdtemp(prefix="gpumesh-test-theirs-"))
    try:
        theirs.chmod(0o755)
        (theirs / "python3").symlink_to(SYSTEM_PYTHON)
        os.chown(theirs, uid, gid)
        run = {**env, "GPUMESH_SANDBOX_PYTHON": str(theirs / "python3")}
        p = gpumesh("worker", "--score", "10", "--burst", "--sandbox-user", "nobody", env=run, timeout=60)
    finally:
        shutil.rmtree(theirs, ignore_errors=True)
    assert p.returncode == 2, p.stderr
    assert f"the sandbox user can change {theirs}" in p.stderr and "Traceback" not in p.stderr, p.stderr


# -- 4. Unix sockets, and a task that leaves its cgroup -----------------------------------------------------

# The task connects to a Unix socket that the test process (standing in for systemd --user, D-Bus, docker)
# listens on, and says what happened.
CONNECT = """
import json, socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect({address!r})
    s.sendall(b"from the task")
    print(json.dumps({{"connect": "connected"}}))
except OSError as exc:
    print(json.dumps({{"connect": type(exc).__name__}}))
"""


@pytest.fixture
def listener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """A Unix socket listening in this process: abstract, or at a path outside every task's view."""
    import socket

    if request.param == "abstract":
        address: Any = f"\0gpumesh-test-{os.getpid()}-{time.monotonic_ns()}"
    else:
        address = str(tmp_path / "host.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(address)
    s.listen(8)
    s.settimeout(0)
    yield address, s
    s.close()


def _accepted(s: Any) -> bytes:
    try:
        conn, _ = s.accept()
    except BlockingIOError:
        return b""
    with conn:
        conn.settimeout(2)
        return bytes(conn.recv(64))


@needs_landlock
@pytest.mark.skipif(landlock.abi() < 6, reason="abstract Unix sockets are scoped from Landlock ABI 6")
@pytest.mark.parametrize("listener", ["abstract"], indirect=True)
def test_a_confined_task_cannot_connect_to_an_abstract_socket_of_the_host(mode, listener):
    address, s = listener
    source = CONNECT.format(address=address)
    out, lines = attempt(source, mode, isolation=landlock.Isolation())
    assert out.returncode == 0, lines
    assert _escaped(lines).get("connect") == "PermissionError", lines
    assert _accepted(s) == b"", "the host's listener heard from a confined task"
    # Without isolation the same task gets through: what shows the refusal above is Landlock's.
    out, lines = attempt(source, mode)
    assert _escaped(lines).get("connect") == "connected", lines
    assert _accepted(s) == b"from the task"


@needs_landlock
@pytest.mark.skipif(landlock.abi() < landlock.UNIX_SOCKETS_ABI, reason="pathname sockets are confined from ABI 9")
@pytest.mark.parametrize("listener", ["pathname"], indirect=True)
def test_a_confined_task_cannot_connect_to_a_pathname_socket_outside_its_view(mode, listener):
    address, s = listener
    out, lines = attempt(CONNECT.format(address=address), mode, isolation=landlock.Isolation())
    assert _escaped(lines).get("connect") == "PermissionError", lines
    assert _accepted(s) == b""


def test_a_root_worker_without_sandbox_user_warns_once_that_tasks_reach_root_s_sockets(workers):
    if os.geteuid() != 0:
        pytest.skip("a worker that is not root runs tasks as its own user")
    workers.start()
    log = workers.log(0)
    assert log.count("runs as root without --sandbox-user: tasks run as uid 0") == 1, log
    assert "/run/systemd/private" in log and "start it with --sandbox-user USER" in log, log
    if landlock.abi() < landlock.UNIX_SOCKETS_ABI:  # said with the isolation line, once
        assert log.count("does not confine pathname Unix sockets") == 1, log


@needs_root
def test_a_root_worker_with_a_sandbox_user_does_not_warn_about_root_s_sockets(workers):
    workers.start("--sandbox-user", "nobody", GPUMESH_SANDBOX_PYTHON=SYSTEM_PYTHON)
    log = workers.log(0)
    assert "tasks isolated with Landlock" in log or "NOT isolated" in log, log
    assert "without --sandbox-user" not in log, log


# With no Landlock, as the worker's user (root here), the task leaves its cgroup for the worker's, starts a daemon
# there (fork, setsid, fork) and SIGKILLs its supervisor: the cgroup, emptied, no longer says what it started.
LEAVE_CGROUP = """
import json, os
with open(os.path.join(BASE, "cgroup.procs"), "w") as f:
    f.write("0")
print(json.dumps({"left": "gpumesh-attempt-" not in open("/proc/self/cgroup").read()}), flush=True)
"""


@pytest.mark.skipif(tree.cgroup_base() is None, reason="this process may not make cgroups here")
def test_a_task_that_leaves_its_cgroup_and_kills_its_supervisor_leaves_nothing_running(mode):
    base = tree.cgroup_base()
    assert base is not None
    started = time.monotonic()
    out, lines = attempt(f"BASE = {base!r}" + LEAVE_CGROUP + ESCAPE, mode)
    seen = _escaped(lines)
    # The supervisor's death may take the task down before it says it killed it: the attempt's SIGKILL says so too.
    killed = seen.get("killed") is True or out.returncode == -signal.SIGKILL
    assert seen.get("left") is True and killed, (lines, out.describe_exit())
    assert time.monotonic() - started < 20, "the attempt ended when its supervisor died, not at its timeout"
    for what in ("task", "daemon"):
        assert not pid_alive(seen[what]), f"the {what} outlived its attempt ({seen[what]})"


def test_a_supervisor_that_cannot_join_its_attempt_s_cgroup_runs_nothing(mode, monkeypatch, tmp_path: Path):
    """The worker made the attempt a cgroup: a task that would run outside it does not run at all."""
    monkeypatch.setattr(tree, "attempt_cgroups", lambda owner=None: (str(tmp_path / "not-a-cgroup"), None))
    marker = tmp_path / "ran"
    out, lines = attempt(f"open({str(marker)!r}, 'w').write('ran')", mode)
    assert out.returncode == 70, (lines, out.describe_exit())
    assert not marker.exists(), "the task ran outside its cgroup"
    assert any("could not join the attempt's cgroup" in line for _, line in lines), lines


@needs_landlock
def test_a_confined_task_reads_opt_but_opens_no_terminal(mode):
    """/opt is readable (CUDA at /opt/cuda, conda); terminals are not: a task that could open /dev/pts/N could
    read what is typed in the shell its worker was started from."""
    source = """
import json, os
try:
    os.openpty()
    pty = "opened"
except OSError as exc:
    pty = type(exc).__name__
print(json.dumps({"pty": pty, "opt": isinstance(os.listdir("/opt"), list)}))
"""
    if not os.path.isdir("/opt"):
        pytest.skip("no /opt on this machine")
    out, lines = attempt(source, mode, isolation=landlock.Isolation())
    assert out.returncode == 0, lines
    assert _escaped(lines) == {"pty": "PermissionError", "opt": True}, lines


# What each attempt may write, asked in turn of one zygote: a warm spare builds the last attempt's rules before
# its own attempt comes, so each attempt must still get exactly its own, whether they match the last one's or not.
WRITES = """
import json, os, sys
def writes(path):
    try:
        with open(os.path.join(path, "probe-%d" % os.getpid()), "w") as f:
            f.write("x")
        return True
    except OSError:
        return False
print(json.dumps({"own": writes(os.environ["TMPDIR"]), "shared": writes(json.load(sys.stdin)["shared"])}))
"""


def writes_seen(z: Zygote, payload: str, isolation: landlock.Isolation) -> dict[str, Any]:
    """One warm attempt of WRITES on ``z``: where it could write."""
    lines: list[tuple[str, str]] = []
    lim = sandbox.Limits(timeout=30, memory_bytes=0, grace=1.0, isolation=isolation)
    out = sandbox.run(
        WRITES, "task.py", payload, {}, lim, lambda s, line: lines.append((s, line)), lambda: None, zygote=z
    )
    assert out.returncode == 0, lines
    return _escaped(lines)


@needs_landlock
def test_each_warm_attempt_gets_its_own_rules_whatever_the_last_attempt_had(tmp_path: Path):
    shared = tmp_path / "shared"
    shared.mkdir()
    payload = json.dumps({"shared": str(shared)})
    granted, denied = landlock.Isolation(write=(str(shared),)), landlock.Isolation()
    z = Zygote()
    z.start()
    seen = []
    try:
        # Granted, then not (built for the grant), not again (built for these very rules), granted again.
        for isolation in (granted, denied, denied, granted, denied):
            seen.append(writes_seen(z, payload, isolation))
    finally:
        z.close()
    expect = [{"own": True, "shared": grant} for grant in (True, False, False, True, False)]
    assert seen == expect
    assert len(list(shared.iterdir())) == 2, "only the two attempts granted it wrote there"


@needs_landlock
def test_an_owner_s_write_path_is_resolved_at_each_attempt_not_ahead_by_the_spare(tmp_path: Path):
    """A --write-path may be a name its owner (or anyone who may write its parent) repoints: each attempt gets
    what it names when the attempt starts, resolved as the task's user, never what a spare resolved ahead."""
    first, second, shared = tmp_path / "first", tmp_path / "second", tmp_path / "shared"
    first.mkdir()
    second.mkdir()
    shared.symlink_to(first)
    isolation = landlock.Isolation(write=(str(shared),))
    payload = json.dumps({"shared": str(shared)})
    z = Zygote()
    z.start()
    seen = []
    try:
        for target in (first, second):
            shared.unlink()
            shared.symlink_to(target)  # while the next attempt's spare waits, built already
            seen.append(writes_seen(z, payload, isolation))
    finally:
        z.close()
    assert seen == [{"own": True, "shared": True}] * 2
    assert len(list(first.iterdir())) == 1 and len(list(second.iterdir())) == 1


@needs_landlock
def test_a_rule_set_built_ahead_is_not_used_for_a_script_directory_that_is_one_of_the_interpreter_s(tmp_path: Path):
    """A spare builds the interpreter's rules before its attempt is known, without the attempt's directory left out
    of them: it is used only where that directory is none of the interpreter's paths, by any name (a symlink to
    one is the same directory). Run in a process of its own: building the rules ahead drops a root process's
    bounding set."""
    (tmp_path / "own").mkdir()
    (tmp_path / "to-prefix").symlink_to(sys.prefix)
    check = textwrap.dedent(
        """
        import json, os, sys
        from gpumesh.sandbox import landlock, launcher
        took = {}
        for name in sys.argv[1:]:
            rules = landlock.rules(landlock.Isolation(), name)
            launcher.prepare_landlock(rules)
            fd = launcher.take_prepared(json.loads(rules), name)
            took[name] = fd is not None
            if fd is not None:
                os.close(fd)
        print(json.dumps(took))
        """
    )
    names = [str(tmp_path / "own"), sys.prefix, str(tmp_path / "to-prefix")]
    out = subprocess.run([sys.executable, "-c", check, *names], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {names[0]: True, names[1]: False, names[2]: False}


def test_a_warm_supervisor_compiles_a_script_without_opening_the_file_its_name_names(tmp_path: Path):
    """Python reads the file a code's name names to show a syntax error's or a warning's line. The supervisor (root,
    unconfined) compiles the script the worker sent: never through the attempt's file, which a task's user may have
    swapped for a FIFO (a hang) or a link to a file only root reads (its line in a log, or cached for later tasks)."""
    fifo = tmp_path / "task.py"
    os.mkfifo(fifo)
    check = textwrap.dedent(
        """
        import json, linecache, sys
        from gpumesh.sandbox import launcher
        took = {}
        for name, source in (("warning", "x = 1\\nif x is 1: pass\\n"), ("syntax error", "return 5\\n"),
                             ("fine", "x = 1\\n")):
            code = launcher._compiled(source, sys.argv[1])
            took[name] = code is not None and code.co_filename == sys.argv[1]
        print(json.dumps({"took": took, "cached": sys.argv[1] in linecache.cache}))
        """
    )
    out = subprocess.run([sys.executable, "-c", check, str(fifo)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"took": {"warning": False, "syntax error": False, "fine": True}, "cached": False}
    assert "is" not in out.stderr, "no warning of the task's shown by the supervisor"


def test_a_warm_task_finds_nothing_of_another_job_s_script_in_its_supervisor(tmp_path: Path):
    """A supervisor serves attempts of any job, and each script's process is a copy of it: the script it compiled for
    one job is gone once an attempt of another job comes, inlined or not (a script over the inline size is read from
    its file by its own process)."""
    z = Zygote()
    z.start()
    try:
        lim = sandbox.Limits(timeout=30, memory_bytes=0, grace=1.0)
        for _ in range(3):  # every supervisor the zygote keeps has compiled it
            out = sandbox.run("SECRET = 'job-a-secret'\n", "a.py", "{}", {}, lim, lambda s, line: None, lambda: None, z)
            assert out.returncode == 0
        peek = "import sys\nprint('job-a-' + 'secret' in repr(sys._getframe(1).f_globals.get('_CODE')))\n"
        big = peek + "#" * SOURCE_INLINE_MAX + "\n"  # not inlined
        for source in (big, peek + "# job b\n"):
            out = sandbox.run(source, "b.py", "{}", {}, lim, lambda s, line: None, lambda: None, z)
            assert out.returncode == 0, list(out.stderr_tail)
            assert out.last_line == "False"
    finally:
        z.close()
