"""The record of attempts (``Job.attempts()``, what the dashboard's timeline draws): every way an attempt
ends leaves one entry with its worker, copy, times and outcome, written by the same atomic script that
ends it; running attempts are read from the tasks the workers hold."""

from __future__ import annotations

import time

import pytest
import redis

import gpumesh
from gpumesh.store import keys, scripts
from gpumesh.store.broker import Broker
from gpumesh.store.reaper import reap_once
from gpumesh.store.submit import delete_job

from ..store.test_lua_transitions import LEASE_MS, submit
from ..store.test_speculation import backup, started


def runs(broker: Broker, job: str) -> list[tuple[int, int, str, str, str, str | None]]:
    return [(a.index, a.attempt, a.worker, a.copy, a.outcome, a.kind) for a in broker.attempts(job)]


def hold(r: redis.Redis, worker: str, tid: str) -> None:
    """Register ``worker`` as live and holding ``tid`` (what its heartbeat keeps)."""
    r.zadd(keys.WORKERS, {worker: time.time() * 1000})
    r.hset(keys.worker(worker), "current_task", tid)


@pytest.mark.core
def test_a_retried_then_done_task_has_two_attempts_in_order_with_times(broker: Broker, r: redis.Redis):
    job, (tid,) = submit(broker, max_attempts=3)
    first = scripts.acquire(broker.scripts, r, tid, "w1", LEASE_MS)
    hold(r, "w1", tid)
    (running,) = broker.attempts(job)
    assert (running.worker, running.outcome, running.ended_at) == ("w1", "running", None)
    scripts.fail(broker.scripts, r, first, "w1", "exit code 1\nboom", 0.2)
    second = scripts.acquire(broker.scripts, r, tid, "w2", LEASE_MS)
    scripts.complete(broker.scripts, r, second, "w2", "1", 0.1)
    assert runs(broker, job) == [(0, 1, "w1", "primary", "retried", "script"), (0, 2, "w2", "primary", "done", None)]
    a, b = broker.attempts(job)
    assert a.started_at and a.ended_at and b.started_at and b.ended_at
    assert a.started_at <= a.ended_at <= b.started_at <= b.ended_at
    assert abs(b.ended_at - time.time()) < 5, "broker time, in seconds since the epoch"


@pytest.mark.core
def test_failed_for_good_lost_handed_back_and_cancelled_attempts_are_each_recorded(broker: Broker, r: redis.Redis):
    job, (t0, t1, t2) = submit(broker, n=3, max_attempts=1)
    scripts.fail(broker.scripts, r, scripts.acquire(broker.scripts, r, t0, "w", LEASE_MS), "w", "boom", 0.1)
    scripts.fail(broker.scripts, r, scripts.acquire(broker.scripts, r, t1, "w", LEASE_MS), "w", "", 0, release=True)
    scripts.acquire(broker.scripts, r, t1, "w", 30)
    time.sleep(0.08)
    reap_once(broker, audit_grace_ms=0)  # its lease lapsed: lost (free), queued again
    scripts.acquire(broker.scripts, r, t2, "w", LEASE_MS)
    broker.cancel(job)
    assert sorted(runs(broker, job)) == [
        (0, 1, "w", "primary", "failed", "script"),
        (1, 1, "w", "primary", "handed back", None),
        (1, 1, "w", "primary", "lost", "lost"),
        (2, 1, "w", "primary", "cancelled", None),
    ]


@pytest.mark.core
def test_backups_show_as_backups_superseded_failed_or_promoted(broker: Broker, r: redis.Redis):
    job, (t0, t1, t2), (p0, p1, p2) = started(broker, r, n=3)
    b0, b1, b2 = backup(broker, r, t0), backup(broker, r, t1, "fast2", 9.0), backup(broker, r, t2, "fast3", 9.0)
    assert isinstance(b0, scripts.Lease) and isinstance(b1, scripts.Lease) and isinstance(b2, scripts.Lease)
    hold(r, "slow", t0)
    hold(r, "fast", t0)
    live = {(a.index, a.worker, a.copy, a.outcome) for a in broker.attempts(job)}
    assert {(0, "slow", "primary", "running"), (0, "fast", "backup", "running")} <= live
    scripts.complete(broker.scripts, r, b0, "fast", "1", 0.1)  # the backup wins task 0
    scripts.fail(broker.scripts, r, b1, "fast2", "killed", 0.1)  # task 1's backup fails; its primary runs on
    scripts.complete(broker.scripts, r, p1, "slow", "1", 0.1)
    scripts.fail(broker.scripts, r, p2, "slow", "exit code 1", 0.1)  # task 2's primary fails: backup promoted
    scripts.complete(broker.scripts, r, b2, "fast3", "1", 0.1)
    assert sorted(runs(broker, job)) == [
        (0, 1, "fast", "backup", "done", None),
        (0, 1, "slow", "primary", "superseded", None),
        (1, 1, "fast2", "backup", "failed", "script"),
        (1, 1, "slow", "primary", "done", None),
        (2, 1, "fast3", "backup", "done", None),
        (2, 1, "slow", "primary", "failed", "script"),
    ]
    promoted = next(a for a in broker.attempts(job) if a.worker == "fast3")
    failed = next(a for a in broker.attempts(job) if a.index == 2 and a.worker == "slow")
    assert promoted.started_at and failed.started_at and promoted.started_at >= failed.started_at


