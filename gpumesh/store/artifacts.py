"""Artifacts (DESIGN §9): the files a task's winning attempt wrote to ``GPUMESH_OUTPUT_DIR``, kept with
its job until the job's retention ends (or it is cancelled), and read back by ``gpumesh pull``.

Where they live:

* **in the broker** (the default): each attempt copy stages its files as ~1 MiB chunks in one hash,
  ``keys.task_files_staging(id, copy)`` (field ``<file number>:<chunk number>``), with a TTL. The fenced
  ``complete`` script renames the winner's hash to ``keys.task_files(id)`` and drops the TTL in
  the same step that records the result, so a losing backup copy, a failed or a lost attempt leaves
  nothing behind once its staging expires (the worker deletes it at once when it can).
* **in an object store** named by ``GPUMESH_ARTIFACTS`` (any fsspec URL: ``s3://bucket/prefix``,
  ``file:///nfs/runs``, ...): workers write ``<url>/<job>/<task index>/<copy>/<path>`` directly and
  the broker keeps only the index, so a large checkpoint never passes through Redis.

The index, in the task's hash as JSON (``artifacts``): ``{"store", "prefix", "chunk", "files":
[{"path", "bytes", "sha256"}], "skipped": [{"path", "reason"}]}``. Caps per file, per task and per job
(``GPUMESH_ARTIFACT_FILE_MB``, ``_TASK_MB``, ``_JOB_MB``, ``GPUMESH_ARTIFACT_FILES``): a file over one is
skipped with a note (in the index, the task's log and ``pull``'s output) and the task still completes.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import posixpath
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import redis

from gpumesh.errors import BrokerError, UsageError
from gpumesh.settings import Settings
from gpumesh.store import keys

# Bytes per chunk in the broker, and per read and write everywhere: a little under 1 MiB, so that a
# chunk with Redis's string header fits jemalloc's 1 MiB size class (1 MiB + header takes 1.25 MiB).
CHUNK = (1 << 20) - 4096
PIPELINE_BYTES = 8 << 20  # chunks sent per round trip
DELETE_WAIT_S = 120.0  # how long cancel waits for an object store's delete before going on without it
STAGING_TTL_S = 3600  # a staged copy nobody completed (its worker died mid-upload) expires
MB = 1 << 20

log = logging.getLogger("gpumesh")


@dataclass(frozen=True)
class Caps:
    """Bytes and count a task may store; 0 = no cap."""

    file_bytes: int
    task_bytes: int
    job_bytes: int
    files: int

    @classmethod
    def of(cls, s: Settings) -> Caps:
        return cls(
            int(s.artifact_file_mb * MB), int(s.artifact_task_mb * MB), int(s.artifact_job_mb * MB), s.artifact_files
        )


class Entry(Protocol):
    """What the sandbox's walk of the output dir yields (gpumesh.sandbox.outputs.Found / Skipped)."""

    path: str


@dataclass
class Staged:
    """One attempt copy's files, written where they will live; ``index`` goes to the complete script."""

    store: Backend
    copy: str
    index: dict[str, Any]
    total: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.index["files"] and not self.index["skipped"]

    def discard(self) -> None:
        """The attempt did not win: drop what it staged."""
        self.store.discard(self.index)


@dataclass(frozen=True)
class StageFailed:
    """Storing an attempt's files failed (an object store refused, the broker went away): the attempt fails."""

    reason: str


def copy_name(attempt: int, backup: bool, token: str) -> str:
    """The name of one attempt copy's files: the attempt, and its lease token's digest (a retried job
    counts attempts from 1 again, and a handed-back attempt is not counted: the token is never reused)."""
    return f"{'b' if backup else ''}{attempt}-{hashlib.sha256(token.encode()).hexdigest()[:12]}"


def backend(settings: Settings, rq_client: redis.Redis) -> Backend:
    """The store this worker (or reader) uses: the broker, or the object store ``settings.artifacts`` names."""
    if settings.artifacts:
        return ObjectStore(settings.artifacts)
    return BrokerStore(rq_client)


