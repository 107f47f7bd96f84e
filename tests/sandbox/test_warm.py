"""What only the warm executor can get wrong: state shared through the zygote, its own death, preloads.

The behaviour both executors share (limits, kills, output, the mesh) is tested in both modes by
test_sandbox.py, test_mesh.py and test_faults.py."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil
import pytest
import redis

from gpumesh.sandbox import landlock, namespaces
from gpumesh.sandbox import runner as sandbox
from gpumesh.sandbox.preloaded import JobZygote
from gpumesh.sandbox.warm import ZYGOTE_LOST, Zygote, ZygoteError

from ..conftest import OPEN_FDS_SCRIPT, gpumesh, pid_alive, wait_until


def zygote_children(zygote) -> tuple[int, int]:
    """(idle, busy) supervisors among a zygote's children (a psutil.Process): a busy one has a child, the
    process running its attempt's script."""
    idle = busy = 0
    for child in zygote.children():
        try:
            running = bool(child.children())
        except psutil.NoSuchProcess:  # reaped meanwhile
            continue
        busy += running
        idle += not running
    return idle, busy


def run(zygote: Zygote, source: str, **limits):
    named = {"timeout": 20, "memory_bytes": 0, "grace": 1.0, **limits}
    # a job's preload zygote: its attempts run in its env, confined as it is
    lim = dataclasses.replace(zygote.limits, **named) if isinstance(zygote, JobZygote) else sandbox.Limits(**named)
    return sandbox.run(textwrap.dedent(source), "task.py", "{}", {}, lim, lambda s, line: None, lambda: None, zygote)


MakeZygote = Callable[..., Zygote]


@pytest.fixture(scope="module")
def env_python(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """An environment as gpumesh.envs makes one (a venv made by uv, on this Python): its interpreter and site."""
    root = tmp_path_factory.mktemp("env") / "env"
    uv = Path(sys.executable).with_name("uv")
    subprocess.run([str(uv), "venv", "-q", str(root), "--python", sys.executable], check=True, env={
        **os.environ, "UV_NO_INDEX": "1", "UV_PYTHON_DOWNLOADS": "never"})  # fmt: skip
    (site,) = root.glob("lib/python3*/site-packages")
    return str(root / "bin" / "python"), str(site)


@pytest.fixture(params=["worker", "env"])
def make_zygote(request: pytest.FixtureRequest, tmp_path: Path) -> MakeZygote:
    """The warm guarantees hold for both zygotes: the worker's own (its --preload), and a job's preload zygote in
    the job's env (gpumesh.sandbox.preloaded), confined as its tasks are. ``modules``: files the preload may import
    (path -> text), on PYTHONPATH for the worker's, in the env's site-packages for the job's."""

    def make(preload: Sequence[str] = (), modules: Mapping[str, str] | None = None) -> Zygote:
        if request.param == "worker":
            for rel, text in (modules or {}).items():
                (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp_path / rel).write_text(text)
            return Zygote(list(preload), env={"PYTHONPATH": str(tmp_path)} if modules else None)
        python, site = request.getfixturevalue("env_python")
        for rel, text in (modules or {}).items():
            (Path(site) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(site) / rel).write_text(text)
        isolation = None
        if landlock.abi() > 0:
            # the test's folder as a --write-path: a task there says it started (its pid file)
            isolation = landlock.Isolation(write=(str(tmp_path),), private=namespaces.unavailable() is None)
        limits = sandbox.Limits(timeout=20, memory_bytes=0, grace=1.0, python=python, site=site, isolation=isolation)
        return JobZygote("job-" + request.node.name[-20:], list(preload), limits)

    return make


@pytest.mark.security
def test_each_task_starts_from_the_zygote_not_from_the_task_before(tmp_path: Path, make_zygote: MakeZygote):
    z = make_zygote(["json", "decimal"])
    z.start()
    try:
        src = """
            import json, os, random, sys
            seen = "leaked_by_an_earlier_task" in sys.modules
            sys.modules["leaked_by_an_earlier_task"] = sys
            print(json.dumps({"seen": seen, "preloaded": "decimal" in sys.modules,
                              "rand": random.random(), "pid": os.getpid(), "tmp": os.environ["TMPDIR"],
                              "tempdir": __import__("tempfile").gettempdir()}))
        """
        first, second = (json.loads(run(z, src).last_line) for _ in range(2))
    finally:
        z.close()
    assert not first["seen"] and not second["seen"], "a task must not see what an earlier one imported"
    assert first["preloaded"] and second["preloaded"], "--preload modules are already imported"
    assert first["rand"] != second["rand"], "each task gets its own random seed"
    assert first["pid"] != second["pid"]
    assert first["tempdir"] == first["tmp"] and second["tempdir"] == second["tmp"] != first["tmp"]


@pytest.mark.security
def test_the_zygote_holds_no_credentials(monkeypatch, make_zygote: MakeZygote):
    monkeypatch.setenv("GPUMESH_URL", "redis://:hunter2@127.0.0.1:1/0")
    monkeypatch.setenv("REDIS_PASSWORD", "hunter2")
    z = make_zygote()
    z.start()
    try:
        assert z.proc is not None
        # the zygote, and (a job's) the confined process below its supervisor that imported the preload
        pids = [z.proc.pid, *(p.pid for p in psutil.Process(z.proc.pid).children(recursive=True))]
        environ = [Path(f"/proc/{pid}/environ").read_bytes() for pid in pids]
        cmdline = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in pids]
    finally:
        z.close()
    assert all(b"hunter2" not in e and b"GPUMESH_URL" not in e for e in environ)
    assert all(b"hunter2" not in c for c in cmdline)


