"""Every Redis key name gpumesh uses. No key is built anywhere else."""

from __future__ import annotations

PREFIX = "gpumesh:"

JOBS = PREFIX + "jobs"  # zset: job id -> created_at
STAGING = (
    PREFIX + "staging"
)  # zset: job id -> created_at ms, for a large job whose tasks are written but not yet visible
WORKERS = PREFIX + "workers"  # zset: worker id -> last heartbeat (ms, server time)
SCORES = PREFIX + "scores"  # zset: worker id -> benchmark score (GFLOP/s)
LEASES = PREFIX + "leases"  # zset: task id -> lease deadline (ms)
QUEUED = PREFIX + "queued"  # zset: queued task id -> ms its delivery was last enqueued or checked (the audit)
EVENTS = PREFIX + "events"  # stream, capped
REAPER_LOCK = PREFIX + "reaper"  # string, PX: the worker currently reaping
STATS = PREFIX + "stats"  # hash: done / failed / retried / lease_expired counters, for metrics
STATS_DURATION = PREFIX + "stats:duration"  # hash: task duration histogram (per-bucket counts, sum, count)
EPOCH = PREFIX + "epoch"  # string: random id of this broker's data; a change means the data was lost

QUEUE_PREFIX = "gpumesh-tier-"  # RQ queue names: gpumesh-tier-<k>


def job(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}"


def job_tasks(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:tasks"


def task(task_id: str) -> str:
    return f"{PREFIX}task:{task_id}"


def task_log(task_id: str) -> str:
    return f"{PREFIX}task:{task_id}:log"


def script(sha: str) -> str:
    return f"{PREFIX}script:{sha}"


def worker(worker_id: str) -> str:
    return f"{PREFIX}worker:{worker_id}"


def lease(task_id: str) -> str:
    return f"{PREFIX}lease:{task_id}"


def queue_name(tier: int) -> str:
    return f"{QUEUE_PREFIX}{tier}"


def task_id(job_id: str, index: int) -> str:
    return f"{job_id}-{index}"


def job_of_task(task_id: str) -> str:
    return task_id.rsplit("-", 1)[0]


def rq_job_id(task_id: str, delivery: int) -> str:
    """Deterministic RQ job id per delivery (submit = 1, each requeue +1): re-enqueueing is idempotent."""
    return f"{task_id}_{delivery}"
