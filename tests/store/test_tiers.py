"""Tiers in RQ's view: a worker's tier is computed from the registered fleet as it asks, its deliveries go
through its tier's queue `gpumesh-tier-<k>`, and the tasks placed for each tier wait there (a window), where
rq-dashboard and `rq info` count and list them. Placement itself is test_dispatch.py's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from rq import Queue
from rq.serializers import JSONSerializer

from gpumesh import scheduling
from gpumesh._version import PROTOCOL
from gpumesh.models import JobOptions
from gpumesh.store import keys, protocols, scripts
from gpumesh.store.broker import EXECUTOR, Broker
from gpumesh.store.reaper import reap_once

from ..conftest import Workers, gpumesh, wait_until
from .test_dispatch import register, sleep_script, submit, wait_done


def take(broker: Broker, r: redis.Redis, worker: str, score: float, tiers: int = 3) -> scripts.Lease | str:
    return scripts.dispatch(broker.scripts, r, worker, 60_000, score, tiers=tiers)


def waiting(r: redis.Redis, tier: int) -> list[str]:
    return r.lrange("rq:queue:" + keys.tier_queue(tier), 0, -1)


def next_window(r: redis.Redis) -> None:
    """Let the next dispatch of any tier refresh its window (at most one refresh a second per tier)."""
    r.hdel(keys.FLEET, *[f"at:{k}" for k in range(3)])


@pytest.mark.core
def test_a_worker_s_tier_is_its_rank_in_the_fleet_as_it_asks_as_workers_shows_it(broker: Broker, r: redis.Redis):
    """The dispatcher's tier (Lua) and the one `gpumesh workers` shows (Python) are one rule, computed as the
    worker asks: a stronger worker that registers moves the others down at once."""
    broker.submit("print(1)", "t.py", [{"i": i} for i in range(20)], JobOptions())
    register(r, "a", 2.0)
    alone = take(broker, r, "a", 2.0)
    assert isinstance(alone, scripts.Lease) and alone.tier == 2, "a lone worker serves the top tier"
    for w, s in (("b", 4.0), ("c", 8.0), ("d", 1.0), ("e", 8.0)):
        register(r, w, s)
    expected = scheduling.worker_tiers({"a": 2.0, "b": 4.0, "c": 8.0, "d": 1.0, "e": 8.0}, 3)
    assert expected == {"d": 0, "a": 1, "b": 1, "c": 2, "e": 2}
    for w, s in (("a", 2.0), ("b", 4.0), ("c", 8.0), ("d", 1.0), ("e", 8.0)):
        got = take(broker, r, w, s)
        assert isinstance(got, scripts.Lease) and got.tier == expected[w], (w, got)
    for n in range(1, 9):  # the rounding agrees for every fleet size and tier count
        scores = {f"w{i}": float(i) for i in range(n)}
        for k in (1, 2, 3, 5):
            r.delete(keys.SCORES)
            r.zadd(keys.SCORES, scores)
            r.hset(keys.FLEET, "dirty", 1)
            lua = {w: scripts.dispatch(broker.scripts, r, w, 60_000, s, tiers=k) for w, s in scores.items()}
            assert {w: g.tier for w, g in lua.items() if isinstance(g, scripts.Lease)} == {
                w: t for w, t in scheduling.worker_tiers(scores, k).items() if isinstance(lua[w], scripts.Lease)
            }


@pytest.mark.core
def test_the_tasks_placed_for_a_tier_wait_in_its_rq_queue_and_leave_it_when_taken(broker: Broker, r: redis.Redis):
    """What rq-dashboard lists: each tier's next tasks, as RQ jobs RQ reads (the executor's name, the task's id
    and a description that says what the window is); a task taken or cancelled leaves it."""
    costs = [1, 16, 2, 8, 4] + [1] * 30
    job = broker.submit("print(1)", "t.py", [{"cost": c} for c in costs], JobOptions(name="sweep")).job_id
    register(r, "weak", 1.0)
    lone = take(broker, r, "weak", 1.0)
    assert isinstance(lone, scripts.Lease) and lone.tier == 2
    top = Queue(keys.tier_queue(2), connection=broker.rq, serializer=JSONSerializer)
    assert top.count == 20, "a lone worker's window: its next 20 tasks, lightest first"
    jobs = top.get_jobs()
    assert len(jobs) == 20 and all(j.func_name == EXECUTOR and j.get_status() == "queued" for j in jobs)
    first = jobs[0]
    assert first.id == keys.rq_waiting_id(first.args[0]) and costs[int(first.args[0].rsplit("-", 1)[1])] == 1
    assert 'of job "sweep"' in (first.description or "") and "placed for tier 2" in (first.description or "")
    assert "next 20 at most" in (first.description or "") and first.meta["waiting"] is True
    assert keys.tier_queue(2) in {q.name for q in Queue.all(connection=broker.rq)}
    register(r, "strong", 8.0)  # the fleet changes: weak is tier 0 now, strong tier 2
    next_window(r)
    strong = take(broker, r, "strong", 8.0)
    assert isinstance(strong, scripts.Lease) and strong.tier == 2 and costs[strong.index] == 16
    heavy_first = [keys.task_id(job, i) for i in (3, 4)]  # within its horizon, heaviest first: 8, then 4
    assert [keys.rq_waiting_id(t) for t in heavy_first] == waiting(r, 2)[:2], waiting(r, 2)
    weak = take(broker, r, "weak", 1.0)
    assert isinstance(weak, scripts.Lease) and weak.tier == 0
    assert keys.rq_waiting_id(weak.task_id) not in waiting(r, 0) + waiting(r, 2), "taken: out of every window"
    weak_next = [int(e.split("_")[0].rsplit("-", 1)[1]) for e in waiting(r, 0)]
    assert weak_next and max(costs[i] for i in weak_next) < 8, (
        "the heaviest cost left to the strongest, as dispatch does"
    )
    assert not r.exists("rq:job:" + keys.rq_waiting_id(weak.task_id))
    listed = {e for t in range(3) for e in waiting(r, t)}
    marked = {
        keys.rq_waiting_id(keys.task_id(job, i))
        for i in range(len(costs))
        if r.hget(keys.task(keys.task_id(job, i)), "tier")
    }
    assert listed == marked, "a task is marked placed exactly while its entry waits"
    broker.cancel(job)
    assert [waiting(r, t) for t in range(3)] == [[], [], []], "cancelled: no window lists its tasks"
    assert not r.keys("rq:job:*_waiting")


@pytest.mark.core
def test_tasks_a_previous_protocol_worker_takes_leave_the_window_at_the_next_reaper_pass(
    broker: Broker, r: redis.Redis
):
    """A worker one protocol behind takes tasks through its own dispatch, which knows no windows: what it ran
    stayed listed as waiting in the tier's queue (rq-dashboard, `gpumesh workers`) after its job had ended."""
    old = protocols.frozen(PROTOCOL - 1)
    assert old is not None
    r.function_load(old.code, replace=True)
    job = broker.submit("print(1)", "t.py", [{"i": i} for i in range(5)], JobOptions()).job_id
    register(r, "new", 2.0)
    register(r, "old", 2.0)
    first = take(broker, r, "new", 2.0)
    assert isinstance(first, scripts.Lease) and len(waiting(r, first.tier)) == 4
    fleet = [keys.READY, keys.SCORES, keys.FLEET, keys.worker("old"), keys.LEASES, keys.EVENTS, keys.IDLE]
    for _ in range(4):
        got = r.fcall(f"{old.name}_dispatch", len(fleet), *fleet, "old", 60_000, 2.0, f"token-{_}")
        assert got[0] == 1, got
    assert r.hget(keys.job(job), "queued") == "0"
    assert len(waiting(r, first.tier)) == 4, "the previous protocol's dispatch leaves the window as it was"
    reap_once(broker)
    assert [waiting(r, t) for t in range(3)] == [[], [], []]
    assert not r.keys("rq:job:*_waiting")
    assert not any(r.hget(keys.task(keys.task_id(job, i)), "tier") for i in range(5))


