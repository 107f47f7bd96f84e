"""The Lua transitions against a real Redis: fencing, counters, retries, reaping, cancellation."""

from __future__ import annotations

import time

import pytest
import redis

from gpumesh.models import JobOptions
from gpumesh.store import keys, scripts, tasklog
from gpumesh.store.broker import Broker
from gpumesh.store.reaper import reap_once

from ..conftest import RedisServer

SCRIPT = "import json,sys; print(json.dumps(json.load(sys.stdin)))"
LEASE_MS = 30_000


def submit(broker: Broker, n: int = 1, max_attempts: int = 3, retry_on: str = "all") -> tuple[str, list[str]]:
    options = JobOptions(max_attempts=max_attempts, retry_on=retry_on)
    res = broker.submit(SCRIPT, "t.py", [{"i": i} for i in range(n)], options)
    return res.job_id, broker.task_ids(res.job_id)


def counters(r: redis.Redis, job_id: str) -> dict[str, str]:
    return r.hgetall(keys.job(job_id))


def assert_counters_match_tasks(r: redis.Redis, job_id: str) -> None:
    job = counters(r, job_id)
    statuses = [r.hget(keys.task(t), "status") for t in r.lrange(keys.job_tasks(job_id), 0, -1)]
    for state in ("queued", "running", "done", "failed", "cancelled"):
        assert int(job[state]) == statuses.count(state), (state, job, statuses)


@pytest.mark.core
def test_acquire_only_from_queued_and_duplicates_are_skipped(broker: Broker, r: redis.Redis):
    job, (tid,) = submit(broker)
    lease = scripts.acquire(broker.scripts, r, tid, "w1", LEASE_MS)
    assert isinstance(lease, scripts.Lease)
    assert lease.attempt == 1 and lease.job_id == job and lease.payload == '{"i": 0}'
    assert r.get(keys.lease(tid)) == scripts.token_digest(lease.token), "only the token's digest is stored"
    assert scripts.acquire(broker.scripts, r, tid, "w2", LEASE_MS) == "running"
    assert counters(r, job)["status"] == "running"
    assert_counters_match_tasks(r, job)


@pytest.mark.core
def test_complete_is_fenced_by_the_token(broker: Broker, r: redis.Redis):
    job, (tid,) = submit(broker)
    lease = scripts.acquire(broker.scripts, r, tid, "w1", LEASE_MS)
    forged = scripts.Lease(**{**lease.__dict__, "token": "w2:1:0"})
    out = scripts.complete(broker.scripts, r, forged, "w2", '{"x": 1}', 0.1)
    assert not out.accepted and out.status == "stale"
    assert r.hget(keys.task(tid), "status") == "running"
    out = scripts.complete(broker.scripts, r, lease, "w1", '{"x": 2}', 0.1)
    assert out.accepted
    assert r.hget(keys.task(tid), "result") == '{"x": 2}'
    assert counters(r, job)["status"] == "done"
    assert not r.exists(keys.lease(tid)) and r.zscore(keys.LEASES, tid) is None
    # the same completion again (its reply was lost and the call retried) is told it won, and changes nothing
    assert scripts.complete(broker.scripts, r, lease, "w1", '{"x": 3}', 0.1) == scripts.Outcome(True, "done")
    assert r.hget(keys.task(tid), "result") == '{"x": 2}'
    assert counters(r, job)["done"] == "1" and r.hget(keys.STATS, "done") == "1"
    # another lease's late completion is still refused
    assert scripts.complete(broker.scripts, r, forged, "w2", '{"x": 4}', 0.1) == scripts.Outcome(False, "done")


