"""``gpumesh worker``: an RQ SimpleWorker that runs only gpumesh's executor, under leases.

Work is placed when the worker asks for it: ``dispatch.lua`` picks, against the live fleet, the task
this worker should run now and leases it in the same step, with the worker's tier in that fleet; the
worker then delivers that task through its tier's RQ queue ``gpumesh-tier-<k>`` (to the front, popped in
the same transaction) and RQ runs it, so rq-dashboard and ``rq info`` see every delivery, and list the
worker under the tier queue it serves now. A worker that finds
nothing waits on its wake list, which every submit, retry and requeue fills. A much stronger worker
also backs up stragglers (speculate.lua): when a stronger worker joins after a weak one took a heavy
task, and at the end of a job.

The worker process itself never initialises CUDA: the benchmark and every task run in child
processes. A heartbeat thread renews the registration and the current lease, learns about
cancellation, and takes its turn as the mesh's reaper.

What rq-dashboard shows is what ran: a delivery that must not run here (a stale or duplicate one) is
dropped before RQ starts it, so it counts nowhere; each delivery's description and meta name its task
and, once it ran, how the attempt ended. A worker whose credentials the broker refuses (``gpumesh access
revoke``) stops at once without RQ's bookkeeping, which it can no longer write.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psutil
import redis
from rq.exceptions import StopRequested
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.utils import now as rq_now
from rq.worker import SimpleWorker, WorkerStatus
from rq.worker_registration import WORKERS_BY_QUEUE_KEY

from gpumesh import scheduling
from gpumesh.envs.cache import EnvError
from gpumesh.envs.lock import python_resource
from gpumesh.errors import BrokerError
from gpumesh.models import Capability
from gpumesh.sandbox import landlock, namespaces, tree
from gpumesh.sandbox.runner import Limits
from gpumesh.sandbox.taskdir import sweep_dead_workers_dirs
from gpumesh.store import keys, reaper, scripts
from gpumesh.store.broker import EXECUTOR, Broker
from gpumesh.store.registry import Registry
from gpumesh.worker import executor, lending
from gpumesh.worker.heartbeat import Heartbeat
from gpumesh.worker.logship import LogShipper
from gpumesh.worker.rqworker import BAD_DATA, REFUSED, LeanRQWorker

log = logging.getLogger("gpumesh.worker")

SWEEP_INTERVAL = 60.0  # s between sweeps for the task directories of workers that died here
SPECULATION_SPEEDUP = 2.0  # a backup copy runs only on a worker at least this many times as strong as the primary's
ADVERTISE_EVERY_S = 3600.0  # s between a worker's namings of the envs and trees its machine holds (env_held.lua)
STRAGGLER_GAIN = 0.5  # back up a straggler while its job has queued work only if the copy ends in half its time left


def refusal(job: Job) -> str | None:
    """Why an RQ job must not run here, or None. Whoever can write rq:job:* picks the function."""
    if job.func_name != EXECUTOR:
        return f"refused: function {job.func_name!r} is not gpumesh's executor"
    for attr in ("_success_callback_name", "_failure_callback_name", "_stopped_callback_name"):
        if getattr(job, attr, None):
            return "refused: gpumesh jobs carry no callbacks"
    if getattr(job, "webhooks", None):
        return "refused: gpumesh jobs carry no webhooks"
    if len(job.args) != 1 or not isinstance(job.args[0], str) or job.kwargs:
        return "refused: a gpumesh job takes exactly one task id"
    return None


def isolation_of(settings: Any, user: tuple[int, int] | None = None) -> tuple[landlock.Isolation | None, str]:
    """How tasks will be confined (None: not at all), and the line the worker says about it once, at start.
    ``user``: the (uid, gid) tasks run as (--sandbox-user), as whom the worker asks whether each attempt can have
    namespaces of its own (its IPC, /dev/shm, keyring and cache overlays)."""
    if not settings.isolation:
        return None, "isolation off (--no-isolation): tasks can read whatever this worker's user can"
    why = landlock.unavailable()
    if why is not None:
        return None, f"tasks are NOT isolated from this machine's files: {why}; see `gpumesh doctor`"
    read, write = landlock.split_paths(settings.read_paths), landlock.split_paths(settings.write_paths)
    cache = landlock.split_paths(settings.cache_paths)
    for flag, paths in (("--read-path", read), ("--write-path", write), ("--cache-path", cache)):
        for path in paths:
            found = credential_files(path)
            if found:
                from gpumesh.errors import UsageError

                raise UsageError(
                    f"{flag} {path}: holds {found[0]}, which looks like a credential that every task would read; "
                    "give the cache's own folder instead (for Hugging Face ~/.cache/huggingface/hub, HF_HUB_CACHE), "
                    "or move the credential out"
                )
    no_namespaces = namespaces.unavailable(*(user or (-1, -1)))
    said = f"tasks isolated with Landlock (ABI {landlock.abi()}): they read only the system and Python"
    said += "".join(f", {p}" for p in read) + ", and write only their own directory" + "".join(f", {p}" for p in write)
    if no_namespaces is None and cache:
        refused = namespaces.unavailable(*(user or (-1, -1)), tuple(os.path.abspath(p) for p in cache))
        if refused is not None:
            from gpumesh.errors import UsageError

            raise UsageError(
                f"--cache-path: an attempt could not lay its overlay ({refused}); the tasks' user must be able to "
                "read each cache (with --sandbox-user, that user)"
            )
    if no_namespaces is None:
        said += "; each attempt has its own IPC, /dev/shm (within its memory cap) and keyring"
        said += "".join(f", and its own overlay of the cache {p}" for p in cache)
    else:
        said += "".join(f"; they read the cache {p} and write none of it" for p in cache)
    return landlock.Isolation(read, write, cache, private=no_namespaces is None), said


# Names of what a tool keeps its login in (huggingface-cli's token and stored_tokens, netrc, cloud CLIs'
# credentials, keys): a path given to tasks that holds one at its top gives every submitter's task the owner's login.
CREDENTIAL_NAMES = ("token", "stored_tokens", ".netrc", "credentials*", "*.pem", "*.key", "id_rsa*")


def credential_files(path: str) -> list[str]:
    """The files at the top of ``path`` (or ``path`` itself) whose names look like a credential's."""
    import fnmatch

    try:
        names = sorted(os.listdir(path)) if os.path.isdir(path) else [os.path.basename(path)]
    except OSError:
        return []
    return [n for n in names if any(fnmatch.fnmatchcase(n.lower(), pattern) for pattern in CREDENTIAL_NAMES)]


