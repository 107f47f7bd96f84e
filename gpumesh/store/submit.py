"""Submit: validated input becomes a job and its queued tasks, visible all at once.

Nothing about placement is decided here (dispatch.lua decides when a worker asks). A task is a
small hash plus one member of its job's pending zset for its requirement class; no RQ job exists
until a worker takes the task, so a queued task costs a few hundred bytes of broker memory.
A job of up to STAGE_ABOVE tasks is written in one MULTI/EXEC; a larger one in stages (claim, tasks
in chunks, one MULTI/EXEC to make it visible), so neither the client nor Redis's MULTI buffer holds
it whole.

The path runs one way: the API checks its input once, into a :class:`SubmitRequest` (``SubmitRequest.checked``,
the one place a submit's input is checked); :class:`gpumesh.store.broker.Broker` sends it (``Broker.send``)
through a :class:`Submitter`, which plans the job (ids, costs, classes) and writes it, trusting the request.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import redis

from gpumesh import requirements, scheduling
from gpumesh.envs.lock import Lock, env_requirements
from gpumesh.errors import BrokerError, UsageError
from gpumesh.models import (
    JobOptions,
    Payloads,
    SubmitResult,
    check_payloads,
    check_reusable,
    check_script,
    payload_cost,
    payload_requires,
)
from gpumesh.project import Packed
from gpumesh.settings import Settings
from gpumesh.store import keys, projects, scripts
from gpumesh.store.connection import TextClient, translate
from gpumesh.store.retention import delete_job

if TYPE_CHECKING:
    from gpumesh.signing import Signer

log = logging.getLogger("gpumesh")


def _c_payload_json() -> Callable[[Any], str]:
    """``json.dumps`` of a payload (checked already: JSON, finite, not circular), the same text in one call of
    the C encoder that json.dumps ends in: 0.18 s against 0.50 s for 200,000 small payloads. json.dumps
    itself where the accelerator is missing (another Python)."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return json.dumps
    # (markers, default, encoder, indent, separators, sort_keys, skipkeys, allow_nan); json.dumps's default, so
    # what was not checked (a Payloads made by hand) fails with json.dumps's TypeError
    args = (
        None,
        json.JSONEncoder().default,
        json.encoder.encode_basestring_ascii,
        None,
        ": ",
        ", ",
        False,
        False,
        True,
    )
    encode = make(*args)
    return lambda payload: "".join(encode(payload, 0))


_payload_json = _c_payload_json()

STAGE_ABOVE = 10_000  # a larger job is written in stages (Submitter._submit_staged); a smaller one in one MULTI/EXEC
STAGE_CHUNK = 5_000  # tasks per round trip while staging
# A chunk's payloads travel as one argument, and Redis refuses one over 512 MB (proto-max-bulk-len): a chunk
# also ends once its payloads pass this many bytes, which bounds what Redis and this process hold for one call.
STAGE_BYTES = 32 * 2**20
# A staging claim's score is its submitter's last progress (server ms). One that made none for this long was
# abandoned (the submitter died): the reaper deletes what it wrote, and a retry with its idempotency key
# takes the job id over at once instead of waiting.
STAGING_STALE_MS = 60_000


MAX_IDEMPOTENCY_KEY = 200


