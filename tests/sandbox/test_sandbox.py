"""The sandbox with real processes: environment, limits, kills, output caps, cleanup.

Every test runs three ways: fresh as a worker runs it (a new interpreter per attempt, started while
the one before ran), cold (that interpreter started only when the attempt comes: the fallback, and
--sandbox-user's path) and warm (forked from a zygote)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpumesh.sandbox import runner as sandbox
from gpumesh.sandbox.warm import Zygote

from ..conftest import OPEN_FDS_SCRIPT, pid_alive, wait_until

MODE: dict[str, Any] = {"zygote": None, "spares": None}


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    z.start()
    yield z
    z.close()


@pytest.fixture(scope="module")
def spares():
    s = sandbox.Spares()
    yield s
    s.close()


@pytest.fixture(params=["fresh", "cold", "warm"], autouse=True)
def mode(request):
    MODE["zygote"] = request.getfixturevalue("zygote") if request.param == "warm" else None
    MODE["spares"] = request.getfixturevalue("spares") if request.param == "fresh" else None
    yield request.param
    MODE["zygote"] = MODE["spares"] = None


def run(source: str, payload: dict | None = None, should_stop=lambda: None, name: str = "task.py", **limits):
    lines: list[tuple[str, str]] = []
    lim = sandbox.Limits(**{"timeout": 20, "memory_bytes": 0, "grace": 1.0, **limits})
    out = sandbox.run(
        textwrap.dedent(source), name, json.dumps(payload or {}), {"GPUMESH_DEVICE": "cpu"}, lim,
        lambda s, line: lines.append((s, line)), should_stop, zygote=MODE["zygote"], spares=MODE["spares"],
    )  # fmt: skip
    return out, lines


@pytest.mark.security
def test_payload_on_stdin_result_is_last_line_and_env_is_clean(monkeypatch):
    monkeypatch.setenv("GPUMESH_URL", "redis://:hunter2@127.0.0.1:1/0")
    monkeypatch.setenv("REDIS_PASSWORD", "hunter2")
    out, lines = run(
        """
        import json, os, sys
        p = json.load(sys.stdin)
        print("progress", file=sys.stderr)
        print(json.dumps({"x": p["x"] * 2, "cwd": os.getcwd(), "env": sorted(os.environ),
                          "out": os.environ["GPUMESH_OUTPUT_DIR"], "dev": os.environ["GPUMESH_DEVICE"]}))
        print("   ")
        """,
        {"x": 21},
    )
    assert out.returncode == 0 and out.killed is None
    res = json.loads(out.last_line)
    assert res["x"] == 42 and res["dev"] == "cpu"
    assert "GPUMESH_URL" not in res["env"] and "REDIS_PASSWORD" not in res["env"]
    assert not any("hunter2" in v for v in res["env"])
    assert res["out"].startswith(res["cwd"])
    assert not Path(res["cwd"]).exists(), "the temp working directory is removed afterwards"
    assert ("stderr", "progress") in lines


@pytest.mark.security
def test_the_task_holds_no_descriptor_of_the_worker_s():
    """Only its stdin, stdout and stderr: no broker connection, control socket or worker log."""
    out, _ = run(OPEN_FDS_SCRIPT)
    fds = json.loads(out.last_line)
    assert sorted(fds) == ["0", "1", "2"], fds
    assert fds["1"].startswith("pipe:") and fds["2"].startswith("pipe:")


@pytest.mark.security
def test_the_task_reads_its_payload_but_can_neither_change_nor_grow_it():
    """Its stdin holds the payload in memory: a task that could grow it would hold memory no cap counts."""
    out, lines = run(
        """
        import json, os, sys
        p = json.load(sys.stdin)
        tried = {}
        for what, act in [("write", lambda: os.pwrite(0, b"x" * 10, 0)), ("grow", lambda: os.ftruncate(0, 1 << 30)),
                          ("append", lambda: os.pwrite(0, b"y", 1 << 20))]:
            try:
                act()
                tried[what] = "done"
            except OSError as exc:
                tried[what] = type(exc).__name__
        os.lseek(0, 0, 0)
        print(json.dumps({"p": p, "again": json.load(sys.stdin), "tried": tried}))
        """,
        {"x": 7},
    )
    assert out.returncode == 0, lines
    res = json.loads(out.last_line)
    assert res["p"] == res["again"] == {"x": 7}
    assert all(v != "done" for v in res["tried"].values()), res["tried"]


@pytest.mark.security
@pytest.mark.parametrize("name", ["signal.py", "resource.py", "ctypes.py", "typing.py", "gpumesh.py", "os.py"])
def test_a_script_may_be_named_like_a_module_the_launcher_imports(name):
    # The launcher starts outside the task's directory: a script named signal.py is the task's own
    # business, never what the sandbox imports before it sets the limits up.
    out, _ = run("import sys\nprint(sys.argv[0].rsplit('/', 1)[-1])", name=name)
    assert (out.returncode, out.last_line) == (0, name), list(out.stderr_tail)


@pytest.mark.core
def test_script_error_gives_exit_code_and_stderr_tail():
    out, _ = run("import sys\nprint('bad things', file=sys.stderr)\nsys.exit(3)")
    assert out.returncode == 3 and out.describe_exit() == "exit code 3"
    assert list(out.stderr_tail) == ["bad things"]


@pytest.mark.core
def test_uncaught_exception_is_exit_1_with_traceback():
    out, _ = run("raise ValueError('nope')")
    assert out.returncode == 1
    assert out.stderr_tail[-1] == "ValueError: nope"


@pytest.mark.core
def test_a_script_runs_under_its_own_future_flags_not_the_launcher_s():
    """The launcher's own `from __future__ import annotations` must not reach the task: a script's annotations
    are evaluated as plain Python evaluates them (a library that reads them at run time sees the class)."""
    out, _ = run("import json\ndef f(x: int): pass\nprint(json.dumps({'x': repr(f.__annotations__['x'])}))")
    assert out.returncode == 0, list(out.stderr_tail)
    assert json.loads(out.last_line) == {"x": "<class 'int'>"}


@pytest.mark.core
def test_each_attempt_of_one_script_names_its_own_file_in_a_traceback_and_a_syntax_error_is_the_task_s():
    """Attempts of the same script (a warm supervisor compiles it once) each see their own file: ``__file__``, and
    every frame of a traceback, nested functions' included. A script that does not compile fails as the task."""
    source = (
        "import json, sys\ndef inner():\n    raise ValueError(__file__)\nprint(__file__, file=sys.stderr)\ninner()\n"
    )
    files = []
    for _ in range(3):
        out, _lines = run(source)
        assert out.returncode == 1
        tail = list(out.stderr_tail)
        own = tail[0]
        assert own.endswith("/task.py") and tail[-1] == f"ValueError: {own}"
        assert [line for line in tail if line.strip().startswith("File ")] == [
            f'  File "{own}", line 5, in <module>',
            f'  File "{own}", line 3, in inner',
        ]
        files.append(own)
    assert len(set(files)) == 3, "each attempt has a directory of its own"
    out, _lines = run("print('never'\n")
    assert out.returncode == 1 and out.stderr_tail[-1].startswith("SyntaxError")


