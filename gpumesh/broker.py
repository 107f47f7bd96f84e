"""Broker calls: connecting, submitting, reading and cancelling jobs, enqueueing deliveries, reaping.

Everything a CLI command does goes through :class:`Broker`, so Python can do all the CLI can.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from rq import Queue
from rq.serializers import JSONSerializer

from . import keys, scheduling, scripts
from .errors import BrokerError, NotFound, UsageError
from .models import TERMINAL, JobOptions, JobStatus, SubmitResult, TaskResult, WorkerInfo, payload_cost, ts
from .settings import Settings

log = logging.getLogger("gpumesh")

EXECUTOR = "gpumesh.executor.run_task"  # the only function a gpumesh worker runs
STAGE_ABOVE = 10_000  # a larger job is written in stages (Broker._submit_staged); a smaller one in one MULTI/EXEC
STAGE_CHUNK = 5_000  # tasks per round trip while staging and delivering
RESULT_TTL = 600  # RQ keeps its own copy of a delivery's outcome this long; gpumesh keeps the real one
FAILURE_TTL = 86400


def mask_url(url: str) -> str:
    """The URL with its password replaced by ***, for logs and messages."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _client(url: str, *, decode: bool, socket_timeout: float, retries: int) -> redis.Redis:
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise UsageError(f"broker URL {mask_url(url)!r} must start with redis://, rediss:// or unix://")
    try:
        return redis.Redis.from_url(
            url,
            decode_responses=decode,
            socket_connect_timeout=3,
            socket_timeout=socket_timeout,
            health_check_interval=15,
            retry=Retry(ExponentialBackoff(cap=2.0, base=0.1), retries),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        )
    except ValueError as exc:
        raise UsageError(f"invalid broker URL {mask_url(url)!r}: {exc}") from None


def translate(exc: redis.RedisError, url: str) -> BrokerError:
    """One line for a Redis error, without the password."""
    text = str(exc).replace(urlsplit(url).password or "\0", "***")
    if isinstance(exc, redis.AuthenticationError) or "WRONGPASS" in text or "NOAUTH" in text:
        return BrokerError(f"the broker at {mask_url(url)} refused the credentials ({text}); check the URL's password")
    if "OOM" in text or isinstance(exc, redis.exceptions.OutOfMemoryError):
        return BrokerError(
            f"the broker at {mask_url(url)} is out of memory (maxmemory reached, noeviction) and refused the write; "
            "nothing was written. Free memory (finished jobs) or raise maxmemory"
        )
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return BrokerError(f"cannot reach the broker at {mask_url(url)} ({text}); is Redis running there?")
    return BrokerError(f"the broker at {mask_url(url)} answered an error: {text}")


@dataclass(frozen=True)
class _Job:
    """What submit writes for one job (ids, costs and tiers already decided)."""

    id: str
    sha: str
    source: str
    script_name: str
    payloads: list[dict[str, Any]]
    costs: list[float]
    tiers: list[int]
    options: JobOptions
    created: float
    per_tier: dict[str, int]

    def delivery_order(self) -> list[int]:
        return sorted(range(len(self.payloads)), key=lambda i: (-self.costs[i], i))  # heaviest first in each tier


