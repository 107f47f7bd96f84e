"""Fresh mode's head start: the next attempt's interpreter starts while the current one runs.

What must hold: every attempt still gets an interpreter no other task touched; the waiting one holds
no credentials; a dead or unsuitable spare costs a cold start, never the attempt."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import psutil
import pytest

from gpumesh.sandbox import runner as sandbox
from gpumesh.sandbox import warm

from ..conftest import pid_alive, wait_until

pytestmark = pytest.mark.core

PROBE = """
import json, os, sys
payload = json.load(sys.stdin)
seen = getattr(sys, "_gpumesh_test_mark", None)
sys._gpumesh_test_mark = payload["i"]
print(json.dumps({"i": payload["i"], "launcher": os.getppid(), "seen": seen, "path": sys.path}))
"""


@pytest.fixture
def spares():
    s = sandbox.Spares()
    yield s
    s.close()


def attempt(spares: sandbox.Spares, i: int, source: str = PROBE, python: str = "") -> dict:
    lines: list[tuple[str, str]] = []
    limits = sandbox.Limits(timeout=20, memory_bytes=0, grace=1.0, python=python)
    out = sandbox.run(
        source, "probe.py", json.dumps({"i": i}), {"GPUMESH_DEVICE": "cpu"}, limits,
        lambda s, line: lines.append((s, line)), lambda: None, spares=spares,
    )  # fmt: skip
    assert out.returncode == 0 and out.last_line, (out.describe_exit(), lines)
    return json.loads(out.last_line)


def waiting() -> list[psutil.Process]:
    """This process's spare interpreters, as `ps` shows them."""
    found = []
    for p in psutil.Process().children():
        try:
            if "--spare" in p.cmdline():
                found.append(p)
        except psutil.Error:  # a zombie that an earlier test's orphan left to this subreaper, or one gone meanwhile
            continue
    return found


def test_each_attempt_runs_in_the_interpreter_that_was_waiting_for_it(spares, monkeypatch):
    monkeypatch.setenv("GPUMESH_URL", "redis://:hunter2@127.0.0.1:1/0")
    attempt(spares, 0)  # the first attempt starts cold; from now on one waits
    launchers = set()
    for i in range(1, 4):
        (spare,) = waiting()
        environ = Path(f"/proc/{spare.pid}/environ").read_bytes()
        assert b"hunter2" not in environ and b"GPUMESH_URL" not in environ, "a spare holds no credentials"
        res = attempt(spares, i)
        assert res["launcher"] == spare.pid, "the attempt ran in the interpreter started ahead of it"
        assert res["seen"] is None, "nothing of an earlier attempt is left in the interpreter"
        launchers.add(res["launcher"])
    assert len(launchers) == 3
    (last,) = waiting()
    spares.close()
    wait_until(lambda: not pid_alive(last.pid), timeout=5, what="close() to stop the waiting spare")
    assert not waiting()


def test_a_spare_that_died_costs_a_cold_start_not_the_attempt(spares):
    attempt(spares, 0)
    (spare,) = waiting()
    os.kill(spare.pid, signal.SIGKILL)
    spare.wait(5)
    res = attempt(spares, 1)
    assert res["i"] == 1 and res["launcher"] != spare.pid
    assert len(waiting()) == 1, "a new spare waits for the next attempt"


def test_an_environment_change_reaches_the_next_attempt(spares, monkeypatch, tmp_path: Path):
    """PYTHONPATH is read as the interpreter starts: a spare started before the change cannot serve."""
    attempt(spares, 0)
    (stale,) = waiting()
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    res = attempt(spares, 1)
    assert str(tmp_path) in res["path"] and res["launcher"] != stale.pid
    wait_until(lambda: not pid_alive(stale.pid), timeout=5, what="the unsuitable spare to be stopped")
    res = attempt(spares, 2)
    assert str(tmp_path) in res["path"], "the next spare starts with the new environment"


def test_helpers_for_another_interpreter_leave_no_copy_of_the_launcher(spares):
    """--sandbox-python: a spare (and the warm zygote) runs a private copy of launcher.py, since that
    interpreter may not see gpumesh. Each removes its copy as it starts, so a worker killed with
    SIGKILL, which cannot clean up, leaves nothing of it behind in the temp dir."""
    other = os.path.realpath(sys.executable)  # the venv's base interpreter: it does not see gpumesh
    assert other != sys.executable
    for i in range(3):
        assert attempt(spares, i, python=other)["i"] == i
        (spare,) = waiting()
        copy = Path(spare.cmdline()[2])
        assert copy.parent.name.startswith("gpumesh-launcher-"), spare.cmdline()
        wait_until(lambda copy=copy: not copy.parent.exists(), timeout=10, what="the spare to remove its copy")
    zygote = warm.Zygote(python=other)
    zygote.start()
    try:
        assert zygote.proc is not None
        copy = Path(psutil.Process(zygote.proc.pid).cmdline()[2])
        assert copy.parent.name.startswith("gpumesh-launcher-") and not copy.parent.exists()
    finally:
        zygote.close()