@dataclass(frozen=True)
class SubmitRequest:
    """One job to submit, checked: what the API builds once and the broker sends (``Broker.send``).

    Build it with :meth:`checked`, the one place where a submit's input is checked; what comes after
    (Submitter) trusts it."""

    source: str
    script_name: str
    payloads: Payloads
    options: JobOptions  # its requirements include the environment's (env_requirements)
    idempotency_key: str | None = None  # a retried submit with the same key returns the first one's job
    signer: Signer | None = None  # signs every task (gpumesh.signing)
    expires_in: float = 7 * 86400  # s a signed job stays valid
    project: Packed | None = None  # the folder that travels with the job (gpumesh.project.pack)
    siblings: tuple[str, ...] = ()  # modules beside a lone script where it was submitted (the worker's hint)
    env: Lock | None = None  # its environment's lock (gpumesh.envs), stored once in the job's hash

    @classmethod
    def checked(
        cls,
        source: str,
        script_name: str,
        payloads: list[dict[str, Any]],
        options: JobOptions,
        *,
        idempotency_key: str | None = None,
        signer: Signer | None = None,
        expires_in: float = 7 * 86400,
        project: Packed | None = None,
        siblings: tuple[str, ...] = (),
        env: Lock | None = None,
    ) -> SubmitRequest:
        """The request, once its input passed every check (a UsageError naming what is wrong otherwise).
        Payloads that ``check_payloads`` returned already (the CLI's, the API's) are not checked again."""
        checked = check_payloads(payloads)
        if idempotency_key is not None:
            _check_idempotency_key(idempotency_key)
        check_script(source, script_name)
        if not isinstance(options, JobOptions):
            raise UsageError(f"options must be a gpumesh.models.JobOptions, got {type(options).__name__}")
        if options.reuse_process:
            check_reusable(source, script_name)
        if options.preload and env is None:
            raise UsageError(
                "preload names modules of the job's environment: declare one (--with, --requirements, a PEP 723 "
                "block, [env] dependencies) or leave preload out"
            )
        if env is not None:  # only workers that build envs, of a Python the lock allows, may take its tasks
            options = options.model_copy(update={"requires": (*options.requires, *env_requirements(env))})
        siblings = siblings if project is None else ()
        return cls(source, script_name, checked, options, idempotency_key, signer, expires_in, project, siblings, env)

    @property
    def sha(self) -> str:
        """The script's SHA-256: its key in the broker (keys.script), and what tasks and signatures name."""
        return hashlib.sha256(self.source.encode()).hexdigest()

    def job_id(self) -> str:
        """Derived from the idempotency key (a retry names the same job), else random."""
        if self.idempotency_key:
            return hashlib.sha256(f"gpumesh-idempotency:{self.idempotency_key}".encode()).hexdigest()[:12]
        return uuid.uuid4().hex[:12]

    def fingerprint(self) -> str:
        """What an idempotent retry must repeat exactly: a digest of script, payloads, options, project and
        environment ('' without an idempotency key: never compared, so never computed)."""
        if not self.idempotency_key:
            return ""
        project = self.project.digest if self.project else ""
        what = [self.sha, self.script_name, self.payloads, self.options.model_dump(), project]
        what += [self.env.digest] if self.env else []
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class _Job:
    """What submit writes for one job: the request, and what was decided for it (ids, costs and requirement
    classes, the time it was made, the tier forecast)."""

    request: SubmitRequest
    id: str
    sha: str
    costs: list[float]
    classes: list[int]  # requirement class of each task (index into class_reqs)
    class_reqs: list[tuple[requirements.Requirement, ...]]
    created: float
    per_tier: dict[str, int]
    fingerprint: str  # SubmitRequest.fingerprint: '' without an idempotency key

    @property
    def source(self) -> str:
        return self.request.source

    @property
    def script_name(self) -> str:
        return self.request.script_name

    @property
    def payloads(self) -> Payloads:
        return self.request.payloads

    @property
    def options(self) -> JobOptions:
        return self.request.options

    @property
    def project(self) -> Packed | None:
        return self.request.project

    @property
    def siblings(self) -> tuple[str, ...]:
        return self.request.siblings

    @property
    def env(self) -> Lock | None:
        return self.request.env

    @property
    def expires(self) -> float:
        """When a signed job's signatures expire (server seconds)."""
        return self.created + self.request.expires_in

    @property
    def signed_env(self) -> str:
        """The environment's lock digest as the signature covers it ('' for none)."""
        return self.env.digest if self.env else ""

    @property
    def signed_project(self) -> tuple[str, str]:
        """(tree digest, output globs as JSON) as the signature covers them; ('', '') for neither."""
        return self.project.digest if self.project else "", outputs_json(self.options.outputs)


