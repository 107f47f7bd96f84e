"""The one schema for what crosses Redis and what the CLI prints as JSON."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Literal, TypeVar, cast, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
)

from gpumesh import jobstate
from gpumesh.errors import UsageError
from gpumesh.jobstate import RECORDED_KINDS as RECORDED_KINDS  # where callers have always found them
from gpumesh.jobstate import RETRY_KINDS as RETRY_KINDS
from gpumesh.jobstate import ts as ts
from gpumesh.requirements import parse_all

TaskState = Literal["queued", "running", "done", "failed", "cancelled"]
JobState = Literal["queued", "running", "done", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"done", "failed", "cancelled"})


def payload_cost(payload: dict[str, Any]) -> float:
    return float(payload.get("cost", 1))


def _check_cost(payload: dict[str, Any]) -> dict[str, Any]:
    if "cost" in payload:
        cost = payload["cost"]
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not math.isfinite(cost) or cost <= 0:
            raise ValueError(f"cost must be a positive number, got {json.dumps(cost)}")
    if "requires" in payload:
        reqs = payload["requires"]
        if not isinstance(reqs, list):
            raise ValueError(
                f'requires must be a list of requirements such as ["vram_gb>=40"], got {json.dumps(reqs)[:60]}'
            )
        try:
            parse_all(reqs, "requires")
        except UsageError as exc:
            raise ValueError(str(exc)) from None
    return payload


def payload_requires(payload: dict[str, Any]) -> list[str]:
    reqs = payload.get("requires")
    return reqs if isinstance(reqs, list) else []


Payload = Annotated[dict[str, Any], AfterValidator(_check_cost)]
PAYLOADS = TypeAdapter(Annotated[list[Payload], Field(min_length=1)], config=ConfigDict(defer_build=True))


MAX_DEPTH = 100  # how deep a payload or a result may nest (lists and objects); deeper is refused


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (JSON has no NaN or Infinity; send null or a string)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: a literal past a double's range, read as Infinity
        raise ValueError(f"the number {text[:40]} is too large for a 64-bit float; send it as a string")
    return value


def loads_strict(text: str) -> Any:
    """json.loads without NaN/Infinity (written, or a number too large that would read as one), with every
    failure (too deep, a number too long) as a ValueError."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError(f"it nests deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError:
        raise
    except ValueError as exc:
        if "integer string conversion" in str(exc):  # Python's guard against quadratic int parsing
            raise ValueError(
                f"a number in it has more than {sys.get_int_max_str_digits()} digits; send it as a string"
            ) from None
        raise
    if too_deep(value):
        raise ValueError(f"it nests deeper than {MAX_DEPTH} levels")
    return value


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``value`` nests lists and dicts more than ``limit`` levels deep (no recursion: any depth is safe)."""
    level: list[Any] = [value] if isinstance(value, (dict, list)) else []
    for _ in range(limit):
        inner: list[Any] = []
        for v in level:
            inner.extend(v.values() if isinstance(v, dict) else v)
        level = [v for v in inner if isinstance(v, (dict, list))]
        if not level:
            return False
    return bool(level)


class Payloads(list[dict[str, Any]]):
    """A payload list that passed :func:`check_payloads`, so submit does not check it a second time."""


def parse_payloads(text: str, source: str = "payloads") -> Payloads:
    """Validate a JSON list of objects with an optional positive ``cost``; one clear UsageError otherwise."""
    try:
        data = loads_strict(text)
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"{source} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
            'expected a list of objects such as [{"lr": 0.1}, {"lr": 0.01}]'
        ) from None
    except ValueError as exc:  # NaN, too deep, an integer of thousands of digits
        raise UsageError(f"{source} cannot be used: {exc}") from None
    return Payloads(_validate(data, source))


def check_payloads(data: Any, source: str = "payloads") -> Payloads:
    """The checks of :func:`parse_payloads` on data already decoded (what a Python caller passes)."""
    if isinstance(data, Payloads):
        return data
    checked = _validate(data, source)
    try:  # what came from Python, not from JSON text: it must be JSON, and finite
        json.dumps(checked, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        why = f"it nests deeper than {MAX_DEPTH} levels" if isinstance(exc, RecursionError) else str(exc)
        raise UsageError(f"{source} cannot be sent as JSON: {why}") from None
    if too_deep(checked):
        raise UsageError(f"{source} cannot be used: a payload nests deeper than {MAX_DEPTH} levels")
    return Payloads(checked)


def _validate(data: Any, source: str) -> list[dict[str, Any]]:
    try:
        return PAYLOADS.validate_python(data, strict=True)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = err["loc"]
        if not loc:
            if isinstance(data, list):
                raise UsageError(f"{source} is an empty list; a job needs at least one payload") from None
            raise UsageError(f"{source} must be a JSON list of objects, got a JSON {type(data).__name__}") from None
        where = f"{source}[{loc[0]}]"
        if err["type"] == "value_error":
            raise UsageError(f"{where}.{err['msg'].removeprefix('Value error, ')}") from None
        raise UsageError(f"{where} must be a JSON object, got {_show(data[loc[0]])}") from None


def _show(value: Any) -> str:
    try:
        return json.dumps(value)[:60]
    except (TypeError, ValueError):
        return type(value).__name__


def check_script(source: str, name: str) -> str:
    """A script's source, once it compiles; one UsageError naming the line otherwise."""
    if not isinstance(source, str):
        raise UsageError(f"script {name} must be Python source text, got {type(source).__name__}")
    try:
        compile(source, name, "exec")
    except SyntaxError as exc:
        raise UsageError(f"script {name} has a syntax error at line {exc.lineno}: {exc.msg}") from None
    except ValueError as exc:  # e.g. a NUL byte in the source
        raise UsageError(f"script {name} cannot be compiled: {exc}") from None
    return source


