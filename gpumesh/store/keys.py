"""Every Redis key name gpumesh uses: the one home of the layout.

Nothing else spells a key. The Functions library gets ``PREFIX`` when scripts.py assembles it (the scripts
build from it only the names they cannot be passed: the job dispatch picks, the spent set a lease reports,
the wake lists of idle workers); the ACL rules (server/acl.py) are globs made here (``ALL``, a family's
function called with ``"*"``). tests/test_layout.py fails on a literal prefix anywhere else in the package.

Redis Cluster: a script may touch only keys of one hash slot, and every transition names keys of several
families at once (a task, its job, the global LEASES, READY and EVENTS), while dispatch picks its job inside
the script. So the layout could only live in one slot: ``PREFIX = "{gpumesh}:"`` (a hash tag) would put every
key there, with no other change here or in the Lua, and RQ's keys (``rq:*``, each worker's deliveries) would
need a tag of their own, which RQ does not offer. One slot is one node: a cluster would add failover, not
capacity (Sentinel gives the failover already, store/sentinel.py).
"""

from __future__ import annotations

PREFIX = "gpumesh:"
ALL = PREFIX + "*"  # glob: every key of gpumesh's (the ACL rules' read access)

JOBS = PREFIX + "jobs"  # zset: job id -> created_at
STAGING = (
    PREFIX + "staging"
)  # zset: job id -> created_at ms, for a large job whose tasks are written but not yet visible
WORKERS = PREFIX + "workers"  # zset: worker id -> last heartbeat (ms, server time)
SCORES = PREFIX + "scores"  # zset: worker id -> benchmark score (GFLOP/s)
LEASES = PREFIX + "leases"  # zset: task id -> lease deadline (ms)
READY = PREFIX + "ready"  # zset: "<job>/<class>" with queued tasks -> the job's priority (what dispatch scans)
IDLE = PREFIX + "idle"  # set: workers whose last dispatch found nothing they may run (woken when work arrives)
# hash: n, sum, max of the registered workers' scores; 'dirty' when they must be recounted; 'v', the fleet's
# version (moved by every join, leave and recount); at:<tier>, when that tier's window of waiting tasks was last
# refreshed (ms)
FLEET = PREFIX + "fleet"
EVENTS = PREFIX + "events"  # stream, capped
REAPER_LOCK = PREFIX + "reaper"  # string, PX: the worker currently reaping
STATS = PREFIX + "stats"  # hash: done / failed / retried / lease_expired counters, for metrics
STATS_DURATION = PREFIX + "stats:duration"  # hash: task duration histogram (per-bucket counts, sum, count)
STATS_ALL = STATS + ":*"  # glob: the statistics under STATS (STATS_DURATION)
PRUNING = PREFIX + "pruning"  # zset: jobs the reaper deletes in steps (past their retention) -> when it began (ms)
EPOCH = PREFIX + "epoch"  # string: random id of this broker's data; a change means the data was lost
# hash: worker ACL user -> its result public key (ed25519:<base64>), written by the admin only (signing.py)
RESULT_KEYS = PREFIX + "resultkeys"
# hash: what the broker serves (protocol -> library name, "version" -> the gpumesh that loaded them), written
# by the admin only (serve, access load-functions); a client whose protocol is not served names them (protocols)
PROTOCOLS = PREFIX + "protocols"

QUEUE_PREFIX = "gpumesh-w-"  # RQ queue names of earlier versions, one per worker: only tidied away by the reaper
TIER_QUEUE_PREFIX = "gpumesh-tier-"  # RQ queue names: gpumesh-tier-<k>, the deliveries and waiting tasks of tier k


def job(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}"