@pytest.mark.core
def test_a_script_s_coding_declaration_counts_as_python_counts_it_in_every_mode():
    """A script is compiled from its file, whose coding declaration Python obeys (a warm supervisor's compile of
    the text it was sent would ignore it): an unknown codec is the task's SyntaxError, warm as fresh."""
    out, _ = run("# -*- coding: no-such-codec -*-\nprint('ran')\n")
    assert out.returncode == 1 and out.last_line != "ran"
    assert out.stderr_tail[-1].startswith("SyntaxError") and "no-such-codec" in out.stderr_tail[-1]


@pytest.mark.core
def test_timeout_kills_the_whole_tree_including_a_setsid_grandchild(tmp_path: Path):
    pidfile = tmp_path / "pids"
    started = time.monotonic()
    out, _ = run(
        f"""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(300)"])
        open({str(pidfile)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
        time.sleep(300)
        """,
        timeout=5,  # time to start both interpreters and write the file, on a loaded machine too
    )
    assert out.killed == "timeout" and out.describe_exit() == "timed out"
    assert time.monotonic() - started < 60, "killed at its timeout, not at the end of its 300 s"
    for pid in map(int, pidfile.read_text().split()):
        wait_until(lambda pid=pid: not pid_alive(pid), what=f"pid {pid} to die")


@pytest.mark.core
def test_script_ignoring_sigterm_is_killed_after_the_grace_period():
    out, _ = run("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(300)", timeout=0.5)
    assert out.killed == "timeout"
    assert out.duration < 8


@pytest.mark.core
def test_processes_left_behind_by_a_finished_script_are_killed(tmp_path: Path):
    pidfile = tmp_path / "pid"
    out, _ = run(
        f"""
        import subprocess, sys
        p = subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(300)"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        open({str(pidfile)!r}, "w").write(str(p.pid))
        print('{{"ok": true}}')
        """
    )
    assert out.returncode == 0 and out.last_line == '{"ok": true}'
    pid = int(pidfile.read_text())
    wait_until(lambda pid=pid: not pid_alive(pid), timeout=5, what="the daemonised child to die")


@pytest.mark.core
def test_memory_cap_by_rss_kills_the_task():
    out, _ = run("b = bytearray(400 << 20)\nimport time\ntime.sleep(30)", memory_bytes=200 << 20)
    assert out.killed == "memory"
    assert "memory cap" in out.describe_exit()


@pytest.mark.core
def test_cpu_rlimit_kills_a_busy_loop():
    out, _ = run("while True: pass", cpu_seconds=1)
    assert out.returncode is not None and out.returncode < 0
    assert out.describe_exit() in ("killed by SIGXCPU", "killed by SIGKILL")


@pytest.mark.core
def test_rlimits_are_set_for_the_script():
    out, _ = run(
        "import json, resource\n"
        "print(json.dumps([resource.getrlimit(resource.RLIMIT_CORE)[0], resource.getrlimit(resource.RLIMIT_NOFILE)[0],"
        " resource.getrlimit(resource.RLIMIT_FSIZE)[0]]))",
        open_files=256, file_bytes=1 << 20,
    )  # fmt: skip
    assert json.loads(out.last_line) == [0, 256, 1 << 20]


