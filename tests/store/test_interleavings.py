"""Model-based test: random interleavings of dispatch/acquire/heartbeat/complete/fail/reap/cancel/retry,
backup copies (speculate), and workers joining and leaving, over two jobs of different priorities with
requirements, against a real Redis, with the invariants checked after every step (hypothesis stateful
testing).

What it checks besides the counters: every task ends exactly once (one accepted result, terminal
states stay terminal), a dispatch never hands a worker a task whose requirements it does not meet or
a lower priority while higher-priority work it may run waits, and a dispatch that finds nothing
means there is nothing queued that this live worker may run (no runnable task waits past one pop).
"""

from __future__ import annotations

import json

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from gpumesh import requirements
from gpumesh.models import JobOptions
from gpumesh.settings import Settings
from gpumesh.store import keys, scripts
from gpumesh.store.broker import Broker
from gpumesh.store.reaper import reap_once

pytestmark = pytest.mark.faults

FREE_LOST = 3  # _lib.lua's FREE_LOST
MAX_ATTEMPTS = 2
STATES = ("queued", "running", "done", "failed", "cancelled")
TERMINAL = ("done", "failed", "cancelled")
# Workers of the model: score and resources. s* are strong enough to back up w* (speculation needs 2x).
WORKERS = {
    "w1": (1.0, {"device": "cpu"}),
    "w2": (1.0, {"device": "cuda", "gpu": "NVIDIA A100", "vram_gb": 80}),
    "s1": (10.0, {"device": "cuda", "gpu": "NVIDIA H200", "vram_gb": 141}),
    "s2": (10.0, {"device": "cpu"}),
}
# Job 0: two plain tasks of different cost. Job 1: one task that needs a GPU with 40 GB, one an A100.
PAYLOADS = [
    [{"i": 0, "cost": 1}, {"i": 1, "cost": 5}],
    [{"i": 0, "requires": ["vram_gb>=40"]}, {"i": 1, "cost": 3, "requires": ["gpu~a100"]}],
]