@pytest.mark.security
def test_a_task_holds_no_descriptor_but_its_stdio(make_zygote: MakeZygote):
    """Neither the zygote's socket to the worker nor the attempt's reply socket (on which a task could tell the
    worker its own outcome) reaches the task: only its stdin, stdout and stderr."""
    z = make_zygote(["json"])
    z.start()
    try:
        outs = [run(z, OPEN_FDS_SCRIPT) for _ in range(2)]
    finally:
        z.close()
    for out in outs:
        assert out.returncode == 0, list(out.stderr_tail)
        assert sorted(json.loads(out.last_line)) == ["0", "1", "2"], out.last_line


@pytest.mark.processes
def test_a_preload_that_writes_much_at_import_does_not_stall_its_zygote(make_zygote: MakeZygote):
    z = make_zygote(
        ["chatty"],
        # it writes a temp file as it imports, too (a cache): its zygote has a HOME and TMPDIR it may write
        {
            "chatty.py": "import sys, tempfile\ntempfile.TemporaryFile().write(b'x')\n"
            "for _ in range(4096):\n    print('x' * 255, file=sys.stderr)\n"
        },
    )
    z.start()
    try:
        out = run(z, "import json, sys\nprint(json.dumps('chatty' in sys.modules))\n")
    finally:
        z.close()
    assert out.returncode == 0 and out.last_line == "true", list(out.stderr_tail)


@pytest.mark.faults
def test_a_zygote_that_dies_mid_attempt_fails_that_attempt_and_is_restarted(tmp_path: Path, make_zygote: MakeZygote):
    pidfile = tmp_path / "pid"
    z = make_zygote()
    z.start()
    try:
        result: list[sandbox.Attempt] = []
        src = f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(300)"
        t = threading.Thread(target=lambda: result.append(run(z, src)))
        t.start()
        wait_until(lambda: pidfile.exists() and pidfile.read_text(), what="the task to start")
        task = int(pidfile.read_text())
        assert z.proc is not None
        os.kill(z.proc.pid, signal.SIGKILL)
        t.join(timeout=15)
        assert not t.is_alive()
        assert result[0].killed == ZYGOTE_LOST
        wait_until(lambda: not pid_alive(task), timeout=8, what="the task to die with its zygote")
        again = run(z, "print('{\"ok\": 1}')")
        assert again.returncode == 0 and again.last_line == '{"ok": 1}'
        assert z.started == 2
    finally:
        z.close()


