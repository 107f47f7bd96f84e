"""Load once, run many (``submit --reuse-process``), with real workers: a job's tasks on a worker share one process
that stays loaded, confined as any attempt is; a task that misbehaves takes the process down, its outcome its own;
the process ends with its job, its cancel, its worker, or an idle bound. And waits that wake on the job's end.

Most run against both executors (a new interpreter per process, and processes forked from a warm zygote).
Isolation first, then what a failure does, then what reuse gives, then the waits."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import gpumesh as gm
from gpumesh.models import EXCEPTION_MARKER
from gpumesh.sandbox import landlock, launcher, tree

from .. import reused
from ..conftest import Workers, gpumesh, pid_alive, wait_until

needs_landlock = pytest.mark.skipif(landlock.abi() < 1, reason="this kernel has no Landlock")
SYSTEM_PYTHON = "/usr/bin/python3"  # one the sandbox user can read (this machine's venv lives under /root, 0700)

# A reused script: each task says which process ran it and how many tasks that process served; a payload's "act"
# makes the job's first task to run misbehave (its "mark" file says which task, and in which process).
REUSED = """
import json, os, signal, subprocess, sys, threading, time

SERVED = []
LOADED_AT = time.time()


def main(payload):
    SERVED.append(payload.get("i"))
    act, mark = payload.get("act", ""), payload.get("mark")
    if payload.get("sleep"):
        time.sleep(payload["sleep"])
    if mark:
        if os.path.exists(mark):  # misbehave once: the job's first task to run
            act = ""
        else:
            with open(mark, "w") as f:
                json.dump({"pid": os.getpid(), "served": len(SERVED), "i": payload.get("i")}, f)
    if act == "timeout":
        time.sleep(120)
    elif act == "memory":
        hog = bytearray(600 << 20)
        for at in range(0, len(hog), 4096):
            hog[at] = 1
        time.sleep(30)
    elif act == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    elif act == "exit":
        sys.exit(3)
    elif act == "raise":
        raise ValueError("bad payload " + str(payload.get("i")))
    elif act == "thread":
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    elif act == "child":
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    elif act == "leave":
        globals()["LEFT"] = payload["secret"]
        with open("left.txt", "w") as f:
            f.write(payload["secret"])
    seen = {"pid": os.getpid(), "served": len(SERVED), "i": payload.get("i"), "loaded_at": LOADED_AT}
    seen["left"] = globals().get("LEFT")
    seen["left_file"] = open("left.txt").read() if os.path.exists("left.txt") else None
    return seen
"""

# What a reused task can reach of the host (as test_isolation.PEEK, from inside main), on every task it serves.
PEEK = """
import json, os

SERVED = []


def main(payload):
    SERVED.append(1)
    seen = {"pid": os.getpid(), "served": len(SERVED), "uid": os.getuid(), "env": sorted(os.environ)}
    def attempt(name, fn):
        try:
            seen[name] = fn()
        except OSError as exc:
            seen[name] = type(exc).__name__
    def read(path, n=-1):
        with open(path, "rb") as f:
            return "read " + str(len(f.read(n)))
    worker = int(payload["worker"])
    attempt("secret", lambda: read(payload["secret"]))
    attempt("environ", lambda: read(f"/proc/{worker}/environ"))
    attempt("mem", lambda: read(f"/proc/{worker}/mem", 1))
    attempt("write_outside", lambda: open(payload["outside"], "w").write("x"))
    attempt("write_output", lambda: open(os.path.join(os.environ["GPUMESH_OUTPUT_DIR"], "ok.txt"), "w").write("ok"))
    seen["cgroup"] = open("/proc/self/cgroup").read()
    seen["stat"] = open("/proc/self/status").read()
    return seen
"""


def _script(tmp_path: Path, name: str, source: str) -> str:
    path = tmp_path / name
    path.write_text(source)
    return str(path)


def _run(mesh: gm.Mesh, script: str, payloads: list[dict[str, Any]], wait: float = 120, **opts: Any) -> list[Any]:
    """Submit with reuse, wait for the end, and return each task's result row."""
    job = mesh.submit(script, payloads, reuse_process=True, **opts)
    st = job.wait(timeout=wait)
    assert st.finished, st
    return job.results()


def _processes(rows: list[Any]) -> dict[int, list[int]]:
    """pid -> the served counts its done tasks reported."""
    seen: dict[int, list[int]] = {}
    for row in rows:
        if row.status == "done":
            seen.setdefault(row.result["pid"], []).append(row.result["served"])
    return seen


