"""Artifacts (DESIGN §9): the files a task's winning attempt writes to GPUMESH_OUTPUT_DIR come
back with ``gpumesh pull`` / ``Job.pull``, byte for byte, from the broker or from an object store; what
cannot or may not be stored is skipped with a note; losing, failed and cancelled copies keep nothing;
pruning a job gives its memory back."""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import redis

import gpumesh
from gpumesh.models import JobOptions
from gpumesh.sandbox import outputs, taskdir
from gpumesh.sandbox.runner import Attempt
from gpumesh.settings import Settings
from gpumesh.store import keys, scripts
from gpumesh.store.broker import Broker
from gpumesh.store.reaper import reap_once
from gpumesh.worker.executor import Running

from ..conftest import cli, wait_until

pytestmark = pytest.mark.core

WRITER = """
import json, os, random, sys
p = json.load(sys.stdin)
out = os.environ["GPUMESH_OUTPUT_DIR"]
for rel, size in p["files"].items():
    path = os.path.join(out, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(random.Random(rel + str(p["i"])).randbytes(size))
if p.get("symlink"):
    os.symlink(p["symlink"], os.path.join(out, "link-out"))
    os.symlink("/", os.path.join(out, "root-dir"))
if p.get("fifo"):
    os.mkfifo(os.path.join(out, "a-fifo"))
if p.get("fail"):
    sys.exit(3)
print(json.dumps({"i": p["i"]}))
"""

MIB = 1 << 20
SPECULATIVE = "import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n"


def content(rel: str, i: int, size: int) -> bytes:
    return random.Random(rel + str(i)).randbytes(size)


def four_tasks() -> list[dict]:
    """Four tasks writing files of 1 to 3 MiB in subfolders, and a small one at the top."""
    return [
        {"i": i, "files": {f"ckpt/epoch{i}/model.bin": (1 + i % 3) * MIB, "plots/loss.txt": 100 + i, "top.json": 7}}
        for i in range(4)
    ]


def staged_keys(r) -> list[str]:
    return [k for k in r.scan_iter("gpumesh:task:*:files:*")]


@pytest.fixture
def writer(tmp_path: Path) -> Path:
    path = tmp_path / "writer.py"
    path.write_text(WRITER)
    return path


def test_pull_brings_every_file_back_byte_for_byte_and_again_is_harmless(env, r, mesh_worker, writer, tmp_path):
    before = set(os.listdir(tempfile.gettempdir()))
    mesh_worker.start()
    with gpumesh.connect() as mesh:
        job = mesh.submit(writer, four_tasks())
        assert job.wait(timeout=60).status == "done"
        rows = job.results()
        # in walk order: a directory's files, then its subdirectories, each sorted
        assert [a.path for a in rows[2].artifacts] == ["top.json", "ckpt/epoch2/model.bin", "plots/loss.txt"]
        model = rows[2].artifacts[1]
        assert model.bytes == 3 * MIB and model.sha256 == hashlib.sha256(content(model.path, 2, 3 * MIB)).hexdigest()

        dest = tmp_path / "pulled"
        paths = job.pull(dest)
        assert len(paths) == 12
        for i, payload in enumerate(four_tasks()):
            for rel, size in payload["files"].items():
                assert (dest / str(i) / rel).read_bytes() == content(rel, i, size)
        mtimes = {p: p.stat().st_mtime_ns for p in paths}
        again = mesh.broker.pull(job.id, dest)
        assert again.fetched == [] and len(again.present) == 12 and again.bytes == 0
        assert {p: p.stat().st_mtime_ns for p in paths} == mtimes  # nothing rewritten

        (dest / "1" / "top.json").write_bytes(b"damaged")  # a file that is there but not whole is fetched again
        fixed = mesh.broker.pull(job.id, dest, 1, pattern="*.json")
        assert fixed.fetched == [dest.resolve() / "1" / "top.json"] and len(fixed.present) == 0
        assert (dest / "1" / "top.json").read_bytes() == content("top.json", 1, 7)
        assert [p.name for p in job.pull(dest, task=0, glob="ckpt/*", force=True)] == ["model.bin"]
    assert staged_keys(r) == []  # every winner's staging became its files
    ours = f"gpumesh-task-{taskdir._owner()}-"  # this process's worker's (tests beside this one make theirs)
    leftover = {d for d in set(os.listdir(tempfile.gettempdir())) - before if d.startswith(ours)}
    assert leftover == set()  # the attempts' directories are still removed


