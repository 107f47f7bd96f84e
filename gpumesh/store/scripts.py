"""The task state machine: one atomic Lua script per transition, run as a Redis Functions library.

The transition scripts (``lua/_lib.lua`` + ``lua/<name>.lua``) are built into one library,
``gpumesh_p<N>``, named by the protocol it implements (gpumesh._version.PROTOCOL: releases that share it
call the same functions), with one function per script; clients call them with ``FCALL``, never ``EVAL``:
a broker that `gpumesh serve` runs refuses ``EVAL``/``EVALSHA``/``SCRIPT``/``FUNCTION`` to workers and
submitters (they could freeze Redis with a Lua loop of their own). ``serve`` loads the library at every
start, beside the previous protocol's (gpumesh.store.protocols); elsewhere (a plain Redis without ACLs) the
first client that finds a function missing loads it. A client facing a broker that serves only the
previous protocol calls that one's functions. Functions survive a restart (AOF/RDB) and ``SCRIPT FLUSH``.

The contract (also at the top of ``lua/_lib.lua``): each script names its KEYS and ARGV in a block of
locals at its top, in the order the functions below send them. Every script replies in one shape::

    [ok, status, field, value, field, value, ...]

``ok`` is 1 when the call did what it asks for and 0 when it was refused or found nothing to do;
``status`` is then the task's status now (or what the call did), else why not; the rest are named
results as field/value pairs, read here by name (``_fields``), never by position. A lease is such a
reply, ``[1, "running", "task_id", ..., "attempt", ..., ...]``, its field names those of ``Lease``.

Lease tokens: the worker that takes a task makes a random token (``new_token``) and passes it in;
Redis keeps only its digest (``token_digest``, SHA-1 hex: what the scripts compute with
``redis.sha1hex``), in the lease key and the task's ``lease``/``backup`` fields (``done_token``: its first
64 bits). The holder presents the token itself to complete, fail or renew, so nothing readable in Redis
lets another credential act as the holder.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

import redis
import redis.client

from gpumesh._version import PROTOCOL
from gpumesh.errors import BrokerError
from gpumesh.signing import leased_identity
from gpumesh.store import keys, protocols, tasklog

if TYPE_CHECKING:
    from gpumesh.store import artifacts

log = logging.getLogger(__name__)

NAMES = (
    "dispatch",
    "acquire",
    "complete",
    "fail",
    "heartbeat",
    "reap",
    "cancel",
    "retry",
    "speculate",
    "wake",
    "stage",
    "project_attach",
    "project_detach",
    "checkpoint",
    "env_failed",
    "env_held",
    "read",
)
READ_ONLY = frozenset({"read"})  # registered 'no-writes': callable by FCALL_RO, and never a write
# Functions this protocol added: a client calling the previous protocol's library (an older broker) has none of
# them, and does without (Scripts.offers): workers then build a job's env inside its first lease, as they did.
ADDED = frozenset({"env_held", "env_failed"})


def _lua(name: str) -> str:
    return (resources.files("gpumesh.store") / "lua" / f"{name}.lua").read_text()


def _prelude() -> str:
    """What the library defines before ``_lib.lua`` (library() and _source put it first): the key prefix, from
    keys.py (the one home of the layout), from which the scripts build the few names they cannot be passed."""
    return f"local PREFIX = '{keys.PREFIX}'  -- keys.PREFIX"


@cache
def _source(name: str) -> str:
    """A script as one chunk, ``_lib.lua`` first (what EVAL of one transition would take; tests use it)."""
    return "\n".join([_prelude(), _lua("_lib"), _lua(name)])


def new_token() -> str:
    """A lease token: random, known only to the worker that holds the lease."""
    return secrets.token_hex(16)


def token_digest(token: str) -> str:
    """What Redis stores of a lease token (the scripts compute the same with ``redis.sha1hex``)."""
    return hashlib.sha1(token.encode()).hexdigest()


def done_token(token: str) -> str:
    """What a done task keeps of the token that completed it: its digest's first 64 bits (_lib.lua's done_token)."""
    return token_digest(token)[:16]


@cache
def library() -> tuple[str, str]:
    """(library name, the code FUNCTION LOAD takes): ``_lib.lua`` once at the top of the library (its
    helpers are made when the library loads, not at every call), then one function ``<library>_<script>``
    per script, and ``<library>_version`` (read-only), which answers the library's name and a digest of its
    code. The name is the protocol's, ``gpumesh_p<N>``: a release that changes a script without changing
    the contract keeps its name (and a broker keeps whichever release's code `serve` loaded last). Each
    function reaches the helpers as upvalues: Lua 5.1 allows a function 60, and ``_lib.lua`` defines fewer
    names."""
    lib_code, bodies = _lua("_lib"), [_lua(name) for name in NAMES]
    parts = ["#!lua name=" + _NAME, _prelude(), lib_code]
    for name, body in zip(NAMES, bodies):
        flags = ", flags={'no-writes'}" if name in READ_ONLY else ""
        once, per_call = _split(body)
        parts.append(
            f"do\n{once}\nredis.register_function{{function_name='{_NAME}_{name}', callback=function(KEYS, ARGV)\n"
            f"{per_call}\nend{flags}}}\nend"
        )
    parts.append(
        f"redis.register_function{{function_name='{_NAME}_version', callback=function() return '{_NAME} "
        f"{_DIGEST}' end, flags={{'no-writes'}}}}"
    )
    template = "\n".join(parts) + "\n"
    lib = f"gpumesh_p{PROTOCOL}"
    digest = hashlib.sha256(template.encode()).hexdigest()[:12]  # of the code, assembly included
    return lib, template.replace(_NAME, lib).replace(_DIGEST, digest)


PER_CALL = "\n-- per call\n"  # the line between what a script makes at load and what it runs per call


def _split(body: str) -> tuple[str, str]:
    """A script's (load-time part, per-call part): what stands above its ``-- per call`` line (constant tables and
    pure functions, scoped to the script) is made once when the library loads, not at every call."""
    once, marked, per_call = body.partition(PER_CALL)
    return (once, per_call) if marked else ("", body)


_NAME = "__gpumesh_library__"  # where library() writes the library's name once it knows it
_DIGEST = "__gpumesh_digest__"  # and the digest of its code


def _function_missing(exc: redis.ResponseError) -> bool:
    return "function not found" in str(exc).lower()


def _load(client: redis.Redis, code: str, replace: bool = False) -> bool:
    """FUNCTION LOAD ``code``: whether the broker has it now (False: this credential may not load functions)."""
    try:
        client.function_load(code, replace=replace)
    except redis.ResponseError as exc:
        if "already exists" in str(exc):
            return True
        if isinstance(exc, redis.exceptions.NoPermissionError) or "NOPERM" in str(exc):
            return False
        raise
    return True


def load_library(client: redis.Redis, replace: bool = False) -> str:
    """Load this version's library unless the broker has it already (``replace``: load this release's code
    whatever another release of the same protocol loaded); its name. A credential that may not load
    functions gets one clear BrokerError (exit 3) naming what the broker serves."""
    lib, code = library()
    if not _load(client, code, replace):
        raise BrokerError(protocols.unserved_message(client, lib))
    return lib


ENSURE_EVERY = 30.0
FALLBACK_CHECK_EVERY = 2.0


class Function:
    """One transition of the library, called as ``f(keys=[...], args=[...], client=redis_or_pipeline)``
    (the shape of redis-py's ``Script``). A direct call that finds the library missing loads it (or says
    why it cannot) and calls again; a pipeline, whose error would come only at its execute, checks first
    that it is there (one round trip per ``Scripts`` every ENSURE_EVERY seconds: a broker restarted empty
    has lost it)."""

    def __init__(self, owner: Scripts, name: str) -> None:
        self.owner = owner
        self.short = name

    @property
    def name(self) -> str:
        """The function's name in the library its ``Scripts`` calls now (this protocol's, or the previous one's)."""
        return f"{self.owner.lib}_{self.short}"

    def __call__(self, keys: list[Any] | tuple[Any, ...] = (), args: list[Any] | tuple[Any, ...] = (),
                 client: Any = None) -> Any:  # fmt: skip
        client = self.owner.client if client is None else client
        if isinstance(client, redis.client.Pipeline):
            self.owner.ensure()
            return client.fcall(self.name, len(keys), *keys, *args)
        try:
            return client.fcall(self.name, len(keys), *keys, *args)
        except redis.ResponseError as exc:
            if not _function_missing(exc):
                raise
        self.owner.ensure(force=True)
        return client.fcall(self.name, len(keys), *keys, *args)