# -- 2. isolation kept where it matters -------------------------------------------------------------------


@needs_landlock
@pytest.mark.security
@pytest.mark.usefixtures("both_modes")
def test_a_reused_process_is_confined_as_any_attempt_is_on_every_task(env, workers: Workers, tmp_path: Path):
    """Landlock, the clean environment (no broker URL), no capabilities, the attempt's cgroup where one is made: for
    the process's first task and for the ones it serves after."""
    secret = tmp_path.parent / f"{tmp_path.name}-secret"
    secret.write_text("the worker owner's\n")
    try:
        proc = workers.start(GPUMESH_READ_PATHS="", GPUMESH_WRITE_PATHS="")
        payload = {"secret": str(secret), "worker": proc.pid, "outside": str(tmp_path.parent / f"{tmp_path.name}-w")}
        with gm.connect() as mesh:
            rows = _run(mesh, _script(tmp_path, "peek.py", PEEK), [payload] * 3)
    finally:
        secret.unlink()
    assert all(row.status == "done" for row in rows), [(r.status, r.error) for r in rows]
    seen = [row.result for row in rows]
    assert len({s["pid"] for s in seen}) == 1 and sorted(s["served"] for s in seen) == [1, 2, 3], seen
    for s in seen:
        assert s["secret"] == "PermissionError" and s["write_outside"] == "PermissionError", s
        assert s["environ"] == "PermissionError" and s["mem"] == "PermissionError", s
        assert s["write_output"] == 2, s
        assert not [k for k in s["env"] if k in ("GPUMESH_URL", "REDIS_URL", "GPUMESH_CONFIG")], s["env"]
        assert "CapEff:\t0000000000000000" in s["stat"], s["stat"]
        if tree.cgroup_base() is not None:
            assert tree.CGROUP_PREFIX in s["cgroup"], s["cgroup"]
    assert not Path(payload["outside"]).exists()


@pytest.mark.security
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON), reason="--sandbox-user needs a root worker")
@pytest.mark.usefixtures("both_modes")
def test_a_reused_process_runs_as_the_sandbox_user(env, workers: Workers, tmp_path: Path):
    workers.start("--sandbox-user", "nobody", GPUMESH_SANDBOX_PYTHON=SYSTEM_PYTHON)
    script = _script(tmp_path, "reused.py", REUSED.replace('"i": payload.get("i"),', '"i": os.getuid(),'))
    os.chmod(script, 0o644)
    with gm.connect() as mesh:
        rows = _run(mesh, script, [{"i": i} for i in range(3)])
    assert all(row.status == "done" for row in rows), [(r.status, r.error) for r in rows]
    import pwd

    nobody = pwd.getpwnam("nobody").pw_uid
    assert {row.result["i"] for row in rows} == {nobody}
    assert len(_processes(rows)) == 1, _processes(rows)


@pytest.mark.security
@pytest.mark.usefixtures("both_modes")
def test_two_jobs_never_share_a_process_nor_see_each_other_s_leftovers(env, workers: Workers, tmp_path: Path):
    """Within a job a task sees what the last one left (memory, files); another job on the same worker does not."""
    workers.start()
    script = _script(tmp_path, "reused.py", REUSED)
    with gm.connect() as mesh:
        first = _run(mesh, script, [{"i": 0, "act": "leave", "secret": "job one's"}, {"i": 1, "sleep": 0.5}])
        second = _run(mesh, script, [{"i": 0}, {"i": 1}])
    by_index = {row.index: row.result for row in first}
    assert by_index[0]["pid"] == by_index[1]["pid"], first
    assert by_index[1]["left"] == "job one's" and by_index[1]["left_file"] == "job one's", first
    assert {row.result["pid"] for row in second}.isdisjoint({by_index[0]["pid"]}), (first, second)
    assert all(row.result["left"] is None and row.result["left_file"] is None for row in second), second


# -- 2. a task that misbehaves takes the process down, and its outcome is its own ----------------------------


