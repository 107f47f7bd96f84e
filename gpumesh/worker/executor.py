"""The one function a gpumesh worker lets RQ call: run one delivery of a task.

``run_task(task_id)`` acquires the task's lease (a duplicate or stale delivery is skipped), fetches the
script by hash, runs the attempt in the sandbox while the worker's heartbeat thread keeps the lease
alive, then completes or fails the task with its fenced token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis

from gpumesh.envs.cache import Env, EnvCache, EnvError, default_root
from gpumesh.models import TERMINAL, Capability
from gpumesh.project import safe_rel
from gpumesh.sandbox import resident
from gpumesh.sandbox import runner as sandbox
from gpumesh.sandbox.outputs import Found
from gpumesh.sandbox.preloaded import JobZygote, JobZygoteLost, PreloadFailed
from gpumesh.sandbox.projectview import View, folders_to_expand
from gpumesh.sandbox.spares import Spares
from gpumesh.sandbox.warm import Zygote, ZygoteError
from gpumesh.signing import PROOF_FIELD, ResultSigner, Verifier, leased_identity
from gpumesh.store import artifacts, checkpoints, scripts
from gpumesh.store.broker import Broker
from gpumesh.worker import lent
from gpumesh.worker.classify import bad_result, failure_of, module_hint, next_step, outcome
from gpumesh.worker.lending import PAUSED
from gpumesh.worker.logship import LogShipper
from gpumesh.worker.projects import Held, ProjectCache, ProjectError

log = logging.getLogger("gpumesh.worker")

ERROR_TAIL_CHARS = 2000
UNREPORTED = ("lease lost", "broker lost")  # stop reasons after which the attempt's outcome is not ours to report
ENV_ZYGOTES = 3  # warm mode: the zygotes of this many envs are kept (least recently used closed first)
JOB_ZYGOTES = 3  # warm mode: the preload zygotes of this many jobs are kept (least recently used closed first)
MEMORY_HOLD_TTLS = 10  # a task out of memory waits this many lease TTLs for a live worker with more


@dataclass
class Running:
    """The attempt in progress, shared between the executor (main thread) and the heartbeat thread."""

    lease: scripts.Lease
    stop_reason: str | None = None
    last_renewal: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def stop(self, reason: str) -> None:
        with self.lock:
            self.stop_reason = self.stop_reason or reason


@dataclass
class Begun:
    """An attempt started before RQ's delivery of its task reached the executor (:meth:`Executor.begin`)."""

    running: Running
    limits: sandbox.Limits
    oom_kills: int
    started: sandbox.Started


@dataclass(frozen=True)
class JobExtras:
    """What a job's hash says of its project and outputs (fixed at submit: read once per job per worker)."""

    project: str = ""  # tree digest
    outputs: str = ""  # output globs, JSON (as signed)
    siblings: frozenset[str] = frozenset()  # modules beside a lone script where it was submitted
    reuse: bool = False  # submit --reuse-process: the job's tasks share a process per worker (as signed)
    env: str = ""  # the environment's lock digest (gpumesh.envs)
    preload: str = ""  # modules of the env its warm tasks find imported, comma-separated (as signed)

    @property
    def globs(self) -> tuple[str, ...]:
        try:
            value = json.loads(self.outputs) if self.outputs else []
        except ValueError:
            return ()
        return tuple(g for g in value if isinstance(g, str)) if isinstance(value, list) else ()


NO_EXTRAS = JobExtras()


@dataclass(kw_only=True)
class Host:
    """What the executor needs of the worker it runs in, and nothing more (built by keyword)."""

    broker: Broker
    worker_id: str
    capability: Capability
    cuda_visible_devices: str | None
    limits: Callable[[float], sandbox.Limits]  # the sandbox limits of an attempt with this timeout
    zygote: Zygote | None  # --warm: attempts fork from it instead of starting an interpreter
    logs: LogShipper
    verifier: Verifier | None  # set when this worker runs only signed tasks
    # task id -> (lease delivered to the worker's own queue, when it was leased); run() takes from it
    dispatched: dict[str, tuple[scripts.Lease, float]] = field(default_factory=dict)
    resources: dict[str, Any] = field(default_factory=dict)  # as registered: what a memory failure ran out of
    send_records: Callable[[], None] = lambda: None  # RQ's records of the runs, sent while the next attempt runs
    # Whether a completion should also dispatch this worker's next task (scripts.Next), and who takes that task
    # (with when it was leased): one round trip, where the worker would ask for it right after anyway.
    wants_next: Callable[[], scripts.Next | None] = lambda: None
    got_next: Callable[[scripts.Lease, float], None] = lambda lease, leased_at: None
    # Start that task at once, if the worker means to run it next (Executor.begin), once the last one is reported.
    begin_next: Callable[[], None] = lambda: None
    lent_path: str | None = None  # where each attempt this machine ran is recorded (`gpumesh lent`); None: nowhere
    task_env: dict[str, str] = field(default_factory=dict)  # more for every task (GPUMESH_MAX_VRAM_GB)


_executor: Executor | None = None


def bind(executor: Executor | None) -> None:
    """Called by the worker before it starts taking jobs (and with None as it stops)."""
    global _executor
    _executor = executor


def run_task(task_id: str) -> dict[str, Any]:
    """RQ entry point. Returns a short summary, which RQ stores for rq-dashboard; gpumesh keeps the real result."""
    if _executor is None:
        raise RuntimeError("gpumesh.worker.executor.run_task runs only inside `gpumesh worker`")
    return _executor.run(task_id)


