"""Projects (DESIGN §10): a job's folder travels with it, is stored once by content, is materialised once per
machine in a read-only cache, and no task can change it for anyone else; outputs come back by glob; a job
file describes a job. Real `gpumesh worker` processes and a real Redis throughout."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import gpumesh
from gpumesh.project import pack
from gpumesh.sandbox import landlock
from gpumesh.settings import Settings
from gpumesh.store import keys, projects
from gpumesh.store.broker import Broker
from gpumesh.store.reaper import reap_once

from ..conftest import Workers, wait_until
from ..conftest import gpumesh as run_cli

SYSTEM_PYTHON = "/usr/bin/python3"
can_sandbox_user = os.geteuid() == 0 and os.path.exists(SYSTEM_PYTHON) and sys.platform == "linux"

TRAIN = """\
import json, os, sys
from mylib.model import fit
import helper
p = json.load(sys.stdin)
cfg = json.load(open("configs/base.json"))
os.makedirs("outputs", exist_ok=True)
with open("outputs/metrics.json", "w") as f:
    json.dump({"loss": fit(p["lr"])}, f)
with open("scratch.txt", "w") as f:
    f.write("the attempt's own")
print(json.dumps({"fit": fit(p["lr"]), "k": helper.K, "depth": cfg["depth"], "cwd": os.getcwd(),
                  "project_dir": os.environ.get("GPUMESH_PROJECT_DIR"), "linked": open("link.json").read()}))
"""

# Tries to change the project in every way, then reports what it sees; run twice in a row on one worker.
MEDDLE = """\
import json, os, sys
out = {}
def attempt(name, f):
    try:
        f()
        out[name] = "done"
    except OSError as e:
        out[name] = type(e).__name__