@pytest.mark.faults
@pytest.mark.parametrize(
    ("act", "status", "kind"),
    [
        ("timeout", "failed", "timeout"),
        ("memory", "failed", "memory"),
        ("crash", "failed", "script_error"),
        ("exit", "failed", "script_error"),
        ("thread", "done", None),
        ("child", "done", None),
    ],
)
@pytest.mark.usefixtures("both_modes")
def test_a_task_that_misbehaves_takes_the_process_down_and_the_next_gets_a_new_one(
    env, workers: Workers, tmp_path: Path, act: str, status: str, kind: str | None
):
    """The job's first task to run misbehaves; the other two run after it, together in a process of their own,
    and are done."""
    workers.start(GPUMESH_TASK_MEMORY_MB="300")
    mark = tmp_path / "mark.json"
    payloads = [{"i": i, "act": act, "mark": str(mark)} for i in range(3)]
    with gm.connect() as mesh:
        rows = _run(mesh, _script(tmp_path, "reused.py", REUSED), payloads, wait=180, max_attempts=1, **(
            {"timeout": 5} if act == "timeout" else {}))  # fmt: skip
    went = json.loads(mark.read_text())
    bad, rest = rows[went["i"]], [row for row in rows if row.index != went["i"]]
    assert bad.status == status, (bad.status, bad.error)
    if kind is not None:
        assert bad.error_kind == kind, (bad.error_kind, bad.error)
    assert all(row.status == "done" for row in rest), [(r.status, r.error) for r in rest]
    assert went["served"] == 1  # it ran first, in a new process
    after = _processes(rest)
    assert went["pid"] not in after, (went, after)  # the process it ran in served no other task
    assert len(after) == 1 and sorted(next(iter(after.values()))) == [1, 2], after  # the next one serves on
    assert not pid_alive(went["pid"])


@pytest.mark.faults
@pytest.mark.usefixtures("both_modes")
def test_a_task_that_raises_fails_alone_and_the_process_serves_on(env, workers: Workers, tmp_path: Path):
    workers.start()
    mark = tmp_path / "mark.json"
    payloads = [{"i": i, "act": "raise", "mark": str(mark)} for i in range(3)]
    with gm.connect() as mesh:
        rows = _run(mesh, _script(tmp_path, "reused.py", REUSED), payloads, max_attempts=1)
    went = json.loads(mark.read_text())
    bad, rest = rows[went["i"]], [row for row in rows if row.index != went["i"]]
    assert bad.status == "failed" and f"ValueError: bad payload {went['i']}" in (bad.error or ""), bad
    assert EXCEPTION_MARKER in (bad.error or "")
    assert [r.status for r in rest] == ["done", "done"]
    assert _processes(rest) == {went["pid"]: [2, 3]} or sorted(_processes(rest)[went["pid"]]) == [2, 3]


# -- 1. load once per worker ------------------------------------------------------------------------------


@pytest.mark.processes
@pytest.mark.usefixtures("both_modes")
def test_module_state_is_loaded_once_per_worker_and_survives_between_tasks(env, workers: Workers, tmp_path: Path):
    workers.start()
    workers.start()
    loads = tmp_path / "loads"
    source = REUSED.replace(
        "LOADED_AT = time.time()",
        f"LOADED_AT = time.time()\nopen({str(loads)!r}, 'a').write(str(os.getpid()) + chr(10))\ntime.sleep(1)",
    )
    with gm.connect() as mesh:
        rows = _run(mesh, _script(tmp_path, "model.py", source), [{"i": i, "sleep": 0.05} for i in range(12)])
    assert all(row.status == "done" for row in rows), [(r.status, r.error) for r in rows]
    processes = _processes(rows)
    loaded = loads.read_text().split()
    assert len(loaded) == len(processes) <= 2, (loaded, processes)  # one load per process, one process per worker
    assert sorted(s for served in processes.values() for s in served) != [1] * 12
    for served in processes.values():
        assert sorted(served) == list(range(1, len(served) + 1)), processes
    # With a whole second's load each, twelve fresh processes would take 12 s of loading: the job took far less.
    assert sum(row.duration_s or 0 for row in rows) < 6, [row.duration_s for row in rows]


@pytest.mark.processes
def test_a_function_s_module_level_cache_loads_once_per_worker_through_map(env, workers: Workers, tmp_path: Path):
    workers.start(GPUMESH_WRITE_PATHS=str(tmp_path))
    loads = tmp_path / "loads"
    with gm.connect() as mesh:
        out = mesh.map(reused.cached_square, [{"x": i, "loads": str(loads)} for i in range(8)], reuse_process=True)
    assert [o["y"] for o in out] == [i * i for i in range(8)]
    assert len(loads.read_text().split()) == 1 == len({o["pid"] for o in out})
    assert sorted(o["calls"] for o in out) == list(range(1, 9))