@pytest.mark.core
def test_a_primary_that_wins_supersedes_its_running_backup_and_the_backup_s_result_is_refused(
    broker: Broker, r: redis.Redis
):
    job, (t0, t1), (p0, p1) = started(broker, r, n=2)
    b0 = backup(broker, r, t0)
    assert isinstance(b0, scripts.Lease)
    assert scripts.complete(broker.scripts, r, p0, "slow", "1", 0.1, score=1.0).accepted  # the primary wins
    assert scripts.complete(broker.scripts, r, p1, "slow", "2", 0.2, score=1.0).accepted  # one without a backup
    assert not scripts.complete(broker.scripts, r, b0, "fast", "9", 0.1).accepted
    assert sorted(runs(broker, job)) == [
        (0, 1, "fast", "backup", "superseded", None),
        (0, 1, "slow", "primary", "done", None),
        (1, 1, "slow", "primary", "done", None),
    ]
    assert r.hmget(keys.task(t0), "backup", "backup_worker", "result") == ["", "", "1"]
    assert float(r.hget(keys.job(job), "unit_n")) == 2  # both taught the job its seconds per unit


@pytest.mark.core
def test_the_api_returns_the_record_and_it_goes_with_the_job(broker: Broker, r: redis.Redis, env):
    job, (tid,) = submit(broker)
    scripts.complete(broker.scripts, r, scripts.acquire(broker.scripts, r, tid, "w", LEASE_MS), "w", "1", 0.1)
    r.xadd(keys.job_attempts(job), {"index": "x", "outcome": "<script>"})  # what a credential could write
    with gpumesh.connect() as mesh:
        (a,) = mesh.job(job).attempts()
    assert isinstance(a, gpumesh.Attempt) and (a.task_id, a.outcome) == (tid, "done")
    delete_job(r, job, keys.JOBS)
    assert not r.exists(keys.job_attempts(job))


@pytest.mark.core
def test_a_backup_that_is_not_promoted_is_recorded_too(broker: Broker, r: redis.Redis):
    """The primary refused for good (a bad signature, say) while its backup runs, or failing after the
    backup's lease lapsed: the backup's bar is there, cancelled or lost."""
    job, (t0, t1), (p0, p1) = started(broker, r, n=2)
    assert isinstance(backup(broker, r, t0), scripts.Lease) and isinstance(
        backup(broker, r, t1, "fast2"), scripts.Lease
    )
    scripts.fail(broker.scripts, r, p0, "slow", "bad signature", 0.1, reject=True)
    r.hset(keys.task(t1), "backup_until", 1)  # its backup's lease lapsed long ago
    scripts.fail(broker.scripts, r, p1, "slow", "exit code 1", 0.1)
    assert sorted(runs(broker, job)) == [
        (0, 1, "fast", "backup", "cancelled", None),
        (0, 1, "slow", "primary", "failed", "script"),
        (1, 1, "fast2", "backup", "lost", "lost"),
        (1, 1, "slow", "primary", "failed", "script"),  # a script error is not retried by default
    ]


@pytest.mark.security
def test_a_worker_credential_s_transitions_write_the_record(broker: Broker, r: redis.Redis, redis_server):
    """Scripts run with their caller's ACL: the worker role may append to a job's record of attempts (a
    denied XADD would drop every entry without a word, since the scripts write it with pcall)."""
    from gpumesh.server.broker_server import ROLES, prepare

    r.execute_command("ACL", "SETUSER", "w-att", "reset", "on", ">pw", *ROLES["worker"])
    prepare(r)
    worker = redis.Redis(port=redis_server.port, username="w-att", password="pw", decode_responses=True)
    job, (tid,) = submit(broker)
    as_worker = scripts.Scripts(worker)
    lease = scripts.acquire(as_worker, worker, tid, "w", LEASE_MS)
    assert isinstance(lease, scripts.Lease)
    assert scripts.complete(as_worker, worker, lease, "w", "1", 0.1).accepted
    assert runs(broker, job) == [(0, 1, "w", "primary", "done", None)]
    worker.close()