@pytest.mark.core
def test_a_refresh_time_ahead_of_now_does_not_freeze_a_tier_s_window(broker: Broker, r: redis.Redis):
    """Any worker credential writes the windows' refresh times (the fleet hash's at:<tier>): one far ahead of
    the broker's clock kept the window from ever being refreshed again."""
    broker.submit("print(1)", "t.py", [{"i": i} for i in range(5)], JobOptions())
    register(r, "a", 2.0)
    r.hset(keys.FLEET, "at:2", str(10**15))
    first = take(broker, r, "a", 2.0)
    assert isinstance(first, scripts.Lease) and first.tier == 2
    assert len(waiting(r, 2)) == 4


@pytest.mark.core
def test_a_task_only_another_worker_may_run_never_holds_up_a_worker_of_its_tier(broker: Broker, r: redis.Redis):
    """A requirements task placed for the tier waits in its queue; a worker of the same tier that does not
    meet it takes other work at once: workers are never given the head of a tier queue, only what the
    dispatcher chose for them."""
    register(r, "a100", 4.0, gpu="A100")
    register(r, "plain", 4.0)
    register(r, "laptop", 1.0)  # two tiers: the laptop in tier 0, the two others in tier 1
    big = broker.submit("print(1)", "t.py", [{"i": i} for i in range(5)], JobOptions(requires=("gpu=A100",)))
    first = take(broker, r, "a100", 4.0, tiers=2)
    assert isinstance(first, scripts.Lease) and first.job_id == big.job_id
    ahead = waiting(r, first.tier)
    assert ahead and all(e.startswith(big.job_id) for e in ahead), "the A100 tasks wait in the tier's queue"
    small = broker.submit("print(1)", "t.py", [{"i": 0}], JobOptions())
    plain = take(broker, r, "plain", 4.0, tiers=2)
    assert isinstance(plain, scripts.Lease) and plain.job_id == small.job_id
    assert plain.tier == first.tier == 1 and waiting(r, 1)[: len(ahead)] == ahead, "nothing was popped"


