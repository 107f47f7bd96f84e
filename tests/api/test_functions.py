"""Functions as tasks (DESIGN §8): ``mesh.map`` and ``mesh.submit`` with a plain function, shipped as source
and never pickled; what cannot be shipped is refused before anything is written; a remote exception comes
back typed; ``as_completed`` streams results as tasks end; ``wait`` shows progress without a terminal bar."""

from __future__ import annotations

import _thread
import ast
import functools
import json
import linecache
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
import redis

import gpumesh
from gpumesh import functions

from .. import mapped
from ..conftest import ROOT, wait_until

pytestmark = pytest.mark.core


def run_entry(fn, payload, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The script ``package`` makes for ``fn``, run as a worker runs one: payload on stdin, a fresh interpreter."""
    source, _name = functions.package(fn)
    path = tmp_path / "entry.py"
    path.write_text(source)
    return subprocess.run(
        [sys.executable, str(path)], input=json.dumps(payload), capture_output=True, text=True, cwd=tmp_path
    )


# -- what is shipped, and what is refused -----------------------------------------------------------


def test_a_function_ships_as_its_module_source_and_prints_its_json_result(tmp_path) -> None:
    source, name = functions.package(mapped.shifted)
    assert name == "mapped.shifted.py"
    assert Path(mapped.__file__).read_text() in ast.literal_eval(source.split("_SOURCE = ", 1)[1].split("\n\n")[0])
    ran = run_entry(mapped.shifted, {"x": 2.5}, tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout.splitlines()[-1]) == {"x": 2.5, "y": 102, "task": None}
    # the module's `if __name__ == "__main__":` block did not run (it would exit non-zero)
    assert functions.package(mapped.square) == functions.package(mapped.square)  # content-addressed: same text


def test_a_raised_exception_is_reported_by_type_message_and_traceback(tmp_path) -> None:
    ran = run_entry(mapped.parse, {"text": "two"}, tmp_path)
    assert ran.returncode == 1
    error = "exit code 1\n" + ran.stderr  # what the worker records: the exit, then the stderr tail
    kind, message, tb = functions.remote_exception(error)
    assert (kind, message) == ("ValueError", "invalid literal for int() with base 10: 'two'")
    assert tb.startswith("Traceback (most recent call last):")
    assert 'File "mapped.py", line' in tb and "in parse" in tb and "return int(payload" in tb  # its source lines
    assert "entry.py" not in tb  # the entry point's own frame is left out
    assert gpumesh.models.failure_kind("failed", error) == "exception"


def test_a_result_that_is_not_json_fails_with_the_reason(tmp_path) -> None:
    ran = run_entry(mapped.not_json, {}, tmp_path)
    kind, message, _tb = functions.remote_exception("exit code 1\n" + ran.stderr)
    assert kind == "TypeError"
    assert "not_json() returned a value that is not JSON (Object of type set is not JSON serializable)" in message


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        (lambda p: p, "a lambda cannot be shipped"),
        (mapped.make_closure(), r"remember\(\) is defined inside make_closure\(\).*move it to the top level"),
        (mapped.Holder().method, "is a method"),
        (mapped.Holder.method, "Holder.method is defined in a class"),
        (len, "len is a builtin_function_or_method, not a function defined with def"),
        (functools.partial(mapped.square), "is a partial, not a function defined with def"),
        (mapped.generator, r"generator\(\) is a coroutine or generator function"),
        (mapped.coroutine, r"coroutine\(\) is a coroutine or generator function"),
        (print, "not a function defined with def"),
    ],
)
def test_what_cannot_travel_as_source_is_refused_before_anything_is_written(env, r, fn, reason) -> None:
    with gpumesh.connect() as mesh:
        with pytest.raises(gpumesh.UsageError, match=reason):
            mesh.map(fn, [{"x": 1}])
        with pytest.raises(gpumesh.UsageError, match=reason):
            mesh.submit(fn, [{"x": 1}])
    assert r.dbsize() == 0


def test_a_function_typed_at_a_prompt_is_refused_and_non_json_payloads_too(env, r, monkeypatch) -> None:
    namespace: dict = {"__name__": "__main__"}
    exec(compile("def typed(p):\n    return p\n", "<stdin>", "exec"), namespace)  # as `python` at a prompt
    monkeypatch.setattr(sys.modules["__main__"], "typed", namespace["typed"], raising=False)
    with gpumesh.connect() as mesh:
        with pytest.raises(gpumesh.UsageError, match="defined in <stdin>, whose source gpumesh cannot read"):
            mesh.map(namespace["typed"], [{}])
        with pytest.raises(gpumesh.UsageError, match=r"payloads\[0\] must be a JSON object, got 1"):
            mesh.map(mapped.square, [1, 2])  # type: ignore[list-item]
        with pytest.raises(gpumesh.UsageError, match=r"payloads\[1\]\.x cannot be sent as JSON|not JSON serializable"):
            mesh.map(mapped.square, [{"x": 1}, {"x": object()}])
    assert r.dbsize() == 0


def define_in_cell(monkeypatch, cell: str, namespace: dict) -> dict:
    """Run ``cell`` as IPython runs a notebook cell: compiled under a name that is no file, its text in
    linecache, its names in the ``__main__`` namespace."""
    filename = f"/tmp/ipykernel_0/{abs(hash(cell))}.py"
    linecache.cache[filename] = (len(cell), None, cell.splitlines(True), filename)
    monkeypatch.setitem(linecache.cache, filename, linecache.cache[filename])
    namespace.setdefault("__name__", "__main__")
    exec(compile(cell, filename, "exec"), namespace)
    for key, value in namespace.items():
        if callable(value) and getattr(value, "__module__", None) == "__main__":
            monkeypatch.setattr(sys.modules["__main__"], key, value, raising=False)
    return namespace


def test_a_notebook_cell_ships_its_definitions_and_the_modules_it_uses(monkeypatch, tmp_path) -> None:
    ns = define_in_cell(monkeypatch, "import json as j\nimport math\n", {})  # an earlier cell
    ns = define_in_cell(
        monkeypatch,
        "from __future__ import annotations\n"
        "from os.path import basename\n"
        "SCALE = 10\n"
        "table = [math.sqrt(i) for i in range(3)]\n"  # computed: the notebook's work, not shipped
        "print('the cell ran')\n"
        "def area(p: dict) -> float:\n"
        "    return round(math.pi * p['r'] ** 2 * SCALE, 2)\n"
        "def name(p):\n"
        "    return basename(p['path']) + j.dumps(area(p))\n",
        ns,
    )
    source, script_name = functions.package(ns["name"])
    assert script_name == "cell.name.py"
    shipped = ast.literal_eval(source.split("_SOURCE = ", 1)[1].split("\n\n")[0])
    assert shipped.startswith("from __future__ import annotations\n\nimport json as j  # used from another cell")
    assert "import math  # used from another cell" in shipped
    assert "print(" not in shipped and "table" not in shipped and "SCALE = 10" in shipped
    ran = run_entry(ns["name"], {"r": 1, "path": "/data/x.csv"}, tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout.splitlines()[-1]) == "x.csv31.42"
    assert "the cell ran" not in ran.stdout


def test_a_notebook_cell_keeps_its_decorators_and_a_result_after_an_unfinished_line(monkeypatch, tmp_path) -> None:
    ns = define_in_cell(
        monkeypatch,
        "import dataclasses\n"
        "@dataclasses.dataclass\n"
        "class Point:\n"
        "    x: int\n"
        "    y: int = 2\n"
        "def total(p):\n"
        "    print('working...', end='')\n"  # leaves stdout's line unfinished
        "    pt = Point(p['x'])\n"
        "    return pt.x + pt.y\n",
        {},
    )
    ran = run_entry(ns["total"], {"x": 1}, tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == ["working...", "3"]


def test_a_notebook_function_using_another_cells_variable_is_refused(env, r, monkeypatch) -> None:
    ns = define_in_cell(monkeypatch, "weights = [0.5, 2.0]\n", {})
    ns = define_in_cell(monkeypatch, "def weigh(p):\n    return p['x'] * weights[p['i']]\n", ns)
    with gpumesh.connect() as mesh:
        with pytest.raises(gpumesh.UsageError, match=r"weigh\(\) uses weights from another notebook cell.*same cell"):
            mesh.map(ns["weigh"], [{"x": 1, "i": 0}])
    assert r.dbsize() == 0


def test_a_module_importing_relative_to_its_package_is_refused(tmp_path, monkeypatch) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helpers.py").write_text("def one():\n    return 1\n")
    (pkg / "work.py").write_text("from . import helpers\n\ndef task(p):\n    return helpers.one()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from mypkg import work  # type: ignore[import-not-found]

    with pytest.raises(gpumesh.UsageError, match=r"work.py imports relative to its package at line 1"):
        functions.package(work.task)
    monkeypatch.delitem(sys.modules, "mypkg.work")
    monkeypatch.delitem(sys.modules, "mypkg")


def test_no_pickle_anywhere_in_the_package() -> None:
    # Results and arguments are JSON; nothing that comes back from a worker can run code here.
    banned = {"pickle", "cloudpickle", "dill", "marshal", "shelve", "_pickle"}
    found = []
    for path in (ROOT / "gpumesh").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] in banned]
    assert found == []


# -- on a running mesh -----------------------------------------------------------------------------


def test_map_runs_a_function_and_keeps_payload_order(env, r, mesh_worker) -> None:
    w = mesh_worker.start()
    raw = redis.Redis.from_url(env["GPUMESH_URL"])  # bytes, as RQ stores them
    with gpumesh.connect() as mesh:
        assert mesh.map(mapped.square, [{"x": x} for x in range(10)], progress=False) == [x * x for x in range(10)]
        rows = mesh.map(mapped.shifted, [{"x": 1}, {"x": 2}], progress=False)
        assert rows == [{"x": 1, "y": 101, "task": "0"}, {"x": 2, "y": 102, "task": "1"}]
        assert mesh.map(mapped.chatty, [{}], progress=False) == ["ok"]  # its own prints are only logs
        # RQ carried every task (a delivery's record goes as its run ends: the worker counts the runs), as
        # JSON: the delivery of a running task is no pickle
        job = mesh.submit(mapped.slow, [{"x": 1, "sleep": 2}])
        # a delivery's record, read while its task runs (a tier window's "<task>_waiting" entries are not deliveries)
        datas: list[bytes] = []

        def delivered() -> bool:
            keys = [k for k in raw.scan_iter("rq:job:*") if not k.endswith(b"_waiting")]
            datas[:] = [d for d in (raw.hget(k, "data") for k in keys if raw.type(k) == b"hash") if d]
            return bool(datas)

        wait_until(delivered, what="a delivery")
        assert job.wait(timeout=60).status == "done"
    wait_until(lambda: int(raw.hget(w.key, "successful_job_count") or 0) >= 14, what="RQ's count of the runs")
    raw.close()
    assert all(json.loads(zlib.decompress(d)) for d in datas)


def test_a_failed_task_raises_task_failed_and_cancels_the_rest(env, r, mesh_worker) -> None:
    mesh_worker.start()
    payloads = [{"text": "1"}, {"text": "two"}] + [{"text": str(i)} for i in range(30)]
    with gpumesh.connect() as mesh:
        with pytest.raises(gpumesh.TaskFailed) as caught:
            mesh.map(mapped.parse, payloads, max_attempts=1, progress=False)
        exc = caught.value
        assert isinstance(exc, gpumesh.JobEnded) and isinstance(exc, gpumesh.GpumeshError)
        assert (exc.index, exc.kind, exc.exc_type) == (1, "exception", "ValueError")
        assert exc.message == "invalid literal for int() with base 10: 'two'"
        assert "in parse" in exc.traceback and exc.task_id == f"{exc.job_id}-1"
        assert str(exc).startswith(f"task 1 of job {exc.job_id} raised ValueError: invalid literal")
        st = mesh.job(exc.job_id).wait(timeout=30)
        assert st.status == "cancelled" and st.tasks.failed == 1 and st.tasks.cancelled > 0


def test_as_completed_streams_results_as_tasks_end(env, r, mesh_worker) -> None:
    mesh_worker.start()
    with gpumesh.connect() as mesh:
        job = mesh.submit(mapped.slow, [{"x": i, "sleep": 0.4} for i in range(5)])
        seen = []
        for res in job.as_completed(timeout=60):
            seen.append((res.index, res.result, job.status().tasks.done))
        # one task at a time on one worker: each result arrived while later tasks were still to run
        assert [s[0] for s in seen] == [0, 1, 2, 3, 4] and [s[1] for s in seen] == [0, 1, 2, 3, 4]
        assert seen[0][2] < 5
        # asked again after the end, every result comes at once, each once
        assert sorted(res.index for res in job.as_completed(timeout=5)) == [0, 1, 2, 3, 4]


def test_as_completed_follows_a_retry_and_yields_each_task_once(env, r, mesh_worker) -> None:
    mesh_worker.start()
    with gpumesh.connect() as mesh:
        job = mesh.submit(mapped.parse, [{"text": "1"}, {"text": "x"}], max_attempts=1)
        first = {res.index: res.status for res in job.as_completed(timeout=60)}
        assert first == {0: "done", 1: "failed"}
        assert job.retry() == 1
        again = [(res.index, res.status) for res in job.as_completed(timeout=60)]
        assert sorted(again) == [(0, "done"), (1, "failed")]  # the re-run's end, not its first one


def test_as_completed_times_out_when_nothing_can_run(env, r) -> None:
    with gpumesh.connect() as mesh:
        job = mesh.submit(mapped.square, [{"x": 1}])
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="0 of 1 tasks ended within 1.5 s"):
            list(job.as_completed(timeout=1.5))
        assert time.monotonic() - started < 5


def test_wait_progress_off_a_terminal_is_plain_lines(env, r, mesh_worker, capsys) -> None:
    mesh_worker.start()
    with gpumesh.connect() as mesh:
        job = mesh.submit(mapped.square, [{"x": i} for i in range(3)])
        assert job.wait(timeout=60, progress=True).status == "done"
    lines = capsys.readouterr().err.splitlines()
    assert lines and lines[-1] == f"job {job.id}: 3/3 done"
    assert all(line.startswith(f"job {job.id}: ") for line in lines)
    assert not any("\x1b" in line or "\r" in line for line in lines)  # no cursor movement, no terminal bar


def test_map_cancels_its_job_on_ctrl_c_or_its_timeout(env, r, mesh_worker) -> None:
    mesh_worker.start()
    with gpumesh.connect() as mesh:
        timer = threading.Timer(1.0, _thread.interrupt_main)  # Ctrl-C, in the thread waiting in map
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            mesh.map(mapped.slow, [{"x": i, "sleep": 5} for i in range(3)], progress=False)
        timer.join()
        first = mesh.jobs(1)[0].job_id
        assert mesh.job(first).status().status == "cancelled"
        with pytest.raises(TimeoutError):
            mesh.map(mapped.slow, [{"x": i, "sleep": 5} for i in range(3)], wait_timeout=1, progress=False)
        second = mesh.jobs(1)[0].job_id
        assert second != first
        wait_until(lambda: mesh.job(second).status().status == "cancelled", what="the timed-out map's job to end")


def test_driving_code_outside_the_main_guard_is_named_in_the_error_the_user_sees(env, r, mesh_worker, tmp_path) -> None:
    # The whole file travels and loads on each worker: its unguarded driving code runs there too, and reads
    # a sys.argv the worker's task does not have. The error names that line and where such code belongs.
    drive = tmp_path / "drive.py"
    drive.write_text(
        "import sys\n\nimport gpumesh\n\n\ndef double(payload):\n    return payload['x'] * 2\n\n\n"
        "n = int(sys.argv[1])\nwith gpumesh.connect() as mesh:\n"
        "    print(mesh.map(double, [{'x': i} for i in range(n)], max_attempts=1, progress=False))\n"
    )
    mesh_worker.start()
    ran = subprocess.run([sys.executable, str(drive), "3"], capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert ran.returncode == 1
    last = ran.stderr.strip().splitlines()[-1]
    assert last.startswith("gpumesh.errors.TaskFailed: task ") and "raised IndexError: list index out of range" in last
    assert "drive.py line 10 (n = int(sys.argv[1])) at module level" in last, last
    assert 'the code that drives the job belongs under if __name__ == "__main__":' in last, last
