"""Signed by default: in the set-up `gpumesh serve` prints, a worker credential runs
nothing and forges nothing.

Each attack is made with a real worker credential against a real `serve` broker and real trusting
workers started from serve's own worker line. Some attacks need writes that the broker's ACL refuses
to a worker; each attack is then also made with a credential that may write everything (what a Redis
without gpumesh's ACL gives a leaked password), to show that the signature checks alone refuse it.
A task's script prints a marker to its log when it runs: that is how a test tells it did not.
"""

from __future__ import annotations

import hashlib
import json
import re
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
import redis

from gpumesh.store import keys as k
from gpumesh.store import tasklog

from ..conftest import Workers, free_port, gpumesh, wait_until
from .test_serve_and_local import Serve

pytestmark = pytest.mark.security

SCRIPT = (
    "import json, sys\np = json.load(sys.stdin)\nprint('RAN', json.dumps(p), file=sys.stderr, flush=True)\n"
    "print(json.dumps({'echo': p}))\n"
)
EVIL = "import sys\nprint('EVIL ran', file=sys.stderr, flush=True)\nprint('{\"evil\": true}')\n"
ENDED = "signature: this task already ended (it completed, failed for good or was cancelled): a replay"


@dataclass
class Mesh:
    """A `gpumesh serve` broker, the lines it printed, and clients with each of its credentials."""

    serve: Serve
    data: Path
    env: dict[str, str]
    tmp: Path
    worker_url: str
    trust: str
    sign_key: str
    submitter_url: str
    admin: redis.Redis
    admin_url: str
    refused: list[str] = field(default_factory=list)  # writes an attacker's credential was refused

    def client(self, url: str) -> redis.Redis:
        return redis.Redis.from_url(url, decode_responses=True)

    def submit(self, payloads: list[dict[str, Any]], script: str = SCRIPT, name: str = "job.py", *args: str) -> str:
        path = self.tmp / name
        path.write_text(script)
        p = gpumesh("submit", str(path), "--payloads", "-", "--sign-key", self.sign_key, "--url", self.submitter_url,
                    *args, env=self.env, input=json.dumps(payloads))  # fmt: skip
        assert p.returncode == 0, p.stderr
        return p.stdout.strip()

    def start_worker(self, workers: Workers, *args: str) -> None:
        """A worker from serve's own line: its URL and its pinned --trust key."""
        workers.start(self.worker_url, "--trust", self.trust, *args, client=self.admin)

    def attempt(self, what: str, write: Callable[[], Any]) -> bool:
        """Make one write of an attack; False (and noted) when the broker refuses it to this credential."""
        try:
            write()
        except redis.exceptions.NoPermissionError:
            self.refused.append(what)
            return False
        return True

    def task(self, task_id: str) -> dict[str, str]:
        return self.admin.hgetall(k.task(task_id))

    def settle(self, task_id: str, patience: float = 10) -> dict[str, str]:
        """The task once it has ended (done or failed), or as it is after ``patience`` s (still queued: no
        trusting worker would take it)."""
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            t = self.task(task_id)
            if t.get("status") in ("done", "failed", "cancelled"):
                return t
            time.sleep(0.1)
        return self.task(task_id)

    def ran(self, task_id: str, marker: str = "RAN") -> int:
        """How many times a task's script printed its marker (the task's log stream)."""
        return sum(marker in line for _stream, line in tasklog.task_lines(self.admin, task_id)[0])

    def results(self, job: str, *args: str) -> subprocess.CompletedProcess[str]:
        return gpumesh("results", job, "--url", self.submitter_url, *args, env=self.env)