class Scripts:
    """The transition functions bound to one client (a pipeline may run them too).

    Which library they call is found on first use (``ensure``): this protocol's when the broker has it (or
    this credential may load it), else the previous protocol's when the broker serves that one and this
    release may call it (gpumesh.store.protocols); else one clear BrokerError naming both sides' versions.
    ``lib`` and ``protocol`` say what it calls now."""

    def __init__(self, client: redis.Redis, lib: str | None = None) -> None:
        """``lib``: the name of the library to call (default: this version's; benchmarks/scale.py's
        --against calls another version's, which it loaded itself)."""
        self.client = client
        self.foreign = lib is not None  # another version's, which only its caller can load
        self.lib = lib or library()[0]
        self.protocol = PROTOCOL if lib is None else protocols.protocol_of(lib)
        self._ensured = -ENSURE_EVERY
        self._s: dict[str, Function] = {name: Function(self, name) for name in NAMES}

    def __getitem__(self, name: str) -> Function:
        return self._s[name]

    def offers(self, name: str) -> bool:
        """Whether the library called now has function ``name``: the previous protocol's lacks those in ADDED."""
        return self.protocol == PROTOCOL or name not in ADDED

    def ensure(self, force: bool = False) -> None:
        """Make sure the broker has the library this client calls (once every ENSURE_EVERY s unless ``force``);
        when it is missing, pick again (see the class)."""
        # on the previous protocol's functions, look sooner for this one's (an upgraded broker serves it)
        every = ENSURE_EVERY if self.foreign or self.protocol == PROTOCOL else FALLBACK_CHECK_EVERY
        if not force and time.monotonic() - self._ensured < every:
            return
        if self.foreign:
            if not self._has(self.lib):
                raise BrokerError(f"the broker lacks the Redis functions of library {self.lib}")
        elif self.protocol != PROTOCOL and self._has(library()[0]):  # the broker serves this protocol now
            self.lib, self.protocol = library()[0], PROTOCOL
            log.info("the broker serves gpumesh protocol %d now: calling its functions", PROTOCOL)
        elif not self._has(self.lib):
            self._pick()
        self._ensured = time.monotonic()

    def _has(self, lib: str) -> bool:
        try:
            self.client.fcall_ro(f"{lib}_version", 0)
        except redis.ResponseError as exc:
            if not _function_missing(exc):
                raise
            return False
        return True

    def _pick(self) -> None:
        """The library this client calls lacks: this protocol's, loaded if this credential may, else the previous
        protocol's if the broker serves it, else the BrokerError that says which side to upgrade."""
        lib, code = library()
        if (self.lib != lib and self._has(lib)) or _load(self.client, code):
            self.lib, self.protocol = lib, PROTOCOL
            return
        older = protocols.fallback()
        if older is not None and self._has(older.name):
            if self.lib != older.name:
                log.warning(
                    "the broker serves gpumesh protocol %d, not this gpumesh's %d: calling protocol %d's functions "
                    "(upgrade the broker's gpumesh and restart `gpumesh serve` to use this version's)",
                    older.protocol, PROTOCOL, older.protocol,
                )  # fmt: skip
            self.lib, self.protocol = older.name, older.protocol
            return
        raise BrokerError(protocols.unserved_message(self.client, lib))


