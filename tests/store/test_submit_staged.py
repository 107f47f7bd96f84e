"""A large job is written in stages (tasks in chunks, one visibility flip), never all in one MULTI.

The thresholds are lowered here so a 30-task job takes the staged path; the code is the same that
writes a 100,000-shard job (benchmarks/submit.py measures that)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import redis

from gpumesh.models import JobOptions
from gpumesh.store import keys, reaper, scripts
from gpumesh.store import submit as submit_module
from gpumesh.store.broker import Broker

N = 30
SCRIPT = "import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n"


@pytest.fixture(autouse=True)
def small_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(submit_module, "STAGE_ABOVE", 10)
    monkeypatch.setattr(submit_module, "STAGE_CHUNK", 7)


def pending(r: redis.Redis) -> int:
    """Queued tasks a dispatch could take: in the pending zset of a job that is in the ready index."""
    return sum(r.zcard(keys.pending(*m.rsplit("/", 1))) for m in r.zrange(keys.READY, 0, -1))


def rq_jobs(r: redis.Redis) -> int:
    return len(r.keys("rq:job:*"))


def payloads() -> list[dict]:
    return [{"i": i, "cost": 1 + i % 3} for i in range(N)]


@pytest.mark.core
def test_a_staged_job_is_whole_in_order_and_pending_by_cost(broker: Broker, r: redis.Redis, monkeypatch):
    res = broker.submit(SCRIPT, "t.py", payloads(), JobOptions())
    st = broker.job_status(res.job_id)
    assert st.tasks.total == N and st.tasks.queued == N
    assert broker.task_ids(res.job_id) == [keys.task_id(res.job_id, i) for i in range(N)]
    assert pending(r) == N and rq_jobs(r) == 0, "no RQ job exists before a worker takes a task"
    # across chunks, one pending zset ordered by cost, payload order among equal costs
    members = r.zrange(keys.pending(res.job_id, 0), 0, -1, withscores=True)
    assert [cost for _m, cost in members] == sorted(1 + i % 3 for i in range(N))
    assert [int(m) for m, cost in members if cost == 1] == list(range(0, N, 3))
    first = scripts.acquire(broker.scripts, r, keys.task_id(res.job_id, 2), "w", 30_000)
    assert not isinstance(first, str) and first.payload == '{"i": 2, "cost": 3}'
    monkeypatch.setattr(reaper, "ABANDONED_STAGING_MS", 0)
    assert reaper.reap_once(broker)["jobs_pruned"] == 0, "a visible job's claim is dropped, the job kept"
    assert r.zcard(keys.STAGING) == 0 and broker.job_status(res.job_id).tasks.total == N


@pytest.mark.faults
def test_a_submitter_dying_while_staging_leaves_no_visible_job_and_the_reaper_clears_it(
    broker: Broker, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
):
    def die(*_a, **_k):
        raise ConnectionError("the submitter died")

    monkeypatch.setattr(submit_module.Submitter, "_make_visible", staticmethod(die))  # Broker submits through it
    with pytest.raises(ConnectionError):
        broker.submit(SCRIPT, "t.py", payloads(), JobOptions())
    assert r.zcard(keys.JOBS) == 0 and pending(r) == 0 and r.zcard(keys.READY) == 0
    assert broker.jobs() == []
    assert r.zcard(keys.STAGING) == 1 and r.dbsize() > N
    assert reaper.reap_once(broker)["jobs_pruned"] == 0, "a submit still staging is left alone"
    monkeypatch.setattr(reaper, "ABANDONED_STAGING_MS", 0)
    assert reaper.reap_once(broker)["jobs_pruned"] == 1
    assert not r.keys("gpumesh:task:*") and not r.keys("gpumesh:job:*") and r.zcard(keys.STAGING) == 0


@pytest.mark.core
def test_a_staged_job_is_dispatched_like_any_other(broker: Broker, r: redis.Redis):
    res = broker.submit(SCRIPT, "t.py", payloads(), JobOptions())
    r.zadd(keys.SCORES, {"w": 1.0})
    taken = []
    while isinstance(lease := scripts.dispatch(broker.scripts, r, "w", 30_000, 1.0), scripts.Lease):
        taken.append(lease.index)
    assert sorted(taken) == list(range(N)), "every staged task is takeable exactly once"
    assert broker.job_status(res.job_id).tasks.running == N and r.zcard(keys.READY) == 0


@pytest.mark.core
def test_concurrent_staged_submits_with_one_idempotency_key_make_one_job(broker: Broker, r: redis.Redis, env):
    results: list[str] = []

    def submit() -> None:
        b = Broker(broker.settings)
        results.append(b.submit(SCRIPT, "t.py", payloads(), JobOptions(), idempotency_key="nightly-7").job_id)
        b.close()

    threads = [threading.Thread(target=submit) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 4 and len(set(results)) == 1
    assert r.zcard(keys.JOBS) == 1 and pending(r) == N and r.llen(keys.job_tasks(results[0])) == N


@pytest.mark.faults
def test_a_retry_after_a_submitter_died_while_staging_takes_the_job_over_at_once(
    broker: Broker, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
):
    # The first version made the retry wait 120 s and exit 3 ("still writing") for the hour the dead
    # submitter's claim lived. A claim that makes no progress is stale within STAGING_STALE_MS.
    def die(*_a, **_k):
        raise ConnectionError("the submitter died")

    with monkeypatch.context() as m:
        m.setattr(submit_module.Submitter, "_make_visible", staticmethod(die))
        with pytest.raises(ConnectionError):
            broker.submit(SCRIPT, "t.py", payloads(), JobOptions(), idempotency_key="nightly-8")
    assert r.zcard(keys.STAGING) == 1 and broker.jobs() == []
    monkeypatch.setattr(submit_module, "STAGING_STALE_MS", 50)
    time.sleep(0.1)  # the dead submitter's claim is now older than the stale bound
    t0 = time.monotonic()
    res = broker.submit(SCRIPT, "t.py", payloads(), JobOptions(), idempotency_key="nightly-8")
    assert time.monotonic() - t0 < 10
    st = broker.job_status(res.job_id)
    assert st.tasks.total == N and st.tasks.queued == N and pending(r) == N
    assert [j.job_id for j in broker.jobs()] == [res.job_id], "one job, whole"
    again = broker.submit(SCRIPT, "t.py", payloads(), JobOptions(), idempotency_key="nightly-8")
    assert again.job_id == res.job_id and len(broker.jobs()) == 1


@pytest.mark.core
@pytest.mark.parametrize("path", ["staged", "one-multi", "chunks-by-bytes"])
def test_every_task_keeps_its_exact_payload_cost_and_requirement_class(
    broker: Broker, r: redis.Redis, monkeypatch: pytest.MonkeyPatch, path: str
):
    if path == "one-multi":
        monkeypatch.setattr(submit_module, "STAGE_ABOVE", 1000)
    if path == "chunks-by-bytes":  # a chunk also ends at a size: one, two or three payloads a call here
        monkeypatch.setattr(submit_module, "STAGE_BYTES", 100)
    odd = {"text": 'é\nline two\t"quoted" \\ 日本', "x": 0.1 + 0.2, "big": 10**30, "none": None}
    loads = [
        {"i": i, **(odd if i % 4 == 0 else {}), **({"cost": 2.5} if i % 3 == 1 else {"cost": 1.0} if i % 3 == 2 else {}),
         **({"requires": ["vram_gb>=40"]} if i % 5 == 0 else {})}
        for i in range(N)
    ]  # fmt: skip
    res = broker.submit(SCRIPT, "t.py", loads, JobOptions(requires=("device=cpu",)))
    for i, payload in enumerate(loads):
        task = r.hgetall(keys.task(keys.task_id(res.job_id, i)))
        assert json.loads(task["payload"]) == payload and task["payload"] == json.dumps(payload)
        assert task["index"] == str(i) and task["status"] == "queued"
        assert task.get("cost") == ("2.5" if i % 3 == 1 else None)  # a default cost is not written
        assert task.get("class") == ("1" if i % 5 == 0 else None)  # nor the job's own class
    by_class = {k: r.zrange(keys.pending(res.job_id, k), 0, -1, withscores=True) for k in (0, 1)}
    assert sorted(int(m) for m, _ in by_class[1]) == list(range(0, N, 5))
    assert sorted(int(m) for m, _ in by_class[0]) == [i for i in range(N) if i % 5]
    assert all(cost == (2.5 if int(m) % 3 == 1 else 1.0) for k in (0, 1) for m, cost in by_class[k])
    assert broker.task_ids(res.job_id) == [keys.task_id(res.job_id, i) for i in range(N)]


@pytest.mark.core
def test_a_chunk_whose_lists_disagree_writes_nothing(broker: Broker, r: redis.Redis):
    with pytest.raises(redis.ResponseError, match="2 payloads but 1 costs"):
        scripts.stage(broker.scripts, r, "jobx", 0, ['{"a": 1}', '{"a": 2}'], [2.0], [0, 0])
    assert r.keys("gpumesh:task:jobx-*") == [] and r.llen(keys.job_tasks("jobx")) == 0