@pytest.fixture
def mesh(env: dict[str, str], tmp_path: Path) -> Iterator[Mesh]:
    port, data = free_port(), tmp_path / "broker"
    serve = Serve(env, data, port)
    text = "\n".join(serve.lines)
    join = re.search(r"gpumesh worker '(rediss?://worker:[^']+)' --trust (ed25519:\S+)", text)
    submit = re.search(r"--sign-key (\S+) --url '(rediss?://submitter:[^']+)' --wait", text)
    assert join and submit, text
    admin_password = json.loads((data / "credentials.json").read_text())["admin"]
    admin_url = f"redis://admin:{admin_password}@127.0.0.1:{port}/0"
    admin = redis.Redis.from_url(admin_url, decode_responses=True)
    m = Mesh(
        serve, data, env, tmp_path, join.group(1), join.group(2), submit.group(1), submit.group(2), admin, admin_url
    )
    yield m
    print(f"writes the broker refused: {m.refused}")  # which layer stopped an attack (pytest -s shows it)
    admin.close()
    serve.stop()


@pytest.fixture(params=["worker credential", "full write access"])
def attacker(request: pytest.FixtureRequest, mesh: Mesh) -> Iterator[redis.Redis]:
    """The attacker's client: serve's worker credential, or one that may write every key (the admin's,
    standing in for a broker whose ACL does not limit a worker) but holds no signing key."""
    client = mesh.client(mesh.worker_url if request.param == "worker credential" else mesh.admin_url)
    yield client
    client.close()


def _is_worker(client: redis.Redis) -> bool:
    return bool(client.connection_pool.connection_kwargs.get("username") == "worker")


def test_serve_signs_by_default_and_its_lines_run_a_signed_job_with_attributable_results(mesh: Mesh, workers):
    key = mesh.data / "signing.key"
    assert mesh.sign_key == str(key) and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert mesh.admin.hget(k.RESULT_KEYS, "worker").startswith("ed25519:")  # the default worker's result key
    mesh.start_worker(workers)
    job = mesh.submit([{"i": 0}, {"i": 1}])
    wait_until(lambda: json.loads(mesh.results(job, "--json").stdout)[1]["status"] == "done", timeout=60,
               what="the signed job to run")  # fmt: skip
    p = mesh.results(job, "--json", "--verify")
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    assert [(r["result"], r["verified"], r["signed_by"]) for r in rows] == [
        ({"echo": {"i": 0}}, True, "worker"),
        ({"echo": {"i": 1}}, True, "worker"),
    ]
    assert "signed by" in mesh.results(job).stdout
    # `gpumesh join` takes the same pinned key: a second signed job runs on a worker joined that way
    parts = urlsplit(mesh.worker_url)
    second = mesh.submit([{"i": 2}])
    workers.stop_all()
    joined = gpumesh("join", f"127.0.0.1:{parts.port}", "--token", unquote(parts.password or ""), "--trust",
                     mesh.trust, "--burst", "--score", "2", env=mesh.env, timeout=120)  # fmt: skip
    assert joined.returncode == 0, joined.stderr
    assert json.loads(mesh.results(second, "--json", "--verify").stdout)[0]["result"] == {"echo": {"i": 2}}