class Broker:
    """A connection to the mesh's Redis plus the scripts and queues bound to it."""

    def __init__(self, settings: Settings, *, blocking_timeout: float = 0, retries: int = 2) -> None:
        self.settings = settings
        self.url = settings.url
        timeout = max(10.0, blocking_timeout + 10)
        self.r = _client(self.url, decode=True, socket_timeout=timeout, retries=retries)
        self.rq = _client(self.url, decode=False, socket_timeout=timeout, retries=retries)  # RQ wants bytes
        self.scripts = scripts.Scripts(self.r)
        self.queues = [
            Queue(keys.queue_name(t), connection=self.rq, serializer=JSONSerializer) for t in range(settings.tiers)
        ]

    @property
    def url_masked(self) -> str:
        return mask_url(self.url)

    def ping(self) -> Broker:
        """Fail fast with exit code 3 when the broker is unreachable or refuses us."""
        try:
            self.r.ping()
        except redis.RedisError as exc:
            raise translate(exc, self.url) from None
        return self

    def close(self) -> None:
        self.r.close()
        self.rq.close()

    def epoch(self) -> str:
        """The id of this broker's data, created by whoever comes first; it changes only if the data is lost."""
        with self.r.pipeline(transaction=True) as p:
            p.set(keys.EPOCH, uuid.uuid4().hex, nx=True)
            p.get(keys.EPOCH)
            return p.execute()[1]

    def eviction_warning(self) -> str | None:
        """A warning when Redis may evict keys (and so lose queued work), None when it cannot or we cannot tell."""
        try:
            policy = self.r.config_get("maxmemory-policy").get("maxmemory-policy")
        except redis.ResponseError:  # CONFIG refused (ACL or a managed Redis): nothing to check against
            return None
        if policy and policy != "noeviction":
            return (
                f"the broker's maxmemory-policy is {policy}: under memory pressure Redis may evict queue data "
                "and lose tasks; set it to noeviction (CONFIG SET maxmemory-policy noeviction)"
            )
        return None

    # -- scheduling reads ------------------------------------------------------------------------

    def server_ms(self) -> int:
        sec, usec = self.r.time()
        return sec * 1000 + usec // 1000

    def live_scores(self) -> dict[str, float]:
        """Score of every worker whose last heartbeat is within the worker TTL (server time)."""
        return self._live()[1]

    def _live(self) -> tuple[int, dict[str, float]]:
        """(server time in ms, live scores), in one round trip."""
        with self.r.pipeline(transaction=False) as p:
            p.time()
            p.zrange(keys.SCORES, 0, -1, withscores=True)
            p.zrange(keys.WORKERS, 0, -1, withscores=True)
            (sec, usec), scores, beats = p.execute()
        now = sec * 1000 + usec // 1000
        alive = {w for w, hb in beats if hb >= now - self.settings.worker_ttl * 1000}
        return now, {w: s for w, s in scores if w in alive}

    # -- submit ----------------------------------------------------------------------------------

    def submit(
        self,
        source: str,
        script_name: str,
        payloads: list[dict[str, Any]],
        options: JobOptions,
        idempotency_key: str | None = None,
        signer: Any = None,
        expires_in: float = 7 * 86400,
    ) -> SubmitResult:
        """Write script, job, tasks and their RQ deliveries in one MULTI/EXEC: the job appears whole or not at all.

        With ``idempotency_key`` the job id derives from the key, so a submit retried after a timeout
        returns the job the first one created instead of a second job (WATCH makes the race safe)."""
        if not payloads:
            raise UsageError("a job needs at least one payload")
        sha = hashlib.sha256(source.encode()).hexdigest()
        request = ""  # what an idempotent retry must repeat exactly; only computed when there is a key
        if idempotency_key:
            job_id = hashlib.sha256(f"gpumesh-idempotency:{idempotency_key}".encode()).hexdigest()[:12]
            request = hashlib.sha256(
                json.dumps([sha, script_name, payloads, options.model_dump()], sort_keys=True).encode()
            ).hexdigest()
        else:
            job_id = uuid.uuid4().hex[:12]
        costs = [payload_cost(p) for p in payloads]
        try:
            now_ms, scores = self._live()
            tiers = scheduling.assign_task_tiers(costs, scheduling.tier_capacity(scores, self.settings.tiers))
            created = now_ms / 1000
            per_tier: dict[str, int] = {}
            for t in sorted(tiers):
                per_tier[str(t)] = per_tier.get(str(t), 0) + 1
            if len(payloads) > STAGE_ABOVE:
                job = _Job(job_id, sha, source, script_name, payloads, costs, tiers, options, created, per_tier)
                return self._submit_staged(job, request, idempotency_key, signer, created + expires_in)
            with self.r.pipeline(transaction=True) as p:
                if idempotency_key:
                    p.watch(keys.job(job_id))
                    existing = p.hmget(keys.job(job_id), "request", "total", "tiers")
                    if existing[0] is not None:
                        return self._same_request(job_id, existing, request, idempotency_key)
                    p.multi()
                self._write_job(p, job_id, sha, source, script_name, payloads, costs, tiers, options, created, per_tier)
                if signer is not None:
                    self._sign(p, signer, job_id, sha, payloads, options, created + expires_in)
                if idempotency_key:
                    p.hset(keys.job(job_id), "request", request)
                p.execute()
        except redis.WatchError:  # the same key won a concurrent race: that job is ours
            existing = self.r.hmget(keys.job(job_id), "request", "total", "tiers")
            return self._same_request(job_id, existing, request, idempotency_key or "")
        except redis.RedisError as exc:
            raise translate(exc, self.url) from None
        return SubmitResult(job_id=job_id, tasks=len(payloads), tiers=per_tier)

    @staticmethod
    def _sign(
        p: Any, signer: Any, job_id: str, sha: str, payloads: list[dict[str, Any]], options: JobOptions, expires: float,
        start: int = 0, stop: int | None = None,
    ) -> None:  # fmt: skip
        from .signing import message

        if start == 0 and stop is None:
            p.hset(keys.job(job_id), mapping={"key_id": signer.key_id, "expires_at": f"{expires:.3f}"})
        for i in range(start, len(payloads) if stop is None else stop):
            payload = payloads[i]
            msg = message(
                job_id, i, sha, json.dumps(payload), options.timeout, options.max_attempts, float(f"{expires:.3f}")
            )
            p.hset(keys.task(keys.task_id(job_id, i)), "sig", signer.sign(msg))

    @staticmethod
    def _same_request(job_id: str, existing: list[Any], request: str, key: str) -> SubmitResult:
        if existing[0] != request:
            raise UsageError(
                f"idempotency key {key!r} was already used for job {job_id} with a different script, payloads or "
                "options; use a new key for a new job"
            )
        return SubmitResult(job_id=job_id, tasks=int(existing[1]), tiers=json.loads(existing[2]))

    def _write_job(
        self, p: Any, job_id: str, sha: str, source: str, script_name: str, payloads: list[dict[str, Any]],
        costs: list[float], tiers: list[int], options: JobOptions, created: float, per_tier: dict[str, int],
    ) -> None:  # fmt: skip
        job = _Job(job_id, sha, source, script_name, payloads, costs, tiers, options, created, per_tier)
        p.set(keys.script(sha), source, nx=True)
        self._write_tasks(p, job, 0, len(payloads))
        self._make_visible(p, job)
        self.enqueue(p, ((keys.task_id(job_id, i), tiers[i], 1) for i in job.delivery_order()), options.timeout)

    @staticmethod
    def _write_tasks(p: Any, job: _Job, start: int, stop: int) -> None:
        """Tasks ``start..stop`` and their place in the job's task list; not yet visible to anyone."""
        task_ids = [keys.task_id(job.id, i) for i in range(start, stop)]
        p.rpush(keys.job_tasks(job.id), *task_ids)
        for i, tid in zip(range(start, stop), task_ids):
            p.hset(
                keys.task(tid),
                mapping={
                    "job": job.id,
                    "index": i,
                    "payload": json.dumps(job.payloads[i]),
                    "cost": job.costs[i],
                    "tier": job.tiers[i],
                    "status": "queued",
                    "attempts": 0,
                    "deliveries": 1,
                    "max_attempts": job.options.max_attempts,
                },
            )

    @staticmethod
    def _make_visible(p: Any, job: _Job) -> None:
        """The job hash, the jobs index and the audit's queued set: after this the job exists for everyone."""
        options, total = job.options, len(job.payloads)
        p.set(keys.EPOCH, uuid.uuid4().hex, nx=True)
        p.hset(
            keys.job(job.id),
            mapping={
                "id": job.id,
                "name": options.name,
                "script_sha": job.sha,
                "script_name": job.script_name,
                "timeout": options.timeout,
                "max_attempts": options.max_attempts,
                "status": "queued",
                "total": total,
                "queued": total,
                "running": 0,
                "done": 0,
                "failed": 0,
                "cancelled": 0,
                "created_at": f"{job.created:.3f}",
                "tiers": json.dumps(job.per_tier),
                "speculate": int(options.speculate),
            },
        )
        created_ms = int(job.created * 1000)
        for start in range(0, total, STAGE_CHUNK):
            p.zadd(
                keys.QUEUED,
                {keys.task_id(job.id, i): created_ms for i in range(start, min(total, start + STAGE_CHUNK))},
            )
        p.zadd(keys.JOBS, {job.id: job.created})
        p.xadd(keys.EVENTS, {"kind": "job", "id": job.id, "status": "queued"}, maxlen=10000, approximate=True)

    def _submit_staged(
        self, job: _Job, request: str, idempotency_key: str | None, signer: Any, expires: float
    ) -> SubmitResult:
        """A large job in bounded steps, so neither this process nor Redis's MULTI buffer holds it all at once.

        1. Claim the job id in ``gpumesh:staging`` (a concurrent submit with the same idempotency key
           waits for ours), then stage the tasks chunk by chunk, invisible; the reaper deletes what a
           submitter that died here left behind.
        2. One MULTI/EXEC makes the whole job visible at once.
        3. Deliver chunk by chunk, heaviest first; a delivery lost to a crash here is found by the
           reaper's audit of queued tasks, like any lost delivery."""
        r, total = self.r, len(job.payloads)
        if idempotency_key:
            existing = r.hmget(keys.job(job.id), "request", "total", "tiers")
            if existing[0] is not None:
                return self._same_request(job.id, existing, request, idempotency_key)
        if not r.zadd(keys.STAGING, {job.id: int(job.created * 1000)}, nx=True):
            return self._await_other_submit(job.id, request, idempotency_key or "")
        r.set(keys.script(job.sha), job.source, nx=True)
        for start in range(0, total, STAGE_CHUNK):
            with r.pipeline(transaction=False) as p:
                stop = min(total, start + STAGE_CHUNK)
                self._write_tasks(p, job, start, stop)
                if signer is not None:
                    self._sign(p, signer, job.id, job.sha, job.payloads, job.options, expires, start, stop)
                p.execute()
        with r.pipeline(transaction=True) as p:
            self._make_visible(p, job)
            if signer is not None:
                p.hset(keys.job(job.id), mapping={"key_id": signer.key_id, "expires_at": f"{expires:.3f}"})
            if idempotency_key:
                p.hset(keys.job(job.id), "request", request)
            p.execute()  # the staging entry stays (the reaper drops it later): it is the claim on this job id
        order = job.delivery_order()
        for start in range(0, total, STAGE_CHUNK):
            with r.pipeline(transaction=False) as p:
                chunk = order[start : start + STAGE_CHUNK]
                self.enqueue(p, ((keys.task_id(job.id, i), job.tiers[i], 1) for i in chunk), job.options.timeout)
                p.execute()
        return SubmitResult(job_id=job.id, tasks=total, tiers=job.per_tier)

    def _await_other_submit(self, job_id: str, request: str, key: str, patience: float = 120.0) -> SubmitResult:
        """A concurrent submit with the same idempotency key is staging this job: its result is ours."""
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            existing = self.r.hmget(keys.job(job_id), "request", "total", "tiers")
            if existing[0] is not None:
                return self._same_request(job_id, existing, request, key)
            if self.r.zscore(keys.STAGING, job_id) is None and existing[1] is None:
                break  # the other submit gave up; nothing of it is visible
            time.sleep(0.2)
        raise BrokerError(
            f"another submit with idempotency key {key!r} is still writing job {job_id}; run the same command again"
        )

    def enqueue(self, pipe: Any, deliveries: Iterable[tuple[str, int, int]], timeout: float | None = None) -> None:
        """Add RQ jobs (task id, tier, delivery) to ``pipe``; the id is deterministic, so a repeat is harmless."""
        by_tier: dict[int, list[Any]] = {}
        # RQ's own timeout is only a backstop: the executor enforces the task's timeout itself.
        backstop = int((timeout or 86400) + self.settings.lease_ttl + 60)
        for task_id, tier, delivery in deliveries:
            tier = min(max(tier, 0), self.settings.tiers - 1)
            by_tier.setdefault(tier, []).append(
                Queue.prepare_data(
                    EXECUTOR,
                    args=(task_id,),
                    job_id=keys.rq_job_id(task_id, delivery),
                    timeout=backstop,
                    result_ttl=RESULT_TTL,
                    failure_ttl=FAILURE_TTL,
                    description=f"gpumesh task {task_id}",
                )
            )
        for tier, datas in by_tier.items():
            self.queues[tier].enqueue_many(datas, pipeline=pipe)

    # -- reads -----------------------------------------------------------------------------------

    def job_status(self, job_id: str) -> JobStatus:
        try:
            h = self.r.hgetall(keys.job(job_id))
        except redis.RedisError as exc:
            raise translate(exc, self.url) from None
        if not h:
            raise NotFound(f"no job {job_id!r} on this broker; `gpumesh jobs` lists the jobs")
        return JobStatus.from_hash(job_id, h)

    def task_ids(self, job_id: str) -> list[str]:
        self.job_status(job_id)
        return self.r.lrange(keys.job_tasks(job_id), 0, -1)

    def results(self, job_id: str) -> list[TaskResult]:
        ids = self.task_ids(job_id)
        rows: list[TaskResult] = []
        for start in range(0, len(ids), 2000):
            chunk = ids[start : start + 2000]
            with self.r.pipeline(transaction=False) as p:
                for tid in chunk:
                    p.hgetall(keys.task(tid))
                rows += [TaskResult.from_hash(tid, h) for tid, h in zip(chunk, p.execute()) if h]
        return rows

    def task(self, task_id: str) -> dict[str, str]:
        h = self.r.hgetall(keys.task(task_id))
        if not h:
            raise NotFound(f"no task {task_id!r} on this broker")
        return h

    def workers(self) -> list[WorkerInfo]:
        scores = self.live_scores()
        tiers = scheduling.worker_tiers(scores, self.settings.tiers) if scores else {}
        ids = sorted(scores)
        with self.r.pipeline(transaction=False) as p:
            for w in ids:
                p.hgetall(keys.worker(w))
            hashes = p.execute()
        out = []
        for w, h in zip(ids, hashes):
            if not h:
                continue
            out.append(
                WorkerInfo(
                    id=w,
                    name=h.get("name", w),
                    hostname=h.get("hostname", ""),
                    device=h.get("device", "cpu"),
                    device_name=h.get("device_name", ""),
                    score_gflops=float(h.get("score", 0)),
                    tier=tiers.get(w, 0),
                    state="busy" if h.get("current_task") else "idle",
                    current_task=h.get("current_task") or None,
                    last_heartbeat=ts(h.get("last_heartbeat")),
                )
            )
        return out

    def jobs(self, limit: int = 50) -> list[JobStatus]:
        ids = self.r.zrevrange(keys.JOBS, 0, limit - 1)
        with self.r.pipeline(transaction=False) as p:
            for j in ids:
                p.hgetall(keys.job(j))
            return [JobStatus.from_hash(j, h) for j, h in zip(ids, p.execute()) if h]

    def logs(self, target: str, cursors: dict[str, str] | None = None) -> Iterator[tuple[str, str, str]]:
        """(task id, stream, line) of a task, or of every task of a job in payload order.

        ``cursors`` (task id -> last stream id seen) is updated, so a follower reads only new lines."""
        cursors = {} if cursors is None else cursors
        if self.r.exists(keys.job(target)):
            ids = self.r.lrange(keys.job_tasks(target), 0, -1)
        else:
            self.task(target)
            ids = [target]
        for start in range(0, len(ids), 1000):
            chunk = ids[start : start + 1000]
            with self.r.pipeline(transaction=False) as p:
                for tid in chunk:
                    p.xrange(keys.task_log(tid), min=f"({cursors[tid]}" if tid in cursors else "-")
                for tid, entries in zip(chunk, p.execute()):
                    for entry_id, fields in entries:
                        cursors[tid] = entry_id
                        yield tid, fields.get("stream", "stdout"), fields.get("line", "")

    def target_ended(self, target: str) -> bool:
        """Whether a job, or a task, has reached a terminal status."""
        h = self.r.hget(keys.job(target), "status")
        if h is None:
            h = self.task(target).get("status")
        return h in TERMINAL

    # -- changes ---------------------------------------------------------------------------------

    def cancel(self, job_id: str) -> JobStatus:
        """Cancel every queued or running task; running ones are killed at their worker's next heartbeat."""
        ids = self.task_ids(job_id)
        for start in range(0, len(ids), 2000):
            with self.r.pipeline(transaction=False) as p:
                for tid in ids[start : start + 2000]:
                    scripts.cancel(self.scripts, p, tid)
                p.execute()
        return self.job_status(job_id)

    def retry(self, job_id: str) -> tuple[int, JobStatus]:
        """Re-queue every failed task of a job with a fresh set of attempts. Returns (tasks re-queued, status)."""
        ids = self.task_ids(job_id)
        deliveries: list[tuple[str, int, int]] = []
        for start in range(0, len(ids), 2000):
            chunk = ids[start : start + 2000]
            with self.r.pipeline(transaction=False) as p:
                for tid in chunk:
                    scripts.retry(self.scripts, p, tid)
                for tid, res in zip(chunk, p.execute()):
                    if int(res[0]) == 1:
                        deliveries.append((tid, int(res[2]), int(res[1])))
        self.deliver(deliveries)
        return len(deliveries), self.job_status(job_id)

    def deliver(self, deliveries: list[tuple[str, int, int]]) -> None:
        """Enqueue RQ deliveries (task id, tier, delivery number); ids are deterministic, so repeats are harmless."""
        unique = list({(tid, d): (tid, tier, d) for tid, tier, d in deliveries}.values())
        if not unique:
            return
        with self.r.pipeline(transaction=True) as p:
            self.enqueue(p, unique)
            p.execute()
