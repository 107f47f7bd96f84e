"""Artifacts (DESIGN §9): the files a task's winning attempt wrote to ``GPUMESH_OUTPUT_DIR``, kept with
its job until the job's retention ends (or it is cancelled), and read back by ``gpumesh pull``.

Where they live:

* **in the broker** (the default): each attempt copy stages its files as ~1 MiB chunks in one hash,
  ``gpumesh:task:<id>:files:<copy>`` (field ``<file number>:<chunk number>``), with a TTL. The fenced
  ``complete`` script renames the winner's hash to ``gpumesh:task:<id>:files`` and drops the TTL in
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


def copy_name(attempt: int, backup: bool) -> str:
    return f"{'b' if backup else ''}{attempt}"


def backend(settings: Settings, rq_client: redis.Redis) -> Backend:
    """The store this worker (or reader) uses: the broker, or the object store ``settings.artifacts`` names."""
    if settings.artifacts:
        return ObjectStore(settings.artifacts)
    return BrokerStore(rq_client)


# Object stores a pull reads from on an index's word alone. An index is written by a worker: one naming
# another protocol (http://, an in-memory or a chained one) would make the puller's machine fetch from
# wherever the worker says, so it is read only when the puller's own GPUMESH_ARTIFACTS names it.
READABLE = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "file")


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
    job_bytes: int, close: Callable[[int], None] = os.close,
) -> Staged:  # fmt: skip
    """Write every found file under the caps (``job_bytes``: what the job's tasks stored already) and
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
    staged: Staged, entries: Iterable[Any], caps: Caps, job_bytes: int, close: Callable[[int], None]
) -> None:
    store = staged.store
    n = 0
    for entry in entries:
        size = getattr(entry, "size", None)
        if size is None:  # skipped by the walk
            _skip(staged, entry.path, entry.reason)
            continue
        try:
            why = _over_cap(caps, size, staged.total, job_bytes + staged.total, n)
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
    staged.index["skipped"].append({"path": path, "reason": reason})
    staged.notes.append(f"artifact {path} skipped: {reason}")


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
            raise UsageError(
                f"GPUMESH_ARTIFACTS={url} needs fsspec (and s3fs for s3://): pip install 'gpumesh[artifacts]'"
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
        with self.fs.open(self._path(index, n), "rb") as f:
            while data := f.read(CHUNK):
                yield data


def dumps(index: dict[str, Any]) -> str:
    return json.dumps(index, separators=(",", ":"))


def delete_from_object_store(url: str, job_id: str) -> None:
    """Remove a job's files from the object store it used (best effort: the job goes either way)."""
    try:
        ObjectStore(url).delete_job(job_id)
    except Exception as exc:  # noqa: BLE001 - an unreachable store or missing fsspec must not keep the job
        log.warning("could not delete job %s's files from %s: %s", job_id, url, exc)


def drop(r: Any, job_id: str, task_ids: list[str], store: str | None) -> int:
    """Delete the output files a job's tasks stored (``cancel`` does) and their indexes; how many tasks had any."""
    if store:
        delete_from_object_store(store, job_id)
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
        index = json.loads(raw) if raw else {"files": [], "skipped": []}
        store = reader(index, rq_client, trusted) if index["files"] else None
        for skipped in index.get("skipped", []):
            out.notes.append(f"task {index_no}: {skipped['path']} was not stored: {skipped['reason']}")
        for n, f in enumerate(index["files"]):
            path = safe_path(f["path"])
            if pattern and not fnmatch.fnmatchcase(path, pattern):
                continue
            target = root / str(int(index_no)) / path
            if not target.resolve().is_relative_to(root):  # a symlink already in dest would lead out of it
                raise UsageError(f"refusing to write {target}: it leads out of {dest} (a symbolic link?)")
            if not force and _whole(target, int(f["bytes"]), f["sha256"]):
                out.present.append(target)
                continue
            assert store is not None
            wants.append(_Want(store, index, n, target, int(f["bytes"]), f["sha256"]))
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
    """Write one file next to its target, check its checksum, then move it into place."""
    want.target.parent.mkdir(parents=True, exist_ok=True)
    part = want.target.with_name(f".{want.target.name}.gpumesh-part")
    digest = hashlib.sha256()
    try:
        with open(part, "wb") as f:
            for data in want.store.read(want.index, want.n):
                digest.update(data)
                f.write(data)
                on_bytes(len(data))
        if digest.hexdigest() != want.sha256:
            raise BrokerError(
                f"{want.target}: checksum mismatch (stored {want.sha256[:12]}, fetched {digest.hexdigest()[:12]}); "
                "the stored copy is damaged, nothing was written"
            )
        os.replace(part, want.target)
    finally:
        part.unlink(missing_ok=True)


def pull(
    r: Any, rq_client: redis.Redis, task_ids: list[str], dest: Path, *, pattern: str | None = None,
    force: bool = False, parallel: int = 8, on_start: Callable[[int, int], None] | None = None,
    on_bytes: Callable[[int], None] | None = None, trusted: str = "",
) -> Pulled:  # fmt: skip
    """Fetch the stored files of ``task_ids`` into ``dest``, ``parallel`` at a time. ``on_start(files,
    bytes)`` is told what will be fetched, ``on_bytes(n)`` as bytes arrive (from several threads)."""
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

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        for want, _ in zip(wants, pool.map(lambda w: fetch(w, count), wants)):
            out.fetched.append(want.target)
    return out