def test_a_job_written_with_the_attackers_credential_never_runs(mesh: Mesh, attacker: redis.Redis, workers):
    """Submitting with the credential itself (unsigned), and with a signature copied from an honest job."""
    from gpumesh.models import JobOptions
    from gpumesh.settings import Settings
    from gpumesh.store.broker import Broker

    honest = mesh.submit([{"i": "honest"}])
    url = mesh.worker_url if _is_worker(attacker) else mesh.admin_url
    own: list[str] = []

    def submit_own() -> None:
        b = Broker(Settings.load(url=url))
        try:
            for tag in ("unsigned", "forged"):
                own.append(b.submit(SCRIPT, "own.py", [{"i": tag}], JobOptions()).job_id)
        finally:
            b.close()

    from gpumesh.errors import BrokerError

    try:
        mesh.attempt("submit a job", submit_own)
    except BrokerError as exc:  # the submit path reports a refused write as the broker's error
        assert "permission" in str(exc).lower(), exc
        mesh.refused.append("submit a job")
    if len(own) == 2:  # the 'forged' job claims the trusted key, with an honest task's signature
        forged = own[1]
        mesh.attempt("claim the key", lambda: attacker.hset(k.job(forged), mapping={
            f: mesh.admin.hget(k.job(honest), f) for f in ("key_id", "expires_at")}))  # fmt: skip
        mesh.attempt("copy a signature", lambda: attacker.hset(
            k.task(k.task_id(forged, 0)), "sig", mesh.admin.hget(k.task(k.task_id(honest, 0)), "sig")))  # fmt: skip
    mesh.start_worker(workers)
    wait_until(lambda: mesh.task(k.task_id(honest, 0))["status"] == "done", timeout=60, what="the honest job")
    if len(own) == 2:
        wait_until(lambda: mesh.task(k.task_id(own[1], 0))["status"] == "failed", timeout=30, what="the refusal")
        assert mesh.task(k.task_id(own[1], 0))["error"].startswith("signature: does not match the task")
        assert mesh.task(k.task_id(own[0], 0))["status"] == "queued"  # never given to a trusting worker
    for job in own:
        assert mesh.ran(k.task_id(job, 0)) == 0
    assert mesh.ran(k.task_id(honest, 0)) == 1
    assert own or _is_worker(attacker), mesh.refused


def _copy_job(mesh: Mesh, attacker: redis.Redis, source: str, copy: str) -> None:
    """What a copy of a queued signed job takes: its hashes under a new job id (the job hash keeping its
    old ``id`` field), its task list, pending set and a place in the ready index."""
    job = mesh.admin.hgetall(k.job(source))
    task = mesh.admin.hgetall(k.task(k.task_id(source, 0)))
    writes: list[tuple[str, Callable[[], Any]]] = [
        ("copy the task", lambda: attacker.hset(k.task(k.task_id(copy, 0)), mapping=task)),
        ("list the task", lambda: attacker.rpush(k.job_tasks(copy), k.task_id(copy, 0))),
        ("queue the task", lambda: attacker.zadd(k.pending(copy, 0), {k.pending_member(0): 1})),
        ("copy the job", lambda: attacker.hset(k.job(copy), mapping=job)),  # 'id' is still the source's
        ("index the job", lambda: attacker.zadd(k.JOBS, {copy: float(job["created_at"])})),
        ("make it ready", lambda: attacker.zadd(k.READY, {k.ready_member(copy, 0): 0})),
    ]
    for what, write in writes:
        mesh.attempt(what, write)


def test_a_signed_task_copied_into_another_job_never_runs(mesh: Mesh, attacker: redis.Redis, workers):
    source = mesh.submit([{"i": "once"}])
    copies = ["c0ffee000001", "c0ffee000002", "c0ffee000003"]
    for copy in copies:
        _copy_job(mesh, attacker, source, copy)
    assert mesh.admin.hget(k.job(copies[0]), "id") in (source, None)
    mesh.start_worker(workers)
    wait_until(lambda: mesh.task(k.task_id(source, 0))["status"] == "done", timeout=60, what="the signed job")
    for copy in copies:
        if mesh.task(k.task_id(copy, 0)):
            t = mesh.settle(k.task_id(copy, 0))
            assert t["status"] in ("failed", "queued"), (t, mesh.refused)
            if t["status"] == "failed":
                assert t["error"].startswith("signature: does not match the task (its job id or index"), t
        assert mesh.ran(k.task_id(copy, 0)) == 0
    assert mesh.ran(k.task_id(source, 0)) == 1