@dataclass(frozen=True)
class Lease:
    """What a worker learns when it acquires a task: everything needed to run it."""

    task_id: str
    token: str  # the lease token: random, made by this worker and known only to it (Redis keeps its digest)
    attempt: int
    job_id: str
    index: int
    payload: str
    script_sha: str
    script_name: str
    timeout: float
    max_attempts: int = 0
    signature: str = ""
    key_id: str = ""
    expires_at: float = 0.0
    server_ms: int = 0
    backup: bool = False  # a speculative copy of a task another worker runs (speculate.lua)
    fleet_version: str = ""  # dispatch: the registered fleet's version when this task was placed
    tier: int = -1  # dispatch: the worker's tier among the registered workers as it asked (-1: not dispatched)
    backup_mode: str = ""  # a backup copy: 'idle' (end of its job) or 'straggler' (a stronger worker joined)
    # a signed task: its job's spent set as the lease found it: 'open', 'ended' (the task ended for good: a
    # replay) or 'missing' (the set is gone); '' for an unsigned task
    spent: str = ""


@dataclass(frozen=True)
class Outcome:
    """Answer of complete/fail/reap/cancel: ``accepted`` false means a fenced or late call changed nothing."""

    accepted: bool
    status: str  # new status when accepted, else why not ('stale', 'cancelled', 'missing', ...)
    attempts: int = 0  # when requeued or failed: attempts spent so far
    kind: str = ""  # when requeued or failed: the failure kind recorded (models.FAILURE_KINDS)
    not_retried: bool = False  # failed while attempts remained: the job does not retry this kind
    bigger: tuple[str, float] | None = None  # requeued for a worker with more memory: its id and how much
    next: Lease | Prepare | str | None = None  # complete with ``then``: the worker's next task, or the fleet version


