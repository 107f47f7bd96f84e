"""Model-based test: random interleavings of acquire/heartbeat/complete/fail/reap/cancel, and backup
copies (speculate), against a real Redis, with the invariants checked after every step (hypothesis
stateful testing)."""

from __future__ import annotations

import json

import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from gpumesh import keys, scripts
from gpumesh.broker import Broker
from gpumesh.models import JobOptions
from gpumesh.reaper import reap_once
from gpumesh.settings import Settings

N_TASKS = 2
MAX_ATTEMPTS = 2
STATES = ("queued", "running", "done", "failed", "cancelled")


class Mesh(RuleBasedStateMachine):
    leases = Bundle("leases")

    def __init__(self, url: str) -> None:
        super().__init__()
        self.b = Broker(Settings(url=url))
        self.r: redis.Redis = self.b.r
        self.r.flushall()
        res = self.b.submit(
            "print('{}')", "t.py", [{"i": i} for i in range(N_TASKS)],
            JobOptions(max_attempts=MAX_ATTEMPTS, speculate=True),
        )  # fmt: skip
        self.r.zadd(keys.SCORES, {"w1": 1, "w2": 1, "w3": 1, "s1": 10, "s2": 10})
        self.job = res.job_id
        self.tids = [keys.task_id(self.job, i) for i in range(N_TASKS)]
        self.epoch = self.b.epoch()
        self.accepted: dict[str, list[str]] = {t: [] for t in self.tids}
        self.last_attempts = {t: 0 for t in self.tids}

    def teardown(self) -> None:
        self.b.close()

    @rule(target=leases, i=st.integers(0, N_TASKS - 1), worker=st.sampled_from(["w1", "w2", "w3"]))
    def acquire(self, i: int, worker: str):
        tid = self.tids[i]
        before = self.r.hget(keys.task(tid), "status")
        got = scripts.acquire(self.b.scripts, self.r, tid, worker, 60_000)
        if isinstance(got, str):
            assert before != "queued" and got == before
            return multiple()  # nothing to hold
        assert before == "queued"
        return (worker, got)

    def holds(self, lease: scripts.Lease) -> bool:
        status, token, backup = self.r.hmget(keys.task(lease.task_id), "status", "lease", "backup")
        return status == "running" and lease.token in (token, backup)

    @rule(target=leases, i=st.integers(0, N_TASKS - 1), worker=st.sampled_from(["s1", "s2"]))
    def speculate(self, i: int, worker: str):
        tid = self.tids[i]
        got = scripts.speculate(self.b.scripts, self.r, tid, worker, 60_000, 10.0, 2.0)
        if isinstance(got, str):
            return multiple()
        task = self.r.hgetall(keys.task(tid))
        assert task["status"] == "running" and task["backup"] == got.token and task["lease"] != got.token
        assert int(self.r.hget(keys.job(self.job), "queued")) == 0
        return (worker, got)

    @rule(held=consumes(leases), value=st.integers(0, 9))
    def complete(self, held, value):
        worker, lease = held
        holds = self.holds(lease)
        out = scripts.complete(self.b.scripts, self.r, lease, worker, json.dumps(value), 0.1)
        assert out.accepted == holds
        if out.accepted:
            self.accepted[lease.task_id].append(json.dumps(value))

    @rule(held=leases, release=st.booleans())
    def fail(self, held, release):
        worker, lease = held
        holds = self.holds(lease)
        out = scripts.fail(self.b.scripts, self.r, lease, worker, "boom", 0.1, release=release)
        assert out.accepted == holds

    @rule(held=leases)
    def heartbeat(self, held):
        worker, lease = held
        status = self.r.hget(keys.task(lease.task_id), "status")
        holds = self.holds(lease)
        beat = scripts.heartbeat(self.b.scripts, self.r, worker, 60_000, lease, 60_000, self.epoch)
        expected = "cancelled" if status == "cancelled" else ("ok" if holds else "lost")
        assert beat.lease == expected

    @rule(i=st.integers(0, N_TASKS - 1))
    def lease_lapses(self, i):
        self.r.delete(keys.lease(self.tids[i]))
        self.r.zadd(keys.LEASES, {self.tids[i]: 0}, xx=True)

    @rule()
    def reap(self):
        reap_once(self.b, audit_grace_ms=0)

    @rule(i=st.integers(0, N_TASKS - 1))
    def cancel(self, i):
        scripts.cancel(self.b.scripts, self.r, self.tids[i])

    @invariant()
    def every_task_in_exactly_one_state_and_counters_agree(self):
        tasks = [self.r.hgetall(keys.task(t)) for t in self.tids]
        job = self.r.hgetall(keys.job(self.job))
        for state in STATES:
            assert int(job[state]) == sum(1 for t in tasks if t["status"] == state), (state, job, tasks)
        assert all(t["status"] in STATES for t in tasks)
        open_tasks = int(job["queued"]) + int(job["running"])
        assert (job["status"] in ("done", "failed", "cancelled")) == (open_tasks == 0)
        for t in tasks:
            assert (t["status"] == "running") == bool(t.get("lease")), t
            assert not t.get("backup") or (t["status"] == "running" and t["backup"] != t["lease"]), t
            assert (t["status"] == "running") == (
                self.r.zscore(keys.LEASES, keys.task_id(self.job, int(t["index"]))) is not None
            )

    @invariant()
    def attempts_never_decrease_except_by_a_release_and_never_exceed_max(self):
        for tid in self.tids:
            attempts = int(self.r.hget(keys.task(tid), "attempts"))
            assert 0 <= attempts <= MAX_ATTEMPTS
            assert attempts >= self.last_attempts[tid] - 1  # a release refunds the attempt it was on
            self.last_attempts[tid] = attempts

    @invariant()
    def at_most_one_accepted_result(self):
        for tid in self.tids:
            task = self.r.hgetall(keys.task(tid))
            assert len(self.accepted[tid]) <= 1
            if task["status"] == "done":
                assert self.accepted[tid] == [task["result"]]


def test_state_machine_invariants_hold_in_random_interleavings(redis_server, r):
    run_state_machine_as_test(
        lambda: Mesh(redis_server.url),
        settings=settings(
            max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
        ),
    )