# Object stores a pull reads from on an index's word alone. An index is written by a worker: one naming
# another protocol (http://, an in-memory or a chained one) would make the puller's machine fetch from
# wherever the worker says, so it is read only when the puller's own GPUMESH_ARTIFACTS names it.
# file:// is not among them: it would let a worker make pull copy any local file (or /dev/zero) into DIR.
READABLE = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")
MAX_NOTES = 100  # skipped files listed per task; past it, one line counts the rest
JOB_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def reader(index: dict[str, Any], rq_client: redis.Redis, trusted: str = "") -> Backend:
    """The store an index was written to (which may not be the one this machine's settings name)."""
    store = str(index.get("store", "broker"))
    if store == "broker":
        return BrokerStore(rq_client)
    if store.rstrip("/") != trusted.rstrip("/") and store.partition("://")[0] not in READABLE:
        raise UsageError(
            f"refusing to read artifacts from {store!r}, which a worker named: set GPUMESH_ARTIFACTS={store} "
            "here if you trust it"
        )
    safe_path(index.get("prefix"))
    return ObjectStore(store)


def stage(
    store: Backend, task_id: str, job_id: str, task_index: int, copy: str, entries: Iterable[Any], caps: Caps,
    job_bytes: Callable[[], int], close: Callable[[int], None] = os.close,
) -> Staged:  # fmt: skip
    """Write every found file under the caps (``job_bytes()``: what the job's tasks stored already, asked
    once, and only when there is a file and a per-job cap: most tasks write none) and
    return the staged copy. Each found entry's descriptor is closed here."""
    staged = Staged(store, copy, store.new_index(task_id, job_id, task_index, copy))
    try:
        _stage_all(staged, entries, caps, job_bytes, close)
    except BaseException:
        try:
            staged.discard()  # nothing half-written stays behind (the broker's staging would expire anyway)
        except Exception as exc:  # noqa: BLE001 - the original error is the one to report
            log.warning("could not drop a half-stored copy of %s: %s", task_id, exc)
        raise
    return staged


def _stage_all(
    staged: Staged, entries: Iterable[Any], caps: Caps, job_bytes: Callable[[], int], close: Callable[[int], None]
) -> None:
    store = staged.store
    n = 0
    already: int | None = None  # what the job's tasks stored before this one, read at the first file
    for entry in entries:
        size = getattr(entry, "size", None)
        if size is None:  # skipped by the walk
            _skip(staged, entry.path, entry.reason)
            continue
        try:
            if already is None:
                already = job_bytes() if caps.job_bytes else 0
            why = _over_cap(caps, size, staged.total, already + staged.total, n)
            if why:
                _skip(staged, entry.path, why)
                continue
            sha = store.write(staged.index, n, entry.path, entry.fd, size)
        finally:
            close(entry.fd)
        staged.index["files"].append({"path": entry.path, "bytes": size, "sha256": sha})
        staged.total += size
        n += 1


def _skip(staged: Staged, path: str, reason: str) -> None:
    """Note a file not stored; past MAX_NOTES only counted (a task making a million symlinks must not make
    a million-entry index)."""
    skipped = staged.index["skipped"]
    if len(skipped) < MAX_NOTES:
        skipped.append({"path": path, "reason": reason})
        staged.notes.append(f"artifact {path} skipped: {reason}")
        return
    staged.index["skipped_more"] = staged.index.get("skipped_more", 0) + 1


def _over_cap(caps: Caps, size: int, task_total: int, job_total: int, count: int) -> str | None:
    if caps.files and count >= caps.files:
        return f"over the cap of {caps.files} files per task (GPUMESH_ARTIFACT_FILES)"
    if caps.file_bytes and size > caps.file_bytes:
        return f"{_mib(size)} is over the per-file cap of {_mib(caps.file_bytes)} (GPUMESH_ARTIFACT_FILE_MB)"
    if caps.task_bytes and task_total + size > caps.task_bytes:
        return f"the task's files would pass the per-task cap of {_mib(caps.task_bytes)} (GPUMESH_ARTIFACT_TASK_MB)"
    if caps.job_bytes and job_total + size > caps.job_bytes:
        return f"the job's files would pass the per-job cap of {_mib(caps.job_bytes)} (GPUMESH_ARTIFACT_JOB_MB)"
    return None


def _mib(n: int) -> str:
    return f"{n / MB:.1f} MiB"


def safe_path(path: Any) -> str:
    """A stored file's path, checked before it names anything on the puller's disk: relative, normalised,
    nothing climbing out (an index is written by a worker, and a worker may be hostile)."""
    if not isinstance(path, str) or not path or "\0" in path or "\\" in path:
        raise UsageError(f"refusing an artifact with an unusable path {path!r}")
    norm = posixpath.normpath(path)
    if norm != path or path.startswith("/") or norm == ".." or norm.startswith("../"):
        raise UsageError(f"refusing an artifact whose path {path!r} would leave the destination directory")
    return path