@pytest.mark.core
def test_log_is_capped_and_truncation_is_marked():
    out, lines = run("for i in range(10000): print('x' * 99)\nprint('{}')", log_bytes=10_000)
    assert out.log_truncated and out.last_line == "{}"
    assert len(lines) < 110
    assert lines[-1][1].startswith("[gpumesh] output truncated")


@pytest.mark.core
def test_result_line_over_the_cap_is_flagged():
    out, _ = run("print('[' + '1,' * 5000 + '1]')", result_bytes=1000)
    assert out.result_too_large and out.last_line is None


@pytest.mark.core
def test_should_stop_kills_the_attempt_with_its_reason():
    t0 = time.monotonic()
    out, _ = run(
        "import time\ntime.sleep(300)", should_stop=lambda: "cancelled" if time.monotonic() - t0 > 0.5 else None
    )
    assert out.killed == "cancelled"
    assert out.duration < 15, "stopped when asked, well before its 20 s timeout"


@pytest.mark.faults
def test_sandbox_dies_with_its_worker(tmp_path: Path, mode: str):
    """SIGKILL the process that runs the sandbox: the task, its setsid grandchild and the spare
    interpreter waiting for the next attempt all die too, and the task's directory is removed."""
    pidfile, workdir = tmp_path / "pids", tmp_path / "workdir"
    host = tmp_path / "host.py"
    host.write_text(
        textwrap.dedent(
            f"""
            import json
            from gpumesh.sandbox import runner as sandbox
            from gpumesh.sandbox import warm
            zygote = warm.Zygote() if {mode!r} == "warm" else None
            if zygote:
                zygote.start()
            spares = sandbox.Spares() if {mode!r} == "fresh" else None
            limits = sandbox.Limits(timeout=300, memory_bytes=0, grace=1.0)
            sandbox.run("print(1)", "t.py", "{{}}", {{}}, limits, lambda s, l: None, lambda: None, zygote, spares)
            src = '''
            import os, subprocess, sys, time
            c = subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(300)"])
            open(os.path.join(os.environ["GPUMESH_OUTPUT_DIR"], "half-written.bin"), "wb").write(bytes(1000))
            open({str(workdir)!r}, "w").write(os.getcwd())
            open({str(pidfile)!r}, "w").write(f"{{os.getpid()}} {{c.pid}}")
            time.sleep(300)
            '''
            sandbox.run(src, "t.py", "{{}}", {{}}, limits, lambda s, l: None, lambda: None, zygote, spares)
            """
        )
    )
    proc = subprocess.Popen([sys.executable, str(host)], start_new_session=True)
    wait_until(lambda: pidfile.exists() and len(pidfile.read_text().split()) == 2, what="the task to start")
    pids = set(map(int, pidfile.read_text().split()))
    pids |= {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
    if mode == "fresh":
        assert len(psutil.Process(proc.pid).children()) == 2, "the attempt's launcher, and the next one waiting"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    for pid in pids:
        wait_until(lambda pid=pid: not pid_alive(pid), timeout=8, what=f"process {pid} to die with its worker")
    task_dir = Path(workdir.read_text())
    assert task_dir.name.startswith("gpumesh-task-")
    wait_until(lambda: not task_dir.exists(), timeout=8, what="the dead worker's task directory to be removed")


@pytest.mark.parametrize("reason", ["shutdown"])
@pytest.mark.faults
def test_worker_exception_mid_attempt_kills_the_task(tmp_path: Path, reason: str):
    pidfile = tmp_path / "pid"

    def stop():
        if pidfile.exists() and pidfile.read_text():
            raise SystemExit(reason)  # what a cold shutdown looks like from inside the loop
        return None

    with pytest.raises(SystemExit):
        run(f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(300)", should_stop=stop)
    wait_until(lambda: not pid_alive(int(pidfile.read_text())), timeout=5, what="the task to die")


@pytest.mark.security
def test_what_a_task_writes_in_its_own_directory_goes_with_the_directory():
    """A task's temp files (TMPDIR is its attempt's directory) go with it, in every mode: a warm attempt's
    directory was left in /tmp, holding them, whenever its script and output directory went first."""
    out, _ = run(
        """
        import json, os, tempfile
        here = os.environ["TMPDIR"]
        open(os.path.join(here, "scratch.txt"), "w").write("x")
        os.makedirs(os.path.join(here, "cache", "deeper"))
        open(os.path.join(here, "cache", "deeper", "f"), "w").write("y")
        tempfile.mkstemp()  # in TMPDIR
        print(json.dumps({"dir": here}))
        """
    )
    assert out.returncode == 0, out.describe_exit()
    left = Path(json.loads(out.last_line or "")["dir"])
    assert left.name.startswith("gpumesh-task-")
    run("print('{}')")  # a next attempt: a confined attempt's directory may go while it runs
    wait_until(lambda: not left.exists(), timeout=5, what=f"{left} to be removed")
