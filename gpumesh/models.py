"""The one schema for what crosses Redis and what the CLI prints as JSON."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from .errors import UsageError

TaskState = Literal["queued", "running", "done", "failed", "cancelled"]
JobState = Literal["queued", "running", "done", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"done", "failed", "cancelled"})


def ts(value: Any) -> datetime | None:
    """A Redis time field (epoch seconds as text) as an aware datetime; '' and None stay None."""
    if value in (None, "", b""):
        return None
    return datetime.fromtimestamp(float(value), tz=UTC)


def payload_cost(payload: dict[str, Any]) -> float:
    return float(payload.get("cost", 1))


def _check_cost(payload: dict[str, Any]) -> dict[str, Any]:
    if "cost" in payload:
        cost = payload["cost"]
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not math.isfinite(cost) or cost <= 0:
            raise ValueError(f"cost must be a positive number, got {json.dumps(cost)}")
    return payload


Payload = Annotated[dict[str, Any], AfterValidator(_check_cost)]
PAYLOADS = TypeAdapter(Annotated[list[Payload], Field(min_length=1)])


def parse_payloads(text: str, source: str = "payloads") -> list[dict[str, Any]]:
    """Validate a JSON list of objects with an optional positive ``cost``; one clear UsageError otherwise."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"{source} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
            'expected a list of objects such as [{"lr": 0.1}, {"lr": 0.01}]'
        ) from None
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
        raise UsageError(f"{where} must be a JSON object, got {json.dumps(data[loc[0]])[:60]}") from None


class JobOptions(BaseModel):
    """What a submitter chooses besides the script and the payloads."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("", max_length=200)
    timeout: float = Field(3600.0, gt=0, description="wall-clock seconds per attempt")
    max_attempts: int = Field(3, ge=1, le=100)
    speculate: bool = Field(False, description="back up a straggler on a stronger idle worker at the job's end")


class TaskCounts(BaseModel):
    total: int = 0
    queued: int = 0
    running: int = 0
    done: int = 0
    failed: int = 0
    cancelled: int = 0


class JobStatus(BaseModel):
    """``gpumesh status --json``."""

    job_id: str
    name: str
    status: JobState
    tasks: TaskCounts
    created_at: datetime | None
    finished_at: datetime | None

    @classmethod
    def from_hash(cls, job_id: str, h: dict[str, str]) -> JobStatus:
        counts = TaskCounts(**{k: int(h.get(k, 0)) for k in TaskCounts.model_fields})
        return cls(
            job_id=job_id,
            name=h.get("name", ""),
            status=h["status"],
            tasks=counts,
            created_at=ts(h.get("created_at")),
            finished_at=ts(h.get("finished_at")),
        )

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL


class SubmitResult(BaseModel):
    """``gpumesh submit --json`` (without ``--wait``)."""

    job_id: str
    tasks: int
    tiers: dict[str, int]


class TaskResult(BaseModel):
    """One row of ``gpumesh results``."""

    index: int
    task_id: str
    status: TaskState
    result: Any = None
    error: str | None = None
    attempts: int
    worker: str | None = None
    duration_s: float | None = None

    @classmethod
    def from_hash(cls, task_id: str, h: dict[str, str]) -> TaskResult:
        return cls(
            index=int(h["index"]),
            task_id=task_id,
            status=h["status"],
            result=json.loads(h["result"]) if h.get("result") else None,
            error=h.get("error") or None,
            attempts=int(h.get("attempts", 0)),
            worker=h.get("worker") or None,
            duration_s=float(h["duration"]) if h.get("duration") else None,
        )


class Capability(BaseModel):
    """What a worker's probe and benchmark found."""

    device: Literal["cuda", "mps", "cpu"]
    device_name: str
    memory_bytes: int
    score_gflops: float
    backend: str


class WorkerInfo(BaseModel):
    """One row of ``gpumesh workers``."""

    id: str
    name: str
    hostname: str
    device: str
    device_name: str
    score_gflops: float
    tier: int
    state: Literal["idle", "busy"]
    current_task: str | None
    last_heartbeat: datetime | None