REUSE_ENTRY = "main"  # what a script submitted with --reuse-process defines, and each task calls


def check_reusable(source: str, name: str) -> None:
    """A script submitted with --reuse-process (its tasks share a process per worker) must define its entry point,
    ``def main(payload)`` at its top level, which each task calls; one UsageError saying so otherwise."""
    import ast

    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == REUSE_ENTRY:
            return
    raise UsageError(
        f"script {name} has no top-level def {REUSE_ENTRY}(payload): with --reuse-process each task calls "
        f"{REUSE_ENTRY}(payload) in a process that stays loaded, and returns its result; define it (see docs/reuse.md) "
        "or submit without --reuse-process"
    )


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


class Model(BaseModel):
    """The base of gpumesh's models: each builds its validator on first use, not at import, so a command
    pays only for the models it uses (`gpumesh status --json` starts about 20 ms sooner)."""

    model_config = ConfigDict(defer_build=True)


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

    @model_serializer(mode="wrap")
    def _without_unused_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A job dumps as it always has: the pause fields only for a job that had an attempt handed back by a
        pause (as jobstate.fields), ``env`` only for a job with an environment."""
        out: dict[str, Any] = handler(self)
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
        """Set ``verified`` and ``signed_by`` from the broker's registry of result keys (gpumesh:resultkeys)."""
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


# The last stderr line of a function task that raised (gpumesh.functions), followed by JSON {type, message}.
EXCEPTION_MARKER = "gpumesh-exception "

# How a task failed, as Mesh.map's TaskFailed.kind says it, read from the error its worker recorded.
FAILURE_KINDS = {
    "exception": "the function raised (exc_type, message and traceback say what)",
    "script_error": "the script exited non-zero or was killed by a signal",
    "timeout": "the attempt ran past the job's timeout",
    "memory": "the attempt went over its memory cap, or CUDA ran out of memory",
    "bad_result": "the script ended cleanly but its last stdout line is not a usable JSON result",
    "lost": "its worker stopped heartbeating or stopped during the attempt",
    "refused": "the worker refused to run it (signature, tampered script)",
    "environment": "the job's environment could not be built on the worker's machine (the builder's message)",
    "cancelled": "the job was cancelled",
}


def failure_kind(status: str, error: str | None, recorded: str | None = None) -> str:
    """One of FAILURE_KINDS for a task that ended ``failed`` or ``cancelled``. ``recorded``: the kind its
    worker recorded (RECORDED_KINDS, the task's ``error_kind``); a 'script' failure is told apart further
    (exception, bad_result, script_error) by its error text, as is a task from before kinds were recorded."""
    text = error or ""
    first = text.partition("\n")[0]
    if status == "cancelled":
        return "cancelled"
    if recorded in ("timeout", "memory", "lost", "refused", "environment"):
        return recorded
    if "\n" + EXCEPTION_MARKER in text:
        return "exception"
    if first.startswith(("result line is over", "the script printed nothing", "the last stdout line", "the result")):
        return "bad_result"
    if recorded == "script":
        return "script_error"
    if first.startswith("timed out"):
        return "timeout"
    if "over its memory cap" in first or "CUDA out of memory" in text:
        return "memory"
    if first.startswith(("lease expired", "lease lost", "worker stopped")):
        return "lost"
    if first.startswith(("signature", "the script in the broker does not match")) or "refused" in first:
        return "refused"
    return "script_error"


def error_summary(status: str, error: str | None, recorded: str | None = None) -> str:
    """One line saying how a task failed: its kind, then the exception (``ZeroDivisionError: division by
    zero``) when the error holds a Python traceback, else the error's first line."""
    kind = failure_kind(status, error, recorded)
    text = (error or "").rstrip()
    if kind == "cancelled":
        return "cancelled"
    marker = text.rfind("\n" + EXCEPTION_MARKER)
    if marker >= 0:
        try:
            info = json.loads(text[marker + 1 + len(EXCEPTION_MARKER) :].splitlines()[0])
            return f"{kind}: {info['type']}: {info['message']}".splitlines()[0]
        except (ValueError, KeyError, IndexError, TypeError):
            pass
    lines = text.splitlines()
    first = lines[0] if lines else status
    if "Traceback (most recent call last):" in text:
        for line in reversed(lines):
            if line and not line.startswith((" ", "\t", "Traceback")):
                return f"{kind}: {line}" if line != first else f"{kind}: {first}"
    return f"{kind}: {first}"


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

    @model_serializer(mode="wrap")
    def _without_absent_preparing(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A worker that prepares nothing dumps as it always has: no ``preparing`` key."""
        out: dict[str, Any] = handler(self)
        if out.get("preparing") is None:
            out.pop("preparing", None)
        return out
