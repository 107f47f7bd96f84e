"""Environments (DESIGN §10): a job's packages are locked once at submit (uv's universal resolution, hashes),
built once per machine into a cache its workers share, read-only to tasks, and nothing a package brings runs
outside the sandbox. Real `gpumesh worker` processes, a real Redis and a real uv throughout; the packages are
tiny wheels built here and served from a local --find-links folder (never the public index)."""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from pathlib import Path

import pytest
import redis

import gpumesh
from gpumesh.sandbox import landlock
from gpumesh.store import keys

from .. import mapped
from ..api.test_projects import SYSTEM_PYTHON, can_sandbox_user
from ..conftest import Workers
from ..conftest import gpumesh as run_cli


def make_wheel(folder: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """A minimal, valid pure-Python wheel: ``files`` (path in the wheel -> text), its metadata and RECORD."""
    dist = f"{name}-{version}.dist-info"
    entries = {
        **files,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: gpumesh-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in entries.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    entries[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in entries.items():
            z.writestr(path, text)
    return wheel


@pytest.fixture
def index(tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Path:
    """A local package folder (uv --find-links) with gmtiny 1.0, and uv told to use only it, with a cache of the
    test's own: the submitter's resolution and the workers' builds both read it (the workers' owner's setting)."""
    links = tmp_path / "wheels"
    make_wheel(links, "gmtiny", "1.0", {"gmtiny.py": "VALUE = 42\n"})
    values = {
        "UV_FIND_LINKS": str(links), "UV_NO_INDEX": "1", "UV_CACHE_DIR": str(tmp_path / "uv-cache"),
        "GPUMESH_ENV_CACHE": str(tmp_path / "envs"),
    }  # fmt: skip
    for k, v in values.items():
        monkeypatch.setenv(k, v)
        env[k] = v
    return links


PEP723 = """\
# /// script
# dependencies = ["gmtiny"]
# ///
import json, sys
import gmtiny
p = json.load(sys.stdin)
print(json.dumps({"value": gmtiny.VALUE + p["x"], "exe": sys.executable}))
"""


def finished(job_id: str, workers: Workers, timeout: float = 120) -> list[object]:
    """The results of a job that must end done (the workers' logs say why not)."""
    with gpumesh.connect() as mesh:
        job = mesh.job(job_id)
        st = job.wait(timeout=timeout)
        res = job.results()
        assert st.status == "done", ([(r.status, r.error) for r in res], workers.log(0))
        return [r.result for r in res]


def builds(cache: Path) -> list[dict[str, object]]:
    """The builds (uv venv + uv pip install) the machine's env cache ``cache`` records."""
    path = cache / "builds.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.processes
def test_pep723_script_runs_in_its_env(
    both_modes: str, index: Path, workers: Workers, env: dict[str, str], tmp_path: Path
) -> None:
    """A script with a PEP 723 block runs on a worker whose Python lacks the package; submit names the lock."""
    assert subprocess.run([sys.executable, "-c", "import gmtiny"], capture_output=True).returncode != 0
    script = tmp_path / "job.py"
    script.write_text(PEP723)
    workers.start()
    ran = run_cli("submit", str(script), "--payloads", "-", "--json", env=env, input='[{"x": 1}, {"x": 2}]')
    assert ran.returncode == 0, ran.stderr
    sub = json.loads(ran.stdout)
    assert len(sub["env"]) == 64
    results = finished(sub["job_id"], workers)
    assert [r["value"] for r in results] == [43, 44]
    shown = run_cli("status", sub["job_id"], "--json", env=env)
    assert json.loads(shown.stdout)["env"] == sub["env"]
    assert all(str(tmp_path / "envs") in r["exe"] for r in results)
    assert len(builds(tmp_path / "envs")) == 1


def _evil_wheel(links: Path, marker: Path) -> None:
    """gmevil: a module, and a .pth file that writes ``marker`` (outside any task's reach) whenever a Python whose
    site reads it starts: at build, in a zygote, a spare, or an unconfined launcher, it would."""
    hook = f"import os; open({str(marker)!r}, 'w').write(str(os.getpid()))\n"
    make_wheel(links, "gmevil", "1.0", {"gmevil.py": "VALUE = 7\n", "gmevil_hook.pth": hook})


MEDDLE = """\
# /// script
# dependencies = ["gmevil"]
# ///
import json, os, sys
import gmevil
here = os.path.dirname(gmevil.__file__)
out = {"value": gmevil.VALUE, "site": here}
for name, f in (("change", lambda: open(os.path.join(here, "gmevil.py"), "a").write("VALUE = 0\\n")),
                ("create", lambda: open(os.path.join(here, "sitecustomize.py"), "w").write("x = 1\\n")),
                ("remove", lambda: os.unlink(os.path.join(here, "gmevil.py"))),
                ("rename", lambda: os.rename(os.path.join(here, "gmevil.py"), os.path.join(here, "x.py")))):
    try:
        f()
        out[name] = "done"
    except OSError as e:
        out[name] = type(e).__name__
print(json.dumps(out))
"""


@pytest.mark.security
@pytest.mark.skipif(landlock.abi() < 1, reason="this kernel has no Landlock")
@pytest.mark.parametrize("user", [None, "nobody"])
def test_env_code_runs_only_confined_and_tasks_cannot_change_their_env(
    both_modes: str, index: Path, workers: Workers, env: dict[str, str], tmp_path: Path, user: str | None
) -> None:
    """A wheel's .pth file runs nowhere unconfined (build, launcher, zygote): its write outside the task's reach
    never lands, fresh or warm, with and without a sandbox user. A task that writes into its env's site-packages
    is refused, and the next task (of another job too) sees the original files."""
    extra: list[str] = []
    if user:
        if not can_sandbox_user:
            pytest.skip("--sandbox-user needs a root worker on Linux and a Python the task user can read")
        extra = ["--sandbox-user", user]
        # The env cache where the task's user can reach it (the test's own folder is 0700), and made on a Python
        # that user can read.
        cache = Path(tempfile.mkdtemp(prefix="gpumesh-test-envs-"))
        os.chmod(cache, 0o755)
        workers.env = {**workers.env, "GPUMESH_ENV_CACHE": str(cache), "GPUMESH_SANDBOX_PYTHON": SYSTEM_PYTHON}
    marker = tmp_path.parent / f"pth-ran-{uuid.uuid4().hex}"
    _evil_wheel(index, marker)
    if user:  # the build runs as that user, who must read the owner's package folder
        links = cache / "wheels"
        shutil.copytree(index, links)
        os.chmod(links, 0o755)
        workers.env["UV_FIND_LINKS"] = str(links)
    script = tmp_path / "meddle.py"
    script.write_text(MEDDLE)
    workers.start(*extra)
    try:
        for _ in range(2):  # the second job finds the env built, and (warm) its zygote started
            ran = run_cli("submit", str(script), "--payloads", "-", "--json", env=env, input='[{"i": 0}, {"i": 1}]')
            assert ran.returncode == 0, ran.stderr
            for r in finished(json.loads(ran.stdout)["job_id"], workers):
                assert isinstance(r, dict)
                assert r["value"] == 7
                assert {r[k] for k in ("change", "create", "remove", "rename")} <= {"PermissionError", "OSError"}, r
        assert not marker.exists(), "a .pth file of the env ran outside the sandbox"
        made = builds(Path(workers.env["GPUMESH_ENV_CACHE"]))
        assert len(made) == 1
        site = next(Path(workers.env["GPUMESH_ENV_CACHE"]).glob("*/lib/python3*/site-packages"))
        assert list(site.glob("__pycache__/gmevil.*.pyc")), "its bytecode is compiled at build (running none of it)"
        if user:  # built as the sandbox user, never as root; then root's and read-only, so that user cannot undo it
            import pwd

            assert made[0]["uid"] == pwd.getpwnam(user).pw_uid
            assert {(p.stat().st_uid, p.stat().st_mode & 0o222) for p in site.rglob("gmevil*")} == {(0, 0)}
    finally:
        marker.unlink(missing_ok=True)
        if user:
            workers.stop_all()
            for dirpath, _dirs, _files in os.walk(cache):
                os.chmod(dirpath, 0o755)
            shutil.rmtree(cache, ignore_errors=True)


PLAIN = """\
import json, sys
import gmtiny
p = json.load(sys.stdin)
print(json.dumps(gmtiny.VALUE + p.get("x", 0)))
"""


@pytest.mark.processes
def test_declared_every_way(index: Path, workers: Workers, env: dict[str, str], tmp_path: Path) -> None:
    """--with, --requirements, a job file's [env] and the API's dependencies= (for a function, as mesh.map ships
    one) each give a job that runs on a worker without the package; one lock, so one build for all of them."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    (tmp_path / "requirements.txt").write_text("gmtiny==1.0\n")
    wheel = index / "gmtiny-1.0-py3-none-any.whl"
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (tmp_path / "pylock.toml").write_text(
        'lock-version = "1.0"\ncreated-by = "hand"\n\n[[packages]]\nname = "gmtiny"\nversion = "1.0"\n'
        f'wheels = [{{ url = "{wheel.as_uri()}", hashes = {{ sha256 = "{digest}" }} }}]\n'
    )
    (tmp_path / "gpumesh.toml").write_text(
        '[job]\nscript = "plain.py"\npayloads = [{x = 3}]\n\n[env]\ndependencies = ["gmtiny"]\n'
    )
    workers.start()
    ids = []
    for args in (
        ["--with", "gmtiny"],
        ["--requirements", str(tmp_path / "requirements.txt")],
        ["--requirements", str(tmp_path / "pylock.toml")],
    ):
        ran = run_cli("submit", str(script), "--payloads", "-", "--json", *args, env=env, input='[{"x": 1}]')
        assert ran.returncode == 0, ran.stderr
        ids.append(json.loads(ran.stdout)["job_id"])
    ran = run_cli("submit", "--json", env=env, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    ids.append(json.loads(ran.stdout)["job_id"])
    assert [finished(i, workers) for i in ids] == [[43], [43], [43], [45]]
    with gpumesh.connect() as mesh:
        assert mesh.map(mapped.add_tiny, [{"x": 1}, {"x": 2}], dependencies=["gmtiny"]) == [43, 44]
    assert len(builds(tmp_path / "envs")) == 1  # the same lock every time: built once


@pytest.mark.core
def test_resolution_failure_is_bad_input_and_writes_nothing(
    index: Path, env: dict[str, str], tmp_path: Path, r: redis.Redis
) -> None:
    """An unknown package, or a requires-python no version satisfies: exit 2 with uv's message, no job."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    before = sorted(r.keys("*"))
    for args, said in (
        (["--with", "no-such-package-here"], "no-such-package-here"),
        (["--with", "gmtiny>=2"], "gmtiny"),
    ):
        ran = run_cli("submit", str(script), "--payloads", "-", *args, env=env, input='[{"x": 1}]')
        assert ran.returncode == 2, ran.stderr
        assert "cannot be resolved" in ran.stderr and said in ran.stderr
        assert "Traceback" not in ran.stderr
    assert sorted(r.keys("*")) == before


@pytest.mark.processes
def test_one_build_per_machine_and_every_worker_runs(
    index: Path, workers: Workers, env: dict[str, str], tmp_path: Path, r: redis.Redis
) -> None:
    """Four workers of one machine, one new env: exactly one uv build; the others wait for it, then all take
    tasks. A later job with the same lock builds nothing."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN.replace("print(", "import time; time.sleep(0.3); print("))
    for _ in range(4):
        workers.start()
    payloads = json.dumps([{"x": i} for i in range(16)])
    for _ in range(2):
        ran = run_cli("submit", str(script), "--payloads", "-", "--json", "--with", "gmtiny", env=env, input=payloads)
        assert ran.returncode == 0, ran.stderr
        job = json.loads(ran.stdout)["job_id"]
        assert finished(job, workers) == [42 + i for i in range(16)]
    assert [b["ok"] for b in builds(tmp_path / "envs")] == [True]
    ran_on = {r.hget(keys.task(keys.task_id(job, i)), "worker") for i in range(16)}
    assert len(ran_on) >= 3, ran_on


def _hold_build(cache: Path, digest: str) -> int:
    """Take the machine's build lock of ``digest`` in ``cache`` (EnvCache._locked), as a worker of that machine
    building it would: the machine's workers wait for it (preparing) until it is closed."""
    import fcntl

    cache.mkdir(parents=True, exist_ok=True)
    fd = os.open(cache / f"{digest[:32]}.build", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _until(what: str, check: object, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.mark.processes
def test_workers_prepare_the_env_before_they_lease_and_start_together(
    index: Path, workers: Workers, env: dict[str, str], tmp_path: Path, r: redis.Redis
) -> None:
    """Four workers of one machine and a job whose env the machine lacks: each prepares it before leasing any
    task (`workers` and `status` say "preparing env … for JOB"), exactly one uv build runs, and every worker's
    first task starts after that build's end (the benchmark measures how soon after: benchmarks/envs.py)."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN.replace("print(", "import time; time.sleep(0.3); print("))
    payloads = json.dumps([{"x": i} for i in range(16)])
    ran = run_cli("submit", str(script), "--payloads", "-", "--json", "--with", "gmtiny", env=env, input=payloads)
    assert ran.returncode == 0, ran.stderr
    sub = json.loads(ran.stdout)
    held = _hold_build(tmp_path / "envs", sub["env"])  # the build is slow: the workers wait in plain sight
    for _ in range(4):
        workers.start()

    def shown() -> list[dict[str, object]]:
        return [w for w in json.loads(run_cli("workers", "--json", env=env).stdout) if w.get("preparing")]

    _until("all four workers say they prepare the env", lambda: len(shown()) == 4)
    assert {w["preparing"] for w in shown()} == {f"env {sub['env'][:12]} for {sub['job_id']}"}
    st = json.loads(run_cli("status", sub["job_id"], "--json", env=env).stdout)
    assert len(st["preparing"]) == 4 and st["tasks"]["running"] == 0 and st["tasks"]["done"] == 0, st
    text = run_cli("status", sub["job_id"], env=env).stdout
    assert f"preparing env {sub['env'][:12]} for {sub['job_id']} on " in text, text
    from gpumesh.dashboard.view import View

    with gpumesh.connect() as mesh:  # the dashboard's workers table, as its page shows it
        shown_rows = View(mesh, may_write=False).workers()["workers"]
    assert [w["task"] for w in shown_rows] == [f"preparing env {sub['env'][:12]} for {sub['job_id']}"] * 4
    os.close(held)
    assert finished(sub["job_id"], workers) == [42 + i for i in range(16)]
    done = builds(tmp_path / "envs")
    assert [b["ok"] for b in done] == [True]  # one uv venv + uv pip install for the four workers
    first: dict[str, float] = {}
    for i in range(16):
        t = r.hgetall(keys.task(keys.task_id(sub["job_id"], i)))
        first[t["worker"]] = min(first.get(t["worker"], math.inf), float(t["started_at"]))
    assert len(first) == 4, first
    assert all(started >= float(str(done[0]["at"])) - 0.05 for started in first.values()), (first, done)
    workers_now = json.loads(run_cli("workers", "--json", env=env).stdout)
    assert all(w["envs"] == [sub["env"][:16]] and "preparing" not in w for w in workers_now), workers_now
    with gpumesh.connect() as mesh:
        assert [w["envs"] for w in View(mesh, may_write=False).workers()["workers"]] == [
            [f"{sub['env'][:12]} ready"]
        ] * 4


@pytest.mark.processes
def test_workers_holding_the_env_keep_taking_tasks_while_another_prepares(
    index: Path, workers: Workers, env: dict[str, str], tmp_path: Path, r: redis.Redis
) -> None:
    """Two machines (an env cache each): while machine b prepares the job's env it leases none of its tasks, and
    machine a, which has the env, runs them meanwhile."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN.replace("print(", "import time; time.sleep(0.2); print("))
    payloads = json.dumps([{"x": i} for i in range(10)])
    ran = run_cli("submit", str(script), "--payloads", "-", "--json", "--with", "gmtiny", env=env, input=payloads)
    sub = json.loads(ran.stdout)
    held = _hold_build(tmp_path / "envs-b", sub["env"])
    workers.start(GPUMESH_ENV_CACHE=str(tmp_path / "envs-a"))
    workers.start(GPUMESH_ENV_CACHE=str(tmp_path / "envs-b"))
    job = keys.job(sub["job_id"])
    _until("machine a runs tasks", lambda: int(r.hget(job, "done") or 0) >= 3)
    preparing = json.loads(run_cli("status", sub["job_id"], "--json", env=env).stdout).get("preparing")
    assert preparing and len(preparing) == 1, preparing
    ran_on = {r.hget(keys.task(keys.task_id(sub["job_id"], i)), "worker") for i in range(10)} - {None}
    assert preparing[0] not in ran_on
    os.close(held)
    assert finished(sub["job_id"], workers) == [42 + i for i in range(10)]
    assert [b["ok"] for b in builds(tmp_path / "envs-a")] == [True]


@pytest.mark.faults
def test_when_every_worker_failed_the_build_the_tasks_fail_with_its_message(
    index: Path, workers: Workers, env: dict[str, str], tmp_path: Path, r: redis.Redis
) -> None:
    """Two machines whose indexes both lack the wheel: each tries the build once, before leasing anything; once
    both failed, the tasks fail (kind environment, uv's message) instead of waiting for ever."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    empty = tmp_path / "empty-index"
    empty.mkdir()
    for m in "ab":
        workers.start(UV_FIND_LINKS=str(empty), GPUMESH_ENV_CACHE=str(tmp_path / f"envs-{m}"))
    items = json.dumps([{"x": i} for i in range(4)])
    ran = run_cli("submit", str(script), "--payloads", "-", "--json", "--with", "gmtiny", env=env, input=items)
    job_id = json.loads(ran.stdout)["job_id"]
    with gpumesh.connect() as mesh:
        job = mesh.job(job_id)
        st = job.wait(timeout=120)
        res = job.results()
    assert st.status == "failed" and st.failed_by_kind == {"environment": 4}, st
    assert all(r_.error and r_.error.startswith("environment:") and "gmtiny" in r_.error for r_ in res), res
    assert [b["ok"] for b in builds(tmp_path / "envs-a")] == [False]
    assert [b["ok"] for b in builds(tmp_path / "envs-b")] == [False]
    assert r.hget(keys.job(job_id), "env_dead") == "1"
    shown = json.loads(run_cli("workers", "--json", env=env).stdout)
    assert st.env and [w["env_failed"] for w in shown] == [[st.env[:16]]] * 2, shown


@pytest.mark.faults
def test_failed_build_is_an_environment_failure(
    index: Path, workers: Workers, env: dict[str, str], tmp_path: Path
) -> None:
    """A build that cannot get its wheel (the worker's index lacks it): the tasks fail with kind environment and
    uv's message, in results and the worker's log; the machine does not try that lock again."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    empty = tmp_path / "empty-index"
    empty.mkdir()
    workers.start(UV_FIND_LINKS=str(empty))  # this worker's owner serves other packages
    ran = run_cli("submit", str(script), "--payloads", "-", "--json", "--with", "gmtiny", env=env,
                  input='[{"x": 1}, {"x": 2}]')  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    job_id = json.loads(ran.stdout)["job_id"]
    with gpumesh.connect() as mesh:
        job = mesh.job(job_id)
        st = job.wait(timeout=120)
        res = job.results()
    assert st.status == "failed"
    assert st.failed_by_kind == {"environment": 2}
    assert all(r.error and r.error.startswith("environment:") and "gmtiny" in r.error for r in res), res
    assert "preparing env" in workers.log(0)
    assert [b["ok"] for b in builds(tmp_path / "envs")] == [False]  # the second task did not build again
    shown = run_cli("envs", "--json", env=env)
    assert [e["state"] for e in json.loads(shown.stdout)["envs"]] == ["failed"]
    doctor = run_cli("doctor", env=env, timeout=120)
    assert any(line.startswith("warn") and "failed build" in line for line in doctor.stdout.splitlines()), doctor.stdout
    pruned = run_cli("envs", "--prune", "--json", env=env)
    assert json.loads(pruned.stdout)["envs"] == []


@pytest.mark.processes
def test_no_envs_worker_is_never_given_an_env_job(
    index: Path, workers: Workers, env: dict[str, str], tmp_path: Path, r: redis.Redis
) -> None:
    """A worker with --no-envs takes plain jobs only; an env job waits (and says so) until a worker that builds
    envs joins."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    workers.start("--no-envs")
    ran = run_cli("submit", str(script), "--payloads", "-", "--json", "--with", "gmtiny", env=env, input='[{"x": 1}]')
    assert ran.returncode == 0, ran.stderr
    sub = json.loads(ran.stdout)
    assert any("envs=yes" in json.dumps(w) for w in sub["waiting_for"]), sub
    time.sleep(2)
    assert r.hget(f"gpumesh:job:{sub['job_id']}", "done") == "0"
    workers.start()
    assert finished(sub["job_id"], workers) == [43]
    assert "preparing env" not in workers.log(0)


@pytest.mark.processes
def test_envs_lists_and_prunes_what_no_worker_holds(
    index: Path, workers: Workers, env: dict[str, str], tmp_path: Path
) -> None:
    """`gpumesh envs` shows the machine's env with its packages, in use while a worker holds it; --prune keeps it
    then, and removes it once no worker holds it."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    proc = workers.start()
    ran = run_cli("submit", str(script), "--payloads", "-", "--json", "--with", "gmtiny", env=env, input='[{"x": 0}]')
    assert finished(json.loads(ran.stdout)["job_id"], workers) == [42]
    shown = json.loads(run_cli("envs", "--json", env=env).stdout)["envs"]
    assert [(e["state"], e["in_use"], e["packages"]) for e in shown] == [("ready", True, ["gmtiny==1.0"])]
    assert json.loads(run_cli("envs", "--prune", "--json", env=env).stdout)["envs"] != []
    proc.terminate()
    proc.wait(timeout=30)
    assert json.loads(run_cli("envs", "--prune", "--json", env=env).stdout)["envs"] == []


@pytest.mark.processes
def test_requires_python_is_a_requirement(index: Path, workers: Workers, env: dict[str, str], tmp_path: Path) -> None:
    """A job's requires-python places it: '>=3.9' runs on this worker (3.9 < 3.11 as versions, not as decimals);
    one no live worker's Python meets waits, and submit and status say which requirement."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    workers.start()
    ran = run_cli("submit", str(script), "--payloads", "-", "--json", "--with", "gmtiny", "--python", ">=3.9",
                  env=env, input='[{"x": 1}]')  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert finished(json.loads(ran.stdout)["job_id"], workers) == [43]
    ran = run_cli("submit", str(script), "--payloads", "-", "--json", "--with", "gmtiny", "--python", ">=3.99",
                  env=env, input='[{"x": 1}]')  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    sub = json.loads(ran.stdout)
    assert "python>=3.99" in json.dumps(sub["waiting_for"]), sub
    shown = json.loads(run_cli("status", sub["job_id"], "--json", env=env).stdout)
    assert shown["status"] == "queued" and "python>=3.99" in json.dumps(shown["waiting_for"])


@pytest.mark.security
def test_source_builds_need_both_sides(index: Path, workers: Workers, env: dict[str, str], tmp_path: Path) -> None:
    """A job that allows source builds runs only on a worker that allows them too: elsewhere it fails with kind
    environment, naming the flag, and nothing is built."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    workers.start()
    ran = run_cli("submit", str(script), "--payloads", "-", "--json", "--with", "gmtiny", "--allow-builds",
                  env=env, input='[{"x": 1}]')  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    with gpumesh.connect() as mesh:
        job = mesh.job(json.loads(ran.stdout)["job_id"])
        assert job.wait(timeout=120).failed_by_kind == {"environment": 1}
        assert "--allow-builds" in (job.results()[0].error or "")
    assert builds(tmp_path / "envs") == []
    workers.stop_all()
    workers.start("--allow-builds")
    ran = run_cli("submit", str(script), "--payloads", "-", "--json", "--with", "gmtiny", "--allow-builds",
                  env=env, input='[{"x": 1}]')  # fmt: skip
    assert finished(json.loads(ran.stdout)["job_id"], workers) == [43]


@pytest.mark.faults
def test_a_machine_that_cannot_build_leaves_the_job_to_one_that_can(
    index: Path, workers: Workers, env: dict[str, str], tmp_path: Path, r: redis.Redis
) -> None:
    """Two machines (an env cache each), one whose index lacks the wheel: its failed build is not tried again,
    the tasks it failed go to the other machine, and the job ends done."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    empty = tmp_path / "empty-index"
    empty.mkdir()
    workers.start(UV_FIND_LINKS=str(empty), GPUMESH_ENV_CACHE=str(tmp_path / "envs-a"))
    workers.start(GPUMESH_ENV_CACHE=str(tmp_path / "envs-b"))
    items = json.dumps([{"x": i} for i in range(6)])
    ran = run_cli("submit", str(script), "--payloads", "-", "--json", "--with", "gmtiny", env=env, input=items)
    assert ran.returncode == 0, ran.stderr
    assert finished(json.loads(ran.stdout)["job_id"], workers) == [42 + i for i in range(6)]
    assert [b["ok"] for b in builds(tmp_path / "envs-a")] in ([False], [])  # at most one try on machine a
    assert [b["ok"] for b in builds(tmp_path / "envs-b")] == [True]


@pytest.mark.processes
def test_a_project_s_pyproject_with_its_uv_lock(
    index: Path, workers: Workers, env: dict[str, str], tmp_path: Path
) -> None:
    """--project DIR: its pyproject.toml's dependencies are the job's, pinned by its uv.lock (made when gmtiny 1.0
    was the newest: a newer 1.1 on the index since is not taken)."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "pyproject.toml").write_text(
        '[project]\nname = "proj"\nversion = "0.1"\nrequires-python = ">=3.11"\ndependencies = ["gmtiny"]\n'
    )
    (proj / "plain.py").write_text(PLAIN)
    made = subprocess.run([sys.executable, "-m", "uv", "lock", "--quiet"], cwd=proj, env=env, capture_output=True)
    assert made.returncode == 0, made.stderr
    make_wheel(index, "gmtiny", "1.1", {"gmtiny.py": "VALUE = 1000\n"})
    workers.start()
    ran = run_cli("submit", "plain.py", "--project", ".", "--payloads", "-", "--json", env=env, cwd=proj,
                  input='[{"x": 1}]')  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert finished(json.loads(ran.stdout)["job_id"], workers) == [43]
    ran = run_cli("submit", str(proj / "plain.py"), "--payloads", "-", "--json", "--with", "gmtiny", env=env,
                  input='[{"x": 1}]')  # fmt: skip
    assert finished(json.loads(ran.stdout)["job_id"], workers) == [1001]  # without the lock: the newest


@pytest.mark.security
def test_an_env_cache_another_user_may_write_is_refused(tmp_path: Path) -> None:
    """The default cache sits in the shared temp dir: a folder another local user made first (or may write)
    could hold a planted env that other jobs would run. It is refused, naming it, and nothing in it is used."""
    from gpumesh.envs.cache import READY, EnvCache, EnvError

    root = tmp_path / "cache"
    planted = root / ("a" * 32)
    planted.mkdir(parents=True)
    (planted / READY).write_text("{}")
    os.chmod(root, 0o755)
    assert EnvCache(root).ready("a" * 64) is not None, "this user's own cache is used"
    os.chmod(root, 0o777)
    with pytest.raises(EnvError, match="remove it"):
        EnvCache(root).ready("a" * 64)
    assert EnvCache(root).known() == ([], [])
    if os.geteuid() == 0:  # as root: a folder another user owns
        os.chmod(root, 0o755)
        os.chown(root, 65534, 65534)
        with pytest.raises(EnvError, match=str(root)):
            EnvCache(root).ready("a" * 64)