@pytest.mark.core
def test_stale_worker_after_reap_and_re_lease_changes_nothing(broker: Broker, r: redis.Redis):
    job, (tid,) = submit(broker)
    old = scripts.acquire(broker.scripts, r, tid, "old", 50)
    time.sleep(0.1)  # the lease lapses
    report = reap_once(broker, audit_grace_ms=0)
    assert report["requeued"] == 1
    new = scripts.acquire(broker.scripts, r, tid, "new", LEASE_MS)
    assert isinstance(new, scripts.Lease) and new.attempt == 2
    assert not scripts.complete(broker.scripts, r, old, "old", '"late"', 1).accepted
    assert not scripts.fail(broker.scripts, r, old, "old", "late failure", 1).accepted
    hb = scripts.heartbeat(broker.scripts, r, "old", 5000, old, LEASE_MS, broker.epoch())
    assert hb.lease == "lost"
    assert scripts.complete(broker.scripts, r, new, "new", '"fresh"', 1).accepted
    task = r.hgetall(keys.task(tid))
    assert task["result"] == '"fresh"' and task["attempts"] == "2" and task["worker"] == "new"
    assert_counters_match_tasks(r, job)


@pytest.mark.core
def test_fail_requeues_until_max_attempts_then_fails_the_job(broker: Broker, r: redis.Redis):
    job, (tid,) = submit(broker, max_attempts=2)
    first = scripts.acquire(broker.scripts, r, tid, "w", LEASE_MS)
    out = scripts.fail(broker.scripts, r, first, "w", "exit code 1\nboom", 0.2)
    assert out.accepted and out.status == "queued" and out.attempts == 1
    assert r.zscore(keys.pending(job, 0), keys.pending_member(0)) == 1.0  # takeable again, at its cost
    assert r.zscore(keys.READY, keys.ready_member(job, 0)) == 0  # ... in the ready index at its priority
    assert_counters_match_tasks(r, job)
    second = scripts.acquire(broker.scripts, r, tid, "w", LEASE_MS)
    assert not r.exists(keys.pending(job, 0))
    out = scripts.fail(broker.scripts, r, second, "w", "exit code 1\nboom again", 0.2)
    assert out.accepted and out.status == "failed"
    task = r.hgetall(keys.task(tid))
    assert task["status"] == "failed" and task["attempts"] == "2" and task["error"].endswith("boom again")
    assert counters(r, job)["status"] == "failed"
    assert_counters_match_tasks(r, job)


@pytest.mark.core
def test_release_hands_back_without_spending_an_attempt(broker: Broker, r: redis.Redis):
    _, (tid,) = submit(broker, max_attempts=1)
    lease = scripts.acquire(broker.scripts, r, tid, "w", LEASE_MS)
    out = scripts.fail(broker.scripts, r, lease, "w", "", 0.0, release=True)
    assert out.accepted and out.status == "queued"
    assert r.hget(keys.task(tid), "attempts") == "0"


@pytest.mark.core
def test_reaper_requeues_lost_attempts_free_three_times_then_spends_them(broker: Broker, r: redis.Redis):
    job, (tid,) = submit(broker, max_attempts=2)
    for run in range(1, 6):  # 3 lost attempts are free; the 4th and 5th spend the task's 2 attempts
        lease = scripts.acquire(broker.scripts, r, tid, "w", 30)
        assert isinstance(lease, scripts.Lease) and lease.attempt == run  # every run has its own number
        assert not r.exists(keys.pending(job, 0))
        time.sleep(0.08)
        report = reap_once(broker, audit_grace_ms=0)
        assert report["requeued" if run < 5 else "failed"] == 1, (run, report)
        task = r.hgetall(keys.task(tid))
        assert task["error"].startswith("lease expired: worker w") and task["error_kind"] == "lost"
        if run < 5:
            assert r.zcard(keys.pending(job, 0)) == 1  # pending again: the next dispatch can take it
    assert counters(r, job)["status"] == "failed" and counters(r, job)["failed:lost"] == "1"
    assert_counters_match_tasks(r, job)


@pytest.mark.core
def test_reaper_leaves_a_renewed_lease_alone(broker: Broker, r: redis.Redis):
    _, (tid,) = submit(broker)
    lease = scripts.acquire(broker.scripts, r, tid, "w", 60)
    r.zadd(keys.LEASES, {tid: 0})  # deadline in the past, but the lease key is alive
    scripts.heartbeat(broker.scripts, r, "w", 5000, lease, LEASE_MS, broker.epoch())
    assert reap_once(broker)["requeued"] == 0
    assert r.hget(keys.task(tid), "status") == "running"