@pytest.mark.security
def test_a_supervisor_that_died_while_waiting_is_replaced_by_one_that_holds_nothing_of_the_attempt():
    """The zygote forks its supervisors ahead; those killed while they wait (the OOM killer, an operator) are
    replaced when the attempt comes, by a fork that must not keep the attempt's reply socket (on which a task
    could tell the worker its own outcome) or a second copy of its stdio."""
    z = Zygote()
    z.start()
    try:
        assert run(z, "print('{}')").returncode == 0
        assert z.proc is not None
        zygote = psutil.Process(z.proc.pid)
        wait_until(lambda: zygote_children(zygote)[1] == 0 and zygote.children(), what="only idle supervisors left")
        for idle in zygote.children():
            idle.kill()
        wait_until(lambda: not zygote.children(), what="the zygote to reap them")
        out = run(z, OPEN_FDS_SCRIPT)
    finally:
        z.close()
    assert out.returncode == 0, list(out.stderr_tail)
    assert sorted(json.loads(out.last_line)) == ["0", "1", "2"], out.last_line


@pytest.mark.security
def test_the_zygote_rides_out_its_supervisors_killed_at_any_moment():
    """Supervisors SIGKILLed at random moments, waiting or running an attempt (the OOM killer, an operator): each
    attempt runs to its end or ends killed with its supervisor, none is taken for the zygote's death, and the zygote
    itself is never restarted."""
    import random

    z = Zygote()
    z.start()
    done = threading.Event()
    kills = 0
    killed: list[int] = []

    def kill_one_now_and_then() -> None:
        nonlocal kills
        assert z.proc is not None
        zygote = psutil.Process(z.proc.pid)
        while not done.is_set():
            time.sleep(random.uniform(0.001, 0.02))
            try:
                children = zygote.children()
            except psutil.Error:
                continue
            for child in random.sample(children, random.randint(0, len(children))):  # one, several or all at once
                try:
                    child.kill()
                    kills += 1
                    killed.append(child.pid)
                except psutil.Error:
                    pass

    killer = threading.Thread(target=kill_one_now_and_then)
    killer.start()
    try:
        outcomes = [run(z, "print('{\"ok\": 1}')") for _ in range(150)]
    finally:
        done.set()
        killer.join()
    wait_until(lambda: not any(pid_alive(pid) for pid in killed), what="the last one killed to be gone")
    try:
        after = run(z, "print('{\"ok\": 1}')")
    finally:
        z.close()
    assert kills >= 20, f"only {kills} supervisors were killed: the test did not test much"
    for out in outcomes:
        assert (out.returncode, out.killed) in ((0, None), (-signal.SIGKILL, None)), out.describe_exit()
        assert out.returncode != 0 or out.last_line == '{"ok": 1}'
    assert any(out.returncode == 0 for out in outcomes)
    assert z.started == 1, "the zygote died"
    assert after.returncode == 0 and after.last_line == '{"ok": 1}'


@pytest.mark.core
def test_supervisors_serve_attempt_after_attempt_and_one_is_ready_while_a_long_attempt_runs(tmp_path: Path):
    """No process but the script's is forked between two attempts: a supervisor serves attempt after attempt
    (a fork of a zygote that imported torch takes tens of ms), and while one runs an attempt the zygote keeps a
    second one ready for the next attempt, prepared for it (its cgroup joined, its rules built). A long attempt's
    successor runs in that one."""
    pidfile, release = tmp_path / "pid", tmp_path / "release"
    short = f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getppid()))\nprint('{{}}')"
    # The long attempt runs until the test has seen what the zygote does meanwhile, however slow a loaded machine.
    src = short.replace("print(", f"while not os.path.exists({str(release)!r}):\n    time.sleep(0.01)\nprint(")
    z = Zygote()
    z.start()
    try:
        assert z.proc is not None
        zygote = psutil.Process(z.proc.pid)
        supervisors = []
        for _ in range(6):
            assert run(z, short).returncode == 0
            supervisors.append(int(pidfile.read_text()))
        assert len(set(supervisors)) <= 2, f"a supervisor forked for each attempt: {supervisors}"
        pidfile.unlink()
        t = threading.Thread(target=run, args=(z, src))
        t.start()
        try:
            wait_until(lambda: pidfile.exists() and pidfile.read_text(), what="the long attempt to start")
            wait_until(lambda: zygote_children(zygote) == (1, 1), what="one ready while the attempt runs")
            (ready,) = (c for c in zygote.children() if not c.children())
        finally:
            release.write_text("")
            t.join(timeout=15)
        pidfile.unlink()
        assert run(z, short).returncode == 0
        assert int(pidfile.read_text()) == ready.pid, "the attempt ran in the supervisor made ready for it"
    finally:
        z.close()