class Mesh(RuleBasedStateMachine):
    leases = Bundle("leases")

    def __init__(self, url: str) -> None:
        super().__init__()
        self.b = Broker(Settings(url=url))
        self.r: redis.Redis = self.b.r
        self.r.flushall()
        self.epoch = self.b.epoch()
        self.joined: set[str] = set()

    @initialize(priorities=st.tuples(st.integers(0, 1), st.integers(0, 1)))
    def submit(self, priorities: tuple[int, int]) -> None:
        self.jobs = []
        self.priority: dict[str, int] = {}
        self.requires: dict[str, tuple[requirements.Requirement, ...]] = {}
        for payloads, prio in zip(PAYLOADS, priorities):
            opts = JobOptions(max_attempts=MAX_ATTEMPTS, speculate=True, priority=prio)
            job = self.b.submit("print('{}')", "t.py", payloads, opts).job_id
            self.jobs.append(job)
            for i, p in enumerate(payloads):
                tid = keys.task_id(job, i)
                self.priority[tid] = prio
                self.requires[tid] = requirements.parse_all(p.get("requires", []))
        self.tids = list(self.priority)
        self.accepted: dict[str, list[str]] = {t: [] for t in self.tids}
        self.last_attempts = {t: 0 for t in self.tids}
        self.last_status = {t: "queued" for t in self.tids}

    def teardown(self) -> None:
        self.b.close()

    # -- the fleet -------------------------------------------------------------------------------

    @rule(worker=st.sampled_from(sorted(WORKERS)))
    def join(self, worker: str) -> None:
        score, resources = WORKERS[worker]
        with self.r.pipeline(transaction=True) as p:
            p.hset(keys.worker(worker), mapping={"resources": json.dumps(resources), "score": score})
            p.zadd(keys.SCORES, {worker: score})
            p.zadd(keys.WORKERS, {worker: self.b.server_ms()})
            p.hset(keys.FLEET, "dirty", 1)
            p.execute()
        self.joined.add(worker)

    @rule(worker=st.sampled_from(sorted(WORKERS)))
    def leave(self, worker: str) -> None:
        """The worker is gone (stopped or died): out of the fleet; its leases lapse."""
        with self.r.pipeline(transaction=True) as p:
            p.delete(keys.worker(worker))
            p.zrem(keys.SCORES, worker)
            p.zrem(keys.WORKERS, worker)
            p.srem(keys.IDLE, worker)
            p.hset(keys.FLEET, "dirty", 1)
            p.execute()
        self.joined.discard(worker)
        for tid in self.tids:
            if self.r.hget(keys.task(tid), "worker") == worker:
                self.r.delete(keys.lease(tid))
                self.r.zadd(keys.LEASES, {tid: 0}, xx=True)

    def may_run(self, worker: str, tid: str) -> bool:
        return requirements.meets_all(self.requires[tid], WORKERS[worker][1])

    def queued(self) -> list[str]:
        return [t for t in self.tids if self.r.hget(keys.task(t), "status") == "queued"]

    # -- transitions -----------------------------------------------------------------------------

    @rule(target=leases, worker=st.sampled_from(sorted(WORKERS)))
    def dispatch(self, worker: str):
        if worker not in self.joined:
            return multiple()
        runnable = [t for t in self.queued() if self.may_run(worker, t)]
        got = scripts.dispatch(self.b.scripts, self.r, worker, 60_000, WORKERS[worker][0])
        if isinstance(got, str):
            assert runnable == [], f"{worker} found nothing while it may run {runnable}"
            assert self.r.sismember(keys.IDLE, worker)
            return multiple()
        tid = got.task_id
        assert tid in runnable, f"{worker} got {tid}, which it may not run or which was not queued"
        assert self.priority[tid] == max(self.priority[t] for t in runnable), "a higher priority waited"
        assert not self.r.sismember(keys.IDLE, worker)
        return (worker, got)

    @rule(target=leases, i=st.integers(0, 3), worker=st.sampled_from(sorted(WORKERS)))
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
        return status == "running" and scripts.token_digest(lease.token) in (token, backup)

    @rule(target=leases, i=st.integers(0, 3), worker=st.sampled_from(["s1", "s2"]), straggler=st.booleans())
    def speculate(self, i: int, worker: str, straggler: bool):
        if worker not in self.joined:
            return multiple()
        tid = self.tids[i]
        mode = "straggler" if straggler else "idle"
        got = scripts.speculate(self.b.scripts, self.r, tid, worker, 60_000, 10.0, 2.0, mode)
        if isinstance(got, str):
            return multiple()
        task = self.r.hgetall(keys.task(tid))
        assert task["status"] == "running" and task["backup"] == scripts.token_digest(got.token)
        assert task["lease"] != task["backup"]
        assert self.may_run(worker, tid), "a backup copy runs only where the task may run"
        if not straggler:
            assert int(self.r.hget(keys.job(keys.job_of_task(tid)), "queued")) == 0
        return (worker, got)

    @rule(held=consumes(leases), value=st.integers(0, 9))
    def complete(self, held, value):
        worker, lease = held
        holds = self.holds(lease)
        out = scripts.complete(self.b.scripts, self.r, lease, worker, json.dumps(value), 0.1, WORKERS[worker][0])
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

    @rule(i=st.integers(0, 3))
    def lease_lapses(self, i):
        self.r.delete(keys.lease(self.tids[i]))
        self.r.zadd(keys.LEASES, {self.tids[i]: 0}, xx=True)

    @rule()
    def reap(self):
        reap_once(self.b, audit_grace_ms=0)

    @rule(i=st.integers(0, 3))
    def cancel(self, i):
        scripts.cancel(self.b.scripts, self.r, self.tids[i])

    @rule(i=st.integers(0, 3))
    def retry(self, i):
        tid = self.tids[i]
        if int(scripts.retry(self.b.scripts, self.r, tid)[0]) == 1:
            assert self.last_status[tid] == "failed"
            self.last_status[tid] = "queued"  # the one way out of a terminal state: a retry of a failed task
            self.last_attempts[tid] = 0

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def every_task_in_exactly_one_state_and_counters_agree(self):
        for job in self.jobs:
            tids = [t for t in self.tids if keys.job_of_task(t) == job]
            tasks = [self.r.hgetall(keys.task(t)) for t in tids]
            h = self.r.hgetall(keys.job(job))
            for state in STATES:
                assert int(h[state]) == sum(1 for t in tasks if t["status"] == state), (state, h, tasks)
            open_tasks = int(h["queued"]) + int(h["running"])
            assert (h["status"] in TERMINAL) == (open_tasks == 0)
            for tid, t in zip(tids, tasks):
                assert (t["status"] == "running") == bool(t.get("lease")), t
                assert not t.get("backup") or (t["status"] == "running" and t["backup"] != t["lease"]), t
                assert (t["status"] == "running") == (self.r.zscore(keys.LEASES, tid) is not None)

    @invariant()
    def a_task_is_pending_exactly_while_it_is_queued(self):
        for tid in self.tids:
            job, index = keys.job_of_task(tid), int(tid.rsplit("-", 1)[1])
            t = self.r.hgetall(keys.task(tid))
            klass = int(t.get("class", 0))
            pending = self.r.zscore(keys.pending(job, klass), keys.pending_member(index)) is not None
            assert pending == (t["status"] == "queued"), (tid, t)
            if pending:  # and dispatch can find it: its class is in the ready index at the job's priority
                assert self.r.zscore(keys.READY, keys.ready_member(job, klass)) == self.priority[tid]

    @invariant()
    def terminal_states_stay_terminal_and_attempts_stay_in_bounds(self):
        for tid in self.tids:
            status, attempts, lost = self.r.hmget(keys.task(tid), "status", "attempts", "lost")
            if self.last_status[tid] in TERMINAL:
                assert status == self.last_status[tid], f"{tid} left {self.last_status[tid]} for {status}"
            self.last_status[tid] = status
            n = int(attempts or 0)  # every run; up to 3 lapsed leases (lost) do not spend an attempt
            assert 0 <= n - min(int(lost or 0), FREE_LOST) <= MAX_ATTEMPTS and n <= MAX_ATTEMPTS + FREE_LOST
            assert n >= self.last_attempts[tid] - 1  # a release refunds the attempt it was on
            self.last_attempts[tid] = n

    @invariant()
    def at_most_one_accepted_result(self):
        for tid in self.tids:
            task = self.r.hgetall(keys.task(tid))
            assert len(self.accepted[tid]) <= 1
            if task["status"] == "done":
                assert self.accepted[tid] == [task["result"]]


# 200 random interleavings of 40 steps, each step checking every invariant against Redis: about 95 s on
# this 2-core machine alone, so pytest's 120 s default is too tight under load. Not a speed check.
@pytest.mark.timeout(400)
def test_state_machine_invariants_hold_in_random_interleavings(redis_server, r):
    run_state_machine_as_test(
        lambda: Mesh(redis_server.url),
        settings=settings(
            max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
        ),
    )