out["before"] = open("helper.py").read()
out["leftover"] = os.path.exists("mine.txt")
attempt("write", lambda: open("helper.py", "w").write("K = 666\\n"))
attempt("append_deep", lambda: open("configs/base.json", "a").write("x"))
attempt("create_deep", lambda: open("configs/new.json", "w").write("{}"))
attempt("chmod", lambda: os.chmod(os.path.realpath("helper.py"), 0o666))
attempt("unlink_real", lambda: os.unlink(os.path.realpath("helper.py")))
attempt("delete", lambda: os.remove("helper.py"))
attempt("rename", lambda: os.rename("configs", "configs2"))
attempt("create_top", lambda: open("mine.txt", "w").write("x"))
attempt("replace", lambda: open("helper.py", "w").write("K = 'mine'\\n"))  # its own file where the link was
attempt("relink", lambda: os.symlink("/etc/hostname", "mylib"))
out["after"] = open("helper.py").read()
out["listing"] = sorted(os.listdir("."))
print(json.dumps(out))
"""


def make_project(root: Path) -> Path:
    """A project as a person has one: a script, a sibling module, a package, a config, and what must stay home."""
    (root / "mylib").mkdir(parents=True)
    (root / "configs").mkdir()
    (root / "train.py").write_text(TRAIN)
    (root / "meddle.py").write_text(MEDDLE)
    (root / "helper.py").write_text("K = 7\n")
    (root / "mylib" / "__init__.py").write_text("")
    (root / "mylib" / "model.py").write_text("def fit(lr):\n    return lr * 2\n")
    (root / "configs" / "base.json").write_text('{"depth": 3}')
    (root / "link.json").symlink_to("configs/base.json")
    (root / ".gitignore").write_text("data/\n*.log\n")
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(b"x" * 1000)
    (root / "run.log").write_text("log")
    (root / ".env").write_text("TOKEN=secret")
    (root / "id_rsa").write_text("-----BEGIN-----")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[core]")
    (root / "venv").mkdir()
    (root / "venv" / "pyvenv.cfg").write_text("home = /usr/bin")
    (root / "venv" / "lib.py").write_text("")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "helper.cpython-311.pyc").write_bytes(b"\0")
    (root / "sub").mkdir()
    (root / "sub" / ".gitignore").write_text("skip.txt\n")
    (root / "sub" / "skip.txt").write_text("s")
    (root / "sub" / "keep.txt").write_text("k")
    return root


@pytest.fixture
def proj(tmp_path: Path) -> Path:
    return make_project(tmp_path / "proj")


@pytest.fixture
def cache() -> Iterator[Path]:
    """The machine's project cache for the test's workers: outside the test's directory, which the workers'
    Landlock rules let tasks write (GPUMESH_WRITE_PATHS), and reachable by a --sandbox-user."""
    path = Path(tempfile.mkdtemp(prefix="gpumesh-test-projects-"))
    yield path
    for dirpath, dirnames, _ in os.walk(path):
        os.chmod(dirpath, 0o755)
        for d in dirnames:
            if not os.path.islink(os.path.join(dirpath, d)):
                os.chmod(os.path.join(dirpath, d), 0o755)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def penv(env: dict[str, str], cache: Path, workers: Workers) -> dict[str, str]:
    env = {**env, "GPUMESH_PROJECT_CACHE": str(cache)}
    workers.env = env
    return env


def payloads(tmp_path: Path, items: list[dict[str, object]]) -> str:
    path = tmp_path / f"payloads-{len(items)}.json"
    path.write_text(json.dumps(items))
    return str(path)


def results(job_id: str, env: dict[str, str]) -> list[dict[str, object]]:
    p = run_cli("results", job_id, "--json", env=env)
    assert p.returncode in (0, 1), p.stderr
    return json.loads(p.stdout)  # type: ignore[no-any-return]


def trees(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.is_dir() and not p.name.startswith("."))


# -- 1. a folder runs as at home -----------------------------------------------------------------------


@pytest.mark.processes
@pytest.mark.parametrize("user", [None, "nobody"])
def test_a_folder_runs_as_at_home_fresh_and_warm(penv, workers, both_modes, proj, tmp_path, cache, user):
    if user and not can_sandbox_user:
        pytest.skip("--sandbox-user needs a root worker on Linux and a Python the task user can read")
    extra = ["--sandbox-user", user] if user else []
    env = {"GPUMESH_SANDBOX_PYTHON": SYSTEM_PYTHON} if user else {}
    workers.start(*extra, **env)
    p = run_cli(
        "submit", "train.py", "--project", ".", "--payloads", payloads(tmp_path, [{"lr": 0.1}, {"lr": 0.2}]),
        "--output", "outputs/*.json", "--wait", env=penv, timeout=90, cwd=proj,
    )  # fmt: skip
    assert p.returncode == 0, (p.stderr, workers.log(0))
    job_id = p.stdout.split()[0]
    rows = results(job_id, penv)
    for row, lr in zip(rows, (0.1, 0.2)):
        res = row["result"]
        assert isinstance(res, dict)
        assert (res["fit"], res["k"], res["depth"]) == (lr * 2, 7, 3), row
        assert res["cwd"] == res["project_dir"], "GPUMESH_PROJECT_DIR names the working directory"
        assert json.loads(str(res["linked"])) == {"depth": 3}, "a link inside the folder keeps working"
    assert rows[0]["result"]["cwd"] != rows[1]["result"]["cwd"], "each attempt has its own directory"
    # One line: files and bytes sent, and what the rules left out, the secret-looking names among it.
    summary = next(line for line in p.stderr.splitlines() if line.startswith("project "))
    assert "sent 9 files" in summary, summary
    assert "1 .git" in summary and "1 virtualenv" in summary and "1 __pycache__" in summary, summary
    assert "3 by .gitignore" in summary and ".env" in summary and "id_rsa" in summary, summary
    # Outputs by glob came back as artifacts, beside GPUMESH_OUTPUT_DIR's.
    pulled = tmp_path / "pulled"
    p = run_cli("pull", job_id, "--to", str(pulled), env=penv)
    assert p.returncode == 0, p.stderr
    assert json.loads((pulled / "1" / "outputs" / "metrics.json").read_text()) == {"loss": 0.4}
    assert not (pulled / "0" / "scratch.txt").exists(), "only what the globs name comes back"
    # Files the task created belong to its attempt: gone with it; the machine holds one copy of the tree.
    wait_until(lambda: not list(Path(tempfile.gettempdir()).glob("gpumesh-task-*/scratch.txt")), what="cleanup")
    assert len(trees(cache)) == 1


@pytest.mark.core
def test_what_travels_is_what_a_person_expects(proj):
    packed = pack(proj, proj / "train.py")
    paths = {f.path for f in packed.files}
    assert paths == {
        ".gitignore", "configs/base.json", "helper.py", "meddle.py", "mylib/__init__.py", "mylib/model.py",
        "sub/.gitignore", "sub/keep.txt", "train.py",
    }, paths  # fmt: skip
    assert packed.links == [("link.json", "configs/base.json")]
    assert sorted(packed.left_out.secrets) == [".env", "id_rsa"]
    rescued = pack(proj, proj / "train.py", include=[".env"])
    assert ".env" in {f.path for f in rescued.files} and rescued.digest != packed.digest


# -- 2. what is refused, before anything is written ----------------------------------------------------


@pytest.mark.processes
def test_a_folder_that_cannot_be_sent_is_exit_2_naming_it_and_nothing_is_written(env, r, proj, tmp_path):
    items = payloads(tmp_path, [{"lr": 0.1}])
    outside = tmp_path / "outside.py"
    outside.write_text("print(1)")
    cases = []
    p = run_cli("submit", str(outside), "--project", str(proj), "--payloads", items, env=env)
    cases.append((p, "outside the project folder"))
    (proj / "escape").symlink_to("/etc/hostname")
    p = run_cli("submit", str(proj / "train.py"), "--project", str(proj), "--payloads", items, env=env)
    cases.append((p, f"{proj / 'escape'} is a symbolic link leading out"))
    (proj / "escape").unlink()
    os.mkfifo(proj / "pipe")
    p = run_cli("submit", str(proj / "train.py"), "--project", str(proj), "--payloads", items, env=env)
    cases.append((p, f"{proj / 'pipe'} is not a regular file"))
    (proj / "pipe").unlink()
    (proj / "weights").mkdir()
    (proj / "weights" / "w.bin").write_bytes(os.urandom(300_000))
    p = run_cli(
        "submit", str(proj / "train.py"), "--project", str(proj), "--payloads", items,
        env={**env, "GPUMESH_PROJECT_MAX_MB": "0.2"},
    )  # fmt: skip
    cases.append((p, "largest: weights/ (293.0 KiB, 1 files)"))
    p = run_cli(
        "submit", str(proj / "train.py"), "--project", str(proj), "--payloads", items,
        env={**env, "GPUMESH_PROJECT_MAX_FILES": "3"},
    )  # fmt: skip
    cases.append((p, "over the cap of 3"))
    for p, said in cases:
        assert p.returncode == 2, (said, p.stderr)
        assert said in p.stderr and "Traceback" not in p.stderr, (said, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert r.dbsize() == 0, r.keys()


# -- 3. sent once; kept while a job refers to it; covered by the signature --------------------------------


@pytest.mark.processes
def test_a_resubmit_sends_no_bytes_and_a_change_sends_that_file_only(env, r, proj, tmp_path):
    mesh = gpumesh.connect()
    first = mesh.submit(proj / "train.py", [{"lr": 0.1}], project=proj).submitted
    assert first is not None and first.project is not None
    assert first.project.sent_files == 9 and first.project.sent_bytes == first.project.bytes
    again = mesh.submit(proj / "train.py", [{"lr": 0.1}], project=proj).submitted
    assert again is not None and again.project is not None
    assert (again.project.sent_files, again.project.sent_bytes) == (0, 0)
    assert again.project.digest == first.project.digest
    (proj / "helper.py").write_text("K = 8\n")
    changed = mesh.submit(proj / "train.py", [{"lr": 0.1}], project=proj).submitted
    assert changed is not None and changed.project is not None
    assert (changed.project.sent_files, changed.project.sent_bytes) == (1, len("K = 8\n"))
    assert changed.project.digest != first.project.digest
    # Two trees, their shared files held once each (counted per tree).
    assert r.zcard(keys.PROJECT_TREES) == 2
    assert r.hget(keys.PROJECT_REFS, hashlib.sha256(b"K = 8\n").hexdigest()) == "1"
    assert r.hget(keys.PROJECT_REFS, hashlib.sha256(b"K = 7\n").hexdigest()) == "1"
    assert r.hget(keys.PROJECT_REFS, hashlib.sha256(b'{"depth": 3}').hexdigest()) == "2"
    mesh.close()


def _project_keys(r: redis.Redis) -> list[str]:
    return sorted(k for k in r.keys("gpumesh:project:*"))


@pytest.mark.processes
def test_files_go_with_the_last_job_that_refers_to_them(env, r, proj, tmp_path, monkeypatch):
    mesh = gpumesh.connect()
    a = mesh.submit(proj / "train.py", [{"lr": 0.1}], project=proj)
    b = mesh.submit(proj / "train.py", [{"lr": 0.1}], project=proj)
    (proj / "helper.py").write_text("K = 9\n")
    c = mesh.submit(proj / "train.py", [{"lr": 0.1}], project=proj)
    blob_7 = keys.project_blob(hashlib.sha256(b"K = 7\n").hexdigest())
    blob_9 = keys.project_blob(hashlib.sha256(b"K = 9\n").hexdigest())
    assert r.exists(blob_7) and r.ttl(blob_7) == -1, "a file a tree holds has no TTL"
    a.cancel()
    assert r.exists(blob_7), "job b still refers to the tree"
    b.cancel()
    assert not r.exists(blob_7), "cancelled with the last job that referred to it"
    assert r.exists(blob_9) and r.exists(keys.project_blob(hashlib.sha256(b'{"depth": 3}').hexdigest()))
    # Retention: the reaper's prune of a finished job takes its tree with it.
    c.cancel(keep_files=True)
    assert r.exists(blob_9), "--keep-files keeps the project too"
    monkeypatch.setenv("GPUMESH_JOB_RETENTION", "0.001")
    admin = Broker(Settings.load())
    time.sleep(0.1)
    reap_once(admin)
    admin.close()
    assert not r.exists(keys.job(c.id)) and _project_keys(r) == [], _project_keys(r)
    mesh.close()


@pytest.mark.processes
def test_a_killed_submit_leaves_nothing_the_reaper_does_not_remove(env, r, proj, tmp_path):
    """Killed after its files were sent and its job attached, before the job was written."""
    killer = tmp_path / "killer.py"
    killer.write_text(
        "import os, signal, sys\n"
        "import gpumesh\n"
        "from gpumesh.store import submit\n"
        "def die(*a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "submit.Submitter._write = die\n"
        f"gpumesh.connect().submit({str(proj / 'train.py')!r}, [{{'lr': 1}}], project={str(proj)!r})\n"
    )
    p = subprocess.run([sys.executable, str(killer)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == -9, p.stderr
    left = _project_keys(r)
    assert left and not r.keys("gpumesh:job:*"), left
    blobs = r.keys(keys.PROJECT_BLOB_PREFIX + "*")
    assert blobs and all(r.ttl(k) == -1 for k in blobs), "attached: held for the job it named"
    # Time passes (the attach is older than DANGLING_MS): the reaper detaches the job that never came.
    digest = r.zrange(keys.PROJECT_TREES, 0, 0)[0]
    r.zadd(keys.project_jobs(digest), {m: 0 for m in r.zrange(keys.project_jobs(digest), 0, -1)})
    admin = Broker(Settings.load())
    report = reap_once(admin)
    admin.close()
    assert report["projects_detached"] == 1
    assert _project_keys(r) == [], _project_keys(r)


@pytest.mark.processes
def test_a_file_sent_but_never_attached_expires(env, r, proj):
    b = Broker(Settings.load())
    files = b.project_files()
    packed = pack(proj, proj / "train.py")
    sha, path = next(iter(packed.local.items()))
    files.write(sha, path)
    assert 0 < r.ttl(keys.project_blob(sha)) <= projects.UNATTACHED_TTL_S
    b.close()


@pytest.mark.security
def test_a_tampered_file_is_refused_by_digest_before_any_task_runs(penv, r, workers, proj, tmp_path, cache):
    mesh = gpumesh.connect()
    job = mesh.submit(proj / "train.py", [{"lr": 0.1}], project=proj, max_attempts=1)
    blob = keys.project_blob(hashlib.sha256(b"K = 7\n").hexdigest())
    r.hset(blob, "0", b"import os; os.system('touch /tmp/pwned'); K = 7\n")
    workers.start()
    st = job.wait(timeout=60)
    row = job.results()[0]
    assert st.status == "failed" and row.error_kind == "refused", row
    assert "does not match its digest" in (row.error or ""), row.error
    assert trees(cache) == [], "nothing of a tree that failed its check is kept"
    mesh.close()


@pytest.mark.security
def test_the_signature_covers_the_tree(penv, r, workers, proj, tmp_path):
    from gpumesh import signing

    priv, pub = signing.generate(tmp_path / "keys")
    mesh = gpumesh.connect()
    other = make_project(tmp_path / "other")
    (other / "helper.py").write_text("K = 'theirs'\n")
    decoy = mesh.submit(other / "train.py", [{"lr": 0.1}], project=other, sign_key=priv)
    job = mesh.submit(proj / "train.py", [{"lr": 0.1}], project=proj, sign_key=priv, max_attempts=1)
    # A worker credential rewrites the job's tree to another stored one (the decoy keeps it stored).
    r.hset(keys.job(job.id), "project", r.hget(keys.job(decoy.id), "project"))
    decoy.cancel(keep_files=True)
    workers.start("--trust", signing.inline(signing.public_key(pub)))
    assert job.wait(timeout=60).status == "failed"
    row = job.results()[0]
    assert row.error_kind == "refused" and "signature" in (row.error or ""), row
    mesh.close()


# -- 4. materialised once per machine, shared safely --------------------------------------------------------


@pytest.mark.processes
def test_concurrent_workers_of_a_machine_make_one_copy(penv, r, workers, proj, tmp_path, cache):
    mesh = gpumesh.connect()
    (proj / "slow.py").write_text("import json, time, helper\ntime.sleep(1)\nprint(json.dumps({'k': helper.K}))\n")
    workers.start("--gpus", "0,1", wait=False)  # a supervisor's two children (as on a two-GPU machine)...
    workers.start(wait=False)  # ...and a worker of its own
    wait_until(lambda: r.zcard(keys.WORKERS) == 3, timeout=60, what="three workers")
    job = mesh.submit(proj / "slow.py", [{} for _ in range(6)], project=proj)  # all three need the tree at once
    st = job.wait(timeout=90)
    assert st.status == "done", [workers.log(i) for i in range(2)]
    assert len({row.worker for row in job.results()}) == 3, "every worker ran some of it"
    made = sum(workers.log(i).count("ready in") for i in range(2))
    assert made == 1, "one worker made the tree; the others waited for it"
    said = [(t, line) for t, stream, line in job.logs() if stream == "gpumesh" and "fetched and checked" in line]
    assert len(said) == 1 and "files" in said[0][1], said  # the task it was made for says so in its log
    assert len(trees(cache)) == 1
    holders = keys.env_holders(trees(cache)[0][:16])  # dispatch places the tree's next jobs on them first
    wait_until(lambda: r.zcard(holders) == 3, what="every worker of the machine listed as the tree's holder")
    tree = cache / trees(cache)[0]
    assert (tree / "helper.py").stat().st_mode & 0o777 == 0o444
    assert (tree / "mylib").stat().st_mode & 0o777 == 0o555
    mesh.close()


@pytest.mark.security
@pytest.mark.skipif(landlock.abi() < 1, reason="this kernel has no Landlock")
@pytest.mark.parametrize("user", [None, "nobody"])
def test_a_task_cannot_change_the_project_for_the_next(penv, r, workers, proj, tmp_path, cache, user):
    if user and not can_sandbox_user:
        pytest.skip("--sandbox-user needs a root worker on Linux and a Python the task user can read")
    extra = ["--sandbox-user", user] if user else []
    env = {"GPUMESH_SANDBOX_PYTHON": SYSTEM_PYTHON} if user else {}
    workers.start(*extra, **env)
    mesh = gpumesh.connect()
    first = mesh.submit(proj / "meddle.py", [{}, {}], project=proj)  # two tasks, one after the other
    assert first.wait(timeout=60).status == "done", workers.log(0)
    second = mesh.submit(proj / "meddle.py", [{}], project=proj)  # another job, same tree
    assert second.wait(timeout=60).status == "done", workers.log(0)
    seen = [row.result for row in first.results()] + [row.result for row in second.results()]
    for out in seen:
        assert isinstance(out, dict)
        assert out["before"] == "K = 7\n" and out["leftover"] is False, out
        for change in ("write", "append_deep", "create_deep", "unlink_real"):
            assert out[change] != "done", (change, out)
        if user:  # not the task's files: it may not even change their mode (Landlock does not rule on chmod)
            assert out["chmod"] != "done", out
        assert out["delete"] == "done" and out["create_top"] == "done", "its own view: a link, a file of its own"
        assert out["replace"] == "done" and out["after"] == "K = 'mine'\n" and "mine.txt" in out["listing"]
    tree = cache / trees(cache)[0]
    assert (tree / "helper.py").read_text() == "K = 7\n" and (tree / "configs").is_dir()
    assert not (tree / "configs" / "new.json").exists()
    mesh.close()


@pytest.mark.processes
def test_the_cache_is_bounded_least_recently_used_first(penv, r, workers, proj, tmp_path, cache):
    workers.env = {**penv, "GPUMESH_PROJECT_CACHE_MB": "0.0005"}  # ~500 bytes: one tree at a time
    workers.start()
    mesh = gpumesh.connect()
    a = mesh.submit(proj / "train.py", [{"lr": 0.1}], project=proj)
    assert a.wait(timeout=60).status == "done"
    first = trees(cache)
    (proj / "helper.py").write_text("K = 10\n")
    b = mesh.submit(proj / "train.py", [{"lr": 0.1}], project=proj)
    assert b.wait(timeout=60).status == "done"
    assert len(first) == 1 and trees(cache) != first and len(trees(cache)) == 1, (first, trees(cache))
    mesh.close()


# -- API, run --local, the hint ---------------------------------------------------------------------------

TASKS = """\
import helper
from mylib.model import fit