def test_what_must_not_be_followed_is_skipped_with_a_note(env, r, mesh_worker, writer, tmp_path):
    mesh_worker.start()
    secret = tmp_path / "secret.txt"
    secret.write_text("the worker's secret")
    payload = {"i": 0, "files": {"ok.txt": 3}, "symlink": str(secret), "fifo": True}
    with gpumesh.connect() as mesh:
        job = mesh.submit(writer, [payload])
        assert job.wait(timeout=60).status == "done"
        row = job.results()[0]
        assert [a.path for a in row.artifacts] == ["ok.txt"]
        assert {s.path: s.reason for s in row.skipped_artifacts} == {
            "a-fifo": "not a regular file (a FIFO, socket or device)",
            "link-out": "a symbolic link (never followed)",
            "root-dir": "a symbolic link (never followed)",
        }
        got = mesh.broker.pull(job.id, tmp_path / "out")
        assert sorted(got.notes) == [
            "task 0: a-fifo was not stored: not a regular file (a FIFO, socket or device)",
            "task 0: link-out was not stored: a symbolic link (never followed)",
            "task 0: root-dir was not stored: a symbolic link (never followed)",
        ]
    raw = redis.Redis.from_url(env["GPUMESH_URL"])  # chunks are bytes
    stored = b"".join(v for k in raw.scan_iter("gpumesh:task:*:files") for v in raw.hvals(k))
    raw.close()
    assert b"ok" not in stored or len(stored) < 20  # only ok.txt's 3 bytes (and its size field) are there
    assert b"secret" not in stored
    assert "artifact link-out skipped: a symbolic link" in cli("logs", job.id).stderr


def test_over_a_cap_a_file_is_skipped_with_a_note_and_the_task_completes(env, r, mesh_worker, writer, tmp_path):
    mesh_worker.start(GPUMESH_ARTIFACT_FILE_MB="1", GPUMESH_ARTIFACT_TASK_MB="1.5", GPUMESH_ARTIFACT_FILES="3")
    files = {"a-big.bin": 2 * MIB, "b.bin": MIB, "c.bin": MIB, "d.txt": 1, "e.txt": 1, "f.txt": 1}
    with gpumesh.connect() as mesh:
        job = mesh.submit(writer, [{"i": 0, "files": files}])
        assert job.wait(timeout=60).status == "done"
        row = job.results()[0]
    assert [a.path for a in row.artifacts] == ["b.bin", "d.txt", "e.txt"]
    reasons = {s.path: s.reason for s in row.skipped_artifacts}
    assert reasons["a-big.bin"] == "2.0 MiB is over the per-file cap of 1.0 MiB (GPUMESH_ARTIFACT_FILE_MB)"
    assert reasons["c.bin"].startswith("the task's files would pass the per-task cap of 1.5 MiB")
    assert reasons["f.txt"] == "over the cap of 3 files per task (GPUMESH_ARTIFACT_FILES)"
    ran = cli("pull", job.id, "--to", str(tmp_path / "out"))
    assert ran.returncode == 0, ran.stderr
    assert "note: task 0: a-big.bin was not stored: 2.0 MiB is over the per-file cap" in ran.stderr
    assert sorted(p.name for p in (tmp_path / "out" / "0").iterdir()) == ["b.bin", "d.txt", "e.txt"]


