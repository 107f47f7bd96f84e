"""Project files (DESIGN §10): stored once by content digest, beside the artifacts, kept while a job refers to them.

Where the bytes live is where artifacts live: in the broker by default, one hash of ~1 MiB chunks per
file (``keys.project_blob(sha256)``), or under ``<GPUMESH_ARTIFACTS>/_projects/<sha256>`` in an
object store. The broker always holds the bookkeeping: each tree's manifest (``project:tree:<digest>``),
the jobs that refer to it (``project:jobs:<digest>``) and, per file, how many trees hold it
(``project:refs``). Both transitions are Lua functions (project_attach.lua, project_detach.lua), so a
file is never dropped by one job's end while another's submit counts on it.

A submit: ask which files the mesh holds (one HMGET), send the others, attach the job to its tree, write
the job; a job write that fails detaches it again. A submit killed between leaves files the mesh keeps
for nobody: in the broker they carry a TTL until a tree holds them, and a job id attached but never
written is detached by the reaper (:func:`detach_dangling`).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import redis

from gpumesh.errors import BrokerError
from gpumesh.project import Packed
from gpumesh.store import keys, scripts
from gpumesh.store.artifacts import CHUNK, JOB_ID_CHARS, PIPELINE_BYTES, ObjectStore

log = logging.getLogger("gpumesh")

UNATTACHED_TTL_S = 3600  # a file sent by a submit that never attached it expires
DANGLING_MS = 120_000  # a job attached this long ago whose hash is nowhere (its submit died) is detached
OBJECT_DIR = "_projects"  # under GPUMESH_ARTIFACTS: not a job id (job ids are [a-zA-Z0-9_-], never a leading _)


class Files:
    """Where a mesh keeps project files: the broker (``store`` None) or an object store's URL."""

    def __init__(self, rq_client: redis.Redis, store: str = "") -> None:
        self.rq = rq_client  # binary client: chunks are bytes
        self.url = store.rstrip("/")
        self._object: ObjectStore | None = ObjectStore(self.url) if self.url else None

    @property
    def blob_prefix(self) -> str:
        """What the Lua functions put before a digest to name a file's key ('' when files live elsewhere)."""
        return "" if self._object else keys.PROJECT_BLOB_PREFIX

    def _object_path(self, sha: str) -> str:
        assert self._object is not None
        return f"{self._object.root.rstrip('/')}/{OBJECT_DIR}/{sha}"

    def held(self, client: Any, shas: list[str]) -> set[str]:
        """Which of ``shas`` a stored tree holds (kept while it does)."""
        if not shas:
            return set()
        counts = client.hmget(keys.PROJECT_REFS, shas)
        return {sha for sha, n in zip(shas, counts) if n is not None}

    def write(self, sha: str, path: Path) -> int:
        """Store the bytes of ``path`` (whose digest is ``sha``); the bytes sent."""
        if self._object is not None:
            target = self._object_path(sha)
            self._object.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            with open(path, "rb") as src, self._object.fs.open(target, "wb") as out:
                n = 0
                while data := src.read(CHUNK):
                    out.write(data)
                    n += len(data)
            return n
        key = keys.project_blob(sha)
        n = 0
        # No DEL first: a file's bytes are what its digest says, so a copy another submit is writing (or one an
        # earlier submit half wrote) only gets the same chunks again.
        with open(path, "rb") as src, self.rq.pipeline(transaction=False) as p:
            c = pending = 0
            while data := src.read(CHUNK):
                p.hset(key, str(c), data)
                c += 1
                n += len(data)
                pending += len(data)
                if pending >= PIPELINE_BYTES:
                    p.expire(key, UNATTACHED_TTL_S)  # a submit killed mid-file leaves nothing for long
                    p.execute()
                    pending = 0
            p.hset(key, "size", str(n))
            p.expire(key, UNATTACHED_TTL_S)
            p.execute()
        if self.rq.hexists(keys.PROJECT_REFS, sha):  # a tree took it meanwhile (another submit): not to expire
            self.rq.persist(key)
        return n

    def read(self, sha: str, size: int) -> Iterator[bytes]:
        """A stored file's bytes; LookupError when the mesh does not hold it."""
        if self._object is not None:
            try:
                with self._object.fs.open(self._object_path(sha), "rb") as f:
                    while data := f.read(CHUNK):
                        yield data
            except FileNotFoundError:
                raise LookupError(f"project file {sha[:12]} is missing from {self.url}") from None
            return
        key = keys.project_blob(sha)
        count = -(-size // CHUNK)
        per_trip = max(1, PIPELINE_BYTES // CHUNK)
        if count == 0 and not self.rq.exists(key):
            raise LookupError(f"project file {sha[:12]} is missing from the broker")
        for start in range(0, count, per_trip):
            with self.rq.pipeline(transaction=False) as p:
                for c in range(start, min(count, start + per_trip)):
                    p.hget(key, str(c))
                for data in p.execute():
                    if data is None:
                        raise LookupError(f"project file {sha[:12]} is missing from the broker")
                    yield data

    def read_many(self, wanted: list[tuple[str, int]]) -> Iterator[tuple[str, bytes]]:
        """(digest, whole bytes) of many small files, a pipeline of them per round trip (broker); one by one
        from an object store or for a file over a chunk."""
        small = [(sha, size) for sha, size in wanted if self._object is None and size <= CHUNK]
        large = [(sha, size) for sha, size in wanted if not (self._object is None and size <= CHUNK)]
        for start in range(0, len(small), 256):
            batch = small[start : start + 256]
            with self.rq.pipeline(transaction=False) as p:
                for sha, _ in batch:
                    p.hmget(keys.project_blob(sha), "0", "size")
                rows = p.execute()
            for (sha, _size), (data, stored) in zip(batch, rows):
                if stored is None:
                    raise LookupError(f"project file {sha[:12]} is missing from the broker")
                yield sha, data or b""
        for sha, size in large:
            yield sha, b"".join(self.read(sha, size))

    def forget(self, shas: list[str], own: str) -> None:
        """Delete files no tree holds any more from an object store, when it is this machine's own (as
        artifacts.delete_from_object_store decides: a URL a worker wrote is not one to delete under)."""
        if self._object is None or not shas or self.url != own.rstrip("/"):
            return
        for sha in shas:
            if len(sha) != 64 or not set(sha) <= JOB_ID_CHARS:
                continue
            try:
                self._object.fs.rm(self._object_path(sha))
            except FileNotFoundError:
                pass
            except Exception as exc:  # noqa: BLE001 - an object store's own errors: the file stays, harmless
                log.warning("could not delete project file %s from %s: %s", sha[:12], self.url, exc)


def store(files: Files, s: scripts.Scripts, client: Any, packed: Packed, job_id: str) -> None:
    """Send what the mesh lacks of ``packed`` and attach ``job_id`` to its tree (counted in ``packed``'s
    ``sent_files``/``sent_bytes``). Called before the job is written: the caller detaches on failure."""
    shas = sorted({f.sha256 for f in packed.files})
    held = files.held(client, shas)
    written: set[str] = set()
    for attempt in range(3):
        for sha in shas:
            if sha in held or sha in written:
                continue
            packed.sent_bytes += files.write(sha, packed.local[sha])
            packed.sent_files += 1
            written.add(sha)
        marked = [("+" + sha) if sha in written else sha for sha in shas]
        missing = scripts.project_attach(s, client, job_id, packed.digest, packed.manifest, files.blob_prefix, marked)
        if not missing:
            return
        # Dropped meanwhile with the last job that held them (or a stored copy's TTL ran out): send them.
        held -= set(missing)
        written -= set(missing)
        log.info("project: %d file(s) went meanwhile; sending them (try %d)", len(missing), attempt + 2)
    raise BrokerError("the project's files kept disappearing while they were sent; submit again")


def detach(files: Files, s: scripts.Scripts, client: Any, job_id: str, digest: str, own: str = "") -> None:
    """``job_id`` no longer refers to tree ``digest``: with its last job the tree goes, and the files no
    other tree holds."""
    gone = scripts.project_detach(s, client, job_id, digest, files.blob_prefix)
    files.forget(gone, own)


def detach_dangling(files: Files, s: scripts.Scripts, client: Any, now_ms: int, own: str = "", batch: int = 50) -> int:
    """Detach the jobs that attached to a tree DANGLING_MS ago or more and exist nowhere (their submit died
    before the job was written, or the job was deleted by an older version): how many."""
    n = 0
    for digest in client.zrange(keys.PROJECT_TREES, 0, batch - 1):
        old = client.zrangebyscore(keys.project_jobs(digest), "-inf", now_ms - DANGLING_MS, start=0, num=batch)
        if not old:
            continue
        with client.pipeline(transaction=False) as p:
            for job_id in old:
                p.exists(keys.job(job_id))
                p.zscore(keys.STAGING, job_id)
            seen = p.execute()
        for i, job_id in enumerate(old):
            if not seen[2 * i] and seen[2 * i + 1] is None:
                detach(files, s, client, job_id, digest, own)
                n += 1
    return n


SWEEP_EVERY_S = 600.0  # how often a reaper lists an object store's project files for ones nobody attached
_last_sweep: dict[str, float] = {}


def sweep_unattached(files: Files, client: Any, own: str = "", now: float | None = None) -> int:
    """In an object store (this machine's own), delete the project files no tree holds that were written more
    than UNATTACHED_TTL_S ago: what a submit killed before it attached them left (in the broker such files
    expire by themselves). At most every SWEEP_EVERY_S per store: a listing is not free. How many went."""
    obj = files._object
    if obj is None or files.url != own.rstrip("/"):
        return 0
    now = time.time() if now is None else now
    if now - _last_sweep.get(files.url, 0.0) < SWEEP_EVERY_S:
        return 0
    _last_sweep[files.url] = now
    folder = f"{obj.root.rstrip('/')}/{OBJECT_DIR}"
    try:
        entries = obj.fs.ls(folder, detail=True) if obj.fs.exists(folder) else []
    except Exception as exc:  # noqa: BLE001 - an object store's own errors: try again at the next sweep
        log.warning("could not list project files in %s: %s", files.url, exc)
        return 0
    old = {}
    for entry in entries:
        sha = str(entry.get("name", "")).rstrip("/").rsplit("/", 1)[-1]
        written = _written_at(entry)
        if len(sha) == 64 and written is not None and now - written > UNATTACHED_TTL_S:
            old[sha] = written
    if not old:
        return 0
    shas = sorted(old)
    held = files.held(client, shas)
    gone = [sha for sha in shas if sha not in held]
    files.forget(gone, own)
    return len(gone)


def _written_at(entry: dict[str, Any]) -> float | None:
    """When an object store says a file was written (local: mtime; S3: LastModified), in epoch seconds."""
    value = entry.get("mtime", entry.get("LastModified", entry.get("created")))
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, datetime):
        return value.timestamp()
    return None


def tree_manifest(client: Any, digest: str) -> str | None:
    return client.get(keys.project_tree(digest))  # type: ignore[no-any-return]


def digest_of(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
