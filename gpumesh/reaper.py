"""The reaper: one pass puts lapsed leases back in play, re-delivers lost deliveries and drops dead workers.

Safe to run from several processes at once (every change is a fenced Lua script or an idempotent
enqueue); workers take turns through a lock only to avoid doing the work twice.
"""

from __future__ import annotations

from rq.job import Job

from . import keys, scripts
from .broker import Broker
from .models import TERMINAL

ABANDONED_STAGING_MS = 3_600_000  # a staged job not made visible within an hour was abandoned by its submitter


def reap_once(b: Broker, audit_grace_ms: int | None = None, batch: int = 500) -> dict[str, int]:
    """One reaper pass. Safe to run concurrently (every change is a fenced script or idempotent):

    * leases that lapsed send their tasks back to queued (or failed at max attempts);
    * the audit re-enqueues queued tasks whose delivery was lost: never enqueued (a worker died
      between the state change and the enqueue) or popped by a worker that died before acquiring
      it (its tier queue is empty, yet the task waits). A duplicate delivery is harmless;
    * workers that stopped heartbeating leave the live sets;
    * finished jobs older than the retention (``GPUMESH_JOB_RETENTION``) are deleted with their tasks
      and logs, so a busy mesh does not fill a ``noeviction`` Redis; so are the staged tasks of a large
      submit whose submitter died before making its job visible.
    """
    now = b.server_ms()
    grace = int(b.settings.lease_ttl * 1000) if audit_grace_ms is None else audit_grace_ms
    report = {"requeued": 0, "failed": 0, "redelivered": 0, "workers_dropped": 0, "jobs_pruned": 0}
    deliveries: list[tuple[str, int, int]] = []
    expired = b.r.zrangebyscore(keys.LEASES, "-inf", now, start=0, num=batch)
    if expired:
        with b.r.pipeline(transaction=False) as p:
            for tid in expired:
                scripts.reap(b.scripts, p, tid)
            for tid, raw in zip(expired, p.execute()):
                out = scripts.reap_outcome(raw)
                if out.status == "queued":
                    deliveries.append((tid, out.tier, out.delivery))
                    report["requeued"] += 1
                elif out.status == "failed":
                    report["failed"] += 1
    b.deliver(deliveries)
    report["redelivered"] = _audit_queued(b, now - grace, now, batch)
    dead = b.r.zrangebyscore(keys.WORKERS, "-inf", now - b.settings.worker_ttl * 1000)
    if dead:
        with b.r.pipeline(transaction=True) as p:
            p.zrem(keys.WORKERS, *dead)
            p.zrem(keys.SCORES, *dead)
            p.execute()
        report["workers_dropped"] = len(dead)
    report["jobs_pruned"] = _prune(b, now) + _prune_abandoned_staging(b, now)
    return report


def _audit_queued(b: Broker, older_than_ms: int, now: int, batch: int) -> int:
    old = b.r.zrangebyscore(keys.QUEUED, "-inf", older_than_ms, start=0, num=batch)
    if not old:
        return 0
    with b.r.pipeline(transaction=False) as p:
        for q in b.queues:
            p.llen(q.key)
        for tid in old:
            p.hmget(keys.task(tid), "status", "tier", "deliveries")
        res = p.execute()
    lengths, states = res[: len(b.queues)], res[len(b.queues) :]
    queued = [(tid, int(t), int(d)) for tid, (st, t, d) in zip(old, states) if st == "queued"]
    with b.r.pipeline(transaction=False) as p:
        for tid, _tier, delivery in queued:
            p.exists(Job.key_for(keys.rq_job_id(tid, delivery)))
        present = p.execute()
    lost = [q for q, there in zip(queued, present) if not there or lengths[min(q[1], len(lengths) - 1)] == 0]
    b.deliver(lost)
    with b.r.pipeline(transaction=True) as p:
        stale = [tid for tid, (st, _t, _d) in zip(old, states) if st != "queued"]
        if stale:
            p.zrem(keys.QUEUED, *stale)
        if queued:  # checked: look again one grace period from now (XX: never re-add an acquired task)
            p.zadd(keys.QUEUED, {tid: now for tid, _t, _d in queued}, xx=True)
        p.execute()
    return len(lost)


def _prune(b: Broker, now_ms: int, batch: int = 50) -> int:
    retention = b.settings.job_retention
    if retention <= 0:
        return 0
    cutoff = now_ms / 1000 - retention
    pruned = 0
    for job_id in b.r.zrangebyscore(keys.JOBS, "-inf", cutoff, start=0, num=batch):  # created before the cutoff
        status, finished = b.r.hmget(keys.job(job_id), "status", "finished_at")
        if status is not None and (status not in TERMINAL or not finished or float(finished) > cutoff):
            continue  # still open, or finished within the retention
        _delete_job(b, job_id, keys.JOBS)
        pruned += 1
    return pruned


def _prune_abandoned_staging(b: Broker, now_ms: int, batch: int = 50) -> int:
    """A large submit stages its tasks before the job becomes visible; a submitter that died there left them."""
    pruned = 0
    for job_id in b.r.zrangebyscore(keys.STAGING, "-inf", now_ms - ABANDONED_STAGING_MS, start=0, num=batch):
        if not b.r.exists(keys.job(job_id)):
            _delete_job(b, job_id, keys.STAGING)
            pruned += 1
        else:
            b.r.zrem(keys.STAGING, job_id)
    return pruned


def _delete_job(b: Broker, job_id: str, index: str) -> None:
    tids = b.r.lrange(keys.job_tasks(job_id), 0, -1)
    with b.r.pipeline(transaction=True) as p:
        for start in range(0, len(tids), 1000):
            chunk = tids[start : start + 1000]
            p.delete(*[keys.task(t) for t in chunk], *[keys.task_log(t) for t in chunk])
        p.delete(keys.job(job_id), keys.job_tasks(job_id))
        p.zrem(index, job_id)
        p.execute()