def test_a_job_re_pointed_at_another_script_never_runs_it(mesh: Mesh, attacker: redis.Redis, workers):
    job = mesh.submit([{"i": 0}, {"i": 1}])
    evil_sha = hashlib.sha256(EVIL.encode()).hexdigest()
    mesh.attempt("store a script", lambda: attacker.set(k.script(evil_sha), EVIL))
    mesh.attempt("re-point the job", lambda: attacker.hset(k.job(job), "script_sha", evil_sha))
    mesh.start_worker(workers)
    for i in range(2):
        wait_until(lambda i=i: mesh.task(k.task_id(job, i))["status"] in ("done", "failed"), timeout=60,
                   what="the tasks to end")  # fmt: skip
    for i in range(2):
        t = mesh.task(k.task_id(job, i))
        assert mesh.ran(k.task_id(job, i), "EVIL") == 0
        if mesh.admin.hget(k.job(job), "script_sha") == evil_sha:  # the re-pointing went through...
            assert t["status"] == "failed", t  # ...and was refused (or found no script), unrun
            assert t["error"].startswith(("signature: does not match the task", "script ")), t
        else:
            assert t["status"] == "done" and json.loads(t["result"]) == {"echo": {"i": i}}


def test_a_finished_signed_task_put_back_in_the_queue_never_runs_again(mesh: Mesh, attacker: redis.Redis, workers):
    job = mesh.submit([{"i": "once"}])
    tid = k.task_id(job, 0)
    mesh.start_worker(workers)
    wait_until(lambda: mesh.task(tid)["status"] == "done", timeout=60, what="the signed task")
    assert mesh.ran(tid) == 1
    if _is_worker(attacker):  # the record of what ran takes only additions from a worker
        assert not mesh.attempt("forget that it ran", lambda: attacker.srem(k.spent(job), "0"))
        assert not mesh.attempt("delete the record", lambda: attacker.delete(k.spent(job)))
    # put it back in place: queued, pending, ready, as a retry would
    mesh.attempt("re-queue", lambda: attacker.hset(k.task(tid), mapping={"status": "queued", "attempts": 0}))
    mesh.attempt("re-open", lambda: attacker.hset(k.job(job), mapping={"status": "running", "queued": 1, "done": 0}))
    mesh.attempt("pend", lambda: attacker.zadd(k.pending(job, 0), {k.pending_member(0): 1}))
    mesh.attempt("ready", lambda: attacker.zadd(k.READY, {k.ready_member(job, 0): 0}))
    t = mesh.settle(tid)
    assert t["status"] in ("failed", "queued", "done"), (t, mesh.refused)
    if t["status"] != "done":  # "done": the re-queue did not go through (or it never ended up queued)
        assert t["status"] == "queued" or t["error"] == ENDED, t
    assert mesh.ran(tid) == 1, mesh.refused  # it never ran a second time


def test_results_are_signed_by_their_worker_credential_and_forgeries_are_marked(mesh: Mesh, workers):
    p = gpumesh("access", "add", "eve", "--data-dir", str(mesh.data), env=mesh.env)
    assert p.returncode == 0, p.stderr
    line = re.search(r"gpumesh worker '(rediss?://worker-eve:[^']+)' --trust (ed25519:\S+)", p.stdout)
    assert line and line.group(2) == mesh.trust, p.stdout  # eve's line pins the same job-signing key
    eve = mesh.client(line.group(1))
    assert mesh.admin.hget(k.RESULT_KEYS, "worker-eve")
    with pytest.raises(redis.exceptions.NoPermissionError):  # the registry is the admin's to write
        eve.hset(k.RESULT_KEYS, "worker-eve", mesh.admin.hget(k.RESULT_KEYS, "worker"))
    job = mesh.submit([{"i": i} for i in range(4)])
    mesh.start_worker(workers)
    wait_until(lambda: all(mesh.task(k.task_id(job, i)).get("status") == "done" for i in range(4)), timeout=60,
               what="the job")  # fmt: skip
    assert mesh.results(job, "--verify").returncode == 0

    from gpumesh.signing import PROOF_FIELD, ResultSigner

    honest = json.loads(mesh.task(k.task_id(job, 0))[PROOF_FIELD])
    eve_signer = ResultSigner.of_url(line.group(1))
    assert eve_signer is not None
    forged = '{"forged": 1}'
    # 1: a result changed in place, the worker's proof kept; 2: a proof claiming `worker`, signed by eve
    # 3: a result eve signs as herself: it verifies, and names her
    eve.hset(k.task(k.task_id(job, 1)), "result", forged)
    claim = json.loads(eve_signer.proof(k.task_id(job, 2), honest["attempt"], forged, honest["worker"]))
    eve.hset(
        k.task(k.task_id(job, 2)), mapping={"result": forged, PROOF_FIELD: json.dumps({**claim, "user": "worker"})}
    )
    own = eve_signer.proof(k.task_id(job, 3), 1, forged, "eve-laptop")
    eve.hset(k.task(k.task_id(job, 3)), mapping={"result": forged, PROOF_FIELD: own})
    p = mesh.results(job, "--json", "--verify")
    assert p.returncode == 1
    assert "2 result(s) do not verify" in p.stderr and "task(s) 1, 2" in p.stderr
    rows = json.loads(p.stdout)
    assert [(r["verified"], r["signed_by"]) for r in rows] == [
        (True, "worker"), (False, "worker"), (False, "worker"), (True, "worker-eve")
    ]  # fmt: skip
    table = mesh.results(job)
    assert table.returncode == 0 and table.stdout.count("NOT VERIFIED") == 2 and "worker-eve" in table.stdout