@pytest.mark.core
def test_a_script_without_main_is_refused_at_submit_with_the_reason(env, r, tmp_path: Path):
    script = _script(tmp_path, "oneshot.py", "import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n")
    p = gpumesh("submit", script, "--payloads", "-", "--reuse-process", env=env, input='[{"x": 1}]')
    assert p.returncode == 2, p.stderr
    assert "no top-level def main(payload)" in p.stderr and "--reuse-process" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not r.keys("gpumesh:job:*")
    with gm.connect() as mesh, pytest.raises(gm.UsageError, match="main"):
        mesh.submit(script, [{"x": 1}], reuse_process=True)
    assert not r.keys("gpumesh:job:*")


@pytest.mark.processes
@pytest.mark.usefixtures("both_modes")
def test_a_reused_process_runs_in_its_project_folder(env, workers: Workers, tmp_path: Path):
    """With --project the reused process imports the folder's modules and reads its files, once for all its tasks,
    and cannot change them."""
    proj = tmp_path / "proj"
    (proj / "mylib").mkdir(parents=True)
    (proj / "mylib" / "__init__.py").write_text("")
    (proj / "mylib" / "model.py").write_text("import json\nWEIGHTS = json.load(open('configs/w.json'))\n")
    (proj / "configs").mkdir()
    (proj / "configs" / "w.json").write_text('{"w": 3}')
    (proj / "infer.py").write_text(
        "import os\nfrom mylib.model import WEIGHTS\n\n"
        "def main(payload):\n"
        "    try:\n"
        "        open('configs/w.json', 'w').write('{}')\n"
        "        wrote = True\n"
        "    except OSError:\n"
        "        wrote = False\n"
        "    return {'y': WEIGHTS['w'] * payload['x'], 'pid': os.getpid(), 'wrote': wrote}\n"
    )
    workers.start()
    with gm.connect() as mesh:
        rows = _run(mesh, str(proj / "infer.py"), [{"x": i} for i in range(4)], project=str(proj))
    assert [row.result["y"] for row in sorted(rows, key=lambda r: r.index)] == [0, 3, 6, 9], rows
    assert len({row.result["pid"] for row in rows}) == 1, rows
    assert not any(row.result["wrote"] for row in rows), rows


@pytest.mark.security
def test_the_signature_covers_whether_a_job_s_tasks_share_a_process(env, r, workers: Workers, tmp_path: Path):
    """A worker credential can write a job's hash: switching its tasks into one shared process (or out of it) must
    make a trusting worker refuse them, as a rewritten script or payload does."""
    from gpumesh import signing
    from gpumesh.store import keys

    priv, pub = signing.generate(tmp_path / "keys")
    script = _script(tmp_path, "reused.py", REUSED)
    with gm.connect() as mesh:
        alone = mesh.submit(script, [{"i": 0}], sign_key=priv, max_attempts=1)
        shared = mesh.submit(script, [{"i": 0}], sign_key=priv, max_attempts=1, reuse_process=True)
        honest = mesh.submit(script, [{"i": 0}], sign_key=priv, max_attempts=1, reuse_process=True)
        r.hset(keys.job(alone.id), "reuse_process", "1")  # now its tasks would share a process...
        r.hdel(keys.job(shared.id), "reuse_process")  # ...and this one's would not
        workers.start("--trust", signing.inline(signing.public_key(pub)))
        for job in (alone, shared):
            assert job.wait(timeout=60).status == "failed"
            (row,) = job.results()
            assert row.error_kind == "refused" and "signature" in (row.error or ""), row
        assert honest.wait(timeout=60).status == "done", honest.results()


@pytest.mark.core
def test_output_globs_with_a_reused_process_are_refused_at_submit(env, r, tmp_path: Path):
    script = _script(tmp_path, "reused.py", REUSED)
    p = gpumesh(
        "submit", script, "--payloads", "-", "--reuse-process", "--output", "out/*.json", env=env, input='[{"i": 1}]'
    )
    assert p.returncode == 2 and "--output" in p.stderr and "GPUMESH_OUTPUT_DIR" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not r.keys("gpumesh:job:*"), p.stderr


@pytest.mark.core
def test_the_reused_process_s_exception_marker_is_the_one_taskfailed_reads():
    assert launcher.EXCEPTION_MARKER == EXCEPTION_MARKER


# -- 2. the process ends with its job, its cancel, its worker, and when idle ----------------------------------