def _task_keys(task_id: str, *extra: str) -> list[str]:
    return [
        keys.task(task_id),
        keys.lease(task_id),
        keys.LEASES,
        keys.job(keys.job_of_task(task_id)),
        keys.EVENTS,
        *extra,
    ]


def spent_member(task_id: str) -> str:
    """A task's member in its job's spent set: its index as read from its id (signing.leased_identity),
    '' for an id submit does not make. The set records a signed task that ended for good (done, failed
    for good, cancelled): trusting workers refuse to run it (executor._refusal) until `retry` takes it out."""
    identity = leased_identity(task_id)
    return str(identity[1]) if identity else ""


def _spent_key(task_id: str) -> str:
    return keys.spent(keys.job_of_task(task_id))


def _fields(r: list[Any]) -> dict[str, Any]:
    """The named results of a reply: the field/value pairs after ``ok`` and ``status``."""
    return dict(zip(r[2::2], r[3::2]))


def dispatch(
    s: Scripts, client: Any, worker_id: str, lease_ms: int, score: float, tiers: int = 3
) -> Lease | Prepare | str:
    """The task this worker should run now (dispatch.lua), leased to it; an env to prepare first (Prepare); else
    the fleet version as a string. ``tiers``: how many tiers the fleet is ranked in (the lease's ``tier``)."""
    token = new_token()
    return _dispatched(_dispatch_call(s, client, worker_id, lease_ms, score, token, tiers), token)


def _dispatch_call(
    s: Scripts, client: Any, worker_id: str, lease_ms: int, score: float, token: str, tiers: int = 3
) -> Any:
    return s["dispatch"](
        keys=[keys.READY, keys.SCORES, keys.FLEET, keys.worker(worker_id), keys.LEASES, keys.EVENTS, keys.IDLE],
        args=[worker_id, lease_ms, score, token, tiers],
        client=client,
    )


@dataclass(frozen=True)
class Prepare:
    """dispatch's answer when the job this worker should serve first needs an environment its machine lacks:
    build it (leasing nothing meanwhile), then ask again."""

    fleet_version: str
    env: str  # the lock digest
    job_id: str


def _dispatched(r: list[Any], token: str) -> Lease | Prepare | str:
    if int(r[0]) != 1:
        f = _fields(r)
        if r[1] == "prepare":
            return Prepare(str(f["fleet_version"]), str(f["env"]), str(f["job"]))
        return str(f["fleet_version"])
    return _lease(r, token)


