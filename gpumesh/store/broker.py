"""Broker calls: connecting, submitting, reading and cancelling jobs, delivering dispatched tasks, reaping.

Everything a CLI command does goes through :class:`Broker`, so Python can do all the CLI can.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from gpumesh import models, requirements, scheduling
from gpumesh.errors import BrokerError, NotFound, UsageError
from gpumesh.models import TERMINAL, JobOptions, JobStatus, SubmitResult, TaskResult, TierLoad, Waiting, WorkerInfo, ts
from gpumesh.settings import Settings
from gpumesh.store import jobstatus, keys, protocols, scripts, sentinel, tasklog
from gpumesh.store.connection import SOCKET_TIMEOUT, client, mask_url, text, translate

if TYPE_CHECKING:
    from rq import Queue
    from rq.job import Job

    from gpumesh.store import artifacts, projects
    from gpumesh.store.submit import SubmitRequest, Submitter

log = logging.getLogger("gpumesh")

# The only function a gpumesh worker runs, by the name RQ records (rq-dashboard, `rq info`). Only compared,
# never imported (MeshJob pins the function), so it keeps the name of earlier versions.
EXECUTOR = "gpumesh.executor.run_task"
# RQ keeps no record of a delivery that ran to its end: gpumesh keeps the real outcome (the task's hash), and
# RQ's copy (its job hash and result stream, about 6.8 KB) would cost the broker throughput x TTL while a big
# job runs. The worker deletes RQ's job as the run ends, in the transaction that records it (LeanRQWorker);
# rq-dashboard and `rq info` still see queues, workers and the deliveries queued or running.
RESULT_TTL = 0
FAILURE_TTL = 86400  # a delivery RQ itself failed (an exception, a worker that died mid-run): rare, kept a day
JOB_LABELS_KEPT = 4096  # jobs whose name and requirements a worker keeps for its deliveries' labels
FAILOVER_POLL = 0.25  # s between pings while a failover is awaited (Broker.ping)
PAYLOAD_LABEL_BYTES = 1 << 20  # a larger payload is not parsed for its cost and requirements on the dispatch path

# (broker URL, job id) -> (job name, job-wide requirements), for Broker.deliver's labels
_JOB_LABELS: dict[tuple[str, str], tuple[str, tuple[requirements.Requirement, ...]]] = {}


@dataclass(frozen=True)
class Counters:
    """Broker.counters: what the Prometheus endpoint (server/metrics.py) reads."""

    queued: dict[str, int]  # job priority -> queued tasks
    stats: dict[str, str]  # keys.STATS: done / failed / retried / lease_expired, failed attempts by kind
    duration: dict[str, str]  # keys.STATS_DURATION: per-bucket counts, sum, count


class Broker:
    """A connection to the mesh's Redis plus the scripts and queues bound to it."""

    def __init__(
        self, settings: Settings, *, blocking_timeout: float = 0, retries: int = 2, health_check: bool = True
    ) -> None:
        """``blocking_timeout``: the longest blocking call this client makes (a worker's BLPOP on its wake
        list); a reply may take that long plus SOCKET_TIMEOUT before the broker counts as unreachable."""
        self.settings = settings
        self.url = settings.url
        timeout = blocking_timeout + SOCKET_TIMEOUT
        self.redis = client(self.url, decode=True, socket_timeout=timeout, retries=retries, health_check=health_check)
        self.r = text(self.redis)  # the same client, typed as it answers: str
        self.rq = client(
            self.url, decode=False, socket_timeout=timeout, retries=retries, health_check=health_check
        )  # RQ wants bytes
        self.scripts = scripts.Scripts(self.redis)
        self._submitter: Submitter | None = None  # made by the first submit: reading commands never import it
        self._may_block = True  # false once the broker refused a blocking read (an older serve's submitter user)

    def submit(
        self, source: str, script_name: str, payloads: list[dict[str, Any]], options: JobOptions, **more: Any
    ) -> SubmitResult:
        """Check and send a job in one call (``more``: the keywords of ``SubmitRequest.checked``): the store's
        own callers' way; the API builds the request itself and calls :meth:`send`."""
        from gpumesh.store.submit import SubmitRequest

        return self.send(SubmitRequest.checked(source, script_name, payloads, options, **more))

    def send(self, request: SubmitRequest) -> SubmitResult:
        """Write a checked job and its queued tasks so that it appears whole or not at all (see :mod:`.submit`).

        With an idempotency key the job id derives from the key, so a submit retried after a timeout
        returns the job the first one created instead of a second job. With a project (gpumesh.project.pack)
        the files the mesh lacks are sent first (gpumesh.store.projects)."""
        if self._submitter is None:
            from gpumesh.store.submit import Submitter

            self._submitter = Submitter(self.r, self.url, self.settings, self.scripts, self._live)
        files = self.project_files() if request.project is not None else None
        return self._submitter.submit(request, files)

    def project_files(self) -> projects.Files:
        """Where this mesh keeps project files (the broker, or GPUMESH_ARTIFACTS's object store)."""
        from gpumesh.store import projects

        return projects.Files(self.rq, self.settings.artifacts)

    def queue(self, tier: int, job_class: type[Job] | None = None) -> Queue:
        """The RQ queue of a tier: the deliveries of its workers pass through it (each popped as it is pushed),
        and the tasks placed for the tier wait in it (a window of them, lua/_lib.lua's refresh_window)."""
        from rq import Queue  # only workers use RQ: the CLI's other commands start without importing it
        from rq.serializers import JSONSerializer

        return Queue(keys.tier_queue(tier), connection=self.rq, serializer=JSONSerializer, job_class=job_class)

    @property
    def url_masked(self) -> str:
        return mask_url(self.url)

    def ping(self, say: Callable[[str], None] | None = None) -> Broker:
        """Fail fast with exit code 3 when the broker is unreachable or refuses us. Through Sentinels
        (``redis+sentinel://``), a primary that cannot be reached while a Sentinel monitors its service may
        be one being replaced: wait for the promotion first, for the bound :func:`sentinel.failover_wait`
        gives, told through ``say``."""
        started, bound = time.monotonic(), None
        while True:
            try:
                self.r.ping()
            except redis.RedisError as exc:
                if bound is None:
                    bound = self._failover_wait(exc)
                    if bound and say is not None:
                        say(f"the broker at {self.url_masked} does not answer ({exc.__class__.__name__}); "
                            f"waiting up to {bound:.0f} s for its Sentinels to promote a replica (Ctrl-C stops)")  # fmt: skip
                if time.monotonic() - started + FAILOVER_POLL > bound:
                    said = translate(exc, self.url)
                    if bound:
                        raise type(said)(f"{said} (waited {bound:.0f} s for a failover)") from None
                    raise said from None
                time.sleep(FAILOVER_POLL)
                continue
            if bound and say is not None:
                say(f"broker reachable again after {time.monotonic() - started:.1f} s (failover)")
            return self

    def _failover_wait(self, exc: redis.RedisError) -> float:
        """How long :meth:`ping` waits for a failover after ``exc``: 0 but through Sentinels that monitor our
        service, for a connection error (a refused credential is no outage)."""
        if not sentinel.is_sentinel(self.url) or isinstance(exc, redis.AuthenticationError):
            return 0.0
        if not isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
            return 0.0
        return sentinel.failover_wait(self.redis)

    def close(self) -> None:
        self.r.close()
        self.rq.close()

    def epoch(self) -> str:
        """The id of this broker's data; it changes only if the data is lost. `gpumesh serve` (or
        ``gpumesh access load-functions``) makes it with the admin credential; on a broker without ACLs
        the first client to ask makes it. A credential that may not (a worker on a broker `serve` runs)
        finding none gets one clear BrokerError."""
        found = self.r.get(keys.EPOCH)
        if found:
            return found
        try:
            make_epoch(self.redis)
        except redis.exceptions.NoPermissionError:
            raise BrokerError(
                f"the broker at {self.url_masked} has no epoch key ({keys.EPOCH}: it lost its data, or was never "
                "prepared) and this credential may not make one: restart `gpumesh serve`, or run "
                "`gpumesh access load-functions --url ADMIN_URL`"
            ) from None
        return str(self.r.get(keys.EPOCH))

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
        return jobstatus.live(self.r, self.settings.worker_ttl)

    def deliver(self, queue: Queue, lease: scripts.Lease, take: bool = False) -> tuple[Job, str | None]:
        """The RQ job that carries a dispatched task to the worker holding its lease (RQ moves every task,
        so rq-dashboard and ``rq info`` see each delivery). Its id names the attempt, so a repeat is harmless.

        Its description and meta say, for a person reading rq-dashboard, which task of which job it is
        (see :func:`delivery_label`); the job's name and requirements are read once per job and kept.

        ``take``: the delivery goes to the front of the queue and RQ's pop of that queue rides in the same
        transaction (the LMOVE to its intermediate queue that RQ's dequeue makes), so the worker pops its own
        delivery, never a task waiting in the tier's queue, and saves the pop's two round trips and the read of a
        job it has just written. Returns the job written (of the queue's job class) and the id that pop took
        (None without ``take``): the job's own."""
        # RQ's own timeout is only a backstop: the executor enforces the task's timeout itself.
        backstop = int(lease.timeout + self.settings.lease_ttl + 60)
        name, job_requires = self._job_label(lease.job_id)
        description, meta = delivery_label(lease, name, job_requires)
        job_id = keys.rq_job_id(lease.task_id, lease.attempt, lease.backup)
        data = type(queue).prepare_data(
            EXECUTOR,
            args=(lease.task_id,),
            job_id=job_id,
            timeout=backstop,
            result_ttl=RESULT_TTL,
            failure_ttl=FAILURE_TTL,
            # Run within a lease of its dispatch or never (the executor would stop it as lost at once):
            # a delivery left on a stopped worker's queue expires instead of staying queued for good.
            ttl=int(self.settings.lease_ttl) + 60,
            description=description,
            meta=meta,
            at_front=take,
        )
        for repair in (True, False):
            with self.rq.pipeline() as p:
                # redis-py sends a transaction again when the link fails before its reply comes, though Redis may
                # have run it: what a first run pushed and popped of this delivery goes first, so it is never
                # listed twice (a stray id in the intermediate list is one RQ's maintenance would later fail as
                # stuck). Not covered: a stale job that sat at the head of the queue, which the first run popped
                # and the second run's reply does not name (it stays in the intermediate list until RQ's
                # clean-up).
                p.lrem(queue.key, 0, job_id)
                if take:
                    p.lrem(queue.intermediate_queue_key, 0, job_id)
                job = queue.enqueue_many([data], pipeline=p)[0]
                if take:
                    p.lmove(queue.key, queue.intermediate_queue_key)
                try:
                    replies = p.execute()
                except redis.ResponseError as exc:
                    # A tier's queue is every worker's of the tier, and any credential may write RQ's keys: one
                    # that is not what RQ keeps there (a string SET on the queue) would stop the whole tier.
                    if not repair or "WRONGTYPE" not in str(exc) or not self._clear_wrong_types(queue, job_id):
                        raise
                    continue
            head = replies[-1] if take else None
            return job, head.decode() if isinstance(head, bytes) else head
        raise AssertionError("unreachable: the second try returns or raises")

    def _clear_wrong_types(self, queue: Queue, job_id: str) -> bool:
        """Delete what a delivery writes that holds another type than RQ keeps there (the queue and its
        intermediate list, the delivery's job hash): whether there was any."""
        expected = {queue.key: "list", queue.intermediate_queue_key: "list", queue.job_class.key_for(job_id): "hash"}
        with self.rq.pipeline(transaction=False) as p:
            for key in expected:
                p.type(key)
            found = [t.decode() if isinstance(t, bytes) else str(t) for t in p.execute()]
        wrong = [key for (key, want), got in zip(expected.items(), found) if got not in (want, "none")]
        if wrong:
            log.warning("deleted %s: not the type RQ keeps there", ", ".join(wrong))
            self.rq.delete(*wrong)
        return bool(wrong)

    def _job_label(self, job_id: str) -> tuple[str, tuple[requirements.Requirement, ...]]:
        """A job's name and its job-wide requirements (``submit --require``): one read per job, then kept
        (neither changes while the job exists), so a delivery costs no extra round trip."""
        key = (self.url, job_id)
        label = _JOB_LABELS.get(key)
        if label is None:
            name, classes = self.r.hmget(keys.job(job_id), "name", "classes")
            try:
                base = tuple(requirements.Requirement(*r) for r in json.loads(classes or "[[]]")[0])
            except (ValueError, TypeError, IndexError):
                base = ()
            label = (name or "", base)
            if name is not None or classes is not None:  # a job that is gone is not kept
                if len(_JOB_LABELS) >= JOB_LABELS_KEPT:
                    _JOB_LABELS.clear()
                _JOB_LABELS[key] = label
        return label

    # -- reads -----------------------------------------------------------------------------------

    def job_status(self, job_id: str, waiting: bool = False) -> JobStatus:
        """A job's status; with ``waiting``, also which of its queued tasks no live worker may run."""
        try:
            return JobStatus.model_validate(jobstatus.read(self.r, job_id, self.settings.worker_ttl, waiting))
        except redis.RedisError as exc:
            raise translate(exc, self.url) from None

    def live_resources(self) -> dict[str, dict[str, Any]]:
        """Resources of every live worker (what requirements are checked against)."""
        return jobstatus.live_resources(self.r, self.settings.worker_ttl)

    def waiting_for(self, job_ids: list[str]) -> dict[str, list[Waiting]]:
        """``waiting_for`` of several jobs, the live fleet read once (a page of jobs); a job whose hash does
        not decode (any credential that writes jobs can write garbage) waits for nothing here."""
        if not job_ids:
            return {}
        with self.r.pipeline(transaction=False) as p:
            for j in job_ids:
                p.hgetall(keys.job(j))
            hashes = p.execute()
        fleet = list(self.live_resources().values())
        out: dict[str, list[Waiting]] = {}
        for j, h in zip(job_ids, hashes):
            try:
                out[j] = self._waiting_for(j, h, fleet) if h else []
            except Exception as exc:  # noqa: BLE001 - a job some credential wrote garbage into
                _unreadable("job", j, exc)
                out[j] = []
        return out

    def _waiting_for(self, job_id: str, h: dict[str, str], fleet: list[dict[str, Any]] | None = None) -> list[Waiting]:
        fleet = list(self.live_resources().values()) if fleet is None else fleet
        return [Waiting.model_validate(w) for w in jobstatus.waiting_for(self.r, job_id, h, fleet)]

    def task_ids(self, job_id: str) -> list[str]:
        self.job_status(job_id)
        return self.r.lrange(keys.job_tasks(job_id), 0, -1)

    def results(self, job_id: str) -> list[TaskResult]:
        return list(self.iter_results(job_id))

    def iter_task_ids(self, job_id: str, page: int = scripts.READ_PAGE) -> Iterator[list[str]]:
        """The job's task ids in payload order, a page at a time (a job of 1,000,000 tasks is never held whole)."""
        start = 0
        while True:
            ids = self.r.lrange(keys.job_tasks(job_id), start, start + page - 1)
            if not ids:
                return
            yield ids
            start += len(ids)

    def iter_results(self, job_id: str) -> Iterator[TaskResult]:
        """Every task's row in payload order, read a page per call (scripts.read_tasks) as they are consumed."""
        self.job_status(job_id)  # NotFound
        for ids in self.iter_task_ids(job_id):
            yield from self.task_results(ids)

    def task_results(self, ids: list[str]) -> list[TaskResult]:
        """The rows of these tasks, in this order (a task that no longer exists is left out)."""
        hashes = scripts.read_tasks(self.scripts, self.redis, ids)
        return [TaskResult.from_hash(tid, h) for tid, h in zip(ids, hashes) if h]

    def attempts(self, job_id: str) -> list[models.Attempt]:
        """Every attempt of the job's tasks, by start: those that ended (the job's stream of attempts), then
        those running now (the tasks the live workers hold), ``ended_at`` None."""
        with self.r.pipeline(transaction=False) as p:
            p.xrevrange(keys.job_attempts(job_id), count=ATTEMPTS_READ)  # the newest (MAXLEN ~ keeps a few more)
            p.time()
            p.zrange(keys.WORKERS, 0, -1)
            ended, (sec, _usec), registered = p.execute()
        out = [a for _id, f in reversed(ended) if (a := _attempt(job_id, f)) is not None]
        with self.r.pipeline(transaction=False) as p:
            for w in registered:
                p.hget(keys.worker(w), "current_task")
            current = dict(zip(registered, p.execute()))
        prefix = keys.task_id(job_id, 0)[:-1]
        mine = {w: t for w, t in current.items() if t and t.startswith(prefix)}
        with self.r.pipeline(transaction=False) as p:
            for t in mine.values():
                p.hmget(keys.task(t), "status", "index", "attempts", "worker", "started_at", "promoted",
                        "backup_worker", "backup_started_at")  # fmt: skip
            rows = p.execute()
        for w, (status, index, attempt, primary, started, promoted, backup, backup_started) in zip(mine, rows):
            if status != "running" or w not in (primary, backup):
                continue
            as_backup = w == backup and w != primary
            fields = {"index": index, "attempt": attempt, "worker": w, "outcome": "running",
                      "copy": "backup" if as_backup or promoted else "primary",
                      "started": backup_started if as_backup else started}  # fmt: skip
            if (a := _attempt(job_id, fields)) is not None:
                out.append(a)
        return sorted(out, key=lambda a: (a.started_at or float(sec), a.index, a.attempt, a.copy == "backup"))

    def task_ends(self, job_id: str, after: str = "0", block_ms: int = 1000) -> tuple[str, list[str]]:
        """(last entry id, task ids) of the entries on the job's stream of ends after ``after``, waiting up
        to ``block_ms`` for one when there is none yet; ``([after], [])`` when none came."""
        try:
            if self._may_block:
                reply = self.r.xread({keys.job_ended(job_id): after}, count=1000, block=block_ms)
                entries = reply[0][1] if reply else []
            else:
                entries = self.r.xrange(keys.job_ended(job_id), min=f"({after}", count=1000)
        except redis.exceptions.NoPermissionError as exc:
            if not self._may_block:
                raise translate(exc, self.url) from None
            # A credential that may read streams but not block on one (XREAD is a blocking command to ACLs; the
            # submitter of a broker an earlier serve set up): XRANGE after the last entry, a poll 0.25 s apart.
            self._may_block = False
            return self.task_ends(job_id, after, block_ms)
        except redis.RedisError as exc:
            raise translate(exc, self.url) from None
        if not entries:
            if not self._may_block:
                time.sleep(min(block_ms, 250) / 1000)
            return after, []
        return entries[-1][0], [fields["task"] for _id, fields in entries]

    def end_cursor(self, job_id: str) -> str:
        """The id of the newest entry on the job's stream of ends ("0-0" while there is none): read it before
        the job's status, then :meth:`task_ends` from it, and no end that came between the two is missed."""
        try:
            newest = self.r.xrevrange(keys.job_ended(job_id), count=1)
        except redis.RedisError as exc:
            raise translate(exc, self.url) from None
        return str(newest[0][0]) if newest else "0-0"

    def follow(self, job_id: str, idle_s: float = 1.0) -> JobFollower:
        """A job's status, read again each time one of its tasks ends (see :class:`JobFollower`)."""
        return JobFollower(self, job_id, idle_s)

    def task(self, task_id: str) -> dict[str, str]:
        h = self.r.hgetall(keys.task(task_id))
        if not h:
            raise NotFound(f"no task {task_id!r} on this broker")
        return h

    def job_fields(self, job_id: str, *names: str) -> list[str | None]:
        """These fields of the job's hash, in this order (None for one it lacks, all None for a job that is gone)."""
        return self.r.hmget(keys.job(job_id), *names)

    def job_statuses(self, job_ids: list[str]) -> list[str | None]:
        """Each job's status, in one round trip (None for a job that is gone)."""
        with self.r.pipeline(transaction=False) as p:
            for job_id in job_ids:
                p.hget(keys.job(job_id), "status")
            return list(p.execute())

    def set_preparing(self, worker_id: str, what: str) -> None:
        """What `workers`, `top` and the dashboard show while a worker prepares a job's environment ('' done)."""
        self.r.hset(keys.worker(worker_id), "preparing", what)

    def count_handback(self, job_id: str, lost_s: float) -> None:
        """A task of the job was handed back by a worker pausing (lent): the time its attempt lost, counted."""
        with self.r.pipeline(transaction=False) as p:
            p.hincrbyfloat(keys.job(job_id), "paused_lost_s", round(lost_s, 3))
            p.hincrby(keys.job(job_id), "paused_handbacks", 1)
            p.execute()

    def script_source(self, sha: str) -> str | None:
        """The source submit stored under its SHA-256 (None when it is gone; the caller checks the digest)."""
        return self.r.get(keys.script(sha))

    def task_count(self, job_id: str) -> int:
        """How many tasks the job has (without reading their ids)."""
        return self.r.llen(keys.job_tasks(job_id))

    def first_task_ids(self, job_id: str, n: int) -> list[str]:
        """The job's first ``n`` task ids, in payload order."""
        return self.r.lrange(keys.job_tasks(job_id), 0, n - 1)

    def task_fields(self, task_id: str, *names: str) -> list[str | None]:
        """These fields of the task's hash, in this order (None for one it lacks)."""
        return self.r.hmget(keys.task(task_id), *names)

    def failed_task_ids(self, job_id: str) -> list[str]:
        """The first tasks of the job to fail for good (keys.job_failed), once each (a retried task that failed
        again is listed twice there)."""
        return list(dict.fromkeys(self.r.lrange(keys.job_failed(job_id), 0, -1)))

    def result_keys(self) -> dict[str, str]:
        """The registry of worker result keys (ACL user -> public key), written by the admin (signing.py)."""
        return dict(self.r.hgetall(keys.RESULT_KEYS))

    def register_result_key(self, user: str, public: str) -> None:
        """Record ``user``'s result public key (the admin credential only: others may not write it)."""
        register_result_key(self.redis, user, public)

    def may_write_jobs(self) -> bool:
        """Whether this credential may write the job index (a read-only one may not): see may_write_jobs."""
        return may_write_jobs(self.redis)

    def round_trip_s(self) -> float:
        """One PING's round trip, in seconds."""
        t0 = time.perf_counter()
        self.r.ping()
        return time.perf_counter() - t0

    def counters(self) -> Counters:
        """What the metrics endpoint exports of Redis, in one round trip after reading the ready set: queued
        tasks by job priority, the transitions' counters and the task duration histogram."""
        ready = self.r.zrange(keys.READY, 0, -1, withscores=True)
        with self.r.pipeline(transaction=False) as p:
            for member, _prio in ready:
                job_id, klass = member.rsplit("/", 1)
                p.zcard(keys.pending(job_id, int(klass)))
            p.hgetall(keys.STATS)
            p.hgetall(keys.STATS_DURATION)
            res = p.execute()
        queued: dict[str, int] = {}
        for (_member, prio), depth in zip(ready, res[: len(ready)]):
            queued[str(int(prio))] = queued.get(str(int(prio)), 0) + depth
        return Counters(queued, res[-2], res[-1])

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
            try:
                out.append(_worker_info(w, h, tiers))
            except Exception as exc:  # noqa: BLE001 - a registration some credential wrote garbage into
                _unreadable("worker", w, exc)
        return out

    def tiers(self, sample: int = 10_000, live: list[WorkerInfo] | None = None) -> list[TierLoad]:
        """Each tier: its queue, the live workers in it, the tasks waiting in its queue (the window) and its share of
        every queued task, split as submit's forecast splits a job (by the live tiers' scores, heaviest first). A
        class of a job with more than ``sample`` queued tasks is sampled (ZRANDMEMBER) and scaled. ``live``: the
        workers as :meth:`workers` just read them (else read here)."""
        k = self.settings.tiers
        live = self.workers() if live is None else live
        scores = {w.id: w.score_gflops for w in live}
        capacity = scheduling.tier_capacity(scores, k) if scores else [0.0] * k
        ready = [m.rsplit("/", 1) for m in self.r.zrange(keys.READY, 0, -1)]
        pending = [keys.pending(job, int(klass)) for job, klass in ready if klass.isdigit()]
        with self.r.pipeline(transaction=False) as p:
            for key in pending:
                p.zcard(key)
            for tier in range(k):
                p.llen("rq:queue:" + keys.tier_queue(tier))
            (*cards,) = p.execute(raise_on_error=False)
        waiting, cards = cards[len(pending) :], cards[: len(pending)]
        with self.r.pipeline(transaction=False) as p:
            for key, card in zip(pending, cards):
                if isinstance(card, int) and card > sample:
                    p.zrandmember(key, sample, withscores=True)
                else:
                    p.zrange(key, 0, -1, withscores=True)
            rows = p.execute(raise_on_error=False)
        counts, estimated = [0.0] * k, False
        for card, got in zip(cards, rows):
            if not isinstance(card, int) or not isinstance(got, list) or not got:
                continue
            pairs = got if isinstance(got[0], (list, tuple)) else list(zip(got[::2], got[1::2]))
            costs = [float(cost) for _member, cost in pairs]
            scale = card / len(costs)
            estimated = estimated or scale > 1
            for tier in scheduling.assign_task_tiers(costs, capacity):
                counts[tier] += scale
        return [
            TierLoad(
                tier=t,
                queue=keys.tier_queue(t),
                workers=[w.name for w in live if w.tier == t],
                waiting=n if isinstance(n, int) else 0,
                queued=round(counts[t]),
                estimated=estimated,
            )  # fmt: skip
            for t, n in zip(range(k), waiting)
        ]

    def jobs(self, limit: int = 50) -> list[JobStatus]:
        """The newest jobs; one whose hash does not decode (written by some credential) is left out."""
        ids = self.r.zrevrange(keys.JOBS, 0, limit - 1)
        with self.r.pipeline(transaction=False) as p:
            for j in ids:
                p.hgetall(keys.job(j))
            hashes = p.execute()
        out = []
        for j, h in zip(ids, hashes):
            if h:
                try:
                    out.append(JobStatus.from_hash(j, h))
                except Exception as exc:  # noqa: BLE001 - a job some credential wrote garbage into
                    _unreadable("job", j, exc)
        return out

    def first_failures(self, job_ids: list[str]) -> dict[str, TaskResult]:
        """The first task of each job, as its list of failures names them (at most 100), that is failed now
        (one retried since may be done): a page of jobs in three pipelined reads, not every failed task.
        A job none of whose listed tasks is failed now is left out (Job.failures scans its tasks)."""
        with self.r.pipeline(transaction=False) as p:
            for j in job_ids:
                p.lrange(keys.job_failed(j), 0, -1)
            listed = [list(dict.fromkeys(ids)) for ids in p.execute()]
        with self.r.pipeline(transaction=False) as p:
            for ids in listed:
                for t in ids:
                    p.hget(keys.task(t), "status")
            statuses = iter(p.execute())
        first = {}
        for j, ids in zip(job_ids, listed):
            failed = [t for t, status in zip(ids, statuses) if status == "failed"]
            if failed:
                first[failed[0]] = j
        with self.r.pipeline(transaction=False) as p:
            for t in first:
                p.hgetall(keys.task(t))
            hashes = p.execute()
        out = {}
        for (t, j), h in zip(first.items(), hashes):
            try:
                out[j] = TaskResult.from_hash(t, h)
            except Exception as exc:  # noqa: BLE001 - a task some credential wrote garbage into
                _unreadable("task", t, exc)
        return out

    def logs(self, target: str, cursors: dict[str, str] | None = None) -> Iterator[tuple[str, str, str]]:
        """(task id, stream, line) of a task, or of every task of a job: what was written since the last read,
        grouped by task in payload order (each task's lines in the order written, across its attempts).

        ``cursors`` (target -> the last entry read of the job's log) is updated, so a follower reads only new
        lines. A job's read holds its new lines in memory to group them (store/tasklog.py)."""
        cursors = {} if cursors is None else cursors
        if self.r.exists(keys.job(target)):
            by_task: dict[int, list[tuple[str, str]]] = {}
            for entry_id, index, stream, line in tasklog.job_lines(self.r, target, cursors.get(target)):
                cursors[target] = entry_id
                by_task.setdefault(index, []).append((stream, line))
            for index in sorted(i for i in by_task if i >= 0):  # < 0: an entry that names no task
                tid = keys.task_id(target, index)
                for stream, line in by_task[index]:
                    yield tid, stream, line
        elif self.r.exists(keys.task(target)):
            yield from self.task_logs([target], cursors)
        else:
            raise NotFound(f"no task {target!r} on this broker")

    def task_logs(self, ids: list[str], cursors: dict[str, str]) -> Iterator[tuple[str, str, str]]:
        """(task id, stream, line) of these tasks' logs after ``cursors`` (task id -> the last entry of its job's
        log scanned for it), which is updated."""
        for tid in ids:
            lines, last = tasklog.task_lines(self.r, tid, cursors.get(tid))
            if last:
                cursors[tid] = last
            for stream, line in lines:
                yield tid, stream, line

    def target_ended(self, target: str) -> bool:
        """Whether a job, or a task, has reached a terminal status."""
        h = self.r.hget(keys.job(target), "status")
        if h is None:
            h = self.r.hget(keys.task(target), "status")  # its status alone: a task's hash holds its payload
            if h is None:
                raise NotFound(f"no task {target!r} on this broker")
        return h in TERMINAL

    # -- changes ---------------------------------------------------------------------------------

    def cancel(self, job_id: str) -> JobStatus:
        """Cancel every queued or running task; running ones are killed at their worker's next heartbeat. A call
        per task (each holds Redis some microseconds), a page of them per round trip."""
        self.job_status(job_id)  # NotFound
        for ids in self.iter_task_ids(job_id, 2000):
            with self.r.pipeline(transaction=False) as p:
                for tid in ids:
                    scripts.cancel(self.scripts, p, tid)
                p.execute()
        return self.job_status(job_id)

    def pull(
        self, job_id: str, dest: Path, task: str | int | None = None, *, pattern: str | None = None,
        force: bool = False, parallel: int = 8, on_start: Callable[[int, int], None] | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> artifacts.Pulled:  # fmt: skip
        """Fetch a job's stored output files (or one task's: its id or index) into ``dest``/<index>/<path>."""
        ids = self.task_ids(job_id)
        if task is not None:
            wanted = keys.task_id(job_id, int(task)) if str(task).isdigit() else str(task)
            if wanted not in ids:
                raise NotFound(
                    f"job {job_id} has no task {task!r} (give a task id or an index from 0 to {len(ids) - 1})"
                )
            ids = [wanted]
        from gpumesh.store import artifacts

        try:
            return artifacts.pull(
                self.r, self.rq, ids, dest, pattern=pattern, force=force, parallel=parallel, on_start=on_start,
                on_bytes=on_bytes, trusted=self.settings.artifacts,
            )  # fmt: skip
        except redis.RedisError as exc:
            raise translate(exc, self.url) from None

    def drop_files(self, job_id: str) -> int:
        """Delete the output files a job's tasks stored, from the broker or its object store; how many
        tasks had some."""
        stored, store, project = self.r.hmget(keys.job(job_id), "artifact_bytes", "artifact_store", "project")
        from gpumesh.store import artifacts, projects

        if project:  # the project's files go with the job's files, if no other job refers to them
            projects.detach(self.project_files(), self.scripts, self.r, job_id, project, self.settings.artifacts)
        if stored is None and not store:  # no task of it ever kept a file (complete counts their bytes)
            self.job_status(job_id)  # NotFound
            return 0
        return artifacts.drop(self.r, job_id, self.task_ids(job_id), store, self.settings.artifacts)

    def retry(self, job_id: str, cancelled: bool = False) -> tuple[int, JobStatus]:
        """Re-queue every failed task of a job (and, with ``cancelled``, every cancelled one) with a fresh set
        of attempts. Returns (tasks re-queued, status)."""
        self.job_status(job_id)  # NotFound
        n = 0
        for ids in self.iter_task_ids(job_id, 2000):
            with self.r.pipeline(transaction=False) as p:
                for tid in ids:
                    scripts.retry(self.scripts, p, tid, cancelled)
                n += sum(1 for res in p.execute() if int(res[0]) == 1)
        return n, self.job_status(job_id)


def make_epoch(client: redis.Redis) -> None:
    """Give the broker's data its id (keys.EPOCH) unless it has one: a change tells workers the data was lost."""
    client.set(keys.EPOCH, uuid.uuid4().hex, nx=True)


def register_result_key(client: redis.Redis, user: str, public: str) -> None:
    """Record ``user``'s result public key (signing.result_public) in the registry results are verified with;
    only the admin credential may."""
    client.hset(keys.RESULT_KEYS, user, public)


def may_write_jobs(client: redis.Redis) -> bool:
    """Whether the credential may write the job index: ``ZADD XX`` of a member that is not there adds
    nothing, and a read-only credential is refused it."""
    try:
        client.zadd(keys.JOBS, {f"write-probe-{uuid.uuid4().hex}": 0}, xx=True)
    except redis.exceptions.NoPermissionError:
        return False
    return True


def _worker_info(w: str, h: dict[str, str], tiers: dict[str, int]) -> WorkerInfo:
    """A worker's registration as ``workers`` shows it (ValueError or TypeError when it does not decode)."""
    resources = json.loads(h.get("resources") or "{}")
    return WorkerInfo(
        id=w,
        name=h.get("name", w),
        hostname=h.get("hostname", ""),
        device=h.get("device", "cpu"),
        device_name=h.get("device_name", ""),
        score_gflops=float(h.get("score", 0)),
        tier=tiers.get(w, 0),
        state="busy" if h.get("current_task") else "paused" if h.get("paused") else "idle",
        current_task=h.get("current_task") or None,
        last_heartbeat=ts(h.get("last_heartbeat")),
        resources=resources if isinstance(resources, dict) else {},
        paused=h.get("paused") or None,
        preparing=h.get("preparing") or None,
        version=h.get("version") or None,
        protocol=protocols.of_registration(h.get("protocol"), h.get("version")),
        envs=[d for d in (h.get("envs") or "").split(",") if d],
        env_failed=[d for d in (h.get("env_failed") or "").split(",") if d],
    )


_UNREADABLE: set[tuple[str, str]] = set()  # what was said to be unreadable already (said once per process)


def _unreadable(what: str, name: str, exc: BaseException) -> None:
    """A job, task or registration that does not decode (any credential that writes them can write garbage)
    is left out of what is listed: said once, not at every refresh of a page that lists it."""
    if (what, name) not in _UNREADABLE and len(_UNREADABLE) < 10_000:
        _UNREADABLE.add((what, name))
        log.warning("%s %s is unreadable (%s); left out", what, name, type(exc).__name__)


ATTEMPTS_READ = 50_000  # the most a job's stream of attempts keeps (the Lua scripts cap it there)


def _attempt(job_id: str, f: dict[str, str]) -> models.Attempt | None:
    """An entry of a job's stream of attempts; None for one that does not decode (any credential that
    writes jobs can write the stream)."""
    try:
        index = int(f["index"])
        outcome = f["outcome"]
        if outcome not in models.ATTEMPT_OUTCOMES:
            return None
        return models.Attempt(
            index=index, task_id=keys.task_id(job_id, index), attempt=int(f.get("attempt") or 0),
            worker=str(f["worker"]), copy="backup" if f.get("copy") == "backup" else "primary",
            started_at=float(f["started"]) if f.get("started") else None,
            ended_at=float(f["ended"]) if f.get("ended") else None,
            outcome=outcome, kind=f.get("kind") or None,  # type: ignore[arg-type]
        )  # fmt: skip
    except (KeyError, ValueError, TypeError):
        return None


def delivery_label(
    lease: scripts.Lease, job_name: str, job_requires: tuple[requirements.Requirement, ...] = ()
) -> tuple[str, dict[str, Any]]:
    """What rq-dashboard shows of a delivery: a one-line description and meta (JSON), e.g.
    ``task 7 of job "sweep" (3f2a9c1d0b7e): attempt 2 of 3, cost 4, requires vram_gb>=40``.
    RQ keeps a delivery while it is queued or running (its record goes as its run ends: RESULT_TTL)."""
    cost: float | None = None
    reqs: list[str] | None = None
    if len(lease.payload) <= PAYLOAD_LABEL_BYTES:
        try:
            payload = json.loads(lease.payload)
            if isinstance(payload, dict):
                cost = models.payload_cost(payload)
                own = requirements.parse_all(models.payload_requires(payload), "requires")
                reqs = list(requirements.canonical(job_requires + own))
        except (ValueError, TypeError, UsageError):
            pass  # submit checked the payload; a label never stops a delivery
    if reqs is None:
        reqs = list(requirements.canonical(job_requires))
    meta: dict[str, Any] = {
        "job": job_name,
        "job_id": lease.job_id,
        "task_id": lease.task_id,
        "task_index": lease.index,
        "attempt": lease.attempt,
        "max_attempts": lease.max_attempts,
        "cost": cost,
        "requires": reqs,
        "backup": lease.backup,
        "timeout_s": lease.timeout,
    }
    if lease.backup:
        meta["backup_mode"] = lease.backup_mode
    job = f'job "{job_name}" ({lease.job_id})' if job_name else f"job {lease.job_id}"
    parts = [f"attempt {lease.attempt}" + (f" of {lease.max_attempts}" if lease.max_attempts else "")]
    if cost is not None:
        parts.append(f"cost {cost:g}")
    if reqs:
        parts.append("requires " + " ".join(reqs))
    if lease.backup:
        parts.append("backup copy")
    return f"task {lease.index} of {job}: " + ", ".join(parts), meta


class JobFollower:
    """A job's status as it changes, woken by the job's stream of task ends (a blocking XREAD), not by a poll:
    the first call reads the status at once; each later one blocks until a task of the job ends, or ``idle_s``
    passes with none ending (tasks that only start show then), and reads it again. ``Job.wait``, ``submit
    --wait`` and ``status --watch`` return within a round trip of the job's last task ending.

    >>> follow = broker.follow(job_id)                           # doctest: +SKIP
    >>> while not (st := follow()).finished: print(st.tasks.done)   # doctest: +SKIP
    """

    def __init__(self, broker: Broker, job_id: str, idle_s: float = 1.0) -> None:
        self.broker, self.job_id, self.idle_s = broker, job_id, idle_s
        self.after: str | None = None  # the last entry of the stream of ends seen; None before the first call

    def __call__(self, within: float | None = None) -> JobStatus:
        """The job's status: at once the first time, else once a task ends or ``within`` (default ``idle_s``)
        seconds pass."""
        if self.after is None:
            self.after = self.broker.end_cursor(self.job_id)  # before the status: an end after it wakes the next call
        else:
            wait = self.idle_s if within is None else min(within, self.idle_s)
            self.after, _ended = self.broker.task_ends(self.job_id, self.after, block_ms=max(1, int(wait * 1000)))
        return self.broker.job_status(self.job_id)