def test_an_overwritten_script_is_repaired_by_the_next_honest_submit(mesh: Mesh, attacker: redis.Redis, workers):
    sha = hashlib.sha256(SCRIPT.encode()).hexdigest()
    first = mesh.submit([{"i": "first"}])
    tampered = mesh.attempt("overwrite the script", lambda: attacker.set(k.script(sha), EVIL))
    mesh.start_worker(workers)
    wait_until(lambda: mesh.task(k.task_id(first, 0))["status"] in ("done", "failed"), timeout=60, what="the job")
    if tampered:  # the worker refused it (and did not keep the tampered copy)...
        t = mesh.task(k.task_id(first, 0))
        assert t["status"] == "failed" and t["error"].startswith("the script in the broker does not match"), t
    assert mesh.ran(k.task_id(first, 0), "EVIL") == 0
    second = mesh.submit([{"i": "second"}])  # ...and the next honest submit of the same script repairs it
    assert mesh.admin.get(k.script(sha)) == SCRIPT
    wait_until(lambda: mesh.task(k.task_id(second, 0))["status"] in ("done", "failed"), timeout=60, what="the job")
    t = mesh.task(k.task_id(second, 0))
    assert t["status"] == "done" and json.loads(t["result"]) == {"echo": {"i": "second"}}, t


def test_serve_no_sign_prints_unsigned_lines(env: dict[str, str], tmp_path: Path):
    serve = Serve(env, tmp_path / "broker", free_port(), "--no-sign")
    try:
        text = "\n".join(serve.lines)
        assert "--trust" not in text and "--sign-key" not in text
        assert not (tmp_path / "broker" / "signing.key").exists()
    finally:
        serve.stop()


def test_trust_takes_an_inline_key_and_refuses_a_bad_one_in_one_line(env: dict[str, str]):
    p = gpumesh("worker", "--burst", "--score", "1", "--trust", "ed25519:bm90IGEga2V5", env=env)
    assert p.returncode == 2 and p.stderr.startswith("error: 'ed25519:bm90IGEga2V5' is not an Ed25519 public key")
    assert "Traceback" not in p.stderr


def test_a_task_s_identity_is_read_from_its_id_in_canonical_form_only():
    """The job id and index a signature must cover come from the leased task's id (its key): a key that
    spells an index another way (a copy of task 0 stored as ``-00``) has no identity, and is refused."""
    from gpumesh.signing import leased_identity

    assert leased_identity("8f3c2a1b9d0e-12") == ("8f3c2a1b9d0e", 12)
    assert leased_identity("a-b-3") == ("a-b", 3)
    for bad in ("8f3c2a1b9d0e-00", "8f3c2a1b9d0e-+1", "8f3c2a1b9d0e-", "-3", "8f3c2a1b9d0e-1e0", "8f3c2a1b9d0e"):
        assert leased_identity(bad) is None, bad