def isolation_warnings(settings: Any, isolation: landlock.Isolation | None, user: tuple[int, int] | None) -> list[str]:
    """What a worker says once at start about what its tasks still share with each other and with the host."""
    if isolation is None:
        return []
    said = [
        f"--write-path {p}: every job's tasks write there, so one submitter's task can leave files (code, a cached "
        "model) that another submitter's task runs; for caches use --cache-path (each attempt writes to its own "
        "overlay), and keep --write-path for a mesh with one submitter"
        for p in isolation.write
    ]
    why = namespaces.unavailable(*(user or (-1, -1)))
    if why is not None:
        said.append(
            f"attempts cannot have namespaces of their own here ({why}): tasks share /dev/shm, SysV IPC and the "
            "user keyring with this user's other programs and with other jobs, outside their memory cap; "
            "see `gpumesh doctor`"
        )
    return said


def _python_minor(python: str) -> str:
    """The minor version of the tasks' interpreter (the worker's own, or ``python``) as the ``python`` resource
    holds it (``3.12``; ``3.09`` for 3.9: gpumesh.envs.lock.python_resource)."""
    if not python or python == sys.executable:
        return python_resource(f"{sys.version_info[0]}.{sys.version_info[1]}")
    try:
        out = subprocess.run(
            [python, "-S", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return python_resource(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else ""


def _refuse_writable_interpreter(python: str, uid: int, gid: int) -> None:
    from gpumesh.errors import UsageError
    from gpumesh.sandbox.launch import writable_by

    where = writable_by(python, uid, gid)
    if where is not None:
        raise UsageError(
            f"--sandbox-user: the sandbox user can change {where}, which the worker runs as root ({python}); "
            "install the interpreter where only root can write"
        )


class MeshJob(Job):
    """An RQ job whose function is pinned: nothing read from Redis chooses code to import."""

    @property
    def func(self) -> Callable[[str], dict[str, Any]]:
        if self.func_name != EXECUTOR:
            raise PermissionError(f"refused: function {self.func_name!r} is not gpumesh's executor")
        return executor.run_task


class MeshWorker(LeanRQWorker):
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
        resources: dict[str, Any] | None = None,
        lend: lending.Lend | None = None,
        max_vram_gb: float | None = None,
        lent_path: str | None = None,
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
        self._default_task_memory = int(psutil.virtual_memory().total * 0.9)  # read once, not per task
        # declared ones override the probe; task_memory_gb (the RSS cap of a task) tells a task that ran out
        # of memory which workers have more
        task_memory_gb = round((self.settings.task_memory_mb << 20 or self._default_task_memory) / 2**30, 2)
        # envs: whether it builds jobs' environments (worker --no-envs); python: the minor version its envs run
        envs = {"envs": "yes" if self.settings.envs else "no", "python": _python_minor(self.settings.sandbox_python)}
        self.resources = {
            **capability.resources(), "task_memory_gb": task_memory_gb, **envs, **(resources or {})
        }  # fmt: skip
        self.logs = LogShipper(broker.redis)
        # The lender's say (--lend, --pause-when, --max-vram-gb): asked by a thread of its own (_lend_loop)
        self.lend = lend or lending.Lend()
        self.max_vram_gb = max_vram_gb
        self.monitor = lending.Monitor(
            self.lend, self.settings.pause_probe_timeout, cuda_visible_devices, self.settings.idle_probe,
            self.settings.gpu_probe,
        )  # fmt: skip
        self.paused: str | None = None  # why the worker takes no work now (the lender's probes), or None
        self._lend_changed = threading.Event()
        task_env = {"GPUMESH_MAX_VRAM_GB": f"{max_vram_gb:g}"} if max_vram_gb else {}
        # task id -> (lease delivered to our own queue, when it was leased): nothing renews it before it runs
        self.dispatched: dict[str, tuple[scripts.Lease, float]] = {}
        self.executor = executor.Executor(self._host(verifier, lent_path, task_env))
        # the RQ queue of the tier this worker serves: the top one until the fleet says otherwise (_serve)
        self.my_queue = broker.queue(self.settings.tiers - 1, MeshJob)  # deliver() makes MeshJobs, as RQ's pop reads
        self._serving = threading.Lock()
        self._born = False  # RQ's record of this worker is written (register_birth)
        self.registry = Registry(broker.r, self.worker_id)
        self._fleet_now = ""  # the registered fleet's version, from the last dispatch
        self._advertised_at = time.monotonic()  # when it last named what its machine holds (_advertise_envs)
        # the next task, leased in the round trip of the last one's completion, and when: delivered next
        self._next: tuple[scripts.Lease, float] | None = None
        self._fleet_seen: str | None = None  # the version our last straggler scan looked at
        self._published: int | None = None  # the tier last written to our registration (display only)
        self._registered_lib = ""  # the functions library the registration names (scripts.Scripts.lib)
        self.beats = Heartbeat(
            self.settings.heartbeat_interval,
            self.settings.lease_ttl,
            self._heartbeat_turn,
            refused=self._revoked,
            give_up=self._heartbeat_gave_up,
        )
        self._next_sweep = time.monotonic() + SWEEP_INTERVAL
        self._scores: dict[str, float] = {}
        self.epoch = ""
        self.fatal = ""  # why the worker stopped for good (broker data lost, credentials revoked)
        self.stopping_now = False  # a second signal: the current task handed back (request_force_stop)
        self._work_thread: threading.Thread | None = None  # the thread running RQ's loop
        self.isolation, self.isolation_said = isolation_of(self.settings, sandbox_user)
        root_tasks = os.geteuid() == 0 and sandbox_user is None  # uid 0 tasks: root's sockets are theirs
        self.sockets_said = landlock.unix_socket_warnings(self.isolation is not None, root_tasks)
        self.sockets_said += isolation_warnings(self.settings, self.isolation, sandbox_user)
        if sandbox_user is not None:  # root runs this interpreter before it drops to the sandbox user
            _refuse_writable_interpreter(self.settings.sandbox_python or sys.executable, *sandbox_user)
        super().__init__(
            [self.my_queue],
            name=self.worker_id,
            connection=broker.rq,
            serializer=JSONSerializer,
            worker_ttl=max(60, int(self.settings.worker_ttl * 2)),
        )

    # -- RQ hooks --------------------------------------------------------------------------------

    # Stopping. RQ's handlers, with what each signal does said at the default log level (RQ says it at
    # DEBUG, through a logger gpumesh keeps at WARNING), and a second signal's stop without a traceback.
    def _host(self, verifier: Any, lent_path: str | None, task_env: dict[str, str]) -> executor.Host:
        """What the executor is given of this worker (executor.Host)."""
        return executor.Host(
            broker=self.broker,
            worker_id=self.worker_id,
            capability=self.capability,
            cuda_visible_devices=self.cuda_visible_devices,
            limits=self.limits,
            zygote=self.zygote,
            logs=self.logs,
            verifier=verifier,
            dispatched=self.dispatched,
            resources=self.resources,
            send_records=self.send_records,
            wants_next=self._wants_next,
            got_next=self._got_next,
            begin_next=self._begin_next,
            lent_path=lent_path,
            task_env=task_env,
        )

    def request_stop(self, signum: int, frame: Any) -> None:
        """The first SIGTERM or SIGINT: finish the current task, take no other (RQ's warm shutdown). A task
        started ahead of its delivery (executor.begin) is handed back as the worker stops, so none is named."""
        if self.executor.current is not None:
            log.info("%s: stopping after the current task; the same signal again, a second or more from now, "
                     "hands it back to the queue and stops at once", signal.Signals(signum).name)  # fmt: skip
        else:
            log.info("%s: stopping", signal.Signals(signum).name)
        super().request_stop(signum, frame)  # type: ignore[no-untyped-call]  # RQ leaves it untyped

    def request_force_stop(self, signum: int, frame: Any) -> None:
        """A second signal: stop now, the current task handed back without spending an attempt (the executor
        does it as the SystemExit passes through the attempt). One that comes within a second of the first is
        taken for the same stop, as RQ does: a terminal's Ctrl-C reaches every process of its group, and
        `pkill -f 'gpumesh worker'` a supervised worker as well as its supervisor, which passes it on."""
        name = signal.Signals(signum).name
        if self.stopping_now:
            # The same press again (a supervisor passes on what the terminal sent the whole group): a second
            # SystemExit would land in the hand-back of the first, and leave the task to its lease's lapse.
            log.debug("%s again while stopping at once: ignored", name)
            return
        first = self._shutdown_requested_date  # set by request_stop, just before it installed this handler
        if first is not None and rq_now() - first < datetime.timedelta(seconds=1):
            again = "; send it again to hand the task back and stop at once" if self.executor.current else ""
            log.info("%s again within a second of the first: taken for the same stop%s", name, again)
            return
        self.stopping_now = True
        running = self.executor.current
        log.warning("%s again: stopping now%s", name,
                    f"; {running.lease.task_id} goes back to the queue" if running is not None else "")  # fmt: skip
        raise SystemExit()

    def handle_exception(self, job: Job, *exc_info: Any) -> None:
        if self.stopping_now and exc_info and exc_info[0] is SystemExit:
            return  # the stop said above, not the task's failure: no traceback in the log
        super().handle_exception(job, *exc_info)

    @property
    def dequeue_timeout(self) -> int:
        # How long an idle worker sleeps on its wake list before asking again (wake-ups come sooner).
        return max(1, math.ceil(self.settings.heartbeat_interval))

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None) -> Any:
        """Ask the dispatcher for work, deliver it to our own queue and pop it there; idle, sleep until woken.

        ``timeout`` None is burst mode: return None as soon as there is nothing this worker may run."""
        try:
            return self._dequeue(timeout, max_idle_time)
        except StopRequested:  # SIGTERM while idle: RQ raises out of wherever we are
            self._hand_back_all("the worker is stopping")
            raise

    def _dequeue(self, timeout: int | None, max_idle_time: int | None) -> Any:
        idle_since = time.monotonic()
        errors = 0  # dispatches in a row that failed on what some credential wrote into Redis
        while not (self._stop_requested or self.fatal):
            try:
                if self.paused:  # the lender's probes say no: nothing new, and what was leased goes back
                    self._hand_back_all(f"paused: {self.paused}")
                    self._lend_changed.wait(self.dequeue_timeout)
                    self._lend_changed.clear()
                    if timeout is None:
                        return None
                    continue
                if not self.dispatched and self.beats.stalled():
                    self._hand_back_next("no heartbeat gets through: its lease would lapse here")
                    self._sleep_after_error(1)  # no new work until a heartbeat gets through again
                    continue
                if self.dispatched:  # delivered, not run: never pop the head of a tier queue (a waiting task)
                    self._hand_back_all("its delivery was not run")
                lease, leased_at = self._take_next() or (self._next_lease(), None)
                if lease is not None:
                    result = self._deliver(lease, leased_at)
                    if result is not None:
                        return result
                    continue
            except REFUSED as exc:
                self._revoked(exc)
                break
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("broker unreachable while asking for work (%s); waiting for it", exc)
                self._wait_for_broker()
                continue
            except BAD_DATA as exc:
                # Whatever a credential wrote into a job, a task or our queue: that one dispatch failed, not
                # the worker (RQ's loop would quit on it, and every worker with it). The functions drop
                # what they cannot read, so the next dispatch finds other work; back off meanwhile.
                errors += 1
                self._bad_dispatch(exc)
                if timeout is None and errors >= 5:
                    return None  # burst: stop asking, as when there is nothing to run
                self._sleep_after_error(errors)
                continue
            errors = 0
            self.executor.tidy()  # nothing to run here now: what waited for the next attempt is done at once
            if timeout is None:
                return None
            if max_idle_time is not None and time.monotonic() - idle_since >= max_idle_time:
                return None
            self._sleep_until_woken(timeout)
        self._hand_back_all("the worker is stopping")
        return None

    def _pop_delivery(self, popped: str | None = None) -> Any:
        """RQ's pop of our queue (``popped``: the id a pop already moved to its intermediate queue, read as RQ's
        pop reads it). An RQ job that cannot be read (a timeout field RQ's parser asserts on, say: anything a
        credential can write there) makes RQ raise what its loop would quit on: it is dropped here, said, and
        the worker carries on (its lease, if any, is handed back when its delivery vanishes)."""
        try:
            if popped is None:
                return super().dequeue_job_and_maintain_ttl(None)
            return self.queue_class._fetch_dequeued_job(
                self.connection, self.my_queue.key, popped, job_class=self.job_class, serializer=self.serializer,
                death_penalty_class=self.death_penalty_class,
            )  # fmt: skip
        except (StopRequested, redis.RedisError):
            raise
        except Exception as exc:  # noqa: BLE001 - whatever RQ raises on a delivery it cannot read
            log.warning("dropped an unreadable delivery from this worker's queue (%s: %s)", type(exc).__name__,
                        str(exc)[:200])  # fmt: skip
            self._forget_popped(popped or getattr(exc, "job_id", None))
            return None

    def _forget_popped(self, job_id: str | None) -> None:
        """Take a popped id that will not run off the queue's intermediate list, where RQ's pop moved it (RQ's
        maintenance would read it again, and quit on what it cannot read)."""
        if job_id:
            with contextlib.suppress(redis.RedisError):
                self.connection.lrem(self.my_queue.intermediate_queue_key, 1, job_id)

    def _bad_dispatch(self, exc: Exception) -> None:
        log.warning("asking for work failed (%s: %s); carrying on", type(exc).__name__, str(exc)[:300])
        if isinstance(exc, scripts.MalformedLease) and exc.task_id:
            try:  # it holds a lease on that task: fail it for good, with the reason, rather than let it lapse
                scripts.fail(self.broker.scripts, self.broker.r, exc.lease(), self.worker_id, str(exc), 0.0,
                             reject=True)  # fmt: skip
            except (redis.RedisError, ValueError, KeyError, TypeError, IndexError) as again:
                log.warning("could not fail %s (%s); its lease will lapse", exc.task_id, again)

    def _sleep_after_error(self, errors: int) -> None:
        delay = min(5.0, 0.2 * 2 ** min(errors, 5))
        deadline = time.monotonic() + delay
        while not (self._stop_requested or self.fatal) and time.monotonic() < deadline:
            time.sleep(0.1)

    def _wants_next(self) -> scripts.Next | None:
        """The next task, asked for with this completion (Executor._complete), unless the worker is about to do
        something else: stop, wait for its heartbeat, look for a straggler to back up (the fleet changed), or
        deliver what it holds already."""
        if self._stop_requested or self.fatal or self.revoked or self.dispatched or self._next is not None:
            return None
        if self.paused:
            return None
        if self._fleet_seen != self._fleet_now or self.beats.out_of_touch():
            return None
        return scripts.Next(
            int(self.settings.lease_ttl * 1000), self.capability.score_gflops, scripts.new_token(), self.settings.tiers
        )

    def _got_next(self, lease: scripts.Lease, leased_at: float) -> None:
        self._fleet_now = lease.fleet_version
        self._next = (lease, leased_at)

    def _begin_next(self) -> None:
        """Start the task leased with the last completion before RQ's bookkeeping of that run and the task's
        delivery (Executor.begin), when nothing will come before it: no stop, no straggler scan (the fleet
        is as the last scan saw it), a heartbeat that gets through."""
        held = self._next
        if held is None or self._stop_requested or self.fatal or self.revoked or self.dispatched or self.paused:
            return
        if self._fleet_seen != self._fleet_now or self.beats.out_of_touch():
            return
        self.executor.begin(*held)

    def _take_next(self) -> tuple[scripts.Lease, float | None] | None:
        """The task leased with the last completion, if any; a straggler's backup first when that dispatch saw
        the fleet change (the worker would have looked for one before asking), the task handed back then."""
        held, self._next = self._next, None
        if held is None:
            return None
        try:
            backup = self._straggler_backup()
        except BaseException:
            self._next = held  # still ours: delivered, or handed back, once the worker gets past this
            raise
        if backup is not None:
            self.executor.hand_back(held[0], "a backup copy of a straggler comes first")
            return backup, None
        return held

    def _straggler_backup(self) -> scripts.Lease | None:
        """Once per change of the fleet: a backup copy of a straggler that this worker should rescue, if any."""
        if self._fleet_seen == self._fleet_now:
            return None
        self._fleet_seen = self._fleet_now
        return self._speculate("straggler")

    def _next_lease(self) -> scripts.Lease | None:
        """The next thing to run: a straggler's backup when the fleet changed, else a dispatched task,
        else (nothing dispatchable) a backup of a straggler at the end of its job."""
        backup = self._straggler_backup()
        if backup is not None:
            return backup
        if self.executor.trees_changed or time.monotonic() - self._advertised_at > ADVERTISE_EVERY_S:
            self._advertise_envs()  # a task ran in a tree not named yet, or an hour passed (the holders sets expire)
        for _ in range(3):  # an env to prepare first: then ask again at once
            got = scripts.dispatch(
                self.broker.scripts, self.broker.r, self.worker_id, int(self.settings.lease_ttl * 1000),
                self.capability.score_gflops, self.settings.tiers,
            )  # fmt: skip
            if not isinstance(got, scripts.Prepare) or self._stop_requested or self.fatal:
                break
            self._prepare(got)
        if isinstance(got, scripts.Prepare):
            self._fleet_now = got.fleet_version
            return None
        if isinstance(got, scripts.Lease):
            self._fleet_now = got.fleet_version
            return got
        self._fleet_now = got
        return self._speculate("idle")

    def _deliver(self, lease: scripts.Lease, leased_at: float | None = None) -> Any:
        """Put the leased task on our own RQ queue and pop the queue in the same transaction, as RQ's pop
        would (LMOVE to its intermediate queue): (RQ job, queue) for RQ to run like any job it popped, or
        None to pop again. What the pop took is our delivery, written by us a moment ago and not read back;
        or whatever sat in the queue before it, read and run (or dropped) as RQ's pop would, ours behind it."""
        self.dispatched[lease.task_id] = (lease, time.monotonic() if leased_at is None else leased_at)
        queue = self._serve(lease.tier)
        try:
            job, popped = self.broker.deliver(queue, lease, take=True)
        except redis.RedisError as exc:
            self.dispatched.pop(lease.task_id, None)
            # If the transaction ran and only its reply was lost (or one of its writes failed), its pop did too.
            job_id = keys.rq_job_id(lease.task_id, lease.attempt, lease.backup)
            if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)) and self.executor.has_begun(lease):
                # The broker went away with the task started: it is ours still (its lease was acknowledged),
                # and runs on as a running task rides out an outage. RQ does not record this one delivery.
                log.warning("%s: its delivery through RQ failed (%s); it runs on without RQ's record of it",
                            lease.task_id, exc)  # fmt: skip
                self.executor.run_lease(lease, leased_at)
                self._forget_popped(job_id)
                return None
            self.executor.hand_back(lease, "the delivery to this worker's queue failed")
            self._forget_popped(job_id)
            raise
        if popped is None:  # cannot be, as it was just pushed in the same transaction: pop again
            return None
        if popped == job.id:
            return job, queue
        return self._pop_delivery(popped)

    def _serve(self, tier: int) -> Any:
        """The RQ queue of ``tier`` (-1: keep the tier served now), which this worker serves from now on: RQ's
        record of the worker names it, so `rq info` and rq-dashboard list the worker under its tier's queue."""
        with self._serving:
            old = self.my_queue
            if tier < 0 or old.name == keys.tier_queue(tier):
                return old
            queue = self.broker.queue(tier, MeshJob)
            self.my_queue, self.queues, self._ordered_queues = queue, [queue], [queue]
            if self._born and not self.revoked:
                with contextlib.suppress(redis.RedisError), self.connection.pipeline() as p:
                    p.srem(WORKERS_BY_QUEUE_KEY % old.name, self.key)
                    p.sadd(WORKERS_BY_QUEUE_KEY % queue.name, self.key)
                    p.hset(self.key, "queues", queue.name)
                    p.sadd(self.queue_class.redis_queues_keys, queue.key)
                    p.execute()
            return queue

    def register_birth(self, *args: Any, **kwargs: Any) -> None:
        super().register_birth(*args, **kwargs)  # type: ignore[no-untyped-call]  # RQ leaves it untyped
        self._born = True  # RQ's record of the worker exists: _serve keeps its queue up to date

    def _hand_back_next(self, why: str) -> None:
        """The task leased with the last completion (if any) goes back to queued, attempts unspent."""
        held, self._next = self._next, None
        if held is not None and not self.revoked:
            self.executor.hand_back(held[0], why)

    def _hand_back_all(self, why: str) -> None:
        """Leased tasks whose delivery will not run here go back to queued at once, attempts unspent."""
        self._hand_back_next(why)
        if self.revoked:  # nothing can be handed back: their leases lapse and the reaper requeues them
            self.dispatched.clear()
        while self.dispatched:
            _tid, (lease, _at) = self.dispatched.popitem()
            self.executor.hand_back(lease, why)

    def _sleep_until_woken(self, timeout: int) -> None:
        if self._state_written != WorkerStatus.IDLE and not self.revoked:
            with self._unless_refused(), self._through_outage("idle state"):
                # RQ's own write (LeanRQWorker.set_state leaves idle to this moment): what rq-dashboard shows
                SimpleWorker.set_state(self, WorkerStatus.IDLE)
                self._state_written = WorkerStatus.IDLE
        self._state = WorkerStatus.IDLE
        try:
            self.registry.sleep_until_woken(timeout)
        except REFUSED as exc:
            self._revoked(exc)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("broker unreachable while idle (%s); waiting for it", exc)
            self._wait_for_broker()

    def _speculate(self, mode: str) -> scripts.Lease | None:
        """A backup copy of the running task this worker would most likely rescue, if any: this reads the
        running tasks and their jobs, scheduling.backup_candidates decides (mode 'idle' or 'straggler')."""
        me, mine = self.worker_id, self.capability.score_gflops
        scores = self._scores or self.broker.live_scores()
        if not scores or mine < SPECULATION_SPEEDUP * min(scores.values()):
            return None  # no live worker is weak enough for us to rescue
        now, running = self.registry.others_running()
        if not running:
            return None
        jobs = sorted({keys.job_of_task(row.task_id) for row in running})
        info, ready = self.registry.job_progress(jobs, with_ready=mode == "straggler")
        job_info = {job: scheduling.JobProgress.from_fields(row) for job, row in zip(jobs, info)}
        tasks = [
            scheduling.RunningTask(row.task_id, keys.job_of_task(row.task_id), row.worker, row.started_at, row.cost)
            for row in running
        ]
        top_jobs = scheduling.top_priority_jobs([(m.rsplit("/", 1)[0], score) for m, score in ready])
        chosen = scheduling.backup_candidates(
            mode, mine, scores, tasks, job_info, top_jobs, now, SPECULATION_SPEEDUP, STRAGGLER_GAIN
        )
        for tid in chosen[:3]:
            lease = scripts.speculate(
                self.broker.scripts,
                self.broker.r,
                tid,
                me,
                int(self.settings.lease_ttl * 1000),
                mine,
                SPECULATION_SPEEDUP,
                mode,
            )
            if isinstance(lease, scripts.Lease):
                log.info("backing up %s (%s): a much weaker worker runs it", tid, mode)
                return lease
        return None

    def execute_job(self, job: Job, queue: Any) -> None:
        why = refusal(job)
        if why:
            log.error("RQ job %s from %s %s", job.id, queue.name, why)
            # Recorded failed, and nothing more: no webhook to a URL its writer chose, no retry.
            job.webhooks, job.retries_left = [], None
            self.handle_job_failure(job, queue, exc_string=why)
            return
        try:
            if self._delivered_here(job):
                super().execute_job(job, queue)
            else:
                self._drop(job, queue)
        except REFUSED as exc:
            self._revoked(exc)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            # RQ's own bookkeeping lost the broker: keep the worker alive (RQ would quit) and wait for it.
            # gpumesh's state is safe: the task was reported, or its lease lapses and it is re-queued.
            log.warning("broker unreachable during RQ bookkeeping for %s (%s); waiting for it", job.id, exc)
            self._wait_for_broker()

    def _delivered_here(self, job: Job) -> bool:
        """Whether this RQ job is the delivery of a task the dispatcher leased to this worker, for the
        attempt it holds: not a stale one (an earlier attempt's, a handed-back task's) or a duplicate."""
        held = self.dispatched.get(job.args[0])
        if held is None:
            return False
        lease = held[0]
        return bool(job.id == keys.rq_job_id(lease.task_id, lease.attempt, lease.backup))

    def _drop(self, job: Job, queue: Any) -> None:
        """Drop a delivery that must not run here before RQ starts it, so that RQ records no run: it counts
        as neither finished nor failed in rq-dashboard. Its RQ record goes too, unless it is not this
        delivery's to delete (a run already recorded under the same id, or another worker's delivery)."""
        log.info("dropped %s: task %s is not dispatched to this worker (a stale or duplicate delivery)",
                 job.id, job.args[0])  # fmt: skip
        with self.connection.pipeline() as p:
            p.lrem(queue.intermediate_queue_key, 1, job.id)  # where RQ's pop moved it
            if job.origin == queue.name and job.get_status(refresh=False) == JobStatus.QUEUED:
                job.delete(pipeline=p, remove_from_queue=False)
            p.execute()

    def _wait_for_broker(self) -> None:
        delay = 0.5
        while not self._stop_requested:
            try:
                self.connection.ping()
                log.info("broker reachable again")
                return
            except REFUSED as exc:
                self._revoked(exc)
                return
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(delay)
                delay = min(delay * 2, 10.0)

    def work(self, *args: Any, **kwargs: Any) -> bool:
        self._work_thread = threading.current_thread()
        executor.bind(self.executor)
        self.epoch = self.broker.epoch()
        # which functions library to call (this protocol's, or the previous one's on an older broker), before
        # anything is written: a worker whose protocol the broker does not serve stops here, in one line
        self.broker.scripts.ensure(force=True)
        warning = self.broker.eviction_warning()
        if warning:
            log.warning(warning)
        self.logs.start()
        # List every tier's queue in RQ's registry so `rq info` and rq-dashboard show it while it is empty too.
        self.connection.sadd(self.queue_class.redis_queues_keys,
                             *[self.broker.queue(k).key for k in range(self.settings.tiers)])  # fmt: skip
        # Everything a task starts is ours to kill when its attempt ends, even what escapes its supervisor.
        tree.become_subreaper()
        if self.isolation is None:
            log.warning(self.isolation_said)
        else:
            log.info(self.isolation_said)
        for line in self.sockets_said:
            log.warning(line)
        swept = sweep_dead_workers_dirs()
        if swept:
            log.info("removed %d task directories that workers which died on this machine left behind", swept)
        lend_thread = None
        if not self.lend.always or self.max_vram_gb:
            log.info("lending: %s%s", self.lend.describe(),
                     f"; at most {self.max_vram_gb:g} GB of GPU memory per task" if self.max_vram_gb else "")  # fmt: skip
            self._lend_check(announce=False)  # before the first dispatch: a worker started paused takes nothing
            lend_thread = threading.Thread(target=self._lend_loop, name="gpumesh-lend", daemon=True)
        try:
            self._register()
        except redis.exceptions.NoPermissionError:
            from gpumesh.errors import UsageError

            user = self.connection.connection_pool.connection_kwargs.get("username") or "default"
            raise UsageError(
                f"the credential in this URL ({user}) may not register a worker: it is a submitter's or another "
                "role's; a worker needs a worker credential: the `gpumesh worker 'redis://worker:…'` line serve "
                "printed, or one of `gpumesh access add NAME`"
            ) from None
        try:
            self._beat()
        except BAD_DATA as exc:  # something in Redis it cannot read: the heartbeat thread keeps trying
            log.warning("first heartbeat failed (%s: %s); retrying", type(exc).__name__, str(exc)[:200])
        self.beats.start()
        if lend_thread is not None:
            lend_thread.start()
        log.info(
            "worker %s ready: %s (%s), %.1f GFLOP/s, broker %s",
            self.worker_id, self.capability.device, self.capability.device_name,
            self.capability.score_gflops, self.broker.url_masked,
        )  # fmt: skip
        try:
            return super().work(*args, **kwargs)
        finally:
            self._hand_back_all("the worker is stopping")  # a stop that interrupted a delivery
            if not self.revoked:
                self.logs.flush(timeout=1.0)  # the last notes (a task handed back) wait no longer than they would
            self.beats.stop(timeout=5)
            self._unregister()
            self.executor.close()
            executor.bind(None)
            if self.zygote is not None:
                # Its idle supervisors wait in the cgroups of the last attempt and the next one: gone with it, those
                # cgroups are removed at once, not after a second of waiting for each.
                self.zygote.close()
            tree.release_cgroups(wait=True)

    # -- gpumesh ---------------------------------------------------------------------------------

    def limits(self, timeout: float) -> Limits:
        mem = self.settings.task_memory_mb << 20 or self._default_task_memory
        cpus = os.cpu_count() or 1
        return Limits(
            grace=self.settings.stop_grace,
            timeout=timeout,
            memory_bytes=mem,
            cpu_seconds=math.ceil(timeout * cpus) + 10,
            log_bytes=self.settings.log_max_bytes,
            result_bytes=self.settings.result_max_bytes,
            user=self.sandbox_user,
            python=self.settings.sandbox_python,
            isolation=self.isolation,
        )

    def _register(self) -> None:
        ttl_ms = int(self.settings.worker_ttl * 1000)
        called = (self.broker.scripts.lib, self.broker.scripts.protocol or 0)
        self.registry.register(
            self.display_name, self.capability, self.resources, ttl_ms, paused=self.paused or "", library=called
        )
        self._registered_lib = called[0]
        self._advertise_envs()

    def _advertise_envs(self) -> None:
        """Tell dispatch which envs this machine holds and which it failed to build (placement, Prepare), and
        which project trees it holds (placement)."""
        self._advertised_at = time.monotonic()
        held, failed = self.executor.advertised_envs()
        scripts.env_held(self.broker.scripts, self.broker.r, self.worker_id, held, failed,
                         int(self.settings.worker_ttl * 1000), self.executor.advertised_trees())  # fmt: skip

    def _prepare(self, p: scripts.Prepare) -> None:
        """Build (or wait for, or find) the env the job dispatch chose needs, leasing nothing meanwhile: the workers
        that hold it keep taking the job's tasks. A failure is the job's to hear (env_failed.lua)."""
        try:
            self.executor.prepare_env(p.env, p.job_id)
        except (EnvError, OSError) as exc:
            log.error("env %s for %s: %s", p.env[:12], p.job_id, str(exc).splitlines()[-1] if str(exc) else exc)
            if self.executor.env_failure(p.job_id, p.env, str(exc)):
                log.error("no live worker that may run %s can build its env: its tasks fail", p.job_id)
        self._advertise_envs()

    # -- the lender's say ----------------------------------------------------------------------------

    def _lend_loop(self) -> None:
        """Ask the lender's probes every GPUMESH_PAUSE_PROBE_INTERVAL; pause or resume on what they say."""
        while not self.beats.wait(self.settings.pause_probe_interval):
            try:
                self._lend_check()
            except Exception:
                log.exception("lending probe error")

    def _lend_check(self, announce: bool = True) -> None:
        """Pause (no new task, the running one handed back after SIGTERM and the grace) or resume, as the probes
        say; kill an attempt over the lender's VRAM cap."""
        reason = self.monitor.check()
        was, self.paused = self.paused, reason
        running = self.executor.current
        if reason and not was:
            log.warning("paused: %s: taking no new task%s", reason,
                        f"; handing {running.lease.task_id} back" if running is not None else "")  # fmt: skip
        if reason and running is not None:  # also one leased in the moment the pause began
            running.stop(lending.PAUSED + reason)
        elif was and not reason:
            log.info("resumed: the lender's probes allow work again")
        if reason != was and announce:
            with contextlib.suppress(redis.RedisError):
                self.registry.set_paused(reason or "", int(self.settings.worker_ttl * 1000))
            if not reason:
                with contextlib.suppress(redis.RedisError):
                    self.registry.wake("resumed")  # out of its wait for work at once
            self._lend_changed.set()
        if self.max_vram_gb and running is not None and reason is None:
            self._vram_check(running)

    def _vram_check(self, running: executor.Running) -> None:
        try:
            used = self.monitor.vram_used_mib(lending.own_pids(os.getpid()))
        except lending.ProbeError as exc:
            log.debug("VRAM probe: %s", exc)
            return
        if self.max_vram_gb and used > self.max_vram_gb * 1024:
            running.stop(f"{lending.VRAM_OVER} ({used / 1024:.1f} GB used, at most {self.max_vram_gb:g} GB)")

    def _unregister(self) -> None:
        if self.revoked:
            return  # the registration expires by itself; the reaper drops the rest
        try:
            self.registry.unregister()
        except redis.RedisError as exc:
            log.warning("could not unregister (%s); the registration expires by itself", exc)

    def _heartbeat_turn(self) -> None:
        """The heartbeat thread's turn (worker.heartbeat): its chores, then the beat."""
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            log.warning("parent process %d is gone; stopping", self.parent_pid)
            self.parent_pid = None
            os.kill(os.getpid(), signal.SIGTERM)
        if time.monotonic() >= self._next_sweep:  # off this thread: a large directory must not delay a renewal
            self._next_sweep = time.monotonic() + SWEEP_INTERVAL
            threading.Thread(target=sweep_dead_workers_dirs, name="gpumesh-sweep", daemon=True).start()
        self._beat()
        tree.release_cgroups()  # attempt cgroups the kernel let go of since their attempt ended
        self.executor.prune_residents()  # reused processes idle too long, or whose job has ended

    def _heartbeat_gave_up(self, why: str) -> None:
        self._stop_for_good(why + "; --log-level DEBUG shows its traceback")

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
        self.beats.succeeded(sent_at)
        if running is not None:
            if beat.lease == "ok":
                running.last_renewal = sent_at
            elif beat.lease == "cancelled":
                running.stop("cancelled")
            elif beat.lease == "lost":
                running.stop("lease lost: the task was leased again elsewhere")
        try:
            self.broker.scripts.ensure()  # one FCALL_RO now and then: the protocol to call may have changed
        except BrokerError as exc:  # the broker no longer serves this gpumesh's protocols (downgraded, or flushed)
            self._stop_for_good(str(exc))
            return
        if beat.registered and self.broker.scripts.lib != self._registered_lib:  # the broker changed protocol
            log.info("now calling %s (gpumesh protocol %s)", self.broker.scripts.lib, self.broker.scripts.protocol)
            self._register()
        if not beat.registered:
            log.warning("registration had expired (paused or cut off?); registering again")
            self._register()
            # RQ's record of this worker too, which the reaper dropped as dead (ValueError: it is back already)
            with contextlib.suppress(ValueError, redis.RedisError):
                self.register_birth()
                self._state_written = None  # its record starts without a state: the next one is written
            scripts.heartbeat(
                self.broker.scripts, self.broker.r, self.worker_id, int(s.worker_ttl * 1000), None, 0, self.epoch
            )
        scores = self.broker.live_scores()
        scores.setdefault(self.worker_id, self.capability.score_gflops)
        self._scores = scores
        if running is not None and running.lease.backup_mode == "idle" and self._woken_with_work():
            running.stop("the backup copy yielded to queued work")
        tier = scheduling.worker_tiers(scores, s.tiers)[self.worker_id]
        self._serve(tier)  # between dispatches too: an idle worker is listed under its tier as the fleet is
        if tier != self._published or not beat.registered:
            self._published = tier
            self.registry.publish_tier(tier)
        self.broker.rq.expire(self.key, self.worker_ttl + 60)
        if self._reaper_turn():
            report = reaper.reap_once(self.broker)
            if any(report.values()):
                log.info("reaper: %s", ", ".join(f"{k} {v}" for k, v in report.items() if v))

    def _woken_with_work(self) -> bool:
        return self.registry.woken_with_work()

    def _broker_lost(self) -> None:
        """The broker's epoch changed: its data (and our task) is gone. Kill the task, report nothing, stop."""
        self._stop_for_good(
            "the broker lost its data (it restarted empty?); this worker stopped without reporting its task. "
            "Start it again to join the broker as it is now"
        )

    def _revoked(self, exc: Exception) -> None:
        """The broker refuses this worker's credentials: stop for good, saying so in one line (the CLI
        prints ``fatal`` as the worker exits, with code 3). Refused outright (the user was deleted or
        disabled), it writes nothing more; refused some commands only (NOPERM), RQ's bookkeeping of the
        delivery still gets its chance."""
        self.revoked = self.revoked or isinstance(exc, redis.AuthenticationError)
        reason = str(exc).rstrip(". ") or type(exc).__name__
        self._stop_for_good(
            f"access revoked: the broker refused this worker's credentials ({reason}); ask the mesh's admin "
            "for a new token (gpumesh access add)",
            announce=False,
        )

    def _stop_for_good(self, why: str, exc: Exception | None = None, announce: bool = True) -> None:
        """Kill the current task, unreported, and stop. ``announce``: log ``why`` now (else the exit says it)."""
        if self.fatal:
            return
        self.fatal = why
        running = self.executor.current
        if announce:
            log.error("%s%s: killing the current task and stopping", why, f" ({exc})" if exc else "")
        if running is not None:
            running.stop("broker lost: " + (why if announce else "the worker stops for good"))
        self.beats.halt()
        if threading.current_thread() is self._work_thread:
            self._stop_requested = True  # RQ's loop checks it (and our bookkeeping raises StopRequested)
        else:
            os.kill(os.getpid(), signal.SIGTERM)  # RQ's warm shutdown: no new work

    def _reaper_turn(self) -> bool:
        return self.registry.reaper_turn(int(self.settings.heartbeat_interval * 2000) + 1000)
