"""The one schema for what crosses Redis and what the CLI prints as JSON. The payload checks live in
:mod:`gpumesh.payloads` and the failure kinds in :mod:`gpumesh.failures`; their names are found here too."""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, TypeVar, cast, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
)

from gpumesh import jobstate
from gpumesh.errors import UsageError
from gpumesh.failures import EXCEPTION_MARKER as EXCEPTION_MARKER  # where callers have always found them
from gpumesh.failures import FAILURE_KINDS as FAILURE_KINDS
from gpumesh.failures import error_summary as error_summary
from gpumesh.failures import failure_kind as failure_kind
from gpumesh.jobstate import RECORDED_KINDS as RECORDED_KINDS  # where callers have always found them
from gpumesh.jobstate import RETRY_KINDS as RETRY_KINDS
from gpumesh.jobstate import ts as ts
from gpumesh.payloads import MAX_DEPTH as MAX_DEPTH  # where callers have always found them
from gpumesh.payloads import PAYLOADS as PAYLOADS
from gpumesh.payloads import REUSE_ENTRY as REUSE_ENTRY
from gpumesh.payloads import Payload as Payload
from gpumesh.payloads import Payloads as Payloads
from gpumesh.payloads import check_payloads as check_payloads
from gpumesh.payloads import check_reusable as check_reusable
from gpumesh.payloads import check_script as check_script
from gpumesh.payloads import loads_strict as loads_strict
from gpumesh.payloads import parse_payloads as parse_payloads
from gpumesh.payloads import payload_cost as payload_cost
from gpumesh.payloads import payload_requires as payload_requires
from gpumesh.payloads import too_deep as too_deep
from gpumesh.requirements import parse_all

TaskState = Literal["queued", "running", "done", "failed", "cancelled"]
JobState = Literal["queued", "running", "done", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"done", "failed", "cancelled"})


# A script with a bug is not run again by default; what the machine or the mesh did to it is.
DEFAULT_RETRY_ON = ("timeout", "memory", "lost")