def _pids_of_reused(worker_pid: int) -> list[int]:
    """The supervisors of reused processes below a worker (their command line says --resident)."""
    import psutil

    out = []
    for p in psutil.Process(worker_pid).children():
        try:
            if "--resident" in p.cmdline():
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


@pytest.mark.processes
@pytest.mark.usefixtures("both_modes")
def test_the_process_ends_when_its_job_ends(env, workers: Workers, tmp_path: Path):
    proc = workers.start()
    with gm.connect() as mesh:
        rows = _run(mesh, _script(tmp_path, "reused.py", REUSED), [{"i": 0}])
    wait_until(lambda: not pid_alive(rows[0].result["pid"]), timeout=15, what="the reused process to end")
    assert not _pids_of_reused(proc.pid)


@pytest.mark.processes
@pytest.mark.usefixtures("both_modes")
def test_the_process_ends_when_its_job_is_cancelled(env, workers: Workers, tmp_path: Path):
    workers.start()
    mark = tmp_path / "mark.json"
    with gm.connect() as mesh:
        job = mesh.submit(
            _script(tmp_path, "reused.py", REUSED), [{"i": 0, "mark": str(mark), "sleep": 0}, {"i": 1, "sleep": 60}],
            reuse_process=True,
        )  # fmt: skip
        pid = json.loads(wait_until(lambda: mark.exists() and mark.read_text(), what="the first task"))["pid"]
        time.sleep(0.5)
        job.cancel()
        job.wait(timeout=30)
    wait_until(lambda: not pid_alive(pid), timeout=15, what="the reused process to end")


@pytest.mark.processes
@pytest.mark.parametrize("ends_by", ["idle bound", "worker stop"])
@pytest.mark.usefixtures("both_modes")
def test_the_process_ends_after_an_idle_bound_and_when_its_worker_stops(env, workers: Workers, tmp_path: Path, ends_by):
    """The job stays running (its second task waits for a worker that is not there): its process, idle, ends only
    by the idle bound (1 s here), or with its worker."""
    import signal

    proc = workers.start(GPUMESH_REUSE_IDLE="1" if ends_by == "idle bound" else "300")
    with gm.connect() as mesh:
        job = mesh.submit(
            _script(tmp_path, "reused.py", REUSED), [{"i": 0}, {"i": 1, "requires": ["gpu~h900"]}], reuse_process=True
        )
        wait_until(lambda: job.status().tasks.done == 1, what="the first task")
        pid = job.results()[0].result["pid"]
        if ends_by == "worker stop":
            time.sleep(1.5)
            assert pid_alive(pid)  # idle, and kept for the job's next task
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
        wait_until(lambda: not pid_alive(pid), timeout=15, what="the idle process to end")
        assert job.status().status == "running"
        job.cancel()


# -- 4. waits wake on the job's end --------------------------------------------------------------------------


@pytest.mark.core
def test_job_wait_returns_within_milliseconds_of_the_task_s_end(env, workers: Workers, tmp_path: Path, r):
    """A poll every 0.25 s would return 125 ms after the end on average; the stream of ends wakes the wait at once."""
    workers.start("--warm")
    script = _script(tmp_path, "noop.py", "import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n")
    lags = []
    with gm.connect() as mesh:
        mesh.submit(script, [{"x": 0}]).wait(timeout=60)  # the worker's first task
        for i in range(7):
            job = mesh.submit(script, [{"x": i, "pad": "x" * i}])
            job.wait(timeout=60)
            returned = time.time()
            ended = float(r.hget(f"gpumesh:task:{job.id}-0", "finished_at"))
            lags.append(returned - ended)
    assert min(lags) <= 0.005 and statistics.median(lags) <= 0.05, lags


@pytest.mark.core
def test_submit_wait_and_status_watch_follow_the_stream_of_ends(env, workers: Workers, tmp_path: Path):
    workers.start("--warm")
    script = _script(tmp_path, "noop.py", "import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n")
    started = time.monotonic()
    p = gpumesh("submit", script, "--payloads", "-", "--wait", env=env, input='[{"x": 1}, {"x": 2}]')
    assert p.returncode == 0 and p.stdout.split()[1] == "done", p.stderr
    job = p.stdout.split()[0]
    w = gpumesh("status", job, "--watch", env=env)
    assert w.returncode == 0, w.stderr
    assert time.monotonic() - started < 30
    assert sys.executable  # both went through the CLI as a user runs it