def env_held(
    s: Scripts, client: Any, worker_id: str, held: list[str], failed: list[str], ttl_ms: int, trees: Sequence[str] = ()
) -> bool:
    """Name in this worker's live registration the envs its machine holds and those it failed to build (lock
    digests), as dispatch reads them, and join the holders of those envs and of the project ``trees`` it holds
    (env_held.lua); False when the registration is gone. On a broker of the previous protocol, which has no
    env_held and whose dispatch does not ask, nothing is sent."""
    if not s.offers("env_held"):
        return True
    short = 16  # _lib.lua ENV_SHORT
    r = s["env_held"](
        keys=[keys.worker(worker_id)],
        args=[worker_id, ",".join(sorted({d[:short] for d in held})), ",".join(sorted({d[:short] for d in failed})),
              ttl_ms, ",".join(sorted({d[:short] for d in trees}))],
        client=client,
    )  # fmt: skip
    return bool(int(r[0]) == 1)


def env_failed(s: Scripts, client: Any, job_id: str, worker_id: str, env: str, message: str) -> bool:
    """Record that this worker's machine cannot build ``env`` for ``job_id`` (env_failed.lua): True when no live
    worker that may run the job is left to build it (its tasks then fail with ``message``). On a broker of the
    previous protocol, which has no env_failed, nothing is recorded: the task fails as that protocol's do."""
    if not s.offers("env_failed"):
        return False
    r = s["env_failed"](
        keys=[keys.job(job_id), keys.worker(worker_id), keys.SCORES, keys.IDLE],
        args=[worker_id, env, message],
        client=client,
    )
    return bool(int(r[0]) == 1 and r[1] == "dead")


@dataclass(frozen=True)
class Next:
    """What ``complete`` asks dispatch.lua for in the same round trip: this worker's next task. ``token`` is made
    by the caller once (new_token), so that a call sent again is answered with the task it leased, not a second."""

    lease_ms: int
    score: float
    token: str
    tiers: int = 3


def acquire(s: Scripts, client: Any, task_id: str, worker_id: str, lease_ms: int) -> Lease | str:
    """Lease one named queued task; a string says why not (its status or 'missing')."""
    token = new_token()
    r = s["acquire"](
        keys=_task_keys(task_id, keys.worker(worker_id), keys.READY),
        args=[task_id, worker_id, lease_ms, token],
        client=client,
    )
    return _lease(r, token)


def speculate(
    s: Scripts, client: Any, task_id: str, worker_id: str, lease_ms: int, score: float, speedup: float,
    mode: str = "idle",
) -> Lease | str:  # fmt: skip
    """Start a backup copy of a running straggler; a string says why not."""
    token = new_token()
    r = s["speculate"](
        keys=[keys.task(task_id), keys.job(keys.job_of_task(task_id)), keys.worker(worker_id), keys.SCORES, keys.STATS],
        args=[task_id, worker_id, lease_ms, score, speedup, mode, token],
        client=client,
    )
    return _lease(r, token)


def _lease(r: list[Any], token: str) -> Lease | str:
    """A lease reply (lease_reply in _lib.lua) read by field name, holding ``token`` (the plain token, which
    only this caller knows: Redis has its digest); a refusal's status, why not."""
    if int(r[0]) != 1:
        return str(r[1])
    f = _fields(r)
    try:
        return _read_lease(f, token)
    except (KeyError, TypeError, ValueError) as exc:  # the functions check these fields: a bug, or an old library
        raise MalformedLease(str(f.get("task_id", "")), token, f"{type(exc).__name__}: {exc}") from None


class MalformedLease(ValueError):
    """A lease reply whose fields do not read as a Lease (the functions refuse to lease such a task; an
    older library might not). It holds the lease: the worker fails the task with it (``lease``)."""

    def __init__(self, task_id: str, token: str, why: str) -> None:
        super().__init__(f"task {task_id or '?'} has malformed fields ({why})")
        self.task_id, self.token = task_id, token

    def lease(self) -> Lease:
        """Enough of a Lease to fail the task with (fail needs only its id and token)."""
        return Lease(self.task_id, self.token, 0, keys.job_of_task(self.task_id), 0, "", "", "", 0.0)


