"""``gpumesh worker``: an RQ SimpleWorker that runs only gpumesh's executor, under leases.

The worker process itself never initialises CUDA: the benchmark and every task run in child
processes. A heartbeat thread renews the registration and the current lease, learns about
cancellation, recomputes the tier from the live scores (and so the queue order), and takes its turn
as the mesh's reaper.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import threading
import time
import uuid
from typing import Any

import psutil
import redis
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.worker import SimpleWorker

from . import __version__, executor, keys, reaper, scheduling, scripts
from .broker import EXECUTOR, Broker
from .logship import LogShipper
from .models import Capability
from .sandbox import Limits

log = logging.getLogger("gpumesh.worker")

SPECULATION_SPEEDUP = 2.0  # a backup copy runs only on a worker at least this many times as strong as the primary's


def refusal(job: Job) -> str | None:
    """Why an RQ job must not run here, or None. Whoever can write rq:job:* picks the function."""
    if job.func_name != EXECUTOR:
        return f"refused: function {job.func_name!r} is not gpumesh's executor"
    for attr in ("_success_callback_name", "_failure_callback_name", "_stopped_callback_name"):
        if getattr(job, attr, None):
            return "refused: gpumesh jobs carry no callbacks"
    if len(job.args) != 1 or not isinstance(job.args[0], str) or job.kwargs:
        return "refused: a gpumesh job takes exactly one task id"
    return None


class MeshJob(Job):
    """An RQ job whose function is pinned: nothing read from Redis chooses code to import."""

    @property
    def func(self):  # type: ignore[override]
        if self.func_name != EXECUTOR:
            raise PermissionError(f"refused: function {self.func_name!r} is not gpumesh's executor")
        return executor.run_task


class MeshWorker(SimpleWorker):
    job_class = MeshJob

    def __init__(
        self,
        broker: Broker,
        capability: Capability,
        name: str | None = None,
        cuda_visible_devices: str | None = None,
        parent_pid: int | None = None,
        verifier: Any = None,
        sandbox_user: tuple[int, int] | None = None,
        zygote: Any = None,
    ) -> None:
        self.broker = broker
        self.settings = broker.settings
        self.capability = capability
        self.cuda_visible_devices = cuda_visible_devices
        self.parent_pid = parent_pid
        self.verifier = verifier  # signing.Verifier when this worker runs only signed tasks
        self.sandbox_user = sandbox_user  # (uid, gid) tasks run as, when the worker runs as root
        self.zygote = zygote  # warm.Zygote in --warm mode: tasks fork from it instead of a new interpreter
        self.display_name = name or socket.gethostname()
        self.worker_id = f"{self.display_name}-{uuid.uuid4().hex[:6]}"
        self.executor = executor.Executor(self)
        self._order = list(range(self.settings.tiers - 1, -1, -1))
        self._published: list[int] | None = None
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._hb_failing = False
        self._scores: dict[str, float] = {}
        self.epoch = ""
        self.fatal = ""  # why the worker stopped for good (broker data lost, credentials revoked)
        self.logs = LogShipper(broker.r)
        self._default_task_memory = int(psutil.virtual_memory().total * 0.9)  # read once, not per task
        super().__init__(
            [q.name for q in broker.queues],
            name=self.worker_id,
            connection=broker.rq,
            serializer=JSONSerializer,
            worker_ttl=max(60, int(self.settings.worker_ttl * 2)),
        )

    # -- RQ hooks --------------------------------------------------------------------------------

    @property
    def dequeue_timeout(self) -> int:
        # Short blocking pops, so a change of tier (a worker joined or died) applies within a heartbeat.
        return max(1, math.ceil(self.settings.heartbeat_interval))

    @property
    def _ordered_queues(self) -> list[Any]:
        # RQ reads this before every blocking pop, so a tier change applies at the next pop.
        by_name = {q.name: q for q in self.queues}
        return [by_name[keys.queue_name(t)] for t in self._order]

    @_ordered_queues.setter
    def _ordered_queues(self, _value: list[Any]) -> None:
        pass  # the order is the scheduler's, not RQ's dequeue strategy

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None) -> Any:
        # Pop with RQ's own idle limit set to one pop: when every queue stayed empty that long, this
        # worker is idle, the moment to back up a straggler (submit --speculate), then pop again.
        if timeout is None or max_idle_time is not None:  # burst mode, or an idle limit of the caller's
            return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
        while True:
            result = super().dequeue_job_and_maintain_ttl(timeout, max_idle_time=timeout)
            if result is not None or self._stop_requested or self.fatal:
                return result
            try:
                self._speculate()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("could not look for stragglers (%s)", exc)

    def _speculate(self) -> None:
        """Run a backup copy of the running task this worker would most likely finish first, if any."""
        r, me, mine = self.broker.r, self.worker_id, self.capability.score_gflops
        tids = r.zrange(keys.LEASES, 0, 199)
        if not tids:
            return
        with r.pipeline(transaction=False) as p:
            for tid in tids:
                p.hmget(keys.task(tid), "status", "worker", "backup", "job", "started_at")
            rows = [(tid, *row) for tid, row in zip(tids, p.execute()) if row[0] == "running" and row[1] != me]
        jobs = sorted({row[4] for row in rows if row[4]})
        with r.pipeline(transaction=False) as p:
            for job in jobs:
                p.hmget(keys.job(job), "speculate", "queued")
            open_jobs = {job for job, (flag, queued) in zip(jobs, p.execute()) if flag == "1" and queued == "0"}
        scores = self._scores
        candidates = sorted(
            (scores.get(row[2], 0.0), float(row[5] or 0), row[0])
            for row in rows
            if row[4] in open_jobs and not row[3] and scores.get(row[2], 0.0) * SPECULATION_SPEEDUP <= mine
        )
        for _score, _started, tid in candidates[:3]:
            lease = scripts.speculate(
                self.broker.scripts, r, tid, me, int(self.settings.lease_ttl * 1000), mine, SPECULATION_SPEEDUP
            )
            if isinstance(lease, scripts.Lease):
                self.executor.run_lease(lease)
                return

    def execute_job(self, job: Job, queue: Any) -> None:
        why = refusal(job)
        if why:
            log.error("RQ job %s from %s %s", job.id, queue.name, why)
            self.handle_job_failure(job, queue, exc_string=why)
            return
        try:
            super().execute_job(job, queue)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            # RQ's own bookkeeping lost the broker: keep the worker alive (RQ would quit) and wait for it.
            # gpumesh's state is safe: the task was reported, or its lease lapses and it is re-queued.
            log.warning("broker unreachable during RQ bookkeeping for %s (%s); waiting for it", job.id, exc)
            self._wait_for_broker()

    def _wait_for_broker(self) -> None:
        delay = 0.5
        while not self._stop_requested:
            try:
                self.connection.ping()
                log.info("broker reachable again")
                return
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(delay)
                delay = min(delay * 2, 10.0)

    def work(self, *args: Any, **kwargs: Any) -> bool:
        executor.bind(self)
        self.epoch = self.broker.epoch()
        warning = self.broker.eviction_warning()
        if warning:
            log.warning(warning)
        self.logs.start()
        # List every tier queue in RQ's registry so `rq info` and rq-dashboard show the empty ones too.
        self.connection.sadd(self.queue_class.redis_queues_keys, *[q.key for q in self.queues])
        self._register()
        self._beat()
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, name="gpumesh-heartbeat", daemon=True)
        self._hb_thread.start()
        log.info(
            "worker %s ready: %s (%s), %.1f GFLOP/s, broker %s",
            self.worker_id, self.capability.device, self.capability.device_name,
            self.capability.score_gflops, self.broker.url_masked,
        )  # fmt: skip
        try:
            return super().work(*args, **kwargs)
        finally:
            self._hb_stop.set()
            self._hb_thread.join(timeout=5)
            self._unregister()
            self.executor.close()
            executor.bind(None)

    # -- gpumesh ---------------------------------------------------------------------------------

    def limits(self, timeout: float) -> Limits:
        mem = self.settings.task_memory_mb << 20 or self._default_task_memory
        cpus = os.cpu_count() or 1
        return Limits(
            timeout=timeout,
            memory_bytes=mem,
            cpu_seconds=math.ceil(timeout * cpus) + 10,
            log_bytes=self.settings.log_max_bytes,
            result_bytes=self.settings.result_max_bytes,
            user=self.sandbox_user,
            python=self.settings.sandbox_python,
        )

    def _register(self) -> None:
        cap = self.capability
        with self.broker.r.pipeline(transaction=True) as p:
            p.hset(
                keys.worker(self.worker_id),
                mapping={
                    "name": self.display_name,
                    "hostname": socket.gethostname(),
                    "pid": os.getpid(),
                    "device": cap.device,
                    "device_name": cap.device_name,
                    "memory": cap.memory_bytes,
                    "score": cap.score_gflops,
                    "version": __version__,
                    "current_task": "",
                },
            )
            p.pexpire(keys.worker(self.worker_id), int(self.settings.worker_ttl * 1000))
            p.zadd(keys.SCORES, {self.worker_id: cap.score_gflops})
            p.execute()

    def _unregister(self) -> None:
        try:
            with self.broker.r.pipeline(transaction=True) as p:
                p.delete(keys.worker(self.worker_id))
                p.zrem(keys.WORKERS, self.worker_id)
                p.zrem(keys.SCORES, self.worker_id)
                p.execute()
        except redis.RedisError as exc:
            log.warning("could not unregister (%s); the registration expires by itself", exc)

    def _heartbeat_loop(self) -> None:
        while not self._hb_stop.wait(self.settings.heartbeat_interval):
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.warning("parent process %d is gone; stopping", self.parent_pid)
                self.parent_pid = None
                os.kill(os.getpid(), signal.SIGTERM)
            try:
                self._beat()
                if self._hb_failing:
                    log.info("broker reachable again")
                self._hb_failing = False
            except (redis.AuthenticationError, redis.exceptions.NoPermissionError) as exc:
                self._stop_for_good("the broker refused this worker's credentials (revoked?)", exc)
            except redis.RedisError as exc:
                if not self._hb_failing:
                    log.warning("heartbeat failed (%s); retrying every %.1fs", exc, self.settings.heartbeat_interval)
                self._hb_failing = True
            except Exception:
                log.exception("heartbeat error")

    def _beat(self) -> None:
        s = self.settings
        running = self.executor.current
        sent_at = time.monotonic()
        beat = scripts.heartbeat(
            self.broker.scripts,
            self.broker.r,
            self.worker_id,
            int(s.worker_ttl * 1000),
            running.lease if running else None,
            int(s.lease_ttl * 1000),
            self.epoch,
        )
        if not beat.epoch_ok:
            self._broker_lost()
            return
        if running is not None:
            if beat.lease == "ok":
                running.last_renewal = sent_at
            elif beat.lease == "cancelled":
                running.stop("cancelled")
            elif beat.lease == "lost":
                running.stop("lease lost: the task was leased again elsewhere")
        if not beat.registered:
            log.warning("registration had expired (paused or cut off?); registering again")
            self._register()
            scripts.heartbeat(
                self.broker.scripts, self.broker.r, self.worker_id, int(s.worker_ttl * 1000), None, 0, self.epoch
            )
        scores = self.broker.live_scores()
        scores.setdefault(self.worker_id, self.capability.score_gflops)
        self._scores = scores
        if running is not None and running.lease.backup and self._work_waiting():
            running.stop("the backup copy yielded to queued work")
        tiers = scheduling.worker_tiers(scores, s.tiers)
        order = scheduling.queue_order(tiers[self.worker_id], set(tiers.values()), s.tiers)
        self._order = order
        if order != self._published or not beat.registered:
            self._published = order
            self.broker.r.hset(
                keys.worker(self.worker_id),
                mapping={"tier": tiers[self.worker_id], "queues": ",".join(map(str, order))},
            )
        self.broker.rq.expire(self.key, self.worker_ttl + 60)
        if self._reaper_turn():
            report = reaper.reap_once(self.broker)
            if any(report.values()):
                log.info("reaper: %s", ", ".join(f"{k} {v}" for k, v in report.items() if v))

    def _work_waiting(self) -> bool:
        with self.broker.r.pipeline(transaction=False) as p:
            for q in self.queues:
                p.llen(q.key)
            return any(p.execute())

    def _broker_lost(self) -> None:
        """The broker's epoch changed: its data (and our task) is gone. Kill the task, report nothing, stop."""
        self._stop_for_good(
            "the broker lost its data (it restarted empty?); this worker stopped without reporting its task. "
            "Start it again to join the broker as it is now"
        )

    def _stop_for_good(self, why: str, exc: Exception | None = None) -> None:
        if self.fatal:
            return
        self.fatal = why
        log.error("%s%s: killing the current task and stopping", why, f" ({exc})" if exc else "")
        running = self.executor.current
        if running is not None:
            running.stop("broker lost: " + why)
        self._hb_stop.set()
        os.kill(os.getpid(), signal.SIGTERM)  # RQ's warm shutdown: no new work

    def _reaper_turn(self) -> bool:
        """One reaper at a time across the mesh (an optimisation: reaping twice is harmless)."""
        ttl = int(self.settings.heartbeat_interval * 2000) + 1000
        r = self.broker.r
        if r.set(keys.REAPER_LOCK, self.worker_id, nx=True, px=ttl):
            return True
        if r.get(keys.REAPER_LOCK) == self.worker_id:
            r.pexpire(keys.REAPER_LOCK, ttl)
            return True
        return False