@pytest.mark.core
def test_cancel_ends_queued_and_running_tasks_and_heartbeat_reports_it(broker: Broker, r: redis.Redis):
    job, tids = submit(broker, n=3)
    lease = scripts.acquire(broker.scripts, r, tids[0], "w", LEASE_MS)
    scripts.complete(broker.scripts, r, scripts.acquire(broker.scripts, r, tids[1], "w", LEASE_MS), "w", "1", 0)
    st = broker.cancel(job)
    assert st.status == "cancelled"
    assert (st.tasks.cancelled, st.tasks.done, st.tasks.queued, st.tasks.running) == (2, 1, 0, 0)
    assert scripts.heartbeat(broker.scripts, r, "w", 5000, lease, LEASE_MS, broker.epoch()).lease == "cancelled"
    assert scripts.acquire(broker.scripts, r, tids[2], "w", LEASE_MS) == "cancelled"
    assert not scripts.complete(broker.scripts, r, lease, "w", "1", 0).accepted
    assert_counters_match_tasks(r, job)


@pytest.mark.core
def test_heartbeat_renews_the_lease_and_says_when_registration_expired(broker: Broker, r: redis.Redis):
    _, (tid,) = submit(broker)
    lease = scripts.acquire(broker.scripts, r, tid, "w", 200)
    beat = scripts.heartbeat(broker.scripts, r, "w", 5000, lease, 10_000, broker.epoch())
    assert (beat.registered, beat.lease, beat.epoch_ok) == (False, "ok", True)
    assert r.pttl(keys.lease(tid)) > 5000
    assert abs(beat.server_ms / 1000 - time.time()) < 5


@pytest.mark.core
def test_heartbeat_against_a_broker_that_lost_its_data_touches_nothing(broker: Broker, r: redis.Redis):
    _, (tid,) = submit(broker)
    epoch = broker.epoch()
    lease = scripts.acquire(broker.scripts, r, tid, "w", LEASE_MS)
    r.flushall()  # the broker restarted empty
    beat = scripts.heartbeat(broker.scripts, r, "w", 5000, lease, LEASE_MS, epoch)
    assert not beat.epoch_ok
    assert r.dbsize() == 0, "no phantom lease or registration is written"
    assert broker.epoch() != epoch


@pytest.mark.faults
def test_script_flush_does_not_break_the_next_call(broker: Broker, r: redis.Redis):
    _, (tid,) = submit(broker)
    r.script_flush()
    assert isinstance(scripts.acquire(broker.scripts, r, tid, "w", LEASE_MS), scripts.Lease)
    r.script_flush()
    assert reap_once(broker)["requeued"] == 0  # pipelined EVALSHA reloads too


@pytest.mark.faults
def test_a_broker_that_lost_gpumesh_s_functions_gets_them_back_at_the_next_call(broker: Broker, r: redis.Redis):
    """A Redis without ACLs (restarted empty, or FUNCTION FLUSH): any client loads the library again."""
    job, (tid, other) = submit(broker, n=2)
    r.function_flush()
    assert isinstance(scripts.acquire(broker.scripts, r, tid, "w", LEASE_MS), scripts.Lease)
    r.function_flush()
    fresh = Broker(broker.settings)  # a pipeline is checked before it runs (its error would come at execute)
    try:
        assert fresh.cancel(job).tasks.cancelled == 2
    finally:
        fresh.close()
    assert r.hget(keys.task(other), "status") == "cancelled"


@pytest.mark.faults
def test_a_completion_carrying_log_lines_after_the_broker_lost_the_functions_is_recorded_once(
    broker: Broker, r: redis.Redis
):
    """A worker's completion goes in a pipeline with its attempt's log lines, which is not retried by itself when the
    functions are missing: the completion loads them and is recorded, and the lines are written once."""
    _, (tid,) = submit(broker)
    lease = scripts.acquire(broker.scripts, r, tid, "w", LEASE_MS)
    assert isinstance(lease, scripts.Lease)
    broker.scripts.ensure(force=True)  # checked just now: the pipeline will not look again for ENSURE_EVERY s
    r.function_flush()
    lines = [(tid, "stdout", "one"), (tid, "stderr", "two")]
    out = scripts.complete(broker.scripts, r, lease, "w", '{"ok": 1}', 0.1, lines=lines)
    assert out.accepted and r.hget(keys.task(tid), "status") == "done"
    assert lines == [], "the list is emptied once its lines were sent"
    assert [line for _stream, line in tasklog.task_lines(r, tid)[0]] == ["one", "two"]