def _read_lease(f: dict[str, Any], token: str) -> Lease:
    return Lease(
        task_id=f["task_id"],
        token=token,
        attempt=int(f["attempt"]),
        job_id=f["job_id"],
        index=int(f["index"]),
        payload=f["payload"],
        script_sha=f["script_sha"],
        script_name=f["script_name"],
        timeout=float(f["timeout"]),
        max_attempts=int(f["max_attempts"]),
        signature=f["signature"],
        key_id=f["key_id"],
        expires_at=float(f["expires_at"]),
        server_ms=int(f["server_ms"]),
        backup=bool(int(f.get("backup", 0))),
        fleet_version=str(f.get("fleet_version", "")),
        tier=int(f.get("tier", -1)),
        backup_mode=f.get("backup_mode", ""),
        spent=str(f.get("spent", "")),
    )


def stage(
    s: Scripts, client: Any, job_id: str, first: int, payloads: list[str], costs: list[float], classes: list[int]
) -> Any:
    """Write a chunk of a job's tasks, indexes ``first`` on, in one call; not yet visible. A payload is JSON
    text as ``json.dumps`` writes it (ASCII, no newline).

    The raw reply: [1, 'staged', 'tasks', n]."""
    args = [
        job_id,
        first,
        "\n".join(payloads),
        "" if all(c == 1.0 for c in costs) else "\n".join(map(repr, costs)),
        "" if not any(classes) else "\n".join(map(str, classes)),
    ]
    return s["stage"](keys=[keys.job_tasks(job_id)], args=args, client=client)


READ_PAGE = 500  # task hashes one call of read returns (about a millisecond of Redis)


def read_tasks(s: Scripts, client: Any, task_ids: list[str]) -> list[dict[str, str]]:
    """The hashes of these tasks, in this order ({} for one that is gone): one call per READ_PAGE tasks."""
    out: list[dict[str, str]] = []
    for start in range(0, len(task_ids), READ_PAGE):
        page = [keys.task(t) for t in task_ids[start : start + READ_PAGE]]
        hashes = _fields(s["read"](keys=page, args=[], client=client))["hashes"]
        out += [dict(zip(h[::2], h[1::2])) for h in hashes]
    return out


def wake(s: Scripts, client: Any) -> Any:
    """Wake every idle worker: new work is takeable (submit, retry). The raw reply: [1, 'woken', 'workers', n]."""
    return s["wake"](keys=[keys.IDLE], args=[], client=client)


def _project_keys(digest: str) -> list[str]:
    return [keys.project_tree(digest), keys.project_jobs(digest), keys.PROJECT_REFS, keys.PROJECT_TREES]


def project_attach(
    s: Scripts, client: Any, job_id: str, digest: str, manifest: str, blob_prefix: str, files: list[str]
) -> list[str]:
    """Make ``job_id`` refer to the tree ``digest`` (project_attach.lua); the files the mesh lacks for it
    (then nothing changed). ``files``: each file's digest, with '+' before one this caller just wrote to an
    object store."""
    r = s["project_attach"](
        keys=_project_keys(digest), args=[job_id, digest, manifest, blob_prefix, *files], client=client
    )
    if int(r[0]) == 1:
        return []
    return [x for x in str(_fields(r).get("files", "")).split(",") if x]


def project_detach(s: Scripts, client: Any, job_id: str, digest: str, blob_prefix: str) -> list[str]:
    """``job_id`` no longer refers to the tree ``digest`` (project_detach.lua): the files no tree holds now."""
    r = s["project_detach"](keys=_project_keys(digest), args=[job_id, digest, blob_prefix], client=client)
    return [x for x in str(_fields(r).get("files", "")).split(",") if x]


