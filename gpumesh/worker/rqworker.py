"""RQ's side of a gpumesh worker: RQ's own bookkeeping for each delivery, in fewer round trips, and none
at all once the broker refuses the worker's credentials.

RQ beats (three commands, one round trip each) before and after every pop, writes the worker's state
twice a delivery (idle after the run, idle again before the pop), prepares a run in two transactions,
stamps the job's heartbeat once more as it ends and reads a finished job's dependents before recording
it. gpumesh keeps its own state and lease per task: here each of those reaches Redis at most once a
second, or in the transaction that follows. A run's start and the last run's success then wait, in one
transaction, until the next attempt runs, and go in the round trip it overlaps (send_records).
rq-dashboard and ``rq info`` see the same workers, states, queues and running deliveries, a few milliseconds
later (tests/dashboard/test_dashboard_view.py compares a recorded success key by key with RQ's). A delivery's own RQ
records go as its run ends: gpumesh keeps the outcome, and a finished delivery kept for RQ's result TTL would
cost the broker about 6.8 KB each while a big job runs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import redis
from rq.exceptions import StopRequested
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.utils import now
from rq.worker import SimpleWorker, WorkerStatus

log = logging.getLogger("gpumesh.worker")

RQ_BEAT_EVERY = 1.0  # s: RQ's own beat of the worker's record, and its state, at most this often from RQ's loop
# The broker refuses this worker's credentials: its ACL user was deleted or disabled (`gpumesh access revoke`),
# or stripped of the commands a worker needs. Nothing it does can succeed any more.
REFUSED = (redis.AuthenticationError, redis.exceptions.NoPermissionError)
# What a dispatch raises on garbage in Redis (a function's error, an unreadable reply or RQ job): never
# the worker's end. (REFUSED, a ResponseError too, is caught before it.)
BAD_DATA: tuple[type[Exception], ...] = (redis.ResponseError, ValueError, KeyError, TypeError, IndexError)
MAINTENANCE_BAD_DATA: tuple[type[Exception], ...] = (*BAD_DATA, AssertionError)
OUTAGE = (redis.ConnectionError, redis.TimeoutError)  # the broker is down, restarting or cut off


class LeanRQWorker(SimpleWorker):
    """A SimpleWorker whose bookkeeping per job takes fewer round trips (see the module's docstring), and which
    writes nothing more once the broker refuses it (``revoked``; :meth:`_revoked` says what the worker does)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.revoked = False  # the broker refuses our credentials outright: nothing more can be written
        self._rq_beat_at = 0.0  # when RQ's record of this worker was last beaten (RQ_BEAT_EVERY)
        self._rq_lost = False  # the broker went away while RQ recorded a run's success
        self._state_written: str | None = None  # the state last sent to RQ's record
        self._prepared: str | None = None  # the RQ job whose start prepare_execution wrote already
        # RQ's records of runs (the last one's success, the next one's start), gathered in one transaction that
        # send_records sends while the next attempt runs, and before anything else of RQ's is written.
        self._unsent: Any = None
        self._outage_ended: str | None = None  # the RQ job whose run ended in a broker outage (handle_exception)
        super().__init__(*args, **kwargs)

    def _revoked(self, exc: Exception) -> None:
        """The broker refused this worker's credentials (``exc``): set ``revoked`` and stop."""
        raise NotImplementedError

    # -- once the broker refuses our credentials, RQ's bookkeeping is skipped and the worker stops ------

    @contextlib.contextmanager
    def _unless_refused(self) -> Iterator[None]:
        """Around RQ's bookkeeping: once the broker refuses this worker, write nothing more and stop (RQ's
        loop ends on StopRequested); the reaper fails what RQ still shows as started on our queue."""
        if self.revoked:
            raise StopRequested
        try:
            yield
        except REFUSED as exc:
            self._revoked(exc)
            raise StopRequested from None

    @contextlib.contextmanager
    def _through_outage(self, what: str) -> Iterator[None]:
        """Around RQ's bookkeeping between deliveries: RQ's loop quits on any error, and a broker outage or
        failover must not end the worker. The step is skipped (RQ does it again on its next turn); gpumesh's
        own heartbeat thread keeps the registration and lease, and says when the broker is gone."""
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("RQ's %s skipped: the broker is unreachable (%s)", what, exc)
            time.sleep(0.5)

    # -- RQ's bookkeeping per delivery, in fewer round trips -------------------------------------------

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        with self._unless_refused(), self._through_outage("heartbeat"):
            if pipeline is not None:
                super().heartbeat(timeout, pipeline)
                return
            if timeout is None and time.monotonic() - self._rq_beat_at < RQ_BEAT_EVERY:
                return  # the worker's RQ record lives for worker_ttl + 60 s: a beat a second is plenty
            with self.connection.pipeline(transaction=False) as p:
                super().heartbeat(timeout, p)
                if self._state:
                    p.hset(self.key, "state", self._state)  # and the state, once a second too
                p.execute()
            self._rq_beat_at = time.monotonic()
            self._state_written = self._state or None

    def set_state(self, state: str, pipeline: Any = None) -> None:
        if self.revoked:
            self._state = state
            return
        if pipeline is None and (state == self._state_written or state == WorkerStatus.IDLE):
            # Written already, or idle between two deliveries (RQ says so after each run): written when the
            # worker sleeps for want of work (_sleep_until_woken), or by the next beat.
            self._state = state
            return
        super().set_state(state, pipeline)
        self._state_written = state

    def prepare_execution(self, job: Job) -> Any:
        """RQ's two transactions before a run (the execution's record, then the job's start), as one, sent with
        the next records (send_records: once the attempt runs, after the last run's success)."""
        if self.revoked:
            raise StopRequested
        p = self._records()
        ttl = self.get_heartbeat_ttl(job)
        execution = Execution.create(job, ttl, pipeline=p, worker_name=self.name)
        self.executions[execution.id] = execution
        self.set_state(WorkerStatus.BUSY, pipeline=p)
        super().heartbeat(ttl, pipeline=p)
        job.heartbeat(now(), ttl, pipeline=p)
        job.prepare_for_execution(self.name, pipeline=p)
        p.persist(job.key)
        if len(self.queues) == 1:  # as RQ's perform_job asks of its prepare_job_execution
            p.lrem(self.queue_class(job.origin, connection=self.connection).intermediate_queue_key, 1, job.id)
        self._rq_beat_at = time.monotonic()
        self._prepared = job.id
        return execution

    def _records(self) -> Any:
        """The transaction that RQ's records of runs wait in, oldest first, until send_records sends it."""
        if self._unsent is None:
            self._unsent = self.connection.pipeline()
        return self._unsent

    def send_records(self) -> None:
        """Send RQ's records of the runs that wait (the last run's success, the next run's start) in one round trip.

        They wait so that it overlaps the next attempt instead of sitting between two: sandbox.Meanwhile runs
        this once the attempt was handed over. Sent too when the worker has nothing to run, before RQ's own
        writes (a failure, its maintenance) and before the worker's record goes (teardown). Never raises, as it
        runs beside an attempt: refused credentials stop the worker as any refusal does; an unreachable broker
        loses these records, which rq-dashboard alone reads (RQ's maintenance fails a run it shows started for
        too long; gpumesh's own state, the task's lease and result, is written by its own scripts)."""
        p, self._unsent = self._unsent, None
        if p is None or self.revoked:
            return
        try:
            p.execute()
        except REFUSED as exc:
            self._revoked(exc)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("RQ's record of a run was not written: the broker is unreachable (%s)", exc)
        except redis.RedisError as exc:  # what some credential wrote where RQ writes
            log.warning("RQ's record of a run failed (%s: %s); carrying on", type(exc).__name__, str(exc)[:200])
        finally:
            p.reset()

    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        if self._prepared == job.id:  # written with the execution's record
            self._prepared = None
            return
        super().prepare_job_execution(job, remove_from_intermediate_queue)

    def check_for_suspension(self, burst: bool) -> None:
        # RQ's `rq suspend` (the key rq:suspended) is not a gpumesh feature: RQ would pause every worker
        # (and end burst ones) for whoever writes that key, and any worker credential may write RQ's keys.
        # gpumesh stops workers with its own controls (the epoch, revoking a credential, a signal), so
        # the key is ignored here.
        if self.revoked:
            raise StopRequested

    def run_maintenance_tasks(self) -> None:
        self.send_records()  # RQ's clean-up reads what they write (the intermediate queue, the registries)
        with self._unless_refused(), self._through_outage("maintenance"):
            try:
                super().run_maintenance_tasks()  # type: ignore[no-untyped-call]  # RQ leaves it untyped
            except MAINTENANCE_BAD_DATA as exc:  # RQ's parser asserts on a job a credential wrote
                self.last_cleaned_at = now()  # type: ignore[assignment]  # RQ types it None; it sets a datetime
                log.warning("RQ's maintenance stopped on an RQ job it cannot read (%s: %s); carrying on",
                            type(exc).__name__, str(exc)[:200])  # fmt: skip

    def _enqueue_dependents_safely(self, queue: Any, job: Job) -> None:
        # RQ enqueues a failed job's dependents: a delivery has none, and what a credential lists there is
        # not a worker's to enqueue (see _record_success).
        return

    def handle_execution_ended(self, job: Job, queue: Any, heartbeat_ttl: int) -> None:
        # RQ writes the job's last heartbeat here, and saves the whole job in the same moment (success or
        # failure, next): that save carries it. Once revoked, RQ's loop ends here (its failure path too).
        if self.revoked:
            raise StopRequested
        if self._rq_lost:
            self._rq_lost = False
            raise redis.ConnectionError("the broker was lost while RQ recorded the run")
        job.ended_at = job.last_heartbeat = now()

    def handle_job_success(self, job: Job, queue: Any, started_job_registry: Any, execution: Any) -> None:
        with self._unless_refused():
            try:
                if job.repeats_left is None and not job.has_rate_limit:
                    self._record_success(job, execution, self._records())  # sent while the next attempt runs
                else:  # not a delivery of ours (those never repeat, nor have a rate limit): RQ's own way
                    self.send_records()
                    super().handle_job_success(job, queue, started_job_registry, execution)
            except (redis.ConnectionError, redis.TimeoutError):
                # RQ's loop takes any error here for the job's own and records it failed: the broker is what
                # failed (the task was reported, or its lease lapses), so handle_execution_ended, which RQ's
                # failure path calls first, raises it again and execute_job waits for the broker.
                self._rq_lost = True
                raise

    def _record_success(self, job: Job, execution: Any, p: Any) -> None:
        """RQ's handle_job_success (rq 3.0) for a delivery, in one transaction and one round trip. RQ first
        WATCHes the job's dependents set and reads it, to enqueue the jobs that waited for this one: two
        round trips a task here, for a set that Broker.deliver never makes, and which only some credential
        writing into Redis could fill. Its counts, result, registries and the execution's record are RQ's, written
        into the transaction ``p``; a delivery keeps no result (Broker.deliver's RESULT_TTL): its RQ job is
        deleted there instead."""
        self.increment_successful_job_count(pipeline=p)
        assert job.started_at is not None and job.ended_at is not None  # set by RQ's run, as RQ asserts
        self.increment_total_working_time(job.ended_at - job.started_at, p)
        result_ttl = job.get_result_ttl(self.default_result_ttl)
        if result_ttl != 0:
            job._handle_success(
                result_ttl, pipeline=p, worker_name=self.name, execution_id=execution.id,
                execution_started_at=execution.created_at, execution_ended_at=job.ended_at,
            )  # fmt: skip
            job.cleanup(result_ttl, pipeline=p, remove_from_queue=False)
        self.cleanup_execution(job, pipeline=p, execution=execution)
        if result_ttl == 0:
            # A delivery (Broker.deliver, RESULT_TTL): RQ's record of it goes as the run ends. RQ's own
            # job.cleanup(0) would read the job's status and executions first (two round trips a task); the
            # execution went just above, and a delivery has no result, dependents or other registry entry.
            p.delete(job.key)
        job._status = JobStatus.FINISHED
        self.log.info("Successfully completed job %s in %ss on worker %s", job.id, job.ended_at - job.started_at,
                      self.name)  # fmt: skip

    def handle_exception(self, job: Job, *exc_info: Any) -> None:
        if len(exc_info) > 1 and isinstance(exc_info[1], OUTAGE):
            # A report that gave up in a broker outage: the worker's own lines said so (its lease lapses and
            # the reaper requeues the task). RQ's "exception raised while executing" and its traceback: DEBUG.
            self._outage_ended = job.id
            log.debug("RQ's job %s ended in a broker outage", job.id, exc_info=exc_info)
            return
        super().handle_exception(job, *exc_info)

    def handle_job_failure(self, job: Job, queue: Any, started_job_registry: Any = None, exc_string: str = "",
                           execution: Any = None) -> None:  # fmt: skip
        if self._outage_ended == job.id:
            self._outage_ended = None
            try:  # still down: RQ would log its failed write as an ERROR with a traceback; the reaper tidies up
                self.connection.ping()
            except OUTAGE as exc:
                log.debug("RQ's failure record of %s skipped: the broker is unreachable (%s)", job.id, exc)
                return
        self.send_records()  # the run's start first, where it waits still
        with self._unless_refused():
            super().handle_job_failure(job, queue, started_job_registry, exc_string, execution)

    def teardown(self) -> None:
        self.send_records()  # before RQ marks the worker dead: its record then says all it ran
        super().teardown()  # type: ignore[no-untyped-call]  # RQ leaves it untyped

    def set_shutdown_requested_date(self) -> None:
        # Runs in the signal handler, for display only: it must not raise into the task it interrupts.
        if not self.revoked:
            with contextlib.suppress(redis.RedisError):
                super().set_shutdown_requested_date()  # type: ignore[no-untyped-call]  # RQ leaves it untyped

    def register_death(self) -> None:
        if self.revoked:
            return
        try:
            super().register_death()  # type: ignore[no-untyped-call]  # RQ leaves it untyped
        except REFUSED as exc:
            self._revoked(exc)

    def unsubscribe(self) -> None:
        """RQ's, in the order that lets its pubsub thread end at once. The thread waits up to 60 s for a
        message: told to stop before the UNSUBSCRIBE, it ends as the reply arrives; told after (RQ's order),
        it may wait again, and redis-py 8's ``stop()`` joins it: a stopping worker could hang that minute."""
        thread = self.pubsub_thread
        if not thread:
            return
        _stop_without_waiting(thread)
        if not self.revoked:  # revoked: the channel's connection is gone for good, say nothing
            with contextlib.suppress(redis.RedisError):
                self.pubsub.unsubscribe()
        thread.join(timeout=1)
        if not self.revoked and not thread.is_alive():
            # A thread still reading (a stalled broker) closes the pubsub itself as it ends: closed here, its
            # connection would go back to the pool while the thread still reads from it.
            self.pubsub.close()

    def _pubsub_exception_handler(self, exc: Exception, pubsub: Any, pubsub_thread: Any) -> None:
        if isinstance(exc, REFUSED) or self.revoked:
            self._revoked(exc)
            pubsub_thread.stop()
        elif isinstance(exc, redis.ConnectionError):
            log.debug("RQ's command channel lost the broker (%s); retrying", exc)  # the heartbeat reports it
            time.sleep(2.0)
        else:
            super()._pubsub_exception_handler(exc, pubsub, pubsub_thread)


def _stop_without_waiting(thread: Any) -> None:
    """Tell redis-py's pubsub thread to stop at its next wake-up, without waiting for it: redis-py 8's
    ``stop`` joins the thread unless given a timeout; older ones take no timeout and never wait."""
    try:
        thread.stop(timeout=0)
    except TypeError:
        thread.stop()