class Backend(Protocol):
    def new_index(self, task_id: str, job_id: str, task_index: int, copy: str) -> dict[str, Any]: ...
    def write(self, index: dict[str, Any], n: int, path: str, fd: int, size: int) -> str: ...
    def promote(self, index: dict[str, Any]) -> tuple[str, str]: ...
    def discard(self, index: dict[str, Any]) -> None: ...
    def read(self, index: dict[str, Any], n: int) -> Iterator[bytes]: ...


def _chunks(fd: int, size: int) -> Iterator[bytes]:
    """At most ``size`` bytes of the file, CHUNK at a time (what fstat said: a file that grows is cut)."""
    left = size
    while left > 0:
        data = os.read(fd, min(CHUNK, left))
        if not data:
            return
        left -= len(data)
        yield data


class BrokerStore:
    """Chunks in a hash per attempt copy (binary: RQ's bytes client)."""

    def __init__(self, client: redis.Redis) -> None:
        self.r = client

    def new_index(self, task_id: str, job_id: str, task_index: int, copy: str) -> dict[str, Any]:
        return {"store": "broker", "staging": keys.task_files_staging(task_id, copy), "task": task_id,
                "chunk": CHUNK, "files": [], "skipped": []}  # fmt: skip

    def write(self, index: dict[str, Any], n: int, path: str, fd: int, size: int) -> str:
        sha = hashlib.sha256()
        staging = index["staging"]
        p = self.r.pipeline(transaction=False)
        pending = 0
        for c, data in enumerate(_chunks(fd, size)):
            sha.update(data)
            p.hset(staging, f"{n}:{c}", data)
            pending += len(data)
            if pending >= PIPELINE_BYTES:
                p.expire(staging, STAGING_TTL_S)
                p.execute()
                pending = 0
        p.hset(staging, f"{n}:size", str(size))  # the hash exists even for an empty file
        p.expire(staging, STAGING_TTL_S)
        p.execute()
        return sha.hexdigest()

    def promote(self, index: dict[str, Any]) -> tuple[str, str]:
        """(staging key, final key) for the complete script, which renames one to the other."""
        return index["staging"], keys.task_files(index["task"])

    def discard(self, index: dict[str, Any]) -> None:
        self.r.delete(index["staging"])

    def read(self, index: dict[str, Any], n: int) -> Iterator[bytes]:
        size = int(index["files"][n]["bytes"])
        chunk = int(index.get("chunk", CHUNK))
        count = -(-size // chunk)
        final = keys.task_files(index["task"])
        per_trip = max(1, PIPELINE_BYTES // chunk)
        for start in range(0, count, per_trip):
            with self.r.pipeline(transaction=False) as p:
                for c in range(start, min(count, start + per_trip)):
                    p.hget(final, f"{n}:{c}")
                for data in p.execute():
                    if data is None:
                        raise LookupError("a chunk is missing from the broker (the job expired or was cancelled?)")
                    yield data


class ObjectStore:
    """Files under an fsspec URL, written by the workers and read by ``pull`` directly."""

    def __init__(self, url: str) -> None:
        try:
            import fsspec
        except ImportError:
            from gpumesh.extras import install_hint

            raise UsageError(
                f"GPUMESH_ARTIFACTS={url} needs fsspec (and s3fs for s3://), the artifacts extra: "
                + install_hint("artifacts")
            ) from None
        self.url = url.rstrip("/")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as exc:
            raise UsageError(f"GPUMESH_ARTIFACTS={url}: {exc}") from None

    def _dir(self, job_id: str, task_index: int | None = None, copy: str | None = None) -> str:
        parts = [self.root.rstrip("/"), job_id]
        if task_index is not None:
            parts.append(str(task_index))
        if copy is not None:
            parts.append(copy)
        return "/".join(parts)

    def new_index(self, task_id: str, job_id: str, task_index: int, copy: str) -> dict[str, Any]:
        return {"store": self.url, "prefix": f"{job_id}/{task_index}/{copy}", "task": task_id, "chunk": CHUNK,
                "files": [], "skipped": []}  # fmt: skip

    def _path(self, index: dict[str, Any], n: int | None = None, path: str | None = None) -> str:
        base = self.root.rstrip("/") + "/" + index["prefix"]
        if n is not None:
            path = index["files"][n]["path"]
        return base if path is None else f"{base}/{safe_path(path)}"

    def write(self, index: dict[str, Any], n: int, path: str, fd: int, size: int) -> str:
        sha = hashlib.sha256()
        target = self._path(index, path=path)
        parent = posixpath.dirname(target)
        if parent:
            self.fs.makedirs(parent, exist_ok=True)
        with self.fs.open(target, "wb") as out:
            for data in _chunks(fd, size):
                sha.update(data)
                out.write(data)
        return sha.hexdigest()

    def promote(self, index: dict[str, Any]) -> tuple[str, str]:
        return "", ""  # written in place: the index alone says which copy won

    def discard(self, index: dict[str, Any]) -> None:
        path = self._path(index)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def delete_job(self, job_id: str) -> None:
        path = self._dir(job_id)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def read(self, index: dict[str, Any], n: int) -> Iterator[bytes]:
        left = int(index["files"][n]["bytes"])
        with self.fs.open(self._path(index, n), "rb") as f:
            while data := f.read(min(CHUNK, left + 1)):
                left -= len(data)
                if left < 0:
                    raise LookupError("the stored file is longer than its index says")
                yield data


def dumps(index: dict[str, Any]) -> str:
    return json.dumps(index, separators=(",", ":"))


def delete_from_object_store(url: str, job_id: str, own: str, wait: float = 0.0) -> bool:
    """Remove a job's files from the object store it used, if that is this machine's own (``own``, its
    GPUMESH_ARTIFACTS): the URL was written by a worker, and a recursive delete of wherever a worker
    says is not something to run. Best effort, in a thread waited on for ``wait`` seconds (the reaper
    does not wait: a slow store must not hold up a heartbeat); whether it was started."""
    if not url or url.rstrip("/") != own.rstrip("/") or not job_id or not set(job_id) <= JOB_ID_CHARS:
        if url:
            log.warning("job %s's files in %s are left there: this machine's GPUMESH_ARTIFACTS is not that store",
                        job_id, url)  # fmt: skip
        return False

    def delete() -> None:
        try:
            ObjectStore(url).delete_job(job_id)
        except Exception as exc:  # noqa: BLE001 - an unreachable store or missing fsspec must not keep the job
            log.warning("could not delete job %s's files from %s: %s", job_id, url, exc)

    thread = threading.Thread(target=delete, name=f"gpumesh-delete-{job_id}", daemon=True)
    thread.start()
    if wait:
        thread.join(timeout=wait)
    return True


def drop(r: Any, job_id: str, task_ids: list[str], store: str | None, own: str = "") -> int:
    """Delete the output files a job's tasks stored (``cancel`` does) and their indexes; how many tasks had any."""
    if store:
        delete_from_object_store(store, job_id, own, wait=DELETE_WAIT_S)
    n = 0
    for start in range(0, len(task_ids), 1000):
        chunk = task_ids[start : start + 1000]
        with r.pipeline(transaction=False) as p:
            for t in chunk:
                p.hdel(keys.task(t), "artifacts")
            p.delete(*[keys.task_files(t) for t in chunk])
            n += sum(int(x) for x in p.execute()[:-1])
    r.hset(keys.job(job_id), "artifact_bytes", 0)
    return n


# -- pulling -----------------------------------------------------------------------------------------


@dataclass
class Pulled:
    """What a pull did: files written and files already there (both count as present), bytes fetched,
    the tasks that have no files because they did not complete, and notes on files never stored."""

    fetched: list[Path] = field(default_factory=list)
    present: list[Path] = field(default_factory=list)
    bytes: int = 0
    not_done: list[tuple[int, str]] = field(default_factory=list)  # (task index, its status)
    notes: list[str] = field(default_factory=list)

    @property
    def paths(self) -> list[Path]:
        return sorted(self.fetched + self.present)


@dataclass(frozen=True)
class _Want:
    store: Backend
    index: dict[str, Any]
    n: int
    target: Path
    size: int
    sha256: str


def plan(
    r: Any, rq_client: redis.Redis, task_ids: list[str], dest: Path, pattern: str | None, force: bool, out: Pulled,
    trusted: str = "",
) -> list[_Want]:  # fmt: skip
    """The files to fetch for these tasks into ``dest``/<task index>/<path>; what is already there and whole
    is recorded as present (unless ``force``)."""
    with r.pipeline(transaction=False) as p:
        for t in task_ids:
            p.hmget(keys.task(t), "index", "status", "artifacts")
        rows = p.execute()
    root = dest.resolve()
    wants: list[_Want] = []
    for index_no, status, raw in rows:
        if status is None:
            continue
        if status != "done":
            out.not_done.append((int(index_no), status))
            continue
        try:
            wants += _task_wants(int(index_no), raw, rq_client, root, pattern, force, out, trusted)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # an index no honest worker writes
            raise BrokerError(f"task {index_no}'s file index is malformed ({type(exc).__name__}: {exc})") from None
    return wants


def _task_wants(
    index_no: int, raw: str | None, rq_client: redis.Redis, root: Path, pattern: str | None, force: bool,
    out: Pulled, trusted: str,
) -> list[_Want]:  # fmt: skip
    index = json.loads(raw) if raw else {"files": [], "skipped": []}
    store = reader(index, rq_client, trusted) if index["files"] else None
    for skipped in index.get("skipped", []):
        out.notes.append(f"task {index_no}: {skipped['path']} was not stored: {skipped['reason']}")
    if index.get("skipped_more"):
        out.notes.append(f"task {index_no}: {int(index['skipped_more'])} more files were not stored")
    wants = []
    for n, f in enumerate(index["files"]):
        path = safe_path(f["path"])
        if pattern and not fnmatch.fnmatchcase(path, pattern):
            continue
        target = root / str(index_no) / path
        if not target.resolve().is_relative_to(root):  # a symlink already in dest would lead out of it
            raise UsageError(f"refusing to write {target}: it leads out of {root} (a symbolic link?)")
        size, sha = int(f["bytes"]), str(f["sha256"])
        if not force and _whole(target, size, sha):
            out.present.append(target)
            continue
        assert store is not None
        wants.append(_Want(store, index, n, target, size, sha))
    return wants


def _whole(target: Path, size: int, sha256: str) -> bool:
    try:
        if target.stat().st_size != size:
            return False
        digest = hashlib.sha256()
        with open(target, "rb") as f:
            while data := f.read(CHUNK):
                digest.update(data)
    except OSError:
        return False
    return digest.hexdigest() == sha256


def fetch(want: _Want, on_bytes: Callable[[int], None]) -> None:
    """Write one file next to its target, check its size and checksum, then move it into place."""
    part = want.target.with_name(f".{want.target.name}.gpumesh-part")
    digest = hashlib.sha256()
    try:
        want.target.parent.mkdir(parents=True, exist_ok=True)
        with open(part, "wb") as f:
            got = 0
            for data in _stored(want):
                got += len(data)
                if got > want.size:
                    raise BrokerError(f"{want.target}: the stored copy is longer than its index says; nothing written")
                digest.update(data)
                f.write(data)
                on_bytes(len(data))
        if digest.hexdigest() != want.sha256:
            raise BrokerError(
                f"{want.target}: checksum mismatch (stored {want.sha256[:12]}, fetched {digest.hexdigest()[:12]}); "
                "the stored copy is damaged, nothing was written"
            )
        os.replace(part, want.target)
    except OSError as exc:
        raise UsageError(f"cannot write {want.target}: {exc.strerror or exc}") from None
    finally:
        part.unlink(missing_ok=True)


def _stored(want: _Want) -> Iterator[bytes]:
    """The stored bytes; any failure of the store (missing chunk, an object store's own errors) is one line."""
    chunks = want.store.read(want.index, want.n)
    while True:
        try:
            data = next(chunks)
        except StopIteration:
            return
        except redis.RedisError:
            raise
        except Exception as exc:  # noqa: BLE001 - fsspec backends raise their own types
            raise BrokerError(
                f"reading {want.target.name} from its store failed: {type(exc).__name__}: {exc}"
            ) from None
        yield data


def pull(
    r: Any, rq_client: redis.Redis, task_ids: list[str], dest: Path, *, pattern: str | None = None,
    force: bool = False, parallel: int = 8, on_start: Callable[[int, int], None] | None = None,
    on_bytes: Callable[[int], None] | None = None, trusted: str = "",
) -> Pulled:  # fmt: skip
    """Fetch the stored files of ``task_ids`` into ``dest``, ``parallel`` at a time. ``on_start(files,
    bytes)`` is told what will be fetched, ``on_bytes(n)`` as bytes arrive (from several threads). The
    first error (or Ctrl-C) stops the fetches not yet started; files already moved into place stay."""
    out = Pulled()
    wants = plan(r, rq_client, task_ids, dest, pattern, force, out, trusted)
    total = sum(w.size for w in wants)
    if on_start is not None:
        on_start(len(wants), total)
    lock = threading.Lock()

    def count(n: int) -> None:
        with lock:
            out.bytes += n
        if on_bytes is not None:
            on_bytes(n)

    pool = ThreadPoolExecutor(max_workers=max(1, parallel))
    try:
        futures = [pool.submit(fetch, w, count) for w in wants]
        for want, future in zip(wants, futures):
            future.result()
            out.fetched.append(want.target)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return out