def test_the_per_job_cap_counts_every_task(env, r, mesh_worker, writer):
    mesh_worker.start(GPUMESH_ARTIFACT_JOB_MB="2.5")
    with gpumesh.connect() as mesh:
        job = mesh.submit(writer, [{"i": i, "files": {"m.bin": MIB}} for i in range(4)])
        assert job.wait(timeout=60).status == "done"
        stored = [len(row.artifacts) for row in job.results()]
    assert stored == [1, 1, 0, 0]  # one worker, tasks in order: the third would pass 2.5 MiB


def test_a_failed_attempt_stores_nothing_and_pull_says_so(env, r, mesh_worker, writer, tmp_path):
    mesh_worker.start()
    with gpumesh.connect() as mesh:
        job = mesh.submit(writer, [{"i": 0, "files": {"x.bin": 10}}, {"i": 1, "files": {"y.bin": 10}, "fail": True}],
                          max_attempts=2)  # fmt: skip
        assert job.wait(timeout=60).status == "failed"
        assert job.results()[1].artifacts == []
    assert staged_keys(r) == [] and r.exists(keys.task_files(f"{job.id}-1")) == 0
    ran = cli("pull", job.id, "--to", str(tmp_path / "out"))
    assert ran.returncode == 1
    assert "task 1 has no files: it is failed" in ran.stderr
    assert (tmp_path / "out" / "0" / "x.bin").exists() and not (tmp_path / "out" / "1").exists()


def test_a_backup_copy_whose_completion_loses_keeps_nothing(env, r, broker, mesh_worker, tmp_path):
    # A primary and its backup copy both end cleanly: the first completion wins and its files are the
    # task's; the second is rejected, and the worker drops what that copy staged.
    worker = mesh_worker.build()
    res = broker.submit(SPECULATIVE, "t.py", [{"i": 0}], JobOptions(speculate=True))
    tid = keys.task_id(res.job_id, 0)
    r.zadd(keys.SCORES, {"slow": 1.0, "fast": 8.0})
    primary = scripts.acquire(broker.scripts, r, tid, "slow", 60_000)
    copy = scripts.speculate(broker.scripts, r, tid, "fast", 60_000, 8.0, 2.0)
    assert isinstance(copy, scripts.Lease) and copy.backup
    staged = {}
    for lease, text in ((copy, "backup wrote this"), (primary, "primary wrote this")):
        out = tmp_path / text.split()[0]
        (out / "sub").mkdir(parents=True)
        (out / "sub" / "f.txt").write_text(text)
        staged[text.split()[0]] = worker.executor._stage(lease, outputs.walk(str(out)))
    names = sorted(k.rsplit(":", 1)[1] for k in staged_keys(r))  # attempt 1's two copies, named apart
    assert len(names) == 2 and names[0].startswith("1-") and names[1].startswith("b1-")

    def clean_end(collected):
        return Attempt(returncode=0, last_line='"ok"', duration=0.1, collected=collected)

    limits = worker.limits(60)
    assert worker.executor._report(Running(copy), clean_end(staged["backup"]), limits) == "done"
    # the same completion again (its reply was lost, the call retried) still wins, and keeps the files
    assert scripts.complete(broker.scripts, r, copy, "fast", '"ok"', 0.1).accepted
    assert worker.executor._report(Running(primary), clean_end(staged["primary"]), limits) == "rejected:done"
    assert staged_keys(r) == []  # the loser's staging is gone at once, the winner's became the task's files
    with gpumesh.connect() as mesh:
        mesh.job(res.job_id).pull(tmp_path / "pulled")
    assert (tmp_path / "pulled" / "0" / "sub" / "f.txt").read_text() == "backup wrote this"