def parse_retry_on(value: Any) -> tuple[str, ...]:
    """``--retry-on``: kinds, comma-separated (or a list), ``all`` or ``none``; in RETRY_KINDS order."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise ValueError("must be failure kinds, comma-separated: " + ",".join(RETRY_KINDS) + ", all or none")
    chosen = {i.strip().lower() for i in items if i.strip()}
    if chosen in ({"all"}, {"none"}):
        return tuple(RETRY_KINDS) if chosen == {"all"} else ()
    unknown = sorted(chosen - set(RETRY_KINDS))
    if unknown:
        hint = " ('refused' is never retried)" if "refused" in unknown else ""
        raise ValueError(
            f"unknown failure kind {unknown[0]!r}{hint}; choose from " + ",".join(RETRY_KINDS) + ", all or none"
        )
    return tuple(k for k in RETRY_KINDS if k in chosen)


def parse_preload(value: Any, reuse_process: bool = False) -> tuple[str, ...]:
    """Module names to preload: a list, or one comma-separated string; each a dotted module name (``numpy``,
    ``torch.nn``). ValueError naming the first that is not."""
    import keyword

    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise ValueError("must be module names, such as numpy or torch.nn (a list, or comma-separated)")
    names = tuple(dict.fromkeys(i.strip() for i in items if i.strip()))
    for name in names:
        parts = name.split(".")
        if len(name) > 200 or not all(p.isascii() and p.isidentifier() and not keyword.iskeyword(p) for p in parts):
            raise ValueError(f"{name!r} is not a module name (dotted identifiers, such as numpy or torch.nn)")
    if len(names) > 32:
        raise ValueError("at most 32 modules")
    if names and reuse_process:
        raise ValueError("a reused process keeps what its script imports loaded already: preload is for warm workers")
    return names


class Model(BaseModel):
    """The base of gpumesh's models: each builds its validator on first use, not at import, so a command
    pays only for the models it uses (`gpumesh status --json` starts about 20 ms sooner)."""

    model_config = ConfigDict(defer_build=True)

    @classmethod
    def model_rebuild(
        cls, *, force: bool = False, raise_errors: bool = True, _parent_namespace_depth: int = 2,
        _types_namespace: Any = None,
    ) -> bool | None:  # fmt: skip
        """The build on first use, which may come while a command waits for Ctrl-C (``submit --wait``'s first
        status read): pydantic-core turns a KeyboardInterrupt raised inside its build into a SchemaError, a
        traceback where the user pressed Ctrl-C. A Ctrl-C during the build is raised once it is over."""
        with _ctrl_c_held():
            return super().model_rebuild(
                force=force, raise_errors=raise_errors, _parent_namespace_depth=_parent_namespace_depth + 1,
                _types_namespace=_types_namespace,
            )  # fmt: skip


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Hold a SIGINT that arrives inside the block and raise its KeyboardInterrupt at the end. Only where Python's
    own handler would raise it (the main thread, SIGINT not ignored nor handled otherwise); else nothing changes."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    pressed: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:
        raise KeyboardInterrupt


class JobOptions(Model):
    """What a submitter chooses besides the script and the payloads (``Mesh.submit``'s keywords).

    >>> JobOptions(timeout=600, max_attempts=2, requires=("vram_gb>=40",)).requires
    ('vram_gb>=40',)
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field("", max_length=200)
    timeout: float = Field(3600.0, description="wall-clock seconds per attempt, more than 0 and at most a year")
    max_attempts: int = Field(3, ge=1, le=100)
    speculate: bool = Field(True, description="let a much stronger worker run a backup copy of a straggler")
    priority: int = Field(0, ge=-1_000_000, le=1_000_000, description="higher runs first")
    requires: tuple[str, ...] = Field((), description="requirements every task of the job has (EXPR)")
    retry_on: tuple[str, ...] = Field(DEFAULT_RETRY_ON, description="failure kinds retried while attempts remain")
    reuse_process: bool = Field(
        False, description="run the job's tasks on each worker one after another in one process that stays loaded"
    )
    outputs: tuple[str, ...] = Field(
        (), description="globs (gitignore syntax) of files the task writes in its working directory to bring back"
    )
    preload: tuple[str, ...] = Field(
        (), description="modules of the job's environment a warm worker imports once for the job, before its tasks"
    )

    @field_validator("preload", mode="before")
    @classmethod
    def _valid_preload(cls, v: Any, info: ValidationInfo) -> tuple[str, ...]:
        return parse_preload(v, bool(info.data.get("reuse_process")))

    @field_validator("outputs")
    @classmethod
    def _valid_outputs(cls, v: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        if v and info.data.get("reuse_process"):
            raise ValueError(
                "a reused process's working directory is the job's, not a task's, so no glob can say which task "
                "wrote a file: write what each task returns to GPUMESH_OUTPUT_DIR, or submit without --reuse-process"
            )
        for glob in v:
            if not glob.strip() or glob.startswith("!") or "\0" in glob or len(glob) > 300:
                raise ValueError(f"{glob!r} is not a usable glob (such as outputs/*.json or *.pt)")
        if len(v) > 50:
            raise ValueError("at most 50 globs")
        return v

    @field_validator("retry_on", mode="before")
    @classmethod
    def _valid_retry_on(cls, v: Any) -> tuple[str, ...]:
        return parse_retry_on(v)

    @field_validator("timeout")
    @classmethod
    def _finite_timeout(cls, v: float) -> float:
        if not math.isfinite(v) or not 0 < v <= 365 * 86400:  # nan too, which is no "greater than 0"
            raise ValueError("must be a finite number of seconds, more than 0 and at most a year")
        return v

    @field_validator("requires")
    @classmethod
    def _valid_requires(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        try:
            return tuple(str(r) for r in parse_all(v))
        except UsageError as exc:
            raise ValueError(str(exc).removeprefix("--require: ")) from None


class TaskCounts(Model):
    total: int = 0
    queued: int = 0
    running: int = 0
    done: int = 0
    failed: int = 0
    cancelled: int = 0


class Waiting(Model):
    """Queued tasks that no live worker may run: what they require, and how many there are."""

    requires: list[str]
    tasks: int
    # set when workers that meet the requirements are live, but each runs only tasks signed by keys it
    # trusts and this job is not ("unsigned", or the id of the key that signed it)
    signer: str | None = None


class JobStatus(Model):
    """A job's state and task counts: ``Job.status()``, ``Job.wait()``, ``gpumesh status --json``.

    >>> st = job.status()                                        # doctest: +SKIP
    >>> st.status, st.tasks.done, st.tasks.total, st.finished   # doctest: +SKIP
    ('running', 7, 10, False)
    """

    job_id: str
    name: str
    status: JobState
    priority: int = 0
    tasks: TaskCounts
    created_at: datetime | None
    finished_at: datetime | None
    waiting_for: list[Waiting] = Field(default_factory=list)
    # Failed tasks by the kind their last attempt recorded (RECORDED_KINDS), and what the job retries.
    failed_by_kind: dict[str, int] = Field(default_factory=dict)
    retry_on: list[str] = Field(default_factory=list)
    # Attempts handed back because their worker's lender paused it (no attempt spent), and how long they had run.
    paused_handbacks: int = 0
    paused_lost_s: float = 0.0
    env: str | None = None  # the digest of the job's environment lock (gpumesh.envs), when it has one
    # the live workers that prepare its environment now, before they lease its tasks
    preparing: list[str] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _without_unused_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A job dumps as it always has: the pause fields only for a job that had an attempt handed back by a
        pause (as jobstate.fields), ``env`` and ``preparing`` only for a job with an environment."""
        out: dict[str, Any] = handler(self)
        if not self.preparing:
            out.pop("preparing", None)
        if not self.paused_handbacks:
            out.pop("paused_handbacks", None)
            out.pop("paused_lost_s", None)
        if out.get("env") is None:
            out.pop("env", None)
        return out

    @classmethod
    def from_hash(cls, job_id: str, h: dict[str, str]) -> JobStatus:
        return cls.model_validate(jobstate.fields(job_id, h))

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL


class ProjectSent(Model):
    """What a submit packed of its project folder and had to send (the rest the mesh held already)."""

    digest: str
    files: int
    bytes: int
    sent_files: int
    sent_bytes: int
    summary: str


class SubmitResult(Model):
    """What a submit answered: the job id, its task count and how many tasks each tier is forecast to take
    (``Job.submitted``, ``gpumesh submit --json``).

    >>> job.submitted.tasks, job.submitted.tiers                 # doctest: +SKIP
    (10, {'0': 6, '1': 4})
    """

    job_id: str
    tasks: int
    tiers: dict[str, int]
    priority: int = 0
    waiting_for: list[Waiting] = Field(default_factory=list)
    existing: bool = False  # the idempotency key named a job submitted before: nothing new was written
    project: ProjectSent | None = None
    env: str | None = None  # the digest of the job's environment lock (gpumesh.envs), when it has one


class Artifact(Model):
    """A file a task's winning attempt wrote to GPUMESH_OUTPUT_DIR, as stored (``gpumesh pull`` fetches it)."""

    path: str
    bytes: int
    sha256: str


class SkippedArtifact(Model):
    """A file that was not stored, and why (a cap, a symlink, not a regular file)."""

    path: str
    reason: str


AttemptOutcome = Literal["running", "done", "failed", "retried", "lost", "cancelled", "superseded", "handed back"]
ATTEMPT_OUTCOMES: frozenset[str] = frozenset(get_args(AttemptOutcome))


@dataclass(frozen=True)
class Attempt:
    """One run of a task on one worker (``Job.attempts()``; the dashboard's timeline draws one bar each).

    ``copy`` is ``backup`` for a speculative copy started beside a straggler (it keeps its primary's
    attempt number). ``outcome``: ``running`` (``ended_at`` is None), ``done``, ``failed`` (the task failed
    for good, or its backup carried on), ``retried`` (failed, the task was queued again), ``lost`` (its
    worker or lease was lost), ``cancelled``, ``superseded`` (the other copy finished first) or ``handed
    back`` (its worker stopped and returned it unspent). ``kind`` is the failure kind when it failed.
    Times are the broker's, in seconds since the epoch (``started_at`` None: not recorded).

    >>> [(a.index, a.worker, a.outcome) for a in job.attempts()]   # doctest: +SKIP
    [(0, 'w-a100', 'done'), (1, 'w-laptop', 'retried'), (1, 'w-a100', 'done')]
    """

    index: int
    task_id: str
    attempt: int
    worker: str
    copy: Literal["primary", "backup"]
    started_at: float | None
    ended_at: float | None
    outcome: AttemptOutcome
    kind: str | None = None


class TaskResult(Model):
    """One task's outcome (``Job.results()``, ``Job.as_completed()``, ``gpumesh results``): ``result`` is
    the JSON the script printed last or the function returned, ``error`` why a failed task failed.

    >>> [(r.index, r.status, r.result) for r in job.results()]  # doctest: +SKIP
    [(0, 'done', 0.0102), (1, 'failed', None)]
    """

    index: int
    task_id: str
    status: TaskState
    result: Any = None
    error: str | None = None
    # How a failed (or cancelled) task failed, one of FAILURE_KINDS; None for a task that did not fail.
    error_kind: str | None = None
    attempts: int
    worker: str | None = None
    duration_s: float | None = None
    artifacts: list[Artifact] = Field(default_factory=list)
    skipped_artifacts: list[SkippedArtifact] = Field(default_factory=list)
    # Whether the result's proof verifies with the registered result key of the worker credential that
    # signed it (signing.verify_result): None while the task has no result, or when the broker registers
    # no result keys; signed_by names that credential (its ACL user), as the proof says.
    verified: bool | None = None
    signed_by: str | None = None

    _stored: dict[str, str] = PrivateAttr(default_factory=dict)  # what verify_with checks, as stored

    def verify_with(self, result_keys: dict[str, str]) -> TaskResult:
        """Set ``verified`` and ``signed_by`` from the broker's registry of result keys (keys.RESULT_KEYS)."""
        from gpumesh.signing import verify_result

        self.verified, self.signed_by = verify_result(self.task_id, self._stored, result_keys)
        return self

    @classmethod
    def from_hash(cls, task_id: str, h: dict[str, str]) -> TaskResult:
        from gpumesh.signing import PROOF_FIELD

        index = _stored_index(h.get("artifacts"))
        status = h["status"]
        error = h.get("error") or None
        ended_badly = status in ("failed", "cancelled")
        row = cls(
            index=int(h["index"]),
            task_id=task_id,
            status=cast(JobState, status),
            result=_stored_result(h.get("result")),
            error=error,
            error_kind=failure_kind(status, error, h.get("error_kind")) if ended_badly else None,
            attempts=int(h.get("attempts", 0)),
            worker=h.get("worker") or None,
            duration_s=float(h["duration"]) if h.get("duration") else None,
            artifacts=_entries(Artifact, index.get("files")),
            skipped_artifacts=_entries(SkippedArtifact, index.get("skipped")),
        )
        row._stored = {k: h[k] for k in ("status", "result", PROOF_FIELD, "artifacts", "artifacts_lost") if k in h}
        return row


_Entry = TypeVar("_Entry", bound=BaseModel)


def _entries(model: type[_Entry], raw: Any) -> list[_Entry]:
    """An index's list of entries; one that does not fit the model (written by a broken or hostile worker)
    is left out rather than breaking ``results`` for the whole job."""
    out = []
    for item in raw if isinstance(raw, list) else []:
        try:
            out.append(model.model_validate({k: v for k, v in item.items() if k in model.model_fields}))
        except (ValidationError, AttributeError):
            continue
    return out


def _stored_index(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        index = json.loads(text)
    except ValueError:
        return {}
    return index if isinstance(index, dict) else {}


def _stored_result(text: str | None) -> Any:
    """A stored result; one an older worker accepted that cannot be read back (too deep) reads as its text."""
    if not text:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text[:200]


class Capability(Model):
    """What a worker's probe and benchmark found.

    The resource fields have defaults so that a cache file written before they existed still loads
    (``capability.probe`` fills in the host's cores and RAM for such a file). Sizes are GiB (2**30 bytes),
    as ``torch`` and ``free -g`` count them, rounded to 0.1."""

    device: Literal["cuda", "mps", "cpu"]
    device_name: str
    memory_bytes: int  # the device's memory for cuda, else the machine's RAM
    score_gflops: float
    backend: str
    cpu_cores: int = 0  # cores this process may run on (0: not probed, an old cache file)
    ram_gb: float = 0.0
    vram_gb: float | None = None  # cuda only: MPS shares the machine's RAM, a CPU has none
    vram_free_gb: float | None = None  # cuda only, free when probed: a hint, other processes come and go
    # False for the pure-Python backend: its score is ~1000x below numpy's on the same machine and
    # mostly measures the interpreter, so it must not be ranked against numpy or torch scores.
    comparable: bool = True

    def resources(self) -> dict[str, str | float]:
        """What tasks can require of this worker (``--require vram_gb>=40``); unknown ones are left out. The
        device's name is ``gpu`` on a GPU (cuda, mps) and ``cpu`` on a machine without one, so that
        ``gpu~…`` never matches a processor."""
        res: dict[str, str | float] = {
            "device": self.device,
            "cpu" if self.device == "cpu" else "gpu": self.device_name,
            "cpu_cores": self.cpu_cores,
            "ram_gb": self.ram_gb,
        }
        if self.vram_gb is not None:
            res["vram_gb"] = self.vram_gb
        if self.vram_free_gb is not None:
            res["vram_free_gb"] = self.vram_free_gb
        return res


class TierLoad(Model):
    """One tier as ``gpumesh workers`` and ``top`` show it (``Mesh.tiers()``): its RQ queue, the workers that
    serve it now, how many tasks wait in its queue (a window of the next ones, 20 at most) and how many of all
    the queued tasks the fleet as it is would give it (``queued``: the placement rule's split by score, sampled
    per job beyond 10,000 queued tasks, ``estimated`` then).

    >>> [(t.queue, t.workers, t.waiting, t.queued) for t in mesh.tiers()]   # doctest: +SKIP
    [('gpumesh-tier-0', ['laptop'], 20, 95), ('gpumesh-tier-1', [], 0, 0), ('gpumesh-tier-2', ['lab-a100'], 20, 45)]
    """

    tier: int
    queue: str
    workers: list[str]
    waiting: int
    queued: int
    estimated: bool = False


class WorkerInfo(Model):
    """A live worker (``Mesh.workers()``, ``gpumesh workers``): device, benchmark score, tier, resources.

    >>> [(w.name, w.device, w.score_gflops, w.state) for w in mesh.workers()]   # doctest: +SKIP
    [('lab-a100', 'cuda', 19500.0, 'busy')]
    """

    id: str
    name: str
    hostname: str
    device: str
    device_name: str
    score_gflops: float
    tier: int
    state: Literal["idle", "busy", "paused"]
    current_task: str | None
    last_heartbeat: datetime | None
    resources: dict[str, Any] = Field(default_factory=dict)
    paused: str | None = None  # why its lender's probes let it take no work now (``gpumesh worker --lend``)
    preparing: str | None = None  # "env DIGEST for JOB" while it builds a job's environment (gpumesh.envs)
    version: str | None = None  # the gpumesh package it runs
    protocol: int | None = None  # the broker-side protocol it speaks (gpumesh._version.PROTOCOL); None: unknown

    @property
    def release(self) -> str:
        """``0.3.0 (protocol 29)``: what ``workers``, ``top``, the dashboard and ``doctor`` show of its version."""
        if not self.version:
            return "unknown version"
        return f"{self.version} (protocol {self.protocol})" if self.protocol is not None else self.version

    # the environments its machine holds ready, and those it could not build (lock digests, cut short)
    envs: list[str] = Field(default_factory=list)
    env_failed: list[str] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _without_absent_preparing(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A worker that prepares nothing and holds no env dumps as it always has: no ``preparing`` or env keys."""
        out: dict[str, Any] = handler(self)
        if out.get("preparing") is None:
            out.pop("preparing", None)
        for k in ("envs", "env_failed"):
            if not out.get(k):
                out.pop(k, None)
        return out
