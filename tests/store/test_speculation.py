"""Backup copies of stragglers (submit --speculate): the Lua transitions, then real workers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from gpumesh.models import JobOptions
from gpumesh.store import keys, scripts
from gpumesh.store.broker import Broker
from gpumesh.store.reaper import reap_once

from ..conftest import Workers, gpumesh, pid_alive, wait_until
from .test_lua_transitions import LEASE_MS, SCRIPT, assert_counters_match_tasks

EPOCH = "e"


def started(broker: Broker, r: redis.Redis, speculate: bool = True, n: int = 1) -> tuple[str, list[str], list]:
    """A job whose tasks were all acquired by the weak worker 'slow' (score 1)."""
    res = broker.submit(SCRIPT, "t.py", [{"i": i} for i in range(n)], JobOptions(speculate=speculate))
    tids = broker.task_ids(res.job_id)
    r.zadd(keys.SCORES, {"slow": 1.0, "fast": 8.0, "medium": 1.5})
    leases = [scripts.acquire(broker.scripts, r, t, "slow", LEASE_MS) for t in tids]
    return res.job_id, tids, leases


def backup(broker: Broker, r: redis.Redis, tid: str, worker: str = "fast", score: float = 8.0):
    return scripts.speculate(broker.scripts, r, tid, worker, LEASE_MS, score, 2.0)


@pytest.mark.core
def test_a_backup_is_only_for_speculative_jobs_with_nothing_queued_and_a_much_stronger_worker(
    broker: Broker, r: redis.Redis
):
    _job, (tid,), _ = started(broker, r, speculate=False)
    assert backup(broker, r, tid) == "not speculative"
    _job, tids, _ = started(broker, r, n=2)
    r.hset(keys.task(tids[1]), "status", "queued")  # pretend one is still waiting
    r.hincrby(keys.job(keys.job_of_task(tids[1])), "queued", 1)
    assert backup(broker, r, tids[0]) == "job has queued tasks"
    _job, (tid,), _ = started(broker, r)
    assert backup(broker, r, tid, "medium", 1.5) == "not faster"
    assert backup(broker, r, tid, "slow", 1.0) == "own task"
    first = backup(broker, r, tid)
    assert isinstance(first, scripts.Lease) and first.backup and first.attempt == 1
    assert backup(broker, r, tid, "fast2", 9.0) == "has a backup"


@pytest.mark.core
def test_the_first_completion_wins_and_the_other_copy_learns_it_lost(broker: Broker, r: redis.Redis):
    job, (tid,), (primary,) = started(broker, r)
    copy = backup(broker, r, tid)
    assert isinstance(copy, scripts.Lease)
    beat = scripts.heartbeat(broker.scripts, r, "fast", 60_000, copy, LEASE_MS, r.get(keys.EPOCH) or "")
    assert beat.lease == "ok", "a backup copy's lease is renewed like any other"
    assert scripts.complete(broker.scripts, r, copy, "fast", '{"by": "backup"}', 0.5).accepted
    assert scripts.complete(broker.scripts, r, primary, "slow", '{"by": "primary"}', 9.0) == scripts.Outcome(
        False, "done"
    )
    task = r.hgetall(keys.task(tid))
    assert task["result"] == '{"by": "backup"}' and task["attempts"] == "1" and task["backup"] == ""
    assert task["worker"] == "fast", "the task names the worker whose copy made its result"
    (row,) = broker.results(job)
    assert row.worker == "fast" and row.result == {"by": "backup"}
    assert r.hget(keys.STATS, "speculative_wins") == "1" and r.hget(keys.job(job), "status") == "done"
    beat = scripts.heartbeat(broker.scripts, r, "slow", 60_000, primary, LEASE_MS, r.get(keys.EPOCH) or "")
    assert beat.lease == "lost"
    assert_counters_match_tasks(r, job)


@pytest.mark.core
def test_a_primary_that_fails_or_lapses_hands_the_task_to_its_live_backup(broker: Broker, r: redis.Redis):
    job, (t1, t2), (p1, p2) = started(broker, r, n=2)
    b1, b2 = backup(broker, r, t1), backup(broker, r, t2, "fast2", 9.0)
    out = scripts.fail(broker.scripts, r, p1, "slow", "exit code 1", 3.0)
    assert out == scripts.Outcome(True, "running", 0)
    assert r.hget(keys.task(t1), "lease") == scripts.token_digest(b1.token)
    assert r.hget(keys.task(t1), "worker") == "fast"
    assert r.pttl(keys.lease(t1)) > 0
    r.delete(keys.lease(t2))  # the primary's worker died: its lease lapsed
    r.zadd(keys.LEASES, {t2: 0})
    assert reap_once(broker, audit_grace_ms=0)["requeued"] == 0
    assert r.hget(keys.task(t2), "lease") == scripts.token_digest(b2.token)
    assert r.hget(keys.task(t2), "status") == "running"
    assert scripts.complete(broker.scripts, r, b1, "fast", "{}", 0.1).accepted
    assert scripts.complete(broker.scripts, r, b2, "fast2", "{}", 0.1).accepted
    assert r.hget(keys.job(job), "status") == "done"
    assert_counters_match_tasks(r, job)


@pytest.mark.core
def test_a_failed_backup_is_dropped_and_the_primary_runs_on(broker: Broker, r: redis.Redis):
    job, (tid,), (primary,) = started(broker, r)
    copy = backup(broker, r, tid)
    out = scripts.fail(broker.scripts, r, copy, "fast", "killed: yielded", 0.2)
    assert out.accepted and out.status == "running"
    task = r.hgetall(keys.task(tid))
    assert task["status"] == "running" and task["lease"] == scripts.token_digest(primary.token) and task["backup"] == ""
    assert task["attempts"] == "1", "a backup spends no attempt"
    assert isinstance(backup(broker, r, tid), scripts.Lease), "another backup may start"
    assert scripts.complete(broker.scripts, r, primary, "slow", "{}", 4.0).accepted
    assert_counters_match_tasks(r, job)


def speculate_with(monkeypatch: pytest.MonkeyPatch, broker: Broker, r: redis.Redis, tid: str, token: str):
    """One speculate call by 'fast' with a given token: what redis-py sends again when the reply to it was lost."""
    monkeypatch.setattr(scripts, "new_token", lambda: token)
    return backup(broker, r, tid)


@pytest.mark.core
def test_a_resent_speculate_answers_with_the_backup_it_started(broker: Broker, r: redis.Redis, monkeypatch):
    """redis-py sends a call again when its reply was lost, though the function ran: the same token gets the
    same backup back, also once it was promoted in between; nothing is counted twice; another token is refused."""
    job, (t1, t2), (_p1, p2) = started(broker, r, n=2)
    first = speculate_with(monkeypatch, broker, r, t1, "token-one")
    again = speculate_with(monkeypatch, broker, r, t1, "token-one")
    assert isinstance(first, scripts.Lease) and isinstance(again, scripts.Lease) and again.backup
    assert (again.task_id, again.attempt, again.payload, again.token) == (first.task_id, first.attempt, first.payload,
                                                                          first.token)  # fmt: skip
    assert speculate_with(monkeypatch, broker, r, t1, "token-two") == "has a backup"
    assert r.hget(keys.STATS, "speculated") == "1"
    # the primary fails between the call and its resend: the backup is promoted, and is still the answer
    assert isinstance(speculate_with(monkeypatch, broker, r, t2, "token-three"), scripts.Lease)
    assert scripts.fail(broker.scripts, r, p2, "slow", "exit code 1", 1.0).status == "running"
    assert r.hget(keys.task(t2), "worker") == "fast" and r.hget(keys.task(t2), "promoted") == "1"
    promoted = speculate_with(monkeypatch, broker, r, t2, "token-three")
    assert isinstance(promoted, scripts.Lease), f"the promoted backup's resend was refused: {promoted}"
    assert speculate_with(monkeypatch, broker, r, t2, "token-four") == "own task"
    assert r.hget(keys.STATS, "speculated") == "2"
    assert scripts.complete(broker.scripts, r, first, "fast", "{}", 0.1).accepted
    assert scripts.complete(broker.scripts, r, promoted, "fast", "{}", 0.1).accepted
    assert_counters_match_tasks(r, job)


SLEEPER = """
import json, os, sys, time
p = json.load(sys.stdin)
pid_file = os.path.join({tmp!r}, "pid-" + os.environ["GPUMESH_WORKER_ID"])
part = os.path.join({tmp!r}, "part-" + os.environ["GPUMESH_WORKER_ID"])
open(part, "w").write(str(os.getpid()))
os.replace(part, pid_file)  # whole or absent: the test may read it at any moment
time.sleep(p["work"] / float(os.environ["GPUMESH_WORKER_SCORE"]))
print(json.dumps({{"worker": os.environ["GPUMESH_WORKER_ID"]}}))
"""


@pytest.mark.processes
def test_an_idle_strong_worker_backs_up_a_straggler_and_wins(env, workers: Workers, r: redis.Redis, tmp_path: Path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER.format(tmp=str(tmp_path)))
    workers.start(score=1)
    p = gpumesh("submit", str(script), "--payloads", "-", "--speculate", env=env, input='[{"work": 60}]')
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip()
    tid = keys.task_id(job, 0)
    # "running" is set when the lease is taken, before the script has started: wait for the script itself
    wait_until(lambda: any(tmp_path.glob("pid-*")), what="the weak worker to start the script")
    assert r.hget(keys.task(tid), "status") == "running"
    slow_pid = int(next(tmp_path.glob("pid-*")).read_text())
    t0 = time.monotonic()
    workers.start(score=10)  # 60 work units: 60 s on the weak worker, 6 s on this one
    wait_until(lambda: r.hget(keys.task(tid), "status") == "done", timeout=30, what="the backup copy to win")
    elapsed = time.monotonic() - t0
    task = r.hgetall(keys.task(tid))
    strong = [w for w, score in r.zrange(keys.SCORES, 0, -1, withscores=True) if score == 10]
    assert json.loads(task["result"])["worker"] == strong[0], "the strong worker's copy produced the result"
    assert task["worker"] == strong[0], "and the task names it"
    assert elapsed < 20, f"the backup finished the 60 s straggler in {elapsed:.1f} s"
    assert task["attempts"] == "1" and r.hget(keys.STATS, "speculative_wins") == "1"
    wait_until(lambda: not pid_alive(slow_pid), timeout=10, what="the losing copy to be killed")
    assert "backup copy of attempt 1" in gpumesh("logs", tid, env=env).stderr
    from gpumesh.server.metrics import MeshCollector
    from gpumesh.settings import Settings

    b = Broker(Settings.load())
    family = next(f for f in MeshCollector(b).collect() if f.name == "gpumesh_backup_copies")
    assert {s.labels["outcome"]: s.value for s in family.samples if s.name.endswith("_total")} == {
        "started": 1,
        "won": 1,
    }
    b.close()


@pytest.mark.processes
def test_queued_work_runs_before_any_backup(env, workers: Workers, r: redis.Redis, tmp_path: Path):
    """A worker backs up stragglers only when its pop found every queue empty, never with work in hand."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER.format(tmp=str(tmp_path)))
    workers.start(score=1)
    p = gpumesh("submit", str(script), "--payloads", "-", "--speculate", env=env, input='[{"work": 60}]')
    straggler = keys.task_id(p.stdout.strip(), 0)
    wait_until(lambda: r.hget(keys.task(straggler), "status") == "running", what="the weak worker to start it")
    p = gpumesh("submit", str(script), "--payloads", "-", env=env, input='[{"work": 1}]')
    other = keys.task_id(p.stdout.strip(), 0)
    workers.start(score=10)
    wait_until(lambda: r.hget(keys.task(straggler), "status") == "done", timeout=30, what="the backup to win")
    assert r.hget(keys.STATS, "speculative_wins") == "1"
    other_done = float(r.hget(keys.task(other), "finished_at"))
    backup_started = float(r.hget(keys.task(straggler), "backup_started_at"))
    assert backup_started >= other_done, "the other job's queued task ran first, before any backup started"