def tier_forecast(costs: list[float], scores: dict[str, float], tiers: int) -> dict[str, int]:
    """Where the tasks would go on the live fleet as it is now: tasks per worker tier, as ``submit --json``
    prints it. Only a forecast for the submitter: placement is decided by dispatch.lua when a worker asks."""
    per_tier: dict[str, int] = {}
    for t in sorted(scheduling.assign_task_tiers(costs, scheduling.tier_capacity(scores, tiers))):
        per_tier[str(t)] = per_tier.get(str(t), 0) + 1
    return per_tier


def outputs_json(globs: tuple[str, ...]) -> str:
    """A job's output globs as stored in its hash and signed ('' for none)."""
    return json.dumps(list(globs), separators=(",", ":")) if globs else ""


def requirement_classes(
    payloads: list[dict[str, Any]], job_requires: tuple[str, ...]
) -> tuple[list[int], list[tuple[requirements.Requirement, ...]]]:
    """Each task's requirement class: tasks that require the same set share one pending zset."""
    base = requirements.parse_all(job_requires)
    index: dict[tuple[str, ...], int] = {requirements.canonical(base): 0}
    reqs: list[tuple[requirements.Requirement, ...]] = [base]
    classes = [0] * len(payloads)
    for i, payload in enumerate(payloads):
        own = payload_requires(payload)
        if not own:
            continue
        merged = base + requirements.parse_all(own, f"payloads[{i}].requires")
        key = requirements.canonical(merged)
        if key not in index:
            index[key] = len(reqs)
            reqs.append(tuple(requirements.parse(e) for e in key))
        classes[i] = index[key]
    return classes, reqs


def _check_idempotency_key(key: str) -> None:
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError("--idempotency-key must be text (UTF-8); got bytes that are not") from None
    if not key or len(key) > MAX_IDEMPOTENCY_KEY:
        raise UsageError(f"--idempotency-key must be 1 to {MAX_IDEMPOTENCY_KEY} characters, got {len(key)}")