@pytest.mark.faults
def test_redis_restart_does_not_break_the_next_call(tmp_path, env, monkeypatch):
    server = RedisServer(tmp_path).start(appendonly=True)
    try:
        from gpumesh.settings import Settings

        b = Broker(Settings.load(url=server.url))
        _, (tid,) = submit(b)
        server.stop()
        server.start(appendonly=True)
        lease = scripts.acquire(b.scripts, b.r, tid, "w", LEASE_MS)
        assert isinstance(lease, scripts.Lease)
        b.close()
    finally:
        server.stop()


@pytest.mark.parametrize("n_workers", [8])
@pytest.mark.core
def test_race_of_many_processes_acquires_every_task_exactly_once(
    broker: Broker, r: redis.Redis, redis_server, n_workers
):
    """Eight processes hammer the same 400 tasks; each task is acquired once and completed once."""
    import multiprocessing as mp

    job, tids = submit(broker, n=400)
    ctx = mp.get_context("spawn")
    with ctx.Pool(n_workers) as pool:
        won = pool.starmap(_grab_all, [(redis_server.url, tids, f"p{i}") for i in range(n_workers)])
    assert sum(len(w) for w in won) == 400
    assert len(set().union(*map(set, won))) == 400
    attempts = {r.hget(keys.task(t), "attempts") for t in tids}
    assert attempts == {"1"}
    st = broker.job_status(job)
    assert st.status == "done" and st.tasks.done == 400
    assert_counters_match_tasks(r, job)


def _grab_all(url: str, tids: list[str], me: str) -> list[str]:
    import random

    from gpumesh.settings import Settings

    b = Broker(Settings(url=url))
    order = tids[:]
    random.Random(me).shuffle(order)
    won = []
    for tid in order:
        lease = scripts.acquire(b.scripts, b.r, tid, me, LEASE_MS)
        if isinstance(lease, scripts.Lease):
            assert scripts.complete(b.scripts, b.r, lease, me, '"ok"', 0).accepted
            won.append(tid)
    return won


@pytest.mark.core
def test_finished_jobs_past_the_retention_are_pruned_open_ones_kept(r: redis.Redis, env):
    from gpumesh.settings import Settings

    b = Broker(Settings.load(job_retention=1))
    done_job, done_tids = submit(b, n=2)
    open_job, _ = submit(b, n=1)
    b.cancel(done_job)  # terminal, finished now
    assert reap_once(b)["jobs_pruned"] == 0  # finished within the retention
    time.sleep(1.2)
    assert reap_once(b)["jobs_pruned"] == 1
    assert not r.exists(keys.job(done_job), keys.job_tasks(done_job), *[keys.task(t) for t in done_tids])
    assert r.zscore(keys.JOBS, done_job) is None
    assert r.hget(keys.job(open_job), "status") == "queued", "a job still open is never pruned"
    b.close()


@pytest.mark.core
def test_a_cancelled_task_leaves_its_worker_s_registration_at_the_worker_s_next_dispatch(
    broker: Broker, r: redis.Redis
):
    """A cancelled task's worker never completes or fails it: asking for work again (idle) clears it from
    the registration, which `workers` and the dashboard show."""
    job, (tid,) = submit(broker)
    r.hset(keys.worker("w"), mapping={"name": "w", "current_task": ""})
    r.zadd(keys.SCORES, {"w": 1.0})
    lease = scripts.dispatch(broker.scripts, r, "w", LEASE_MS, 1.0)
    assert isinstance(lease, scripts.Lease) and r.hget(keys.worker("w"), "current_task") == tid
    broker.cancel(job)
    assert r.hget(keys.worker("w"), "current_task") == tid  # the worker learns it at its next heartbeat
    assert not isinstance(scripts.dispatch(broker.scripts, r, "w", LEASE_MS, 1.0), scripts.Lease)
    assert r.hget(keys.worker("w"), "current_task") == ""