def _requeue_by_hand(mesh: Mesh, attacker: redis.Redis, job: str, was: str) -> None:
    """Put an ended task back in place with plain writes, as retry.lua would (queued, pending, ready)."""
    tid = k.task_id(job, 0)
    mesh.attempt("re-queue", lambda: attacker.hset(k.task(tid), mapping={"status": "queued", "attempts": 0}))
    mesh.attempt("re-open", lambda: attacker.hset(k.job(job), mapping={"status": "running", "queued": 1, was: 0}))
    mesh.attempt("pend", lambda: attacker.zadd(k.pending(job, 0), {k.pending_member(0): 1}))
    mesh.attempt("ready", lambda: attacker.zadd(k.READY, {k.ready_member(job, 0): 0}))


def test_a_cancelled_or_failed_signed_task_runs_again_only_when_its_submitter_retries_it(mesh: Mesh, workers):
    """A task the submitter cancelled, or one that failed for good, has ended: the worker credential's call
    of the retry function is refused (and changes nothing), a re-queue by hand is refused by the trusting
    worker, and only `gpumesh retry` with the submitter's credential runs it again."""
    from gpumesh.store.scripts import library

    fixed = mesh.tmp / "fixed"
    flaky = SCRIPT.replace("print(json.dumps({", f"import os\nif not os.path.exists({str(fixed)!r}):\n"
                           "    sys.exit('not yet')\nprint(json.dumps({")  # fmt: skip
    cancelled = mesh.submit([{"i": "cancelled"}])
    p = gpumesh("cancel", cancelled, "--url", mesh.submitter_url, env=mesh.env)
    assert p.returncode == 0, p.stderr
    failed = mesh.submit([{"i": "failed"}], flaky, "flaky.py", "--max-attempts", "1")
    mesh.start_worker(workers)
    wait_until(lambda: mesh.task(k.task_id(failed, 0))["status"] == "failed", timeout=60, what="the failure")
    assert mesh.ran(k.task_id(failed, 0)) == 1 and mesh.ran(k.task_id(cancelled, 0)) == 0
    worker = mesh.client(mesh.worker_url)
    lib = library()[0]
    for job, was in ((cancelled, "cancelled"), (failed, "failed")):
        tid = k.task_id(job, 0)
        assert mesh.admin.sismember(k.spent(job), "0"), job  # it ended: its index is spent
        for named in (6, 5):  # with the job's spent set named, and without it (as an old caller would)
            spent = [k.spent(job)] if named == 6 else []
            with pytest.raises(redis.exceptions.ResponseError, match="can.t access"):  # the SREM, its first write
                worker.fcall(f"{lib}_retry", named, k.task(tid), k.job(job), k.EVENTS, k.READY, k.IDLE, *spent,
                             tid, "1", "0")  # fmt: skip
        t = mesh.task(tid)
        assert t["status"] == was and mesh.admin.sismember(k.spent(job), "0"), t  # the refused call changed nothing
        assert not mesh.attempt("forget that it ended", lambda job=job: worker.srem(k.spent(job), "0"))
        p = gpumesh("retry", job, "--cancelled", "--url", mesh.worker_url, env=mesh.env)
        assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
        _requeue_by_hand(mesh, worker, job, was)
    for job in (cancelled, failed):
        wait_until(lambda job=job: mesh.task(k.task_id(job, 0))["status"] == "failed", timeout=30,
                   what="the trusting worker to refuse the re-queued task")  # fmt: skip
        assert mesh.task(k.task_id(job, 0))["error"] == ENDED
    assert mesh.ran(k.task_id(failed, 0)) == 1 and mesh.ran(k.task_id(cancelled, 0)) == 0  # neither ran again
    # the submitter's retry takes the index out again: the task runs, and completes
    fixed.touch()
    p = gpumesh("retry", failed, "--url", mesh.submitter_url, env=mesh.env)
    assert p.returncode == 0, p.stderr
    wait_until(lambda: mesh.task(k.task_id(failed, 0))["status"] == "done", timeout=60, what="the retried task")
    assert mesh.ran(k.task_id(failed, 0)) == 2
    assert json.loads(mesh.task(k.task_id(failed, 0))["result"]) == {"echo": {"i": "failed"}}
    assert mesh.results(failed, "--verify").returncode == 0
    p = gpumesh("retry", cancelled, "--cancelled", "--url", mesh.submitter_url, env=mesh.env)
    assert p.returncode == 0, p.stderr  # the refused copy failed for good: a plain retry re-queues it
    wait_until(lambda: mesh.task(k.task_id(cancelled, 0))["status"] == "done", timeout=60, what="the retried task")
    assert mesh.ran(k.task_id(cancelled, 0)) == 1