def square(p):
    return {"y": fit(p["x"]) * helper.K}
"""


@pytest.mark.processes
def test_map_ships_the_folder_of_a_function(penv, r, workers, proj, monkeypatch):
    (proj / "tasks.py").write_text(TASKS)
    monkeypatch.syspath_prepend(str(proj))
    import tasks  # type: ignore[import-not-found]

    workers.start()
    with gpumesh.connect() as mesh:
        assert mesh.map(tasks.square, [{"x": 1}, {"x": 2}], project=proj, wait_timeout=60) == [{"y": 14}, {"y": 28}]
    sys.modules.pop("tasks", None)


@pytest.mark.processes
def test_run_local_ships_the_folder(env, proj, tmp_path, cache):
    items = payloads(tmp_path, [{"lr": 0.5}])
    p = run_cli(
        "run", "train.py", "--project", ".", "--payloads", items, "--local", "1", "--json",
        env={**env, "GPUMESH_PROJECT_CACHE": str(cache)}, timeout=120, cwd=proj,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)[0]["result"]["fit"] == 1.0


@pytest.mark.processes
def test_a_lone_script_missing_its_sibling_says_to_pass_project(penv, r, workers, proj, tmp_path):
    workers.start()
    p = run_cli(
        "submit", str(proj / "train.py"), "--payloads", payloads(tmp_path, [{"lr": 0.1}]), "--max-attempts", "1",
        "--wait", env=penv, timeout=60,
    )  # fmt: skip
    assert p.returncode == 1
    job_id = p.stdout.split()[0]
    hint = "submit with --project DIR"
    assert hint in p.stderr, p.stderr  # submit --wait explains the failure
    st = run_cli("status", job_id, env=penv)
    assert hint in st.stdout + st.stderr, st
    assert hint in results(job_id, penv)[0]["error"]


# -- 6. a job file --------------------------------------------------------------------------------------


@pytest.mark.processes
def test_a_job_file_written_by_init_submits_and_flags_override(penv, r, workers, proj, tmp_path):
    (proj / "payloads.json").write_text(json.dumps([{"lr": 0.1}, {"lr": 0.3}]))
    (proj / "requirements.txt").write_text("numpy\n")
    with open(proj / "train.py", "a") as f:  # the script with a __main__ guard is the one init names
        f.write('\nif __name__ == "__main__":\n    pass\n')
    p = run_cli("init", env=penv, cwd=proj)
    assert p.returncode == 0, p.stderr
    lines = (proj / "gpumesh.toml").read_text().splitlines()
    assert 'script = "train.py"' in lines and 'payloads = "payloads.json"' in lines, lines
    assert any("requirements.txt" in line for line in lines)
    assert run_cli("init", env=penv, cwd=proj).returncode == 2, "an existing job file is not overwritten"
    with open(proj / "gpumesh.toml", "a") as f:
        f.write('outputs = ["outputs/*.json"]\nname = "from-file"\n')
    workers.start()
    p = run_cli("submit", "--name", "from-flag", "--wait", env=penv, timeout=90, cwd=proj)
    assert p.returncode == 0, p.stderr
    job_id = p.stdout.split()[0]
    with gpumesh.connect() as mesh:
        job = mesh.job(job_id)
        assert job.status().name == "from-flag"
        assert [row.result["fit"] for row in job.results()] == [0.2, 0.6]  # type: ignore[index]
        assert {a.path for row in job.results() for a in row.artifacts} == {"outputs/metrics.json"}
        other = mesh.submit_file(proj / "gpumesh.toml", priority=3)
        assert other.status().name == "from-file" and other.status().priority == 3
        inline = tmp_path / "inline.toml"
        inline.write_text(
            f'[job]\nscript = "{proj / "train.py"}"\nproject = "{proj}"\npayloads = [{{lr = 1}}, {{lr = 2}}]\n'
        )
        assert mesh.submit_file(inline).submitted.tasks == 2  # type: ignore[union-attr]


@pytest.mark.processes
def test_a_bad_job_file_is_exit_2_naming_the_key_and_the_file(env, r, proj, tmp_path):
    bad = tmp_path / "bad.toml"
    for body, said in [
        ('[job]\nscript = "train.py"\npayloads = "p.json"\ntimout = 5\n', "unknown key 'job.timout'"),
        ('[job]\nscript = "train.py"\npayloads = "p.json"\ntimeout = "soon"\n', "job.timeout"),
        ('[job]\npayloads = "p.json"\n', "job.script is required"),
        ('[jobs]\nscript = "x.py"\n', "unknown key 'jobs'"),
    ]:
        bad.write_text(body)
        p = run_cli("submit", "-f", str(bad), env=env)
        assert p.returncode == 2 and said in p.stderr and str(bad) in p.stderr, (body, p.stderr)
        assert "Traceback" not in p.stderr
    p = run_cli("submit", env=env, cwd=tmp_path)
    assert p.returncode == 2 and "gpumesh init" in p.stderr, p.stderr
    assert r.dbsize() == 0


# -- the dashboard ------------------------------------------------------------------------------------------


@pytest.mark.core
def test_the_dashboard_job_page_shows_the_project(env, r, proj):
    from starlette.testclient import TestClient

    from gpumesh.dashboard.app import create_app

    with gpumesh.connect() as mesh:
        job = mesh.submit(proj / "train.py", [{"lr": 0.1}], project=proj, outputs=["outputs/*.json"])
        sent = job.submitted.project  # type: ignore[union-attr]
        assert sent is not None
        page = TestClient(create_app(mesh)).get(f"/jobs/{job.id}").text
        plain = TestClient(create_app(mesh)).get(f"/jobs/{mesh.submit(proj / 'train.py', [{}]).id}").text
    assert f"{sent.files} files, {sent.bytes} B" in page and sent.digest[:12] in page and sent.digest in page
    assert "outputs/*.json" in page
    assert 'class="project"' not in plain


@pytest.mark.processes
def test_in_an_object_store_files_sit_beside_the_artifacts(penv, r, workers, proj, tmp_path, monkeypatch):
    store = tmp_path / "store"
    url = f"file://{store}"
    monkeypatch.setenv("GPUMESH_ARTIFACTS", url)
    workers.env = {**workers.env, "GPUMESH_ARTIFACTS": url}
    workers.start()
    with gpumesh.connect() as mesh:
        job = mesh.submit(proj / "train.py", [{"lr": 0.1}], project=proj, outputs=["outputs/*.json"])
        assert job.wait(timeout=60).status == "done", workers.log(0)
        assert job.results()[0].result["k"] == 7  # type: ignore[index]
        again = mesh.submit(proj / "train.py", [{"lr": 0.1}], project=proj).submitted
        assert again is not None and again.project is not None and again.project.sent_bytes == 0
        blobs = store / projects.OBJECT_DIR
        assert len(list(blobs.iterdir())) == 9 and not r.keys(keys.PROJECT_BLOB_PREFIX + "*")
        assert (store / job.id).is_dir(), "beside the job's artifacts"
        job.cancel()
        assert len(list(blobs.iterdir())) == 9, "the other job still refers to them"
        mesh.job(again.job_id).cancel()
        assert list(blobs.iterdir()) == []


@pytest.mark.core
def test_a_reused_attempt_directory_is_reset_to_the_project_alone(proj, tmp_path):
    from gpumesh.sandbox import projectview, taskdir

    view = projectview.View(str(proj))
    links = projectview.links(view, "train.py")
    workdir, fd = taskdir.make_open()
    try:
        projectview.populate(view, fd, "train.py", None)
        assert taskdir.untouched(workdir, fd, links)
        # What an attempt may do to its own directory: files, folders, its links replaced, modes changed.
        (Path(workdir) / "train.py").write_text("the script")
        (Path(workdir) / "scratch.bin").write_bytes(b"x")
        os.makedirs(Path(workdir) / "runs" / "1")
        (Path(workdir) / "output" / "result.json").write_text("{}")
        os.unlink(Path(workdir) / "helper.py")
        (Path(workdir) / "helper.py").write_text("K = 666\n")
        os.unlink(Path(workdir) / "mylib")
        os.symlink("/etc", Path(workdir) / "mylib")
        os.chmod(workdir, 0o777)
        assert not taskdir.untouched(workdir, fd, links)
        assert projectview.reset(workdir, fd, links, "train.py")
        assert taskdir.untouched(workdir, fd, links)
        assert (Path(workdir) / "helper.py").read_text() == "K = 7\n"
        assert sorted(os.listdir(workdir)) == sorted([*links, "output"])
    finally:
        taskdir.remove(workdir, None, os.path.join(workdir, "output"), dir_fd=fd)
        os.close(fd)


@pytest.mark.processes
def test_in_an_object_store_a_killed_submit_s_files_are_swept_by_the_reaper(env, r, proj, tmp_path, monkeypatch):
    store = tmp_path / "store"
    monkeypatch.setenv("GPUMESH_ARTIFACTS", f"file://{store}")
    admin = Broker(Settings.load())
    files = admin.project_files()
    packed = pack(proj, proj / "train.py")
    for sha, path in packed.local.items():  # what a submit killed before it attached them wrote
        files.write(sha, path)
    kept = gpumesh.connect().submit(proj / "train.py", [{"lr": 1}], project=proj)  # a job that holds them now
    (proj / "helper.py").write_text("K = 11\n")
    orphan = pack(proj, proj / "train.py").local[hashlib.sha256(b"K = 11\n").hexdigest()]
    files.write(hashlib.sha256(b"K = 11\n").hexdigest(), orphan)
    old = time.time() - projects.UNATTACHED_TTL_S - 60
    for f in (store / projects.OBJECT_DIR).iterdir():
        os.utime(f, (old, old))
    projects._last_sweep.clear()
    assert reap_once(admin)["project_files_swept"] == 1
    left = {f.name for f in (store / projects.OBJECT_DIR).iterdir()}
    assert left == {f.sha256 for f in packed.files}, "the files a job holds stay; the one nobody attached went"
    assert kept.status().status == "queued"
    admin.close()
