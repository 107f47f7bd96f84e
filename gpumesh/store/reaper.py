"""The reaper: one pass puts lapsed leases back in play, drops dead workers and prunes old jobs.

Safe to run from several processes at once (every change is a fenced Lua script or idempotent);
workers take turns through a lock only to avoid doing the work twice. No delivery can be lost: a
task is leased in the same step that picks it (dispatch.lua), so a worker that dies before running
it only leaves a lease that lapses.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import redis
from rq.queue import Queue
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.worker import Worker
from rq.worker_registration import REDIS_WORKER_KEYS, WORKERS_BY_QUEUE_KEY

from gpumesh.models import TERMINAL
from gpumesh.store import keys, projects, retention, scripts
from gpumesh.store.broker import FAILURE_TTL, Broker
from gpumesh.store.connection import translate
from gpumesh.store.submit import STAGING_STALE_MS

ABANDONED_STAGING_MS = STAGING_STALE_MS  # a staged job that made no progress this long was abandoned
# s of deletion steps a pass of `gpumesh serve`'s reaper takes at most (its thread has nothing else to do; a
# worker's pass, in its heartbeat thread, takes half a heartbeat interval): a job of 1,000,000 tasks fits
SERVE_PRUNE_BUDGET_S = 30.0


def reap_until(b: Broker, stop: threading.Event, interval: float) -> None:
    """``gpumesh serve``'s reaper: a pass every ``interval`` seconds until ``stop`` is set. A broker error
    is logged and the next pass tries again (workers reap too, so nothing waits on this loop alone)."""
    log = logging.getLogger("gpumesh.serve")
    while not stop.wait(interval):
        try:
            report = reap_once(b, prune_budget=SERVE_PRUNE_BUDGET_S)
            if any(report.values()):
                log.info("reaper: %s", report)
        except redis.RedisError as exc:
            log.warning("reaper: %s", translate(exc, b.url))


def reap_once(
    b: Broker, audit_grace_ms: int | None = None, batch: int = 500, prune_budget: float | None = None
) -> dict[str, int]:
    """One reaper pass. Safe to run concurrently (every change is a fenced script or idempotent):

    * leases that lapsed send their tasks back to queued (or failed at max attempts), pending again;
    * workers that stopped heartbeating leave the live sets (the dispatcher's fleet, the idle set,
      RQ's queue registry), so placement stops counting them;
    * the tiers' windows list no task that is queued no more (one a worker of the previous protocol took);
    * finished jobs older than the retention (``GPUMESH_JOB_RETENTION``) are deleted with their tasks
      and logs, so a busy mesh does not fill a ``noeviction`` Redis; so are the staged tasks of a large
      submit whose submitter died before making its job visible. Each step of a deletion holds Redis about
      a millisecond (store/retention.py); the pass stops taking steps after ``prune_budget`` seconds (default
      half a heartbeat interval: a worker reaps from its heartbeat thread), and the next pass goes on.

    ``audit_grace_ms`` is accepted for compatibility and unused: there is no delivery to audit.
    """
    now = b.server_ms()
    report = {"requeued": 0, "failed": 0, "workers_dropped": 0, "jobs_pruned": 0}
    expired = b.r.zrangebyscore(keys.LEASES, "-inf", now, start=0, num=batch)
    if expired:
        with b.r.pipeline(transaction=False) as p:
            for tid in expired:
                scripts.reap(b.scripts, p, tid)
            for raw in p.execute():
                out = scripts.reap_outcome(raw)
                if out.status == "queued":
                    report["requeued"] += 1
                elif out.status == "failed":
                    report["failed"] += 1
    dead = b.r.zrangebyscore(keys.WORKERS, "-inf", now - b.settings.worker_ttl * 1000)
    if dead:
        _drop_rq_records(b, dead)
        with b.r.pipeline(transaction=True) as p:
            p.zrem(keys.WORKERS, *dead)
            p.zrem(keys.SCORES, *dead)
            p.srem(keys.IDLE, *dead)
            p.srem(Queue.redis_queues_keys, *[Queue.redis_queue_namespace_prefix + keys.queue_name(w) for w in dead])
            p.delete(*[Queue.redis_queue_namespace_prefix + keys.queue_name(w) for w in dead])
            p.delete(*[keys.wake(w) for w in dead])
            p.hset(keys.FLEET, "dirty", 1)
            p.hincrby(keys.FLEET, "v", 1)
            p.execute()
        report["workers_dropped"] = len(dead)
    report["window_entries_dropped"] = _drop_stale_window_entries(b)
    try:
        budget = b.settings.heartbeat_interval / 2 if prune_budget is None else prune_budget
        deadline = time.monotonic() + budget
        report["jobs_pruned"] = _prune(b, now, deadline) + _prune_abandoned_staging(b, now, deadline)
        files = b.project_files()
        report["projects_detached"] = projects.detach_dangling(files, b.scripts, b.r, now, b.settings.artifacts)
        report["project_files_swept"] = projects.sweep_unattached(files, b.r, b.settings.artifacts)
    except (redis.exceptions.NoPermissionError, redis.exceptions.ExecAbortError) as exc:
        if isinstance(exc, redis.exceptions.ExecAbortError) and "NOPERM" not in str(exc):
            raise
        # A worker credential on a broker `gpumesh serve` runs may not delete jobs (SECURITY.md, "What each credential can do"):
        # serve's own reaper, as the admin, prunes them.
    return report


def _drop_rq_records(b: Broker, dead: list[str]) -> None:
    """What RQ keeps of dead workers (and of the queues of their own that workers of earlier versions had), which
    no RQ worker cleans.
    A delivery still shown as started (its worker was killed, cut off or revoked mid-run) is failed as
    abandoned, by RQ's own cleanup; the queue's other bookkeeping goes or expires. gpumesh requeues the
    task itself when its lease lapses."""
    for w in dead:
        name = keys.queue_name(w)
        StartedJobRegistry(name, connection=b.rq, serializer=JSONSerializer).cleanup(timestamp=math.inf)
        queue = Queue(name, connection=b.rq, serializer=JSONSerializer)
        with b.rq.pipeline(transaction=False) as p:
            p.delete(
                queue.intermediate_queue_key,
                FinishedJobRegistry(name, connection=b.rq).key,
                WORKERS_BY_QUEUE_KEY % name,
                # RQ's record of the worker itself (its name is the worker id): a killed one never registered
                # its death, and its key's TTL, set to the delivery's timeout when a task starts, kept it in
                # `rq info` as busy for up to an hour
                Worker.redis_worker_namespace_prefix + w,
            )
            p.srem(REDIS_WORKER_KEYS, Worker.redis_worker_namespace_prefix + w)
            p.expire(FailedJobRegistry(name, connection=b.rq).key, FAILURE_TTL)
            for tier in range(b.settings.tiers):  # the tier queue it served lists it no more
                p.srem(WORKERS_BY_QUEUE_KEY % keys.tier_queue(tier), Worker.redis_worker_namespace_prefix + w)
            p.execute()
    gone = set(dead)
    for tier in range(b.settings.tiers):
        # A tier's queue is every worker's of the tier: the deliveries the dead workers left started there (RQ's
        # record of each run names its worker) are marked expired, and RQ's own cleanup fails them as abandoned.
        started = StartedJobRegistry(keys.tier_queue(tier), connection=b.rq, serializer=JSONSerializer)
        runs = [m.decode() if isinstance(m, bytes) else str(m) for m in b.rq.zrange(started.key, 0, -1)]
        with b.rq.pipeline(transaction=False) as p:
            for run in runs:
                p.hget(f"rq:execution:{run}", "worker_name")
            owners = p.execute()
        left = {run: 0 for run, owner in zip(runs, owners) if owner and owner.decode() in gone}
        if left:
            b.rq.zadd(started.key, left, xx=True)
            started.cleanup()


def _drop_stale_window_entries(b: Broker, most: int = 100) -> int:
    """The entries of the tiers' windows (lua/_lib.lua's refresh_window) whose task is queued no more: a worker
    of the previous protocol takes a task without taking it out of the window it waits in, and a window is
    refreshed only as a worker of its tier takes work, so a finished job's tasks stayed listed in rq-dashboard
    (and counted by `gpumesh workers`) for good. Returns how many went."""
    queues = ["rq:queue:" + keys.tier_queue(tier) for tier in range(b.settings.tiers)]
    with b.r.pipeline(transaction=False) as p:
        for q in queues:
            p.lrange(q, 0, most - 1)
        listed = p.execute(raise_on_error=False)
    entries = [
        (q, e, e.removesuffix("_waiting"))
        for q, got in zip(queues, listed)
        if isinstance(got, list)  # not a list (any credential may write RQ's keys): its window is dispatch's
        for e in got
        if e.endswith("_waiting")
    ]
    if not entries:
        return 0
    with b.r.pipeline(transaction=False) as p:
        for _, _, task_id in entries:
            p.hget(keys.task(task_id), "status")
        statuses = p.execute(raise_on_error=False)
    stale = [(q, e, t) for (q, e, t), status in zip(entries, statuses) if status != "queued"]
    if stale:
        with b.r.pipeline(transaction=False) as p:
            for q, e, task_id in stale:
                p.lrem(q, 0, e)
                p.delete("rq:job:" + e)
                p.hdel(keys.task(task_id), "tier")
            p.execute(raise_on_error=False)
    return len(stale)


def _prune(b: Broker, now_ms: int, deadline: float, batch: int = 50) -> int:
    """Jobs past their retention, deleted; first those a pass before began and did not finish."""
    pruned = 0
    files = b.project_files()
    for job_id in retention.resuming(b.r, batch):
        if not retention.delete_job(b.r, job_id, keys.JOBS, b.settings.artifacts, deadline, files):
            return pruned
        pruned += 1
    retention_s = b.settings.job_retention
    if retention_s <= 0:
        return pruned
    cutoff = now_ms / 1000 - retention_s
    for job_id in b.r.zrangebyscore(keys.JOBS, "-inf", cutoff, start=0, num=batch):  # created before the cutoff
        status, finished = b.r.hmget(keys.job(job_id), "status", "finished_at")
        if status is not None and (status not in TERMINAL or not finished or float(finished) > cutoff):
            continue  # still open, or finished within the retention
        if not retention.delete_job(b.r, job_id, keys.JOBS, b.settings.artifacts, deadline, files):
            return pruned
        pruned += 1
    return pruned


def _prune_abandoned_staging(b: Broker, now_ms: int, deadline: float, batch: int = 50) -> int:
    """A large submit stages its tasks before the job becomes visible; a submitter that died there left them."""
    pruned = 0
    for job_id in b.r.zrangebyscore(keys.STAGING, "-inf", now_ms - ABANDONED_STAGING_MS, start=0, num=batch):
        if time.monotonic() >= deadline:
            break
        if not b.r.exists(keys.job(job_id)):
            files = b.project_files()
            if not retention.delete_job(b.r, job_id, keys.STAGING, b.settings.artifacts, deadline, files):
                break
            pruned += 1
        else:
            b.r.zrem(keys.STAGING, job_id)
    return pruned