@pytest.mark.core
def test_each_tier_s_whole_backlog_is_shown_beside_its_window(broker: Broker, r: redis.Redis):
    """What `gpumesh workers` and `top` print under the workers: per tier its queue, its workers, the tasks
    waiting in its queue (20 at most) and its share of every queued task (the whole backlog)."""
    costs = [8.0] * 10 + [1.0] * 90
    broker.submit("print(1)", "t.py", [{"cost": c} for c in costs], JobOptions())
    register(r, "laptop", 1.0)
    register(r, "server", 8.0)
    assert isinstance(take(broker, r, "server", 8.0), scripts.Lease)
    assert isinstance(take(broker, r, "laptop", 1.0), scripts.Lease)
    tiers = broker.tiers()
    assert [(t.tier, t.queue, t.workers) for t in tiers] == [
        (0, "gpumesh-tier-0", ["laptop"]), (1, "gpumesh-tier-1", []), (2, "gpumesh-tier-2", ["server"])
    ]  # fmt: skip
    # each served tier's window; the laptop took a light task the server's window listed last: out of it
    assert [t.waiting for t in tiers] == [20, 0, 19]
    assert sum(t.queued for t in tiers) == 98 and tiers[2].queued > tiers[0].queued / 10, tiers
    assert not any(t.estimated for t in tiers)
    sampled = broker.tiers(sample=10)
    assert all(t.estimated for t in sampled) and abs(sum(t.queued for t in sampled) - 98) <= 1


@pytest.mark.processes
def test_rq_info_shows_each_tier_s_waiting_tasks_and_which_workers_serve_it(
    env, workers: Workers, r: redis.Redis, tmp_path: Path
):
    """`rq info` against the broker during a job on a fleet of two: a queue per tier with the tasks that wait
    for it, and each worker listed under the tier queue it serves now."""
    workers.start("--warm", score=1)
    workers.start("--warm", score=8)
    wait_until(lambda: r.zcard(keys.WORKERS) == 2, what="both workers to register")
    job = submit(env, sleep_script(tmp_path), [{"sleep": 0.3, "cost": 1 + i % 4} for i in range(60)])
    info = wait_until(lambda: (out := rq_info(env)) and "gpumesh-tier-0" in out and "gpumesh-tier-2" in out
                      and out, what="rq info to list the tier queues")  # fmt: skip
    ids = r.zrange(keys.SCORES, 0, -1)  # weakest first: tier 0, then tier 2
    by_queue = rq_info(env, "--by-queue")
    assert f"gpumesh-tier-0: {ids[0]}" in by_queue and f"gpumesh-tier-2: {ids[1]}" in by_queue, by_queue
    depth = {t: r.llen("rq:queue:" + keys.tier_queue(t)) for t in (0, 2)}
    assert max(depth.values()) > 1, (info, depth)
    shown = gpumesh("workers", env=env).stdout
    assert "gpumesh-tier-0" in shown and "waiting in queue" in shown and "queued for it" in shown, shown
    assert wait_done(env, job)["status"] == "done"
    assert wait_until(lambda: all(not waiting(r, t) for t in range(3)), what="the windows to empty")


def rq_info(env: dict[str, str], *args: str) -> str:
    """`rq info` of RQ's own command line, once, against the test broker."""
    rq = Path(sys.executable).with_name("rq")
    out = subprocess.run(
        [str(rq), "info", "--url", env["GPUMESH_URL"], "--serializer", "rq.serializers.JSONSerializer", *args],
        capture_output=True, text=True, timeout=30, env={**os.environ, **env},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout
