"""Failures told apart: each failed attempt records its kind (script, timeout, memory,
lost, refused); status, results and metrics show it; ``--retry-on`` chooses which kinds are retried; a
lost attempt does not spend one of the task's attempts; a task out of memory is retried on a live worker
with more of it, and its log says so."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import redis

import gpumesh
from gpumesh.store import keys

from ..conftest import Workers, cli, wait_until, written
from ..conftest import gpumesh as run_cli

OOM_TEXT = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB"


def _script(tmp: Path, body: str) -> Path:
    path = tmp / "task.py"
    path.write_text(body)
    return path


@pytest.mark.core
@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("bogus", "--retry-on: unknown failure kind 'bogus'; choose from script,timeout,memory,lost, all or none"),
        ("script,refused", "--retry-on: unknown failure kind 'refused' ('refused' is never retried)"),
    ],
)
def test_a_bad_retry_on_is_one_line_exit_2_and_writes_nothing(env, r: redis.Redis, tmp_path: Path, value, says):
    script = _script(tmp_path, "print('{}')\n")
    before = r.dbsize()
    p = cli("submit", str(script), "--payloads", "-", "--retry-on", value, input="[{}]")
    assert p.returncode == 2 and says in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    assert r.dbsize() == before
    with gpumesh.connect() as mesh, pytest.raises(gpumesh.UsageError, match="retry_on: unknown failure kind"):
        mesh.submit(script, [{}], retry_on=["sometimes"])
    assert r.dbsize() == before


@pytest.mark.processes
def test_each_failure_kind_is_recorded_and_shown_in_status_results_and_metrics(env, workers: Workers, tmp_path):
    script = _script(tmp_path, f"""
import json, sys, time
p = json.load(sys.stdin)
if p["do"] == "raise":
    raise ValueError("bad learning rate")
if p["do"] == "sleep":
    time.sleep(30)
if p["do"] == "memoryerror":
    raise MemoryError()
if p["do"] == "cuda":
    print({OOM_TEXT!r}, file=sys.stderr)
    sys.exit(1)
print(json.dumps(p))
""")  # fmt: skip
    workers.start()
    payloads = [{"do": d} for d in ("raise", "sleep", "memoryerror", "cuda", "ok")]
    # The timeout ends the task that sleeps 30 s; the others must be done by then, a loaded machine's slow
    # interpreter start included, which 2 s left little room for.
    p = run_cli("submit", str(script), "--payloads", "-", "--timeout", "8", "--max-attempts", "1", "--wait",
                env=env, input=json.dumps(payloads))  # fmt: skip
    assert p.returncode == 1
    job = p.stdout.split()[0]
    rows = json.loads(run_cli("results", job, "--format", "json", env=env).stdout)
    assert [row["error_kind"] for row in rows] == ["script_error", "timeout", "memory", "memory", None]
    assert "ValueError: bad learning rate" in rows[0]["error"]
    st = json.loads(run_cli("status", job, "--json", env=env).stdout)
    assert st["failed_by_kind"] == {"script": 1, "timeout": 1, "memory": 2}
    human = run_cli("status", job, env=env)
    assert "4 failed (script 1, timeout 1, memory 2)" in human.stdout
    assert "task 1 failed: timeout: timed out" in human.stderr
    assert "task 3 failed: memory: exit code 1" in human.stderr
    table = run_cli("results", job, env=env).stdout
    assert "script_error: ValueError: bad learning rate" in table and "memory: exit code 1" in table
    with gpumesh.connect() as mesh:  # Mesh.map's TaskFailed carries the same kind
        with pytest.raises(gpumesh.TaskFailed) as failed:
            mesh.map(script, [{"do": "cuda"}], max_attempts=1, progress=False)
        assert failed.value.kind == "memory"


@pytest.mark.faults
def test_a_lost_worker_does_not_spend_the_task_s_only_attempt(env, workers: Workers, r: redis.Redis, tmp_path):
    script = _script(tmp_path, f"""
import json, os, sys, time
attempt = os.environ["GPUMESH_ATTEMPT"]
open(os.path.join({str(tmp_path)!r}, "run-" + attempt), "w").write(os.environ["GPUMESH_WORKER_ID"])
if attempt == "1":
    time.sleep(120)
print(json.dumps({{"attempt": attempt}}))
""")  # fmt: skip
    a = workers.start()
    b = workers.start()
    job = run_cli("submit", str(script), "--payloads", "-", "--max-attempts", "1", env=env, input="[{}]").stdout.strip()
    tid = keys.task_id(job, 0)
    wait_until(lambda: written(tmp_path / "run-1"), what="attempt 1 to start")
    holder = r.hget(keys.task(tid), "worker")
    victim = a if int(r.hget(keys.worker(holder), "pid")) == a.pid else b
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    wait_until(lambda: r.hget(keys.task(tid), "status") == "done", timeout=30, what="the task to finish elsewhere")
    (row,) = json.loads(run_cli("results", job, "--format", "json", env=env).stdout)
    assert row["status"] == "done" and row["attempts"] == 2 and row["result"] == {"attempt": "2"}
    assert row["worker"] != holder
    m = r.hgetall(keys.STATS)
    assert int(m["attempts_failed:lost"]) == 1


@pytest.mark.processes
def test_a_task_out_of_cuda_memory_is_retried_on_a_live_worker_with_more(
    env, workers: Workers, r: redis.Redis, tmp_path
):
    go = tmp_path / "go"
    script = _script(tmp_path, f"""
import json, os, sys, time
me = os.environ["GPUMESH_WORKER_ID"]
if json.load(sys.stdin).get("block"):
    time.sleep(3)
elif me.startswith("small"):
    deadline = time.time() + 60
    while not os.path.exists({str(go)!r}) and time.time() < deadline:
        time.sleep(0.05)
    print({OOM_TEXT!r}, file=sys.stderr)
    sys.exit(1)
print(json.dumps({{"on": me}}))
""")  # fmt: skip
    workers.start("--name", "small", "--resource", "vram_gb=8")
    job = run_cli("submit", str(script), "--payloads", "-", env=env, input="[{}]").stdout.strip()
    tid = keys.task_id(job, 0)
    wait_until(lambda: (r.hget(keys.task(tid), "worker") or "").startswith("small"), what="attempt 1 on small")
    workers.start("--name", "big", "--resource", "vram_gb=24")
    workers.start("--name", "spare", "--resource", "vram_gb=8")  # as small as the first: must not get the retry
    wait_until(lambda: r.zcard(keys.SCORES) == 3, what="three workers registered")
    busy = run_cli("submit", str(script), "--payloads", "-", "--require", "vram_gb>=24", env=env,
                   input='[{"block": true}]').stdout.strip()  # fmt: skip
    wait_until(lambda: r.hget(keys.task(keys.task_id(busy, 0)), "status") == "running", what="big to be busy")
    go.write_text("")
    failed_at = time.monotonic()
    wait_until(lambda: r.hget(keys.task(tid), "status") == "done", timeout=40, what="the retry to finish")
    waited = time.monotonic() - failed_at
    (row,) = json.loads(run_cli("results", job, "--format", "json", env=env).stdout)
    assert row["attempts"] == 2 and row["result"]["on"].startswith("big"), row  # not on the idle spare
    log = run_cli("logs", tid, env=env).stderr
    assert "attempt 1 failed: exit code 1" in log
    assert "retrying on worker big-" in log and "which has more memory (vram_gb 24)" in log, log
    print(
        f"\nout of CUDA memory on vram_gb=8 -> waited {waited:.1f} s for the busy vram_gb=24 worker (idle spare skipped)"
    )


@pytest.mark.core
@pytest.mark.parametrize(
    ("stderr", "returncode", "kind"),
    [
        # logged an out-of-memory, recovered, then died of a bug: the bug is what it failed of
        (["WARNING: CUDA out of memory at batch 512, retrying with batch 256", "Traceback (most recent call last):",
          '  File "t.py", line 3, in <module>', "KeyError: 'labels'"], 1, "script"),
        (["Traceback (most recent call last):", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB"],
         1, "memory"),
        (["Traceback (most recent call last):", "numpy.core._exceptions._ArrayMemoryError: Unable to allocate"], 1,
         "memory"),
        (["CUDA error: out of memory", "CUDA_ERROR_OUT_OF_MEMORY"], -6, "memory"),  # a driver abort: no traceback
        (['gpumesh-exception {"type": "MemoryError", "message": ""}'], 1, "memory"),  # a function task's
        (['gpumesh-exception {"type": "ValueError", "message": "CUDA out of memory? no"}'], 1, "memory"),
        (["Traceback (most recent call last):", "ValueError: bad"], 1, "script"),
        ([], -9, "script"),  # SIGKILL without the kernel's OOM killer running: someone killed it
    ],
)  # fmt: skip
def test_an_attempt_fails_of_what_it_died_of_not_of_what_it_logged(stderr, returncode, kind):
    from gpumesh.sandbox.runner import Attempt
    from gpumesh.worker.executor import failure_of

    out = Attempt(returncode=returncode)
    out.stderr_tail.extend(stderr)
    got, need, _ = failure_of(out, {"task_memory_gb": 8.0, "vram_gb": 24.0})
    assert got == kind
    if kind == "memory":
        assert need in (("vram_gb", 24.0), ("task_memory_gb", 8.0))


def _register(r: redis.Redis, worker_id: str, **resources: object) -> None:
    r.hset(keys.worker(worker_id), "resources", json.dumps(resources))
    r.zadd(keys.SCORES, {worker_id: 1.0})


@pytest.mark.core
def test_a_task_out_of_memory_waits_only_for_a_worker_that_has_clearly_more_and_may_run_it(broker, r: redis.Redis):
    from gpumesh.models import JobOptions
    from gpumesh.store import scripts

    res = broker.submit("print('{}')", "t.py", [{}], JobOptions(requires=("device=cuda",)))
    (tid,) = broker.task_ids(res.job_id)
    _register(r, "small", device="cuda", task_memory_gb=8.0)
    _register(r, "cpu-box", device="cpu", task_memory_gb=256.0)  # more RAM, but the task requires cuda
    _register(r, "about-same", device="cuda", task_memory_gb=8.5)  # not clearly more (under 1.2x)
    _register(r, "liar", device="cuda", task_memory_gb="9" * 30_000 + "x")  # no number: ignored, quickly

    def fail_once() -> scripts.Outcome:
        lease = scripts.acquire(broker.scripts, r, tid, "small", 30_000)
        assert isinstance(lease, scripts.Lease)
        t0 = time.monotonic()
        out = scripts.fail(broker.scripts, r, lease, "small", "killed: over its memory cap", 1.0, kind="memory",
                           need=("task_memory_gb", 8.0), hold_ms=60_000)  # fmt: skip
        assert time.monotonic() - t0 < 1, "a resource that is no number costs no time"
        return out

    out = fail_once()
    assert out.status == "queued" and out.bigger is None  # nobody it could wait for: retried as any failure
    assert r.hget(keys.task(tid), "bigger_on") is None
    _register(r, "big", device="cuda", task_memory_gb=64.0)
    out = fail_once()
    assert out.status == "queued" and out.bigger == ("big", 64.0)
    assert r.hget(keys.task(tid), "error_kind") == "memory"


@pytest.mark.core
def test_failed_by_kind_counts_what_failed_and_retry_takes_it_back(broker, r: redis.Redis):
    from gpumesh.models import JobOptions
    from gpumesh.store import scripts

    res = broker.submit("print('{}')", "t.py", [{}, {}], JobOptions(max_attempts=1))
    tids = broker.task_ids(res.job_id)
    for tid, kind in zip(tids, ("script", "timeout"), strict=True):
        lease = scripts.acquire(broker.scripts, r, tid, "w", 30_000)
        assert isinstance(lease, scripts.Lease)
        assert scripts.fail(broker.scripts, r, lease, "w", "boom", 0.1, kind=kind).status == "failed"
    st = broker.job_status(res.job_id)
    assert st.failed_by_kind == {"script": 1, "timeout": 1} and st.tasks.failed == 2
    assert broker.retry(res.job_id)[0] == 2
    assert broker.job_status(res.job_id).failed_by_kind == {}
    counts = r.hgetall(keys.job(res.job_id))
    assert counts["failed:script"] == "0" and counts["failed:timeout"] == "0"
    # a task that failed before kinds were recorded has none: retrying it takes nothing below zero
    lease = scripts.acquire(broker.scripts, r, tids[0], "w", 30_000)
    assert isinstance(lease, scripts.Lease)
    assert scripts.fail(broker.scripts, r, lease, "w", "boom", 0.1).status == "failed"
    r.hdel(keys.task(tids[0]), "error_kind")
    r.hset(keys.job(res.job_id), "failed:script", 0)
    assert broker.retry(res.job_id)[0] == 1
    assert r.hget(keys.job(res.job_id), "failed:script") == "0"