class Executor:
    last_error = ""  # the error the last failed attempt reported, for run's summary

    def __init__(self, host: Host) -> None:
        self.w = host
        self.broker = host.broker
        self.settings = host.broker.settings
        self._scripts_cache: dict[str, str] = {}
        self.current: Running | None = None
        # The task leased with the last completion, started at once (begin): its delivery through RQ, and RQ's
        # bookkeeping of the run before, happen while it runs.
        self.begun: Begun | None = None
        # Fresh mode: each attempt's interpreter starts while the one before it runs (warm mode forks instead).
        self.spares = Spares() if host.zygote is None else None
        # Done while the next attempt runs, or when the worker idles or stops: ended attempts' directories go,
        # and RQ's records of the runs are sent.
        self.meanwhile = sandbox.Meanwhile(also=host.send_records)
        # Where the winning attempts' output files go (the broker, or GPUMESH_ARTIFACTS's object store).
        self.artifacts = artifacts.backend(self.settings, self.broker.rq)
        self.artifact_caps = artifacts.Caps.of(self.settings)
        # Signs each result with this worker credential's own key (keys.RESULT_KEYS), when the URL has one.
        self.result_signer = ResultSigner.of_url(self.broker.url)
        # submit --reuse-process: each such job's tasks run in one long-lived process here, kept between its tasks.
        self.residents = resident.Pool(self.settings.reuse_idle)
        self._extras: dict[str, JobExtras] = {}
        self._projects: ProjectCache | None = None
        self._held: Held | None = None  # the project tree the last attempt ran in, held until another is needed
        self._trees_seen: set[str] = set()  # the project trees this worker ran in (a new one: advertise them again)
        self.trees_changed = False  # this worker ran in a tree it had not advertised: the worker says so to dispatch
        self.checkpoints = checkpoints.Store(
            self.broker.rq, self.broker.r, self.broker.scripts, self.settings.artifacts
        )
        self.watcher = Watcher()  # the running attempt's checkpoint directory, looked at by one thread
        self._jobs_seen: dict[str, dict[str, str]] = {}  # job id -> what `gpumesh lent` records of it
        self._sent = 0  # bytes of output files the last attempt stored
        self._lent: lent.Record | None = None  # this machine's record of what it ran (`gpumesh lent`)
        self._envs: EnvCache | None = None
        self._env_ready: dict[str, Env] = {}  # lock digest -> its env on this machine, held by this worker
        self._env_failures: set[str] = set()  # lock digests this worker could not have (EnvError)
        self._zygotes: dict[str, Zygote] = {}  # warm mode: a zygote per env, the least recently used closed first
        # warm mode, a job with an env and a preload: its own zygote, by (job id, env digest); the heartbeat thread
        # closes those whose job has ended
        self._job_zygotes: dict[tuple[str, str], JobZygote] = {}
        self._job_zygotes_lock = threading.Lock()
        # (job id, env digest) -> why its preload failed here ("": its zygote did not start, its attempts start cold)
        self._preload_failed: dict[tuple[str, str], str] = {}

    @property
    def projects(self) -> ProjectCache:
        if self._projects is None:
            s = self.settings
            self._projects = ProjectCache(
                s.project_cache, s.project_cache_mb, self.broker.project_files(), self.broker.r
            )
        return self._projects

    @property
    def envs(self) -> EnvCache:
        """This machine's environments (gpumesh.envs), shared by its workers."""
        if self._envs is None:
            s = self.settings
            self._envs = EnvCache(
                s.env_cache or default_root(), s.env_cache_mb, s.allow_builds, s.sandbox_python,
                user=self.w.limits(1.0).user,  # with --sandbox-user, uv runs as that user, never as root
            )  # fmt: skip
        return self._envs

    def _env(self, lease: scripts.Lease) -> Env | None:
        """The job's environment on this machine, held by this worker: prepared before the lease (dispatch answers
        Prepare to a worker that lacks it), else found or built here now. EnvError with the builder's message."""
        digest = self.extras(lease.job_id).env
        if not digest:
            return None
        return self.prepare_env(digest, lease.job_id, lease.task_id)

    def prepare_env(self, digest: str, job_id: str, task_id: str = "") -> Env:
        """The env ``digest`` of ``job_id`` on this machine: found, waited for (another worker of the machine builds
        it), or built here; meanwhile the worker says "preparing env … for JOB" (``workers``, ``status``, the
        dashboard). EnvError with the builder's message when it cannot be had."""
        got = self._env_ready.get(digest)
        if got is not None:
            return got
        if not self.settings.envs:
            raise EnvError("this worker runs no environments (worker --no-envs)")
        text, python, builds = self.broker.job_fields(job_id, "env_lock", "env_python", "env_builds")
        if text is None:
            raise EnvError("the job's lock is missing from the broker")
        preparing = self.envs.ready(digest) is None
        if preparing:
            said = f"preparing env {digest[:12]} for {job_id}"
            log.info("%s", said)
            if task_id:
                self.w.logs.put(task_id, "gpumesh", said)
            # what `workers`, `status`, `top` and the dashboard show meanwhile
            self.broker.set_preparing(self.w.worker_id, said.removeprefix("preparing "))
        started = time.monotonic()
        try:
            got = self.envs.ensure(digest, text, python or "", builds == "1")
        finally:
            if preparing:
                self.broker.set_preparing(self.w.worker_id, "")
        log.info("env %s ready in %.2fs", digest[:12], time.monotonic() - started)
        self._env_ready[digest] = got
        return got

    def env_failure(self, job_id: str, digest: str, message: str) -> bool:
        """Tell dispatch that this machine cannot build ``digest`` for ``job_id`` (it gives this worker the job's
        tasks no more): True when no live worker that may run the job is left to build it, and its tasks fail."""
        self._env_failures.add(digest)
        return scripts.env_failed(self.broker.scripts, self.broker.r, job_id, self.w.worker_id, digest, message)

    def advertised_envs(self) -> tuple[list[str], list[str]]:
        """(held, failed): the envs this machine holds ready and those it could not build, for dispatch."""
        if not self.settings.envs:
            return [], []
        ready, failed = self.envs.known()
        return [*ready, *self._env_ready], [*failed, *self._env_failures]

    def advertised_trees(self) -> list[str]:
        """The project trees this machine holds, for dispatch (placement)."""
        self.trees_changed = False
        return self.projects.trees()

    def _zygote_for(self, env: Env) -> Zygote | None:
        """Warm mode: the zygote of ``env`` (its interpreter, started without site: nothing of the env runs in
        it), started on first use; a few are kept, the least recently used closed first. None: start cold."""
        z = self._zygotes.pop(env.digest, None)
        if z is None or not z.alive():
            try:
                cuda = self.w.cuda_visible_devices  # as the worker's own zygote: the GPU it is pinned to
                z = Zygote(python=env.python, env={"CUDA_VISIBLE_DEVICES": cuda} if cuda else {}, site=True)
                z.start()
            except (OSError, ZygoteError) as exc:
                log.warning("env %s: its zygote did not start (%s); its attempts start cold", env.digest[:12], exc)
                return None
        self._zygotes[env.digest] = z
        while len(self._zygotes) > ENV_ZYGOTES:
            old = next(iter(self._zygotes))
            self._zygotes.pop(old).close()
        return z

    def _job_zygote_for(
        self, job_id: str, env: Env, preload: str, limits: sandbox.Limits, view: View | None
    ) -> Zygote | None:
        """Warm mode, a job with an env and a preload: the job's own zygote (:mod:`gpumesh.sandbox.preloaded`),
        started on its first task here; a few are kept, the least recently used closed first. PreloadFailed (the
        job's tasks fail with it) when the preload does not import; None (its attempts start cold) when the zygote
        could not start for another reason."""
        key = (job_id, env.digest)
        failed = self._preload_failed.get(key)
        if failed == "":
            return None  # its zygote did not start here: cold
        if failed is not None:
            raise PreloadFailed(failed)
        with self._job_zygotes_lock:
            z = self._job_zygotes.pop(key, None)
        if z is None:
            cuda = self.w.cuda_visible_devices
            z = JobZygote(
                job_id, preload.split(","), limits, {"CUDA_VISIBLE_DEVICES": cuda} if cuda else {},
                view.tree if view is not None else "",
            )  # fmt: skip
            try:
                z.start()
            except PreloadFailed as exc:
                z.close()  # its directory too, and what the preload wrote there before it failed
                if len(self._preload_failed) > 256:
                    self._preload_failed.clear()
                self._preload_failed[key] = str(exc)
                raise
            except (OSError, ZygoteError) as exc:
                z.close()
                log.warning("job %s: its preload zygote did not start (%s); its attempts start cold", job_id, exc)
                if len(self._preload_failed) > 256:
                    self._preload_failed.clear()
                self._preload_failed[key] = ""  # the job's other attempts here start cold, not with a new try
                return None
        with self._job_zygotes_lock:
            self._job_zygotes[key] = z
            over = list(self._job_zygotes)[: max(0, len(self._job_zygotes) - JOB_ZYGOTES)]
            old = [self._job_zygotes.pop(k) for k in over]
        for gone in old:
            gone.close()
        return z

    def _pause_job_zygotes(self) -> None:
        """Once an attempt is over: the preload zygotes kept here run nothing until their job's next attempt."""
        with self._job_zygotes_lock:
            kept = list(self._job_zygotes.values())
        for z in kept:
            z.pause()

    def _prune_job_zygotes(self, ended: Callable[[list[str]], set[str]]) -> None:
        """Close the preload zygotes of jobs that have ended (never the one of the attempt running now)."""
        with self._job_zygotes_lock:
            jobs = sorted({job for job, _ in self._job_zygotes})
        if not jobs:
            return
        gone_jobs = ended(jobs)
        running = self.current
        busy = running.lease.job_id if running is not None else None
        with self._job_zygotes_lock:
            keys = [k for k in self._job_zygotes if k[0] in gone_jobs and k[0] != busy]
            victims = [self._job_zygotes.pop(k) for k in keys]
        for z in victims:
            log.info("job %s ended: its preload zygote goes", z.job_id)
            z.close()

    def extras(self, job_id: str) -> JobExtras:
        got = self._extras.get(job_id)
        if got is None:
            project, outputs, siblings, reuse, env, preload = self.broker.job_fields(
                job_id, "project", "outputs", "siblings", "reuse_process", "env", "preload"
            )
            got = NO_EXTRAS
            if project or outputs or siblings or reuse == "1" or env:
                got = JobExtras(
                    project or "",
                    outputs or "",
                    frozenset((siblings or "").split(",")) - {""},
                    reuse == "1",
                    env or "",
                    preload or "",
                )
            if len(self._extras) > 256:
                self._extras.clear()
            self._extras[job_id] = got
        return got

    def _tree(self, digest: str, make: bool = True) -> Held | None:
        """The project tree ``digest`` on this machine, held for this worker's attempts; made here unless
        ``make`` is false (then None where it is not held already)."""
        held = self._held
        if held is not None and held.digest == digest:
            return held
        if not make:
            return None
        self._release_tree()
        self._held = self.projects.acquire(digest)
        if digest not in self._trees_seen:
            self._trees_seen.add(digest)
            self.trees_changed = True
        return self._held

    def _release_tree(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self.projects.release(held)

    def close(self) -> None:
        begun = self.begun
        if begun is not None:  # the worker stops without running it (a revoked one cannot hand it back)
            self._abandon(begun, "the worker is stopping")
        self.tidy()
        self.residents.close()
        self._release_tree()
        for z in self._zygotes.values():
            z.close()
        self._zygotes.clear()
        with self._job_zygotes_lock:
            job_zygotes, self._job_zygotes = list(self._job_zygotes.values()), {}
        for jz in job_zygotes:
            jz.close()
        if self._envs is not None:
            self._envs.release_all()
        if self.spares is not None:
            self.spares.close()
        if self._lent is not None:
            self._lent.close()

    def prune_residents(self) -> None:
        """End the reused processes idle too long, and those whose job has ended (done, failed, cancelled or
        gone): called from the worker's heartbeat thread."""

        def ended(job_ids: list[str]) -> set[str]:
            if not job_ids:
                return set()
            states = self.broker.job_statuses(job_ids)
            return {j for j, st in zip(job_ids, states) if st is None or st in TERMINAL}

        self.residents.prune(ended)
        self._prune_job_zygotes(ended)

    def _reuse_process(self, job_id: str) -> bool:
        """Whether ``job_id`` asked for its tasks to share a process per worker (submit --reuse-process): read
        once per job from its hash."""
        return self.extras(job_id).reuse

    def tidy(self) -> None:
        """Do at once what waits for the next attempt to run (sandbox.Meanwhile): the worker has no task now.
        Its project tree is let go (the machine's cache may remove it once no attempt uses it)."""
        self.meanwhile.run()
        if self.current is None and self.begun is None:
            self._release_tree()

    def _script(self, sha: str) -> str:
        src = self._scripts_cache.get(sha)
        if src is None:
            src = self.broker.script_source(sha)
            if src is None:
                raise LookupError(f"script {sha[:12]} is missing from the broker")
            if hashlib.sha256(src.encode()).hexdigest() != sha:
                return src  # never cached: _refusal refuses it, and an honest submit repairs it
            if len(self._scripts_cache) > 64:
                self._scripts_cache.clear()
            self._scripts_cache[sha] = src
        return src

    def run(self, task_id: str) -> dict[str, Any]:
        """Run the task the dispatcher leased to this worker; any other delivery is skipped (the worker
        drops those before RQ runs them, so none is counted as a run). The summary RQ gets says how the attempt
        ended (``outcome`` done, failed with ``error``, cancelled or lost); RQ keeps none of a delivery once its
        run has ended (Broker.deliver's RESULT_TTL), but a job run by RQ's own ways would keep it."""
        held = self.w.dispatched.pop(task_id, None)
        if held is None:
            log.info("skip %s: not dispatched to this worker (a stale or foreign delivery)", task_id)
            return {"task_id": task_id, "skipped": "not dispatched here"}
        lease, leased_at = held
        self.last_error = ""
        # Nothing renewed the lease between dispatch and now (a broker outage may have held RQ's pop):
        # counted from the dispatch, a lease older than its TTL may be someone else's task by now.
        summary = self.run_lease(lease, leased_at)
        self.w.begin_next()
        return {**summary, **outcome(summary["status"], self.last_error)}

    def hand_back(self, lease: scripts.Lease, why: str) -> None:
        """Return a leased task that never started, or that began and is stopped here, without spending its
        attempt."""
        log.warning("%s: handing it back: %s", lease.task_id, why)
        begun = self.begun
        try:
            if begun is not None and begun.running.lease == lease:
                self._abandon(begun, why)
        finally:
            self._finish_quietly(Running(lease), why, release=True)

    def begin(self, lease: scripts.Lease, leased_at: float) -> None:
        """Start the attempt of a task leased with the last completion now, ahead of RQ's delivery of it: the
        worker's RQ bookkeeping of the last run, the delivery and RQ's pop of it then run beside the attempt
        instead of between two. :meth:`run` takes it over when RQ runs that delivery; a task that does not get
        there is stopped and handed back (:meth:`hand_back`). A task that cannot start at once (its script not
        read yet, or refused here) is left to :meth:`run`, which says why."""
        if self.begun is not None:
            return
        source = self._scripts_cache.get(lease.script_sha)
        if source is None or self._refusal(lease, source):
            return
        extras = self.extras(lease.job_id)  # read once per job (the refusal's check read it already)
        if extras.project and self._tree(extras.project, make=False) is None:
            return  # its tree is not held here yet: run() makes it, and says what fails
        if extras.env and extras.env not in self._env_ready:
            return  # its environment is not ready here yet: run() prepares it, and says what fails
        running = Running(lease, last_renewal=leased_at)
        limits = self.w.limits(lease.timeout)
        oom_kills = kernel_oom_kills()
        self.current = running  # renewed by the heartbeat from now on
        try:
            started = self._start_in_sandbox(running, source, limits)
        except Exception as exc:  # noqa: BLE001 - run() starts it again, and reports what fails then
            log.debug("%s: could not start ahead of its delivery (%s)", lease.task_id, exc)
            self.current = None
            return
        except BaseException:
            self.current = None
            raise
        self.begun = Begun(running, limits, oom_kills, started)

    def has_begun(self, lease: scripts.Lease) -> bool:
        """Whether ``lease``'s attempt was started ahead of its delivery (:meth:`begin`) and runs."""
        return self.begun is not None and self.begun.running.lease == lease

    def _abandon(self, begun: Begun, why: str) -> None:
        """Stop an attempt started ahead of its delivery (it will not be reported) and clean up after it."""
        self.begun = None
        lease = begun.running.lease
        begun.running.stop(f"handed back: {why}")
        try:
            begun.started.finish()
        finally:
            if self.current is begun.running:
                self.current = None
        copy = "backup copy of attempt" if lease.backup else "attempt"
        self.w.logs.put(
            lease.task_id, "gpumesh", f"{copy} {lease.attempt} stopped before its delivery and handed back: {why}"
        )

    def run_lease(self, lease: scripts.Lease, leased_at: float | None = None) -> dict[str, Any]:
        """Run an acquired task, or a backup copy of a straggler (``lease.backup``), to its reported end."""
        task_id = lease.task_id
        if self.begun is not None and not self.has_begun(lease):  # cannot be: deliveries run in the order leased
            self.hand_back(self.begun.running.lease, "another task's delivery came first")
        begun, self.begun = self.begun, None
        if begun is not None:
            running = begun.running
        else:
            running = Running(lease) if leased_at is None else Running(lease, last_renewal=leased_at)
        self.current = running
        log.info("run %s attempt %d%s", task_id, lease.attempt, " (backup copy)" if lease.backup else "")
        started, status, self._sent = time.time(), "lost", 0
        self._job_seen(lease.job_id)  # read now, once per job: the record is written even if the broker goes away
        try:
            status = self._attempt(running, begun)
        except BaseException:
            # Cold shutdown (SystemExit), RQ's backstop timeout or a bug: hand the task back, never strand it.
            self._finish_quietly(running, "worker stopped during the attempt", release=True)
            raise
        finally:
            self.current = None
            self._record_lent(lease, started, status, running.stop_reason)
        return {"task_id": task_id, "attempt": lease.attempt, "status": status}

    def _job_seen(self, job_id: str) -> dict[str, str]:
        """What `gpumesh lent` records of a job (its name, submitter, project and environment digests), read
        once per job; empty fields while the broker cannot be read."""
        job = self._jobs_seen.get(job_id)
        if job is None and self.w.lent_path is not None:
            try:
                got = self.broker.job_fields(job_id, "name", "submitter", "project", "env", "reuse_process")
            except redis.RedisError:
                return {"name": "", "submitter": "", "project": "", "env": "", "reused": ""}
            job = {k: str(v or "") for k, v in zip(("name", "submitter", "project", "env", "reused"), got)}
            if len(self._jobs_seen) > 256:
                self._jobs_seen.clear()
            self._jobs_seen[job_id] = job
        return job or {}

    def _record_lent(self, lease: scripts.Lease, started: float, status: str, stopped: str | None) -> None:
        """Add the attempt to this machine's own record (`gpumesh lent`), broker or not."""
        if self.w.lent_path is None:
            return
        job = self._job_seen(lease.job_id)
        outcome_ = "handed back" if stopped and stopped.startswith(PAUSED) else status
        if outcome_.startswith("rejected:") or outcome_ == "running":
            outcome_ = "lost"
        entry = {
            "job": lease.job_id, "task": lease.task_id, "attempt": lease.attempt, "backup": bool(lease.backup),
            **job, "script": lease.script_sha, "start": round(started, 3),
            "duration": round(time.time() - started, 3), "outcome": outcome_, "sent_bytes": self._sent,
            **({"why": stopped} if stopped else {}),
        }  # fmt: skip
        try:
            if self._lent is None:
                self._lent = lent.Record(lent.path_of(self.w.lent_path))
            self._lent.append(entry)
        except OSError as exc:
            log.warning("could not add the attempt to this machine's record of what it ran (%s)", exc)

    def _attempt(self, running: Running, begun: Begun | None = None) -> str:
        """One attempt, in three steps: check the task may run here, run it in the sandbox, report it.
        ``begun``: started already (checked then), supervised from here."""
        if begun is not None:
            out = self._finish_in_sandbox(begun.started)
            out.kernel_oom = out.returncode == -signal.SIGKILL and kernel_oom_kills() > begun.oom_kills >= 0
            return self._report(running, out, begun.limits)
        lease = running.lease
        try:
            source = self._script(lease.script_sha)
        except LookupError as exc:
            return self._fail(running, str(exc), 0.0, kind="refused")
        refusal = self._refusal(lease, source)
        if refusal:
            log.error("%s refused: %s", lease.task_id, refusal)
            return self._fail(running, refusal, 0.0, reject=True, kind="refused")
        project = self.extras(lease.job_id).project
        if project:
            try:
                held = self._tree(project)
                if held is not None and held.made:  # said once, by the worker that made it for this machine
                    self.w.logs.put(
                        lease.task_id, "gpumesh", f"project {project[:12]} fetched and checked: {held.made}"
                    )
                    held.made = ""
            except (ProjectError, OSError, redis.RedisError) as exc:
                why = f"project: {exc}"
                log.error("%s refused: %s", lease.task_id, why)
                self.w.logs.put(lease.task_id, "gpumesh", why)
                return self._fail(running, why, 0.0, reject=True, kind="refused")
        try:
            self._env(lease)
        except (EnvError, OSError, redis.RedisError) as exc:
            why = f"environment: {exc}"
            log.error("%s: %s", lease.task_id, why)
            self.w.logs.put(lease.task_id, "gpumesh", why)
            try:  # failed for good once no live worker that may run the job is left to build its env
                final = self.env_failure(lease.job_id, self.extras(lease.job_id).env, str(exc))
            except redis.RedisError:
                final = False
            return self._fail(running, why, 0.0, kind="environment", reject=final)
        limits = self.w.limits(lease.timeout)
        oom_kills = kernel_oom_kills()
        try:
            started = self._start_in_sandbox(running, source, limits)
        except PreloadFailed as exc:  # the job's preload, not this worker: its tasks fail with the module named
            why = str(exc)
            self.w.logs.put(lease.task_id, "gpumesh", why)
            return self._fail(running, why, 0.0, kind="script")
        except JobZygoteLost as exc:  # it runs the job's code: a new one starts for the next attempt
            return self._fail(running, str(exc), 0.0, kind="lost")
        out = self._finish_in_sandbox(started)
        # Read again only for what it can explain: an attempt that died by SIGKILL (failure_of).
        out.kernel_oom = out.returncode == -signal.SIGKILL and kernel_oom_kills() > oom_kills >= 0
        return self._report(running, out, limits)

    def _start_in_sandbox(self, running: Running, source: str, limits: sandbox.Limits) -> sandbox.Started:
        """Start the script with its output shipped line by line; it is stopped when the heartbeat thread says so
        or when no renewal reached the broker for a whole lease."""
        lease = running.lease
        ship = self.w.logs.put
        copy = "backup copy of attempt" if lease.backup else "attempt"
        ship(lease.task_id, "gpumesh", f"{copy} {lease.attempt} on {self.w.worker_id}")

        def on_line(stream: str, line: str) -> None:
            ship(lease.task_id, stream, line)

        def should_stop() -> str | None:
            if running.stop_reason:
                return running.stop_reason
            if time.monotonic() - running.last_renewal > self.settings.lease_ttl:
                # Out of touch with the broker for a whole lease: someone else may hold the task now.
                return "lease lost: no heartbeat reached the broker within the lease TTL"
            return None

        collect = functools.partial(self._stage, lease)
        extras = self.extras(lease.job_id)
        view = None
        if extras.project:
            held = self._tree(extras.project, make=False)
            assert held is not None  # made before the attempt started (_attempt), or begin would not start it
            view = View(held.path, folders_to_expand(lease.script_name, extras.globs))
        zygote = self.w.zygote
        env = self._env_ready.get(extras.env) if extras.env else None
        if env is not None:  # its env's interpreter, which adds the env's packages once confined (sandbox.Limits.site)
            limits = dataclasses.replace(limits, python=env.python, site=env.site)
            if zygote is None:
                pass
            elif extras.preload and not extras.reuse:  # the job's own zygote, its preload imported once confined
                zygote = self._job_zygote_for(lease.job_id, env, extras.preload, limits, view)
            else:
                zygote = self._zygote_for(env)
        spec = sandbox.AttemptSpec(
            source=source,
            script_name=lease.script_name,
            payload=lease.payload,
            env=self._task_env(lease),
            limits=limits,
            on_line=on_line,
            should_stop=should_stop,
            zygote=zygote,
            spares=self.spares,
            collect=collect,
            meanwhile=self.meanwhile,
            project=view,
            output_globs=extras.globs,
            checkpoint=Saver(self, running),
        )
        if self._reuse_process(lease.job_id):
            key = (lease.job_id, lease.script_sha, limits.python, str(limits.user))
            return resident.start(self.residents, key, spec)
        return sandbox.start(spec)

    def _finish_in_sandbox(self, started: sandbox.Started) -> sandbox.Attempt:
        """Supervise the attempt to its end. Its log lines are in the broker before its end is reported: sent
        with the completion (_complete), or flushed before any other report (_outcome). Once it is over, the
        job zygotes kept here are paused until their job's next attempt."""
        try:
            return started.finish()
        finally:
            self._pause_job_zygotes()

    def _flush_logs(self) -> None:
        self.w.logs.flush(timeout=self._log_wait)

    @property
    def _log_wait(self) -> float:
        """How long a report waits for the log lines before it (a broker that is slow to take them)."""
        return min(5.0, self.settings.lease_ttl / 2)

    def _stage(self, lease: scripts.Lease, entries: Iterator[Any]) -> artifacts.Staged | artifacts.StageFailed | None:
        """Store the clean attempt's output files as a staged copy (the complete script keeps it if this
        attempt wins); None when it wrote none. Notes on skipped files go to the task's log."""
        copy = artifacts.copy_name(lease.attempt, lease.backup, lease.token)
        try:
            staged = artifacts.stage(
                self.artifacts, lease.task_id, lease.job_id, lease.index, copy, entries, self.artifact_caps,
                lambda: int(self.broker.job_fields(lease.job_id, "artifact_bytes")[0] or 0),
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - an object store's errors are its own; each is the attempt's failure
            for entry in entries:  # close what the walk has not yielded yet
                if isinstance(entry, Found):
                    os.close(entry.fd)
            log.warning("%s: storing the output files failed: %s", lease.task_id, exc)
            return artifacts.StageFailed(f"storing the output files failed: {type(exc).__name__}: {exc}")
        for note in staged.notes:
            self.w.logs.put(lease.task_id, "gpumesh", note)
        if staged.empty:
            return None
        n = len(staged.index["files"])
        self.w.logs.put(lease.task_id, "gpumesh", f"stored {n} output file(s), {staged.total} bytes")
        return staged

    def _task_env(self, lease: scripts.Lease) -> dict[str, str]:
        """What the script learns about its task and its worker (docs/reference/task-environment.md)."""
        env = {
            "GPUMESH_DEVICE": self.w.capability.device,
            "GPUMESH_JOB_ID": lease.job_id,
            "GPUMESH_TASK_ID": lease.task_id,
            "GPUMESH_TASK_INDEX": str(lease.index),
            "GPUMESH_ATTEMPT": str(lease.attempt),
            "GPUMESH_WORKER_ID": self.w.worker_id,
            "GPUMESH_WORKER_SCORE": f"{self.w.capability.score_gflops:.3f}",
        }
        if self.w.cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.w.cuda_visible_devices
        env.update(self.w.task_env)
        return env

    def _report(self, running: Running, out: sandbox.Attempt, limits: sandbox.Limits) -> str:
        """Tell the broker how the attempt ended (or nothing, when it is no longer ours to tell). Output
        files it staged stay only if it completed: a failed, lost or losing copy drops them."""
        status = self._outcome(running, out, limits)
        staged = out.collected
        if isinstance(staged, artifacts.Staged) and status != "done":
            try:
                staged.discard()
            except Exception as exc:  # noqa: BLE001 - the staging expires on its own
                log.warning("%s: could not drop the staged output files (%s); they expire", running.lease.task_id, exc)
        return status

    def _outcome(self, running: Running, out: sandbox.Attempt, limits: sandbox.Limits) -> str:
        lease = running.lease
        why = "" if out.returncode != 0 or out.killed else bad_result(out, limits)
        if not (out.returncode != 0 or out.killed or why or isinstance(out.collected, artifacts.StageFailed)):
            return self._complete(running, out)  # its log lines go in the completion's round trip
        self._flush_logs()
        if out.killed and out.killed.startswith(PAUSED):
            return self._hand_back_paused(running, out)
        if out.killed and out.killed.startswith(UNREPORTED):
            log.warning("%s: %s; the attempt was killed and is not reported", lease.task_id, out.killed)
            return "lost"
        if out.killed == "cancelled":
            log.info("%s: cancelled; the attempt was killed", lease.task_id)
            return "cancelled"
        if out.returncode != 0 or out.killed:
            tail = "\n".join(out.stderr_tail)[-ERROR_TAIL_CHARS:]
            kind, need, said = failure_of(out, self.w.resources)
            hint = module_hint(out.stderr_tail, self.extras(lease.job_id).siblings, lease.script_name)
            error = said + (f"\n{tail}" if tail else "") + (f"\n{hint}" if hint else "")
            return self._fail(running, error, out.duration, kind=kind, need=need)
        if why:
            return self._fail(running, why, out.duration)
        assert isinstance(out.collected, artifacts.StageFailed)  # the worker's storage failed, not the script
        return self._fail(running, out.collected.reason, out.duration, kind="lost")

    def _hand_back_paused(self, running: Running, out: sandbox.Attempt) -> str:
        """The lender paused this machine: the task goes back to queued without spending its attempt, and its
        job counts the time its attempt had run (status: time lost to pauses)."""
        lease = running.lease
        why = out.killed or PAUSED
        res = self._patiently(lambda: self._end(lease, f"handed back: {why}", out.duration, release=True, kind="lost"))
        copy = "backup copy of attempt" if lease.backup else "attempt"
        self.w.logs.put(
            lease.task_id, "gpumesh", f"{copy} {lease.attempt} handed back after {out.duration:.1f}s: {why}"
        )
        log.info("%s: handed back (%s) after %.1fs", lease.task_id, why, out.duration)
        if res.accepted:
            try:
                self.broker.count_handback(lease.job_id, out.duration)
            except redis.RedisError as exc:
                log.debug("could not count the pause in its job (%s)", exc)
        return "lost"

    def _complete(self, running: Running, out: sandbox.Attempt) -> str:
        lease, result = running.lease, out.last_line or ""
        staged = out.collected if isinstance(out.collected, artifacts.Staged) else None
        # A signed task that completes is spent: a trusting worker never runs it again (see _refusal).
        identity = leased_identity(lease.task_id)
        spent = str(identity[1]) if lease.signature and identity else ""
        stored: tuple[tuple[str, str], ...] = ()
        if self.result_signer is not None:
            # The proof covers the artifact index complete stores (each file's SHA-256): the files too.
            index = artifacts.dumps(staged.index) if staged is not None else ""
            proof = self.result_signer.proof(lease.task_id, lease.attempt, result, self.w.worker_id, index)
            stored = ((PROOF_FIELD, proof),)
        then = self.w.wants_next()  # its token made once: a call sent again leases the same next task
        asked = time.monotonic()
        # The attempt's log lines go first in the completion's round trip (complete empties the list once they
        # are sent; a try that fails before sends them again with its retry, and any left go back to the thread).
        with self.w.logs.riding(self._log_wait) as lines:
            res = self._patiently(
                lambda: scripts.complete(
                    self.broker.scripts, self.broker.r, lease, self.w.worker_id, result, out.duration,
                    self.w.capability.score_gflops, staged, spent=spent, stored=stored, then=then, lines=lines,
                )
            )  # fmt: skip
        if isinstance(res.next, scripts.Lease):
            self.w.got_next(res.next, asked)
        if not res.accepted:
            if res.status == "done":  # the race a backup copy runs (speculation): nothing went wrong here
                log.info("%s: another copy finished first; this one's result is not used", lease.task_id)
            else:
                log.warning("%s: result rejected (%s): the lease moved on", lease.task_id, res.status)
            return f"rejected:{res.status}"
        log.info("done %s in %.2fs%s", lease.task_id, out.duration, " (the backup copy won)" * lease.backup)
        self._sent = staged.total if staged is not None else 0
        return "done"

    def _refusal(self, lease: scripts.Lease, source: str) -> str | None:
        """Why this task must not run here: its script is not what its hash says, or (on a worker that
        trusts keys) its signature is missing, wrong, from an untrusted key, or expired, or the task
        already ended for good (its job's spent set has it: completed, failed for good or cancelled; only
        the submitter's `retry` takes it out). The job id and index the signature must cover are the
        leased task's own (from its id, i.e. its key), never the fields stored with it, which anyone may
        copy."""
        if hashlib.sha256(source.encode()).hexdigest() != lease.script_sha:
            return "the script in the broker does not match its hash (tampered)"
        extras = self.extras(lease.job_id)
        if extras.project:
            try:
                safe_rel(lease.script_name)
            except ValueError as exc:
                return f"the script's path in its project cannot be used: {exc}"
        verifier = self.w.verifier
        if verifier is None:
            return None
        from gpumesh.signing import message

        identity = leased_identity(lease.task_id)
        if identity is None or identity != (lease.job_id, lease.index):
            return "signature: does not match the task (its job id or index is not its own: copied from another job)"
        job_id, index = identity
        msg = message(
            job_id, index, lease.script_sha, lease.payload, lease.timeout, lease.max_attempts, lease.expires_at,
            extras.project, extras.outputs, extras.reuse, extras.env, extras.preload,
        )  # fmt: skip
        why = verifier.verify(lease.key_id, lease.signature, msg)
        if why is None and lease.server_ms / 1000 > lease.expires_at:
            why = "signature: the job expired before it ran (a replay, or it waited too long)"
        if why is None and lease.spent != "open":  # read with the lease, in the same call (lease_reply)
            if lease.spent == "ended":
                why = "signature: this task already ended (it completed, failed for good or was cancelled): a replay"
            else:
                why = "signature: the job's record of completed tasks is missing (deleted, or the job expired)"
        return why

    def _end(
        self, lease: scripts.Lease, error: str, duration: float, release: bool = False, reject: bool = False,
        kind: str = "script", need: tuple[str, float] | None = None,
    ) -> scripts.Outcome:  # fmt: skip
        """The fail script (fail, release or reject); a task back in queued is pending again at once."""
        # A failed attempt (not one handed back or refused): other live workers get the task first for a
        # lease TTL, so a sick worker does not spend every attempt of it.
        ttl_ms = int(self.settings.lease_ttl * 1000)
        avoid_ms = 0 if release or reject else ttl_ms
        return scripts.fail(
            self.broker.scripts, self.broker.r, lease, self.w.worker_id, error, duration, release=release,
            reject=reject, avoid_ms=avoid_ms, kind=kind, need=need, hold_ms=ttl_ms * MEMORY_HOLD_TTLS,
        )  # fmt: skip

    def _fail(
        self, running: Running, error: str, duration: float, reject: bool = False, kind: str = "script",
        need: tuple[str, float] | None = None,
    ) -> str:  # fmt: skip
        lease = running.lease
        res = self._patiently(lambda: self._end(lease, error, duration, reject=reject, kind=kind, need=need))
        if not res.accepted:
            log.warning("%s: failure not recorded (%s): the lease moved on", lease.task_id, res.status)
            return f"rejected:{res.status}"
        copy = "backup copy of attempt" if lease.backup else "attempt"
        self.last_error = error
        first = error.splitlines()[0]
        self.w.logs.put(lease.task_id, "gpumesh", f"{copy} {lease.attempt} failed: {first}")
        log.info("%s attempt %d failed (%s, %s): %s", lease.task_id, lease.attempt, kind, res.status, first)
        said = next_step(res, kind, need)
        if said:
            self.w.logs.put(lease.task_id, "gpumesh", said)
            log.info("%s: %s", lease.task_id, said)
        return res.status

    def _finish_quietly(self, running: Running, error: str, release: bool, duration: float = 0.0) -> None:
        if running.stop_reason and running.stop_reason.startswith(UNREPORTED):
            return
        try:
            self._end(running.lease, error, duration, release=release, kind="lost")
        except redis.RedisError as exc:  # the lease will lapse and the reaper requeues it
            log.warning("%s: could not hand the task back (%s); its lease will lapse", running.lease.task_id, exc)

    def _patiently(self, call: Callable[[], scripts.Outcome]) -> scripts.Outcome:
        """Report an outcome through a broker restart or a short network cut: retry for up to a lease TTL.

        Past that the lease has lapsed and the task may be someone else's; fencing makes a late call harmless."""
        deadline = time.monotonic() + self.settings.lease_ttl
        delay = 0.2
        while True:
            try:
                return call()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("broker unreachable while reporting (%s); retrying in %.1fs", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)


class Watcher:
    """One thread per worker that looks at the running attempt's checkpoint directory every 0.1 s (Saver.tick):
    started at the first attempt, idle between attempts."""

    def __init__(self) -> None:
        self._saver: Saver | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def watch(self, saver: Saver) -> None:
        with self._cond:
            self._saver = saver
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="gpumesh-checkpoint", daemon=True)
                self._thread.start()
            self._cond.notify()

    def unwatch(self, saver: Saver) -> None:
        with self._cond:
            if self._saver is saver:
                self._saver = None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._saver is None:
                    self._cond.wait()
                saver = self._saver
            try:
                saver.tick()
            except Exception:
                log.exception("checkpoint watcher error")
            time.sleep(0.1)


class Saver:
    """One attempt's checkpoints (sandbox.runner.Checkpoint): the task's newest restored into its
    GPUMESH_CHECKPOINT_DIR before it starts; saved when the task asks (gpumesh.checkpoint(), or the marker file),
    every GPUMESH_CHECKPOINT_EVERY seconds, and once more when it was stopped (a pause, a timeout, a failure:
    what it wrote in its grace after SIGTERM included)."""

    def __init__(self, executor: Executor, running: Running) -> None:
        self.ex, self.running, self.lease = executor, running, running.lease
        self.settings = executor.settings
        self.seq = 0
        self._fd: int | None = None
        self._lock = threading.Lock()  # held while the directory is read or closed
        self._due = float("inf")

    def _note(self, line: str) -> None:
        self.ex.w.logs.put(self.lease.task_id, "gpumesh", line)

    def restore(self, dir_fd: int, owner: tuple[int, int] | None) -> None:
        try:
            index = self.ex.checkpoints.restore(self.lease.task_id, dir_fd, owner)
        except Exception as exc:  # noqa: BLE001 - whatever the store or the archive says: the task starts afresh
            self._note(f"checkpoint not restored ({type(exc).__name__}: {exc}); the task starts without it")
            log.warning("%s: checkpoint not restored (%s)", self.lease.task_id, exc)
            return
        if index is not None:
            self._note(f"restored the checkpoint of attempt {index.get('attempt', '?')} ({index['bytes']} bytes, "
                       f"{index['files']} files)")  # fmt: skip

    def started(self, dir_fd: int) -> None:
        self._fd = os.dup(dir_fd)
        every = self.settings.checkpoint_every
        self._due = time.monotonic() + every if every else float("inf")
        self.ex.watcher.watch(self)

    def tick(self) -> None:
        """Save when the task asked (then remove its marker: its gpumesh.checkpoint() returns), or when the
        interval is up."""
        with self._lock:
            fd = self._fd
            if fd is None:
                return
            asked = _exists(checkpoints.SAVE_MARKER, fd)
            if not asked and time.monotonic() < self._due:
                return
            every = self.settings.checkpoint_every
            self._save(fd, "asked by the task" if asked else f"every {every:g} s")
            self._due = time.monotonic() + every if every else float("inf")
            if asked:
                with contextlib.suppress(OSError):
                    os.unlink(checkpoints.SAVE_MARKER, dir_fd=fd)

    def _save(self, fd: int, why: str) -> bool:
        """Pack, upload and keep the directory as the task's newest checkpoint; whether it was kept."""
        if not self.seq and not any(name != checkpoints.SAVE_MARKER for name in os.listdir(fd)):
            return False  # nothing in the directory, and nothing saved before: nothing to save
        try:
            data, size = checkpoints.pack(fd, int(self.settings.checkpoint_mb * (1 << 20)))
        except checkpoints.Changed as exc:
            log.debug("%s: checkpoint skipped: %s changed while it was read", self.lease.task_id, exc)
            return False
        except (checkpoints.TooLarge, OSError) as exc:
            self._note(f"checkpoint not saved: {exc}")
            return False
        with data:
            self.seq += 1
            try:
                kept, refused = self.ex.checkpoints.save(self.lease, self.seq, data, size)
            except Exception as exc:  # noqa: BLE001 - the broker or the object store failed: the next save may not
                log.warning("%s: checkpoint not saved (%s)", self.lease.task_id, exc)
                return False
        if kept:
            log.debug("%s: checkpoint %d saved (%s, %d bytes)", self.lease.task_id, self.seq, why, size)
            self._note(f"checkpoint saved ({why}, {size} bytes)")
        elif refused != "backup":
            log.info("%s: checkpoint not kept (%s)", self.lease.task_id, refused)
        return kept

    def ended(self, dir_fd: int, out: sandbox.Attempt) -> None:
        self.ex.watcher.unwatch(self)
        stopped = out.killed and not out.killed.startswith(UNREPORTED) and out.killed != "cancelled"
        if stopped or (out.returncode not in (0, None) and not out.killed):
            with self._lock:
                if self._fd is not None:
                    self._save(self._fd, "as the attempt ended")

    def closed(self) -> None:
        self.ex.watcher.unwatch(self)
        with self._lock:  # after a save in progress
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except OSError:
        return False


_VMSTAT: list[int] = []  # /proc/vmstat, opened once: read for every attempt


def kernel_oom_kills() -> int:
    """How many processes the kernel's out-of-memory killer has killed since boot (/proc/vmstat); -1 when
    this kernel does not say."""
    try:
        if not _VMSTAT:
            _VMSTAT.append(os.open("/proc/vmstat", os.O_RDONLY | os.O_CLOEXEC))
        data = os.pread(_VMSTAT[0], 1 << 16, 0)
        at = data.index(b"\noom_kill ") + len(b"\noom_kill ")
        return int(data[at : data.index(b"\n", at)])
    except (OSError, ValueError):
        return -1