FILES = (
    "import json, os, sys\np = json.load(sys.stdin)\n"
    "open(os.path.join(os.environ['GPUMESH_OUTPUT_DIR'], 'out.txt'), 'w').write('honest ' + str(p['i']))\n"
    "print(json.dumps({'wrote': p['i']}))\n"
)


def test_a_result_whose_output_files_were_changed_does_not_verify(mesh: Mesh, workers):
    """The result proof covers the artifact index (each file's SHA-256, which `pull` checks the bytes
    against): a worker credential that rewrites a task's index, or drops it, leaves that result NOT VERIFIED."""
    job = mesh.submit([{"i": i} for i in range(3)], FILES, "files.py")
    mesh.start_worker(workers)
    wait_until(lambda: all(mesh.task(k.task_id(job, i)).get("status") == "done" for i in range(3)), timeout=60,
               what="the job")  # fmt: skip
    p = mesh.results(job, "--json", "--verify")
    assert p.returncode == 0, p.stderr
    assert [r["verified"] for r in json.loads(p.stdout)] == [True, True, True]
    worker = mesh.client(mesh.worker_url)
    index = json.loads(mesh.task(k.task_id(job, 1))["artifacts"])
    assert [f["path"] for f in index["files"]] == ["out.txt"]
    index["files"][0]["sha256"] = hashlib.sha256(b"forged").hexdigest()  # other bytes, the proof kept
    index["files"][0]["bytes"] = len(b"forged")
    worker.hset(k.task(k.task_id(job, 1)), "artifacts", json.dumps(index, separators=(",", ":")))
    worker.hdel(k.task(k.task_id(job, 2)), "artifacts")  # its files disowned
    p = mesh.results(job, "--json", "--verify")
    assert p.returncode == 1 and "task(s) 1, 2" in p.stderr, p.stderr
    assert [r["verified"] for r in json.loads(p.stdout)] == [True, False, False]
    assert mesh.results(job).stdout.count("NOT VERIFIED") == 2


