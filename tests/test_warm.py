"""What only the warm executor can get wrong: state shared through the zygote, its own death, preloads.

The behaviour both executors share (limits, kills, output, the mesh) is tested in both modes by
test_sandbox.py, test_mesh.py and test_faults.py."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import threading
from pathlib import Path

import pytest
import redis

from gpumesh.sandbox import runner as sandbox
from gpumesh.sandbox.warm import ZYGOTE_LOST, Zygote, ZygoteError

from .conftest import OPEN_FDS_SCRIPT, gpumesh, pid_alive, wait_until


def zygote_children(zygote) -> tuple[int, int]:
    """(spares, supervisors) among a zygote's children (a psutil.Process): a spare waits in the zygote's
    session, a supervisor has taken one of its own for its attempt."""
    spares = supervisors = 0
    for child in zygote.children():
        try:
            own = os.getsid(child.pid) != os.getsid(zygote.pid)
        except ProcessLookupError:  # reaped meanwhile
            continue
        supervisors += own
        spares += not own
    return spares, supervisors


def run(zygote: Zygote, source: str, **limits):
    lim = sandbox.Limits(**{"timeout": 20, "memory_bytes": 0, "grace": 1.0, **limits})
    return sandbox.run(textwrap.dedent(source), "task.py", "{}", {}, lim, lambda s, line: None, lambda: None, zygote)


@pytest.mark.security
def test_each_task_starts_from_the_zygote_not_from_the_task_before(tmp_path: Path):
    z = Zygote(["json", "decimal"])
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
def test_the_zygote_holds_no_credentials(monkeypatch):
    monkeypatch.setenv("GPUMESH_URL", "redis://:hunter2@127.0.0.1:1/0")
    monkeypatch.setenv("REDIS_PASSWORD", "hunter2")
    z = Zygote()
    z.start()
    try:
        assert z.proc is not None
        environ = Path(f"/proc/{z.proc.pid}/environ").read_bytes()
        cmdline = Path(f"/proc/{z.proc.pid}/cmdline").read_bytes()
    finally:
        z.close()
    assert b"hunter2" not in environ and b"GPUMESH_URL" not in environ
    assert b"hunter2" not in cmdline


@pytest.mark.faults
def test_a_zygote_that_dies_mid_attempt_fails_that_attempt_and_is_restarted(tmp_path: Path):
    pidfile = tmp_path / "pid"
    z = Zygote()
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
def test_a_spare_that_died_while_waiting_is_replaced_by_one_that_holds_nothing_of_the_attempt():
    """The zygote forks the next attempt's supervisor ahead; one killed while it waits (the OOM killer, an
    operator) is replaced when the attempt comes, by a fork that must not keep the attempt's reply socket
    (on which a task could tell the worker its own outcome) or a second copy of its stdio."""
    import psutil

    z = Zygote()
    z.start()
    try:
        assert run(z, "print('{}')").returncode == 0
        assert z.proc is not None
        zygote = psutil.Process(z.proc.pid)
        wait_until(lambda: zygote_children(zygote) == (1, 0), what="only the spare left")
        spare = zygote.children()[0]
        spare.kill()
        wait_until(lambda: not zygote.children(), what="the zygote to reap its spare")
        out = run(z, OPEN_FDS_SCRIPT)
    finally:
        z.close()
    assert out.returncode == 0, list(out.stderr_tail)
    assert sorted(json.loads(out.last_line)) == ["0", "1", "2"], out.last_line


@pytest.mark.core
def test_the_next_attempt_s_spare_is_forked_as_an_attempt_ends_or_while_a_long_one_runs(tmp_path: Path):
    """The zygote forks the next attempt's spare as an attempt ends (so that a short attempt keeps both cores;
    benchmarks/core.py shows the gain), and while it runs once it has run a few ms: a long attempt's successor
    does not wait for a fork (tens of ms with torch imported). The next attempt runs in that spare."""
    import psutil

    pidfile = tmp_path / "pid"
    z = Zygote()
    z.start()
    try:
        assert z.proc is not None
        zygote = psutil.Process(z.proc.pid)
        assert run(z, "print('{}')").returncode == 0
        wait_until(lambda: zygote_children(zygote) == (1, 0), what="the spare forked as the attempt ended")
        src = f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getppid()))\ntime.sleep(1.5)\nprint('{{}}')"
        t = threading.Thread(target=run, args=(z, src))
        t.start()
        try:
            wait_until(lambda: pidfile.exists() and pidfile.read_text(), what="the long attempt to start")
            wait_until(lambda: zygote_children(zygote) == (1, 1), timeout=1, what="a spare while the attempt runs")
            (spare,) = (c for c in zygote.children() if os.getsid(c.pid) == os.getsid(zygote.pid))
        finally:
            t.join(timeout=15)
        pidfile.unlink()
        assert run(z, src.replace("time.sleep(1.5)", "")).returncode == 0
        assert int(pidfile.read_text()) == spare.pid, "the attempt ran in the spare forked ahead of it"
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
def test_a_preload_that_initialises_cuda_is_refused_before_any_task(tmp_path: Path):
    # CUDA does not survive fork: a zygote whose preload initialised it would break every task. A stand-in
    # torch whose CUDA says it is initialised shows the refusal without a GPU.
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("class cuda:\n    is_initialized = staticmethod(lambda: True)\n")
    z = Zygote(["torch"], env={"PYTHONPATH": str(tmp_path)})
    with pytest.raises(ZygoteError, match="initialised CUDA"):
        z.start()
    z.close()


@pytest.mark.security
def test_what_the_zygote_preloaded_does_not_count_against_each_task_s_memory_cap(tmp_path: Path):
    # A preload of 120 MB is shared by the zygote, each attempt's supervisor and its script: counted once
    # (by PSS), it leaves a 200 MB cap room for a small task, and a task that allocates past the cap is
    # still killed for it.
    (tmp_path / "ballast.py").write_text("B = bytearray(120 << 20)\nfor i in range(0, len(B), 4096):\n    B[i] = 1\n")
    z = Zygote(["ballast"], env={"PYTHONPATH": str(tmp_path)})
    z.start()
    try:
        small = run(z, "import time\ntime.sleep(1.5)\nprint('{}')\n", memory_bytes=200 << 20)
        big = run(z, "b = bytearray(300 << 20)\nimport time\ntime.sleep(5)\nprint('{}')\n", memory_bytes=200 << 20)
    finally:
        z.close()
    assert small.killed is None and small.returncode == 0, small.describe_exit()
    assert big.killed == "memory", big.describe_exit()