def _outcome(r: list[Any]) -> Outcome:
    """A transition's reply: ``ok``, its status (or why not) and, when it says, the attempts spent, the
    failure kind, whether that kind stopped the retries, and the worker with more memory it waits for."""
    f = _fields(r)
    bigger = (str(f["bigger_on"]), float(f.get("bigger_has", 0))) if "bigger_on" in f else None
    return Outcome(
        int(r[0]) == 1, r[1], int(f.get("attempts", 0)), str(f.get("kind", "")), f.get("not_retried") == 1, bigger
    )


def complete(
    s: Scripts, client: Any, lease: Lease, worker_id: str, result_json: str, duration: float, score: float = 0.0,
    staged: artifacts.Staged | None = None, spent: str = "", stored: tuple[tuple[str, str], ...] = (),
    then: Next | None = None, lines: list[tasklog.Line] | None = None,
) -> Outcome:  # fmt: skip
    """Fenced completion; ``score`` (the worker's) teaches the job how long a unit of cost takes. With
    ``staged`` output files, the same step keeps them (and records their index) if this copy wins.
    ``spent``: the task's member to add to its job's spent set (a signed task); ``stored``: field/value
    pairs kept with the result (the worker's result proof). ``then``: dispatch this worker's next task in the
    same round trip (a pipeline: each function is atomic on its own); the answer is the outcome's ``next``.
    ``lines``: log lines to append first, in the same round trip (a line that cannot be written is skipped); the
    list is emptied once the round trip went through, whatever the completion's answer."""
    staging, final, index, total, store = "", "", "", 0, ""
    if staged is not None:
        from gpumesh.store import artifacts

        if staged.index["files"]:  # no file, only notes of skipped ones (a symlink): nothing staged to promote,
            staging, final = staged.store.promote(staged.index)  # which complete would take for a lost staging
        index, total = artifacts.dumps(staged.index), staged.total
        store = "" if staged.index["store"] == "broker" else staged.index["store"]
    call_keys = _task_keys(lease.task_id, keys.worker(worker_id), keys.STATS, keys.STATS_DURATION) + [
        staging or keys.task_files(lease.task_id), final or keys.task_files(lease.task_id),
        keys.spent(keys.job_of_task(lease.task_id)),
    ]  # fmt: skip
    call_args = [lease.task_id, lease.token, result_json, f"{duration:.3f}", score, index, total, store,
                 1 if staging else 0, spent, *[v for pair in stored for v in pair]]  # fmt: skip
    if then is None and not lines:
        return _outcome(s["complete"](keys=call_keys, args=call_args, client=client))
    with client.pipeline(transaction=False) as p:
        logged = tasklog.append(p, lines or ())
        s["complete"](keys=call_keys, args=call_args, client=p)
        if then is not None:
            _dispatch_call(s, p, worker_id, then.lease_ms, then.score, then.token, then.tiers)
        replies = p.execute(raise_on_error=False)[logged:]
    if lines:
        lines.clear()  # sent
    done = replies[0]
    following = None if then is None or isinstance(replies[1], Exception) else _dispatched(replies[1], then.token)
    if isinstance(done, redis.ResponseError) and _function_missing(done) and not isinstance(following, Lease):
        # The broker lost the library since the last check (restarted empty): a direct call loads it, then calls
        # again; the next task is asked for again by the worker.
        return _outcome(s["complete"](keys=call_keys, args=call_args, client=client))
    if isinstance(done, Exception):
        if isinstance(following, Lease):  # not taken up by a caller that gets this error: back to queued, unspent
            with contextlib.suppress(redis.RedisError):
                fail(s, client, following, worker_id, "handed back: the completion before it failed", 0.0, release=True)
        raise done
    return replace(_outcome(done), next=following)  # None: the dispatch failed; the worker asks again