class Submitter:
    """Writes jobs through one client; ``live`` reads the server's time and the live workers' scores."""

    def __init__(
        self,
        r: TextClient,
        url: str,
        settings: Settings,
        scripts: scripts.Scripts,
        live: Callable[[], tuple[int, dict[str, float]]],
    ) -> None:
        self.r = r
        self.url = url
        self.settings = settings
        self.scripts = scripts
        self._live = live
        self._epoch_made = False
        self._who: str | None = None

    def submitter(self) -> str:
        """The name of the credential this client submits with, as the broker knows it (CLIENT INFO's user):
        recorded in each job, for workers started with --accept-from. Read once."""
        if self._who is None:
            try:
                who = str(cast(Any, self.r).client_info().get("user") or "")
            except redis.ResponseError:  # a Redis before 6.2, or one that refuses CLIENT INFO
                who = ""
            self._who = who or "default"
        return self._who

    def _make_epoch(self) -> None:
        """The broker's epoch, made by the first submit (or worker) on a broker without ACLs, once the job is
        written; once per Submitter. On a broker `gpumesh serve` runs, serve made it and a submitter may not write it."""
        if self._epoch_made:
            return
        try:
            self.r.set(keys.EPOCH, uuid.uuid4().hex, nx=True)
        except redis.exceptions.NoPermissionError:
            pass
        self._epoch_made = True

    def submit(self, request: SubmitRequest, files: projects.Files | None = None) -> SubmitResult:
        """Write script, job and tasks so that the job appears whole or not at all (one MULTI/EXEC, or stages
        for a large job). With a project, its files the mesh lacks are sent to ``files`` first, and the job
        attached to its tree (a job that then fails to be written is detached again).

        With an idempotency key the job id derives from the key, so a submit retried after a timeout
        returns the job the first one created instead of a second job (WATCH makes the race safe)."""
        try:
            job = self._plan(request)
            if request.project is not None:
                assert files is not None
                return self._with_project(job, files)
            return self._write(job)
        except redis.RedisError as exc:
            raise translate(exc, self.url) from None

    def _plan(self, request: SubmitRequest) -> _Job:
        """What is decided for the job before it is written: its id, each task's cost and requirement class,
        its creation time (the server's) and the tier forecast."""
        costs = [payload_cost(p) for p in request.payloads]
        classes, class_reqs = requirement_classes(request.payloads, request.options.requires)
        now_ms, scores = self._live()
        forecast = tier_forecast(costs, scores, self.settings.tiers)
        created = now_ms / 1000
        return _Job(
            request, request.job_id(), request.sha, costs, classes, class_reqs, created, forecast, request.fingerprint()
        )

    def _write(self, job: _Job) -> SubmitResult:
        """The job, written in one MULTI/EXEC or (a large one) in stages."""
        job_id, request, idempotency_key = job.id, job.fingerprint, job.request.idempotency_key
        signer, expires = job.request.signer, job.expires
        if len(job.payloads) > STAGE_ABOVE:
            staged = self._submit_staged(job)
            self._make_epoch()
            return staged
        existing: list[Any]
        try:
            with self.r.pipeline(transaction=True) as p:
                if idempotency_key:
                    cast(Any, p).watch(keys.job(job_id))  # redis-py leaves Pipeline.watch untyped
                    existing = p.hmget(keys.job(job_id), "request", "total", "tiers")
                    if existing[0] is not None:
                        return self._same_request(job_id, existing, request, idempotency_key)
                    p.multi()
                self._write_job(p, job)
                if signer is not None:
                    self._sign(p, signer, job, expires)
                if idempotency_key:
                    p.hset(keys.job(job_id), "request", request)
                p.execute()
            self._make_epoch()  # after the job: a submit that fails leaves the broker as it was
        except redis.WatchError:  # the same key won a concurrent race: that job is ours
            existing = self.r.hmget(keys.job(job_id), "request", "total", "tiers")
            return self._same_request(job_id, existing, request, idempotency_key or "")
        return SubmitResult(job_id=job_id, tasks=len(job.payloads), tiers=job.per_tier, priority=job.options.priority)

    def _with_project(self, job: _Job, files: projects.Files) -> SubmitResult:
        """Send the project's missing files and attach the job to its tree, then write the job; a job not
        written (an error, Ctrl-C) is detached again. An idempotent retry of a job that exists is attached
        already (attaching is idempotent) and keeps its tree."""
        assert job.project is not None
        projects.store(files, self.scripts, self.r, job.project, job.id)
        written = False
        try:
            res = self._write(job)
            written = True
            return res
        finally:
            if not written and not self.r.exists(keys.job(job.id)):
                try:
                    projects.detach(files, self.scripts, self.r, job.id, job.project.digest, self.settings.artifacts)
                except redis.RedisError as exc:  # the reaper detaches it (detach_dangling)
                    log.warning("could not detach job %s from its project (%s); the reaper will", job.id, exc)

    @staticmethod
    def _sign(p: Any, signer: Any, job: _Job, expires: float, start: int = 0, stop: int | None = None) -> None:
        from gpumesh.signing import SPENT_MARGIN, SPENT_PLACEHOLDER, message

        job_id, sha, payloads, options = job.id, job.sha, job.payloads, job.options
        tree, outputs = job.signed_project
        env = job.signed_env

        if start == 0 and stop is None:
            p.hset(keys.job(job_id), mapping={"key_id": signer.key_id, "expires_at": f"{expires:.3f}"})
        if start == 0:  # the job's spent set: trusting workers refuse a task whose index is in it (a replay)
            p.sadd(keys.spent(job_id), SPENT_PLACEHOLDER)
            p.expireat(keys.spent(job_id), int(expires + SPENT_MARGIN))
        for i in range(start, len(payloads) if stop is None else stop):
            payload = payloads[i]
            msg = message(
                job_id, i, sha, json.dumps(payload), options.timeout, options.max_attempts, float(f"{expires:.3f}"),
                tree, outputs, options.reuse_process, env, ",".join(options.preload),
            )  # fmt: skip
            p.hset(keys.task(keys.task_id(job_id, i)), "sig", signer.sign(msg))

    @staticmethod
    def _same_request(job_id: str, existing: list[Any], request: str, key: str) -> SubmitResult:
        if existing[0] != request:
            raise UsageError(
                f"idempotency key {key!r} was already used for job {job_id} with a different script, payloads or "
                "options; use a new key for a new job"
            )
        return SubmitResult(job_id=job_id, tasks=int(existing[1]), tiers=json.loads(existing[2]), existing=True)

    def _write_job(self, p: Any, job: _Job) -> None:
        # Always written, never SET NX: the key is its content's hash, so this is always right, and it
        # repairs a script someone overwrote (workers refuse a script that does not match its hash).
        p.set(keys.script(job.sha), job.source)
        self._write_tasks(p, job, 0, len(job.payloads))
        self._make_visible(p, job)

    def _write_tasks(self, p: Any, job: _Job, start: int, stop: int) -> None:
        """Tasks ``start..stop``, their place in the job's task list and in its pending zsets (stage.lua);
        not yet visible to anyone (no worker looks at a job before it is in the ready index).

        A task hash holds only what differs between tasks (the job hash holds the rest), and a
        default cost or class is not written: a queued task costs a few hundred bytes."""
        lo = start
        while lo < stop:
            payloads = [_payload_json(payload) for payload in job.payloads[lo : min(stop, lo + STAGE_CHUNK)]]
            if sum(map(len, payloads)) > STAGE_BYTES:  # ASCII: characters are bytes
                fit = bisect.bisect_left(list(itertools.accumulate(map(len, payloads))), STAGE_BYTES)
                payloads = payloads[: max(1, fit)]
            hi = lo + len(payloads)
            scripts.stage(self.scripts, p, job.id, lo, payloads, job.costs[lo:hi], job.classes[lo:hi])
            lo = hi

    def _make_visible(self, p: Any, job: _Job) -> None:
        """The job hash, the jobs index and the ready index: after this the job exists for everyone, and
        idle workers are woken to take its tasks."""
        options, total = job.options, len(job.payloads)
        p.hset(
            keys.job(job.id),
            mapping={
                "id": job.id,
                "name": options.name,
                "script_sha": job.sha,
                "script_name": job.script_name,
                "timeout": options.timeout,
                "max_attempts": options.max_attempts,
                # A job with an environment also retries a failed build, elsewhere first: the machine that failed
                # it fails that lock at once from then on, and the other machines may build it.
                "retry_on": ",".join((*options.retry_on, *(["environment"] if job.env is not None else []))),
                "priority": options.priority,
                "classes": json.dumps([[[r.key, r.op, r.value] for r in reqs] for reqs in job.class_reqs]),
                "pending_cost": repr(float(sum(job.costs))),
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
                **({"reuse_process": 1} if options.reuse_process else {}),
                **self._project_fields(job),
                "submitter": self.submitter(),
            },
        )
        p.zadd(keys.JOBS, {job.id: job.created})
        p.zadd(keys.READY, {keys.ready_member(job.id, k): options.priority for k in sorted(set(job.classes))})
        scripts.wake(self.scripts, p)
        p.xadd(keys.EVENTS, {"kind": "job", "id": job.id, "status": "queued"}, maxlen=10000, approximate=True)

    @staticmethod
    def _project_fields(job: _Job) -> dict[str, str | int]:
        """What the job hash holds of its project and output globs (nothing for a job without them: a job
        costs the broker what it did)."""
        out: dict[str, str | int] = {}
        if job.project is not None:
            out.update(project=job.project.digest, project_files=len(job.project.files),
                       project_bytes=job.project.total_bytes)  # fmt: skip
        if job.options.outputs:
            out["outputs"] = outputs_json(job.options.outputs)
        if job.siblings:
            out["siblings"] = ",".join(job.siblings)
        if job.env is not None:  # the lock, once per job; its digest is in every task's signature
            out.update(env=job.env.digest, env_lock=job.env.text, env_python=job.env.requires_python,
                       env_builds=int(job.env.allow_builds))  # fmt: skip
        if job.options.preload:  # in every task's signature too
            out["preload"] = ",".join(job.options.preload)
        return out

    def _submit_staged(self, job: _Job) -> SubmitResult:
        """A large job in bounded steps, so neither this process nor Redis's MULTI buffer holds it all at once.

        1. Claim the job id in ``keys.STAGING`` (a concurrent submit with the same idempotency key
           waits for ours), then stage the tasks chunk by chunk, invisible; the reaper deletes what a
           submitter that died here left behind.
        2. One MULTI/EXEC makes the whole job visible at once."""
        r, total = self.r, len(job.payloads)
        request, idempotency_key = job.fingerprint, job.request.idempotency_key
        signer, expires = job.request.signer, job.expires
        if idempotency_key:
            existing = r.hmget(keys.job(job.id), "request", "total", "tiers")
            if existing[0] is not None:
                return self._same_request(job.id, existing, request, idempotency_key)
        if not r.zadd(keys.STAGING, {job.id: int(job.created * 1000)}, nx=True):
            other = self._await_other_submit(job.id, request, idempotency_key or "")
            if other is not None:
                return other
            # the other submit died: its claim and what it staged are gone; stage the job afresh
            return self._submit_staged(job)
        r.set(keys.script(job.sha), job.source)  # as in _write_job: repairs an overwritten script
        t0 = time.monotonic()
        for start in range(0, total, STAGE_CHUNK):
            with r.pipeline(transaction=False) as p:
                stop = min(total, start + STAGE_CHUNK)
                self._write_tasks(p, job, start, stop)
                progress_ms = int(job.created * 1000 + (time.monotonic() - t0) * 1000)  # server time, from submit
                p.zadd(keys.STAGING, {job.id: progress_ms}, xx=True)
                if signer is not None:
                    self._sign(p, signer, job, expires, start, stop)
                p.execute()
        with r.pipeline(transaction=True) as p:
            self._make_visible(p, job)
            if signer is not None:
                p.hset(keys.job(job.id), mapping={"key_id": signer.key_id, "expires_at": f"{expires:.3f}"})
            if idempotency_key:
                p.hset(keys.job(job.id), "request", request)
            p.execute()  # the staging entry stays (the reaper drops it later): it is the claim on this job id
        return SubmitResult(job_id=job.id, tasks=total, tiers=job.per_tier, priority=job.options.priority)

    def _await_other_submit(self, job_id: str, request: str, key: str, patience: float = 120.0) -> SubmitResult | None:
        """A concurrent submit with the same idempotency key is staging this job: its result is ours. None
        when that submit died (its claim made no progress for STAGING_STALE_MS): its partial job is deleted
        here, and the caller stages the job itself."""
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            existing = self.r.hmget(keys.job(job_id), "request", "total", "tiers")
            if existing[0] is not None:
                return self._same_request(job_id, existing, request, key)
            progress = self.r.zscore(keys.STAGING, job_id)
            if progress is None and existing[1] is None:
                return None  # the other submit gave up; nothing of it is visible
            sec, usec = self.r.time()
            if progress is not None and sec * 1000 + usec // 1000 - progress > STAGING_STALE_MS:
                delete_job(self.r, job_id, keys.STAGING)
                return None
            time.sleep(0.2)
        raise BrokerError(
            f"another submit with idempotency key {key!r} is still writing job {job_id}; run the same command again"
        )