@pytest.mark.processes
def test_bad_preload_is_a_one_line_startup_error_and_joins_nothing(env, r: redis.Redis):
    p = gpumesh("worker", "--score", "5", "--warm", "--preload", "json,no_such_module_xyz", env=env)
    assert p.returncode == 2
    assert (
        p.stderr.strip()
        .splitlines()[-1]
        .startswith("error: --preload no_such_module_xyz: ModuleNotFoundError: No module named 'no_such_module_xyz'")
    )
    assert r.zcard("gpumesh:workers") == 0 and r.zcard("gpumesh:scores") == 0

    p = gpumesh("worker", "--score", "5", "--fresh", "--preload", "json", env=env)
    assert p.returncode == 2 and "--preload needs the warm executor" in p.stderr


@pytest.mark.security
def test_modules_the_zygote_imported_are_reseeded_for_each_task(tmp_path: Path):
    # random and numpy imported by the zygote itself (not by each task): only a reseed after the fork gives
    # two tasks different numbers; tempfile imported there must still pick each task's own TMPDIR
    np = pytest.importorskip("numpy", reason="numpy is a test dependency")
    assert np is not None
    z = Zygote(["random", "tempfile", "numpy"])
    z.start()
    try:
        src = """
            import json, os, random, sys, tempfile
            import numpy
            assert "random" in sys.modules and "numpy" in sys.modules
            print(json.dumps({"rand": random.random(), "np": float(numpy.random.random()),
                              "tempdir": tempfile.gettempdir(), "tmp": os.environ["TMPDIR"]}))
        """
        first, second = (json.loads(run(z, src).last_line) for _ in range(2))
    finally:
        z.close()
    assert first["rand"] != second["rand"] and first["np"] != second["np"], "each task gets its own seed"
    assert first["tempdir"] == first["tmp"] and second["tempdir"] == second["tmp"] != first["tmp"]


@pytest.mark.security
def test_a_preload_that_initialises_cuda_is_refused_before_any_task(tmp_path: Path, make_zygote: MakeZygote):
    # CUDA does not survive fork: a zygote whose preload initialised it would break every task. A stand-in
    # torch whose CUDA says it is initialised shows the refusal without a GPU.
    z = make_zygote(["torch"], {"torch/__init__.py": "class cuda:\n    is_initialized = staticmethod(lambda: True)\n"})
    with pytest.raises(ZygoteError, match="initialised CUDA"):
        z.start()
    z.close()


@pytest.mark.security
def test_what_the_zygote_preloaded_does_not_count_against_each_task_s_memory_cap(
    tmp_path: Path, make_zygote: MakeZygote
):
    # A preload of 120 MB is shared by the zygote, each attempt's supervisor and its script: counted once
    # (by PSS), it leaves a 200 MB cap room for a small task, and a task that allocates past the cap is
    # still killed for it.
    z = make_zygote(
        ["ballast"], {"ballast.py": "B = bytearray(120 << 20)\nfor i in range(0, len(B), 4096):\n    B[i] = 1\n"}
    )
    z.start()
    try:
        small = run(z, "import time\ntime.sleep(1.5)\nprint('{}')\n", memory_bytes=200 << 20)
        big = run(z, "b = bytearray(300 << 20)\nimport time\ntime.sleep(5)\nprint('{}')\n", memory_bytes=200 << 20)
    finally:
        z.close()
    assert small.killed is None and small.returncode == 0, small.describe_exit()
    assert big.killed == "memory", big.describe_exit()