def test_cancel_and_pruning_give_the_memory_back(env, r, mesh_worker, writer, tmp_path, monkeypatch):
    def used() -> int:
        return int(r.info("memory")["used_memory"])

    baseline = used()
    mesh_worker.start()
    with gpumesh.connect() as mesh:
        kept = mesh.submit(writer, [{"i": i, "files": {"m.bin": 2 * MIB}} for i in range(4)])
        assert kept.wait(timeout=60).status == "done"
        during = used()
        assert during - baseline > 8 * MIB
        ran = cli("cancel", kept.id, "--keep-files")
        assert ran.returncode == 0 and len(kept.pull(tmp_path / "kept")) == 4
        dropped = mesh.submit(writer, [{"i": i, "files": {"m.bin": 2 * MIB}} for i in range(4)])
        assert dropped.wait(timeout=60).status == "done"
        ran = cli("cancel", dropped.id)
        assert "deleted the output files of 4 task(s); --keep-files keeps them" in ran.stderr
        assert dropped.results()[0].artifacts == [] and dropped.pull(tmp_path / "dropped") == []
    mesh_worker.stop()
    # the reaper prunes the first job once its retention is over
    monkeypatch.setenv("GPUMESH_JOB_RETENTION", "1")
    r.hset(keys.job(kept.id), "finished_at", "1")
    r.zadd(keys.JOBS, {kept.id: 1})
    b = Broker(Settings.load())
    assert reap_once(b)["jobs_pruned"] == 1
    b.close()
    assert not r.exists(keys.job(kept.id))
    assert list(r.scan_iter("gpumesh:task:*:files*")) == []
    after = used()
    assert after - baseline < MIB, (baseline, during, after)


def test_pull_refuses_a_path_that_would_leave_the_destination(env, r, mesh_worker, writer, tmp_path):
    mesh_worker.start()
    with gpumesh.connect() as mesh:
        job = mesh.submit(writer, [{"i": 0, "files": {"x.bin": 4}}])
        assert job.wait(timeout=60).status == "done"
        tid = keys.task_id(job.id, 0)
        index = json.loads(r.hget(keys.task(tid), "artifacts"))
        for evil in ("../../escaped.bin", "/tmp/escaped.bin", "a/../../escaped.bin"):
            index["files"][0]["path"] = evil  # what a hostile worker could write
            r.hset(keys.task(tid), "artifacts", json.dumps(index))
            ran = cli("pull", job.id, "--to", str(tmp_path / "d"))
            assert ran.returncode == 2 and "would leave the destination directory" in ran.stderr, ran.stderr
        assert not (tmp_path / "escaped.bin").exists() and not Path("/tmp/escaped.bin").exists()
        index["files"][0]["path"] = "x.bin"
        for store, prefix, why in (
            ("http://127.0.0.1:9/steal", "j/0/1", "refusing to read artifacts from 'http://127.0.0.1:9/steal'"),
            (f"file://{tmp_path}", "j/0/1", f"refusing to read artifacts from 'file://{tmp_path}'"),
            ("s3://bucket/x", "../../etc", "would leave the destination directory"),
        ):
            index.update(store=store, prefix=prefix)  # a worker naming where the puller should fetch from
            r.hset(keys.task(tid), "artifacts", json.dumps(index))
            ran = cli("pull", job.id, "--to", str(tmp_path / "d"))
            assert ran.returncode == 2 and why in ran.stderr, ran.stderr
        ran = cli("pull", "nosuchjob", "--to", str(tmp_path / "d"))
        assert ran.returncode == 4


# -- an object store --------------------------------------------------------------------------------