def test_every_way_a_task_ends_for_good_marks_it_spent_and_retry_unmarks_it(broker, r: redis.Redis):
    """Final failure by its worker (fail) or by the reaper (a lapsed lease), and cancel, add a signed
    task's index to its job's spent set; retry (with --cancelled) takes them out. An unsigned job has no
    spent set, and none is made (it would have no expiry)."""
    from gpumesh.models import JobOptions
    from gpumesh.signing import SPENT_PLACEHOLDER
    from gpumesh.store import scripts
    from gpumesh.store.reaper import reap_once

    def job_of_three() -> tuple[str, list[str]]:
        # retry_on without 'lost': the reaper's lapsed lease ends the task for good
        options = JobOptions(max_attempts=1, retry_on=("script", "timeout", "memory"))
        res = broker.submit(SCRIPT, "t.py", [{"i": i} for i in range(3)], options)
        return res.job_id, broker.task_ids(res.job_id)

    def end_all(tids: list[str]) -> None:
        lease = scripts.acquire(broker.scripts, r, tids[0], "w", 30)
        assert isinstance(lease, scripts.Lease)
        time.sleep(0.08)
        assert reap_once(broker, audit_grace_ms=0)["failed"] == 1
        lease = scripts.acquire(broker.scripts, r, tids[1], "w", 30_000)
        assert isinstance(lease, scripts.Lease)
        assert scripts.fail(broker.scripts, r, lease, "w", "boom", 0.1).status == "failed"
        assert int(scripts.cancel(broker.scripts, r, tids[2])[0]) == 1

    signed, tids = job_of_three()
    r.sadd(k.spent(signed), SPENT_PLACEHOLDER)  # what a signed submit makes (with its TTL)
    r.expire(k.spent(signed), 3600)
    end_all(tids)
    assert r.smembers(k.spent(signed)) == {SPENT_PLACEHOLDER, "0", "1", "2"}
    assert [r.hget(k.task(t), "status") for t in tids] == ["failed", "failed", "cancelled"]
    assert broker.retry(signed, cancelled=True)[0] == 3
    assert r.smembers(k.spent(signed)) == {SPENT_PLACEHOLDER} and r.ttl(k.spent(signed)) > 0
    unsigned, tids = job_of_three()
    end_all(tids)
    assert not r.exists(k.spent(unsigned))
    assert broker.retry(unsigned, cancelled=True)[0] == 3


LINKS = """
import json, os, sys
p = json.load(sys.stdin)
out = os.environ["GPUMESH_OUTPUT_DIR"]
if p["real"]:
    open(os.path.join(out, "real.txt"), "w").write("x")
os.symlink("/etc/hostname", os.path.join(out, "link"))
print(json.dumps(p))
"""


def test_an_honest_result_whose_output_dir_held_only_a_symlink_verifies(mesh: Mesh, workers):
    """A task whose output dir held only a symlink (skipped, with a note): its honest result showed NOT VERIFIED and
    `results --verify` exited 1, as if its files were lost, while with a real file beside it it verified. Both do."""
    job = mesh.submit([{"real": False}, {"real": True}], LINKS, "links.py")
    mesh.start_worker(workers)
    wait_until(lambda: all(mesh.task(k.task_id(job, i)).get("status") == "done" for i in range(2)), timeout=60,
               what="the job")  # fmt: skip
    p = mesh.results(job, "--json", "--verify")
    assert p.returncode == 0, p.stderr
    assert [r["verified"] for r in json.loads(p.stdout)] == [True, True]
    index = json.loads(mesh.task(k.task_id(job, 0))["artifacts"])
    assert index["files"] == [] and [s["path"] for s in index["skipped"]] == ["link"], index
    assert "NOT VERIFIED" not in mesh.results(job).stdout


def test_serve_on_loopback_says_its_worker_line_is_for_this_machine(mesh: Mesh):
    """serve listening on 127.0.0.1 headed its join line "Join a worker on another machine:", which cannot reach it."""
    text = "\n".join(mesh.serve.lines)
    assert "Join a worker on another machine" not in text, text
    assert "Join a worker on this machine (the broker listens on 127.0.0.1 only" in text, text


def test_a_worker_given_a_submitter_url_says_so_in_one_line(mesh: Mesh):
    """`gpumesh worker` with the submit line's URL ended in a long pipeline HSET error: it now says in one line that
    this credential is not a worker's and which line to use, exit 2."""
    p = gpumesh("worker", mesh.submitter_url, "--score", "1", "--burst", env=mesh.env, timeout=60)
    assert p.returncode == 2, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "(submitter) may not register a worker" in errors[0], p.stderr
    assert "HSET" not in p.stderr and "Traceback" not in p.stderr and mesh.submitter_url not in p.stderr