def job_tasks(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:tasks"


def job_ended(job_id: str) -> str:
    """stream: one entry {task, status} each time a task of the job ends (what Job.as_completed reads).
    The Lua scripts name it from the job's hash key (job key + ":ended"), so the two must agree."""
    return f"{PREFIX}job:{job_id}:ended"


def job_attempts(job_id: str) -> str:
    """stream: one entry each time an attempt of one of the job's tasks ends (task index, attempt, worker,
    primary or backup copy, start and end in server seconds, outcome, failure kind): what the dashboard's
    timeline draws. Written by the Lua scripts (job key + ":attempts"), capped at the last 50,000."""
    return f"{PREFIX}job:{job_id}:attempts"


def job_failed(job_id: str) -> str:
    """list: the first 100 tasks of the job to fail for good (what status and submit --wait explain)."""
    return f"{PREFIX}job:{job_id}:failed"


def spent(job_id: str) -> str:
    """set, with a TTL past the job's signature expiry: the indexes of its signed tasks that completed (and
    the placeholder it was created with). A trusting worker never runs a task whose index is in it."""
    return f"{PREFIX}spent:{job_id}"


def task(task_id: str) -> str:
    return f"{PREFIX}task:{task_id}"


def job_log(job_id: str) -> str:
    """stream: the job's log, one entry per line of any of its tasks (index, stream, line): see store/tasklog.py."""
    return f"{PREFIX}job:{job_id}:log"


def task_log(task_id: str) -> str:
    """The stream per task that held a task's log before logs moved to one stream per job (job_log): only
    deleted now, with its job, so a broker that ran an earlier version is emptied whole."""
    return f"{PREFIX}task:{task_id}:log"


def task_files(task_id: str) -> str:
    """hash: the winning attempt's output files, as chunks (field "<file>:<chunk>"); see store/artifacts.py."""
    return f"{PREFIX}task:{task_id}:files"


def task_files_staging(task_id: str, copy: str) -> str:
    """hash, with a TTL: one attempt copy's files while it has not won (renamed to task_files when it does)."""
    return f"{PREFIX}task:{task_id}:files:{copy}"


def task_checkpoint(task_id: str) -> str:
    """hash: the task's newest checkpoint, as chunks (field "c:<chunk>"); see store/checkpoints.py."""
    return f"{PREFIX}task:{task_id}:files:ckpt"


def task_checkpoint_upload(task_id: str, copy: str, seq: int) -> str:
    """hash, with a TTL: a checkpoint while it uploads (renamed to task_checkpoint when it is saved)."""
    return f"{PREFIX}task:{task_id}:files:ckpt-{copy}-{seq}"


def script(sha: str) -> str:
    return f"{PREFIX}script:{sha}"


def worker(worker_id: str) -> str:
    return f"{PREFIX}worker:{worker_id}"


def env_holders(short_digest: str) -> str:
    """zset: the live workers whose machines hold the env whose lock digest (or the project tree whose digest)
    starts ``short_digest`` (16 hex), by score; lua/env_held.lua writes it (building this name from PREFIX), dispatch
    reads it (env_strongest)."""
    return f"{PREFIX}envholders:{short_digest}"


def lease(task_id: str) -> str:
    return f"{PREFIX}lease:{task_id}"


def pending(job_id: str, klass: int) -> str:
    """zset: the job's queued tasks of one requirement class, member = zero-padded index, score = cost."""
    return f"{PREFIX}job:{job_id}:pending:{klass}"


def ready_member(job_id: str, klass: int) -> str:
    return f"{job_id}/{klass}"


def wake(worker_id: str) -> str:
    """list: a token here wakes an idle worker blocked on it (new work may fit it)."""
    return f"{PREFIX}wake:{worker_id}"


def queue_name(worker_id: str) -> str:
    """An earlier version's queue of one worker's deliveries (the reaper removes those of dead workers)."""
    return f"{QUEUE_PREFIX}{worker_id}"


def tier_queue(tier: int) -> str:
    """The RQ queue of tier ``tier``: its workers' deliveries pass through it, and the tasks placed for the tier
    wait in it (a window; see lua/_lib.lua's refresh_window, which builds the same name)."""
    return f"{TIER_QUEUE_PREFIX}{tier}"


def rq_waiting_id(task_id: str) -> str:
    """The RQ job that shows a queued task waiting in its tier's queue (written by lua/_lib.lua's refresh_window)."""
    return f"{task_id}_waiting"


def pending_member(index: int) -> str:
    """Fixed width, so equal costs are taken in payload order (zsets order ties by member)."""
    return f"{index:08d}"


def task_id(job_id: str, index: int) -> str:
    return f"{job_id}-{index}"


def job_of_task(task_id: str) -> str:
    return task_id.rsplit("-", 1)[0]


def rq_job_id(task_id: str, attempt: int, backup: bool = False) -> str:
    """The RQ job that carries one dispatched attempt (or backup copy) to the worker that holds its lease."""
    return f"{task_id}_{'b' if backup else ''}{attempt}"


# -- projects (store/projects.py): files stored once by content, trees by digest, each kept while a job refers to it
PROJECT_REFS = PREFIX + "project:refs"  # hash: file sha256 -> how many stored trees hold it
PROJECT_TREES = PREFIX + "project:trees"  # zset: tree digest -> when a job last attached to it (ms)
PROJECT_BLOB_PREFIX = PREFIX + "project:blob:"  # what project_blob names: the Lua scripts add a sha256 to it
PROJECT_ALL = PREFIX + "project:*"  # glob: every key of the project store


def project_tree(digest: str) -> str:
    """string: a tree's manifest (canonical JSON; the digest is its SHA-256), while a job refers to it."""
    return f"{PREFIX}project:tree:{digest}"


def project_jobs(digest: str) -> str:
    """zset: the jobs that refer to a tree -> when each attached (ms); the tree goes with the last."""
    return f"{PREFIX}project:jobs:{digest}"


def project_blob(sha256: str) -> str:
    """hash: one file's bytes as chunks (fields "0", "1", ... and "size"); a TTL until a tree holds it."""
    return f"{PROJECT_BLOB_PREFIX}{sha256}"
