"""A job's status as plain data, from the fields of its hash: the one definition of what
``models.JobStatus`` holds. ``gpumesh.store.jobstatus`` reads it from the broker; the model validates the
same dict, and ``gpumesh status JOB --json`` prints it without building the model (see
``gpumesh/cli/status.py``), so the two cannot drift apart (``tests/cli/test_cli_start.py`` compares them on
jobs in every state).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

# Failure kinds as a worker records them (the task's error_kind; gpumesh/store/lua/_lib.lua end_attempt):
# what ``submit --retry-on`` chooses from. 'refused' (the task must not run) is never retried.
RETRY_KINDS = {
    "script": "the script failed: non-zero exit, a traceback, killed by a signal, or no usable JSON result",
    "timeout": "the attempt ran past the job's timeout",
    "memory": "over its memory cap, out of CUDA memory, MemoryError, or killed by the kernel's OOM killer",
    "lost": "its worker or lease was lost, or its output files could not be stored (a lapsed lease does not "
    "spend an attempt, up to 3 times)",
}
# 'environment': the job's environment could not be built on the worker's machine (gpumesh.envs).
RECORDED_KINDS = (*RETRY_KINDS, "refused", "environment")
COUNTS = ("total", "queued", "running", "done", "failed", "cancelled")  # the job's task counters


def ts(value: Any) -> datetime | None:
    """A Redis time field (epoch seconds as text) as an aware datetime; '' and None stay None."""
    if value in (None, "", b""):
        return None
    return datetime.fromtimestamp(float(value), tz=UTC)


def count(text: str | None) -> int:
    """A counter as stored; one that is not a number (written by some credential) reads as 0."""
    try:
        return max(int(text or 0), 0)
    except ValueError:
        return 0


def fields(job_id: str, h: dict[str, str]) -> dict[str, Any]:
    """JobStatus's fields from the job's hash (``waiting_for`` empty: :func:`waiting_for` reads it)."""
    by_kind = {k: count(h.get("failed:" + k)) for k in RECORDED_KINDS}
    on = h.get("retry_on")
    out = {
        "job_id": job_id,
        "name": h.get("name", ""),
        "status": h["status"],
        "priority": int(h.get("priority", 0)),
        "tasks": {k: int(h.get(k, 0)) for k in COUNTS},
        "created_at": ts(h.get("created_at")),
        "finished_at": ts(h.get("finished_at")),
        "waiting_for": [],
        "failed_by_kind": {k: n for k, n in by_kind.items() if n > 0},
        "retry_on": [k for k in on.split(",") if k in RETRY_KINDS] if on is not None else [*RETRY_KINDS],
        **paused(h),
    }
    if h.get("env"):  # the digest of its environment's lock (gpumesh.envs): only a job with one has the key
        out["env"] = h["env"]
    return out


def paused(h: dict[str, str]) -> dict[str, Any]:
    """Attempts handed back because their worker's lender paused it, and how long they had run: only for a job
    that had such an attempt (models.JobStatus leaves them out too when there was none)."""
    n = count(h.get("paused_handbacks"))
    return {"paused_handbacks": n, "paused_lost_s": seconds(h.get("paused_lost_s"))} if n else {}


def seconds(text: str | None) -> float:
    """A time counter as stored; one that is not a number reads as 0."""
    try:
        value = float(text or 0)
    except ValueError:
        return 0.0
    return round(value, 3) if 0 <= value < 1e12 else 0.0


def to_json(st: dict[str, Any]) -> dict[str, Any]:
    """The fields as ``JobStatus.model_dump(mode="json")`` gives them: times as ISO 8601 in UTC ('Z')."""
    out = dict(st)
    for k in ("created_at", "finished_at"):
        if isinstance(out[k], datetime):
            out[k] = out[k].isoformat().replace("+00:00", "Z")
    return out