def test_artifacts_in_a_file_url_object_store_never_pass_through_redis(env, r, mesh_worker, writer, tmp_path):
    store = tmp_path / "store"
    mesh_worker.start(GPUMESH_ARTIFACTS=f"file://{store}")
    with gpumesh.connect() as mesh:
        job = mesh.submit(writer, four_tasks())
        assert job.wait(timeout=60).status == "done"
        assert list(r.scan_iter("gpumesh:task:*:files*")) == []  # only the index is in the broker
        (copy,) = (store / job.id / "2").iterdir()  # attempt 1's copy, named by its lease
        assert copy.name.startswith("1-") and (copy / "ckpt" / "epoch2" / "model.bin").stat().st_size == 3 * MIB
        paths = job.pull(tmp_path / "pulled")  # file:// is read because GPUMESH_ARTIFACTS here names it
        assert len(paths) == 12
        assert (tmp_path / "pulled" / "3" / "ckpt/epoch3/model.bin").read_bytes() == content(
            "ckpt/epoch3/model.bin", 3, MIB
        )
        mesh.job(job.id).cancel()
    assert not (store / job.id).exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A real S3 API server (moto in server mode) on a free port, with one bucket, and the AWS settings
    that point s3fs at it (for the workers and for pull alike)."""
    port = free_port()
    log = open(tmp_path / "moto.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
    )
    endpoint = f"http://127.0.0.1:{port}"
    for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_ENDPOINT_URL_S3": endpoint}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    try:
        wait_until(lambda: _answers(port), what="the S3 server to listen", timeout=30)
        import s3fs

        s3fs.S3FileSystem(endpoint_url=endpoint).mkdir("gpumesh-test")
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def test_artifacts_in_a_real_s3_api_server(env, r, mesh_worker, writer, tmp_path, s3):
    mesh_worker.start(GPUMESH_ARTIFACTS="s3://gpumesh-test/runs")
    with gpumesh.connect() as mesh:
        job = mesh.submit(writer, four_tasks())
        assert job.wait(timeout=60).status == "done"
        assert list(r.scan_iter("gpumesh:task:*:files*")) == []
        row = job.results()[1]
        assert row.artifacts[1].bytes == 2 * MIB  # ckpt/epoch1/model.bin (top.json comes first)
        index = json.loads(r.hget(keys.task(row.task_id), "artifacts"))
        assert index["store"] == "s3://gpumesh-test/runs" and index["prefix"].startswith(f"{job.id}/1/1-")
        paths = job.pull(tmp_path / "pulled")
        assert len(paths) == 12
        assert (tmp_path / "pulled" / "1" / "ckpt/epoch1/model.bin").read_bytes() == content(
            "ckpt/epoch1/model.bin", 1, 2 * MIB
        )
        mesh.job(job.id).cancel()
    import s3fs

    assert s3fs.S3FileSystem(endpoint_url=s3).find(f"gpumesh-test/runs/{job.id}") == []


def test_a_worker_with_an_unusable_object_store_url_says_so_at_start(env, tmp_path):
    ran = subprocess.run(
        [sys.executable, "-m", "gpumesh", "worker", "--score", "1", "--burst"],
        env={**env, "GPUMESH_ARTIFACTS": "nosuchproto://bucket/x"}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ran.returncode == 2
    assert ran.stderr.strip().splitlines()[-1].startswith("error: GPUMESH_ARTIFACTS=nosuchproto://bucket/x:")


def test_a_store_that_refuses_the_files_fails_the_attempt_with_the_reason(env, r, mesh_worker, writer):
    mesh_worker.start(GPUMESH_ARTIFACTS="file:///proc/gpumesh-cannot-write-here")
    with gpumesh.connect() as mesh:
        job = mesh.submit(writer, [{"i": 0, "files": {"x.bin": 10}}], max_attempts=2)
        st = job.wait(timeout=60)
        row = job.results()[0]
    assert st.status == "failed" and row.attempts == 2  # each try spent an attempt: no endless hand-backs
    assert row.error.startswith("storing the output files failed: ")


def test_pruning_deletes_object_store_files_only_from_this_machines_own_store(env, r, tmp_path, monkeypatch):
    # A job hash names its object store, and any worker can write one: the reaper must not run a recursive
    # delete wherever it says.
    victim = tmp_path / "victim" / "job1"
    victim.mkdir(parents=True)
    (victim / "precious.txt").write_text("keep me")
    r.hset(
        keys.job("job1"), mapping={"status": "done", "finished_at": "1", "artifact_store": f"file://{tmp_path}/victim"}
    )
    r.zadd(keys.JOBS, {"job1": 1})
    monkeypatch.setenv("GPUMESH_JOB_RETENTION", "1")
    b = Broker(Settings.load())
    assert reap_once(b)["jobs_pruned"] == 1
    b.close()
    assert not r.exists(keys.job("job1")) and (victim / "precious.txt").read_text() == "keep me"