def fail(
    s: Scripts, client: Any, lease: Lease, worker_id: str, error: str, duration: float, release: bool = False,
    reject: bool = False, avoid_ms: int = 0, kind: str = "script", need: tuple[str, float] | None = None,
    hold_ms: int = 0,
) -> Outcome:  # fmt: skip
    """End an attempt: requeued (attempts left and its ``kind`` retried by the job) or failed; ``release``
    hands it back unspent, ``reject`` fails it for good. ``avoid_ms``: after a failed attempt, other live
    workers get the task first for that long. ``need``: for a ``memory`` failure, the resource it ran out
    of and this worker's value: a live worker with more gets the task, for up to ``hold_ms``."""
    mode = "reject" if reject else ("release" if release else "fail")
    need_key, need_value = need if need else ("", 0.0)
    r = s["fail"](
        keys=_task_keys(
            lease.task_id, keys.worker(worker_id), keys.READY, keys.STATS, keys.IDLE, _spent_key(lease.task_id),
            keys.SCORES,
        ),
        args=[lease.task_id, lease.token, error, f"{duration:.3f}", mode, spent_member(lease.task_id), avoid_ms,
              kind, need_key, f"{need_value:.6g}" if need else "", hold_ms],
        client=client,
    )  # fmt: skip
    return _outcome(r)


@dataclass(frozen=True)
class Beat:
    registered: bool
    lease: str  # 'none' | 'ok' | 'lost' | 'cancelled'
    server_ms: int
    epoch_ok: bool


def heartbeat(
    s: Scripts, client: Any, worker_id: str, worker_ttl_ms: int, lease: Lease | None, lease_ms: int, epoch: str
) -> Beat:
    task_id = lease.task_id if lease else ""
    r = s["heartbeat"](
        keys=[keys.worker(worker_id), keys.WORKERS, keys.lease(task_id), keys.LEASES, keys.task(task_id), keys.EPOCH],
        args=[worker_id, worker_ttl_ms, lease.token if lease else "", lease_ms, task_id, epoch],
        client=client,
    )
    epoch_ok, f = int(r[0]) == 1, _fields(r)  # not ok: the broker lost its data (a new epoch)
    return Beat(bool(int(f.get("registered", 0))), r[1] if epoch_ok else "none", int(f["server_ms"]), epoch_ok)


def checkpoint(s: Scripts, client: Any, lease: Lease, upload: str, seq: int, index: str) -> tuple[bool, str]:
    """Make an uploaded checkpoint (``upload``: its staging key, '' in an object store) the task's newest, if
    this attempt still holds the lease and nothing newer is kept: (saved, why not)."""
    r = s["checkpoint"](
        keys=[keys.task(lease.task_id), upload, keys.task_checkpoint(lease.task_id)],
        args=[lease.task_id, lease.token, seq, index],
        client=client,
    )
    return int(r[0]) == 1, str(r[1])


def reap(s: Scripts, client: Any, task_id: str) -> Any:
    """Requeue (or fail) a task whose lease lapsed; the raw reply, for ``reap_outcome`` (pipelines)."""
    return s["reap"](
        keys=_task_keys(task_id, keys.READY, keys.STATS, keys.IDLE, _spent_key(task_id)),
        args=[task_id, spent_member(task_id)],
        client=client,
    )


def reap_outcome(r: list[Any]) -> Outcome:
    """reap's reply: accepted with 'queued' or 'failed' and the attempts spent; else 'renewed' or 'gone'."""
    return _outcome(r)


def cancel(s: Scripts, client: Any, task_id: str) -> Any:
    """The raw reply: [1, 'cancelled', 'previous', status] or [0, status or 'missing']. A signed job's
    cancelled task joins its spent set (as one that failed for good does, in fail and reap)."""
    return s["cancel"](
        keys=_task_keys(task_id, keys.READY, _spent_key(task_id)), args=[task_id, spent_member(task_id)], client=client
    )


def retry(s: Scripts, client: Any, task_id: str, cancelled: bool = False) -> Any:
    """The raw reply: [1, 'queued'] or [0, status or 'missing']. ``cancelled``: a cancelled task too.
    Takes the task out of its job's spent set first: a worker credential, which may not, is refused."""
    return s["retry"](
        keys=[keys.task(task_id), keys.job(keys.job_of_task(task_id)), keys.EVENTS, keys.READY, keys.IDLE,
              _spent_key(task_id)],
        args=[task_id, "1" if cancelled else "0", spent_member(task_id)],
        client=client,
    )  # fmt: skip
