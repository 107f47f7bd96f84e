"""Checkpoints: what a task writes to ``GPUMESH_CHECKPOINT_DIR``, saved while it runs and restored into the
next attempt of the same task, on whichever worker, so that a pause, a lost lease, a timeout or a retried
failure costs the work since the last save, not the whole attempt.

A save packs the directory (regular files and directories only, read through descriptors that never follow a
link: a task cannot make the worker read anything outside it) into one tar, uploads it where the task's output
files would go (the broker as chunks, or the object store ``GPUMESH_ARTIFACTS`` names), and then the fenced
``checkpoint`` script makes it the task's newest in one step: only the attempt that holds the lease saves, a
save older than the one kept changes nothing, and an upload cut short is never what a restore finds. A save
whose files changed while they were read (the task was writing them) is dropped and tried again at the next
turn. Capped at ``GPUMESH_CHECKPOINT_MB`` per task; deleted with the job.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import redis

from gpumesh.store import artifacts, keys, scripts
from gpumesh.store.artifacts import CHUNK, PIPELINE_BYTES, STAGING_TTL_S, ObjectStore, safe_path

log = logging.getLogger("gpumesh.worker")

SAVE_MARKER = ".gpumesh-save"  # a task asks for a save by creating it (gpumesh.checkpoint()); gone once saved
MAX_FILES = 10_000


class Changed(Exception):
    """A file changed while the save read it: this save is dropped (the next one is tried at the next turn)."""


class TooLarge(Exception):
    """The checkpoint is over the cap: not saved."""


def pack(dir_fd: int, cap: int) -> tuple[IO[bytes], int]:
    """The checkpoint directory (read through ``dir_fd``) as a tar in a temporary file, and its size. Changed when
    a file changed while it was read; TooLarge past ``cap`` bytes (0: none)."""
    out: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=64 << 20)  # noqa: SIM115 - the caller's to close
    total = files = 0
    try:
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for top, dirs, names, top_fd in os.fwalk(".", dir_fd=dir_fd, follow_symlinks=False):
                dirs.sort()
                rel = os.path.normpath(top)
                if rel != ".":
                    info = tarfile.TarInfo(rel)
                    info.type, info.mode = tarfile.DIRTYPE, 0o700
                    tar.addfile(info)
                for name in sorted(names):
                    if top == "." and name == SAVE_MARKER:
                        continue
                    files += 1
                    if files > MAX_FILES:
                        raise TooLarge(f"more than {MAX_FILES} files")
                    total += _add_file(tar, top_fd, name, os.path.normpath(os.path.join(rel, name)), cap, total)
        size = out.tell()
        out.seek(0)
        return out, size
    except BaseException:
        out.close()
        raise


def _add_file(tar: tarfile.TarFile, dir_fd: int, name: str, path: str, cap: int, total: int) -> int:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:  # a link, or gone since it was listed: not part of the checkpoint
        return 0
    with open(fd, "rb") as f:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            return 0
        if cap and total + before.st_size > cap:
            raise TooLarge(f"{path} takes it past the cap of {cap >> 20} MiB (GPUMESH_CHECKPOINT_MB)")
        info = tarfile.TarInfo(path)
        info.size, info.mode, info.mtime = before.st_size, 0o600, int(before.st_mtime)
        tar.addfile(info, f)
        after = os.fstat(fd)
        if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            raise Changed(path)
        return int(before.st_size)


def unpack(data: IO[bytes], dir_fd: int, owner: tuple[int, int] | None = None) -> int:
    """Write a checkpoint's files into the (empty) directory ``dir_fd``; how many. Names are checked before they
    name anything (a checkpoint was uploaded by a worker, which may be hostile); only files and directories."""
    n = 0
    with tarfile.open(fileobj=data, mode="r:") as tar:
        for member in tar:
            path = safe_path(member.name)
            parent, name = os.path.split(path)
            parent_fd = _open_dirs(dir_fd, parent, owner)
            try:
                if member.isdir():
                    _mkdir(parent_fd, name, owner)
                elif member.isfile():
                    src = tar.extractfile(member)
                    assert src is not None
                    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                 dir_fd=parent_fd)  # fmt: skip
                    with open(fd, "wb") as f:
                        while chunk := src.read(CHUNK):
                            f.write(chunk)
                        if owner is not None:
                            os.fchown(f.fileno(), *owner)
                    n += 1
            finally:
                if parent_fd != dir_fd:
                    os.close(parent_fd)
    return n


def _mkdir(parent_fd: int, name: str, owner: tuple[int, int] | None) -> None:
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    except FileExistsError:
        return
    if owner is not None:
        os.chown(name, *owner, dir_fd=parent_fd, follow_symlinks=False)


def _open_dirs(dir_fd: int, parent: str, owner: tuple[int, int] | None) -> int:
    """A descriptor of ``parent`` under ``dir_fd`` (made as needed, never through a link)."""
    fd = dir_fd
    for part in [p for p in parent.split("/") if p]:
        _mkdir(fd, part, owner)
        nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        if fd != dir_fd:
            os.close(fd)
        fd = nxt
    return fd


@dataclass
class Store:
    """Where a worker's checkpoints go: the broker (``rq``: its bytes client), or an object store."""

    rq: redis.Redis
    r: Any  # the broker's text client: the fenced script
    s: scripts.Scripts
    object_store: str = ""  # GPUMESH_ARTIFACTS

    def save(self, lease: scripts.Lease, seq: int, data: IO[bytes], size: int) -> tuple[bool, str]:
        """Upload one save and make it the task's newest (fenced): (saved, why not)."""
        sha = hashlib.sha256()
        copy = artifacts.copy_name(lease.attempt, lease.backup, lease.token)
        index: dict[str, Any] = {"store": self.object_store or "broker", "bytes": size, "chunk": CHUNK,
                                 "attempt": lease.attempt, "seq": seq}  # fmt: skip
        if self.object_store:
            store = ObjectStore(self.object_store)
            path = f"{lease.job_id}/{lease.index}/checkpoint/{copy}-{seq}.tar"
            target = f"{store.root.rstrip('/')}/{path}"
            store.fs.makedirs(os.path.dirname(target), exist_ok=True)
            with store.fs.open(target, "wb") as out:
                while chunk := data.read(CHUNK):
                    sha.update(chunk)
                    out.write(chunk)
            index.update(path=path, sha256=sha.hexdigest())
            return scripts.checkpoint(self.s, self.r, lease, "", seq, json.dumps(index))
        upload = keys.task_checkpoint_upload(lease.task_id, copy, seq)
        p = self.rq.pipeline(transaction=False)
        pending = c = 0
        while chunk := data.read(CHUNK):
            sha.update(chunk)
            p.hset(upload, f"c:{c}", chunk)
            c += 1
            pending += len(chunk)
            if pending >= PIPELINE_BYTES:
                p.expire(upload, STAGING_TTL_S)
                p.execute()
                pending = 0
        p.hset(upload, "size", str(size))
        p.expire(upload, STAGING_TTL_S)
        p.execute()
        index.update(chunks=c, sha256=sha.hexdigest())
        return scripts.checkpoint(self.s, self.r, lease, upload, seq, json.dumps(index))

    def newest(self, task_id: str) -> tuple[dict[str, Any], Iterator[bytes]] | None:
        """The task's newest checkpoint: its index and its bytes; None when it has none. The bytes are checked
        against the index's digest as they are read (LookupError when they do not match: it was replaced
        meanwhile, and nothing of it is to be used)."""
        raw = self.r.hget(keys.task(task_id), "ckpt")
        if not raw:
            return None
        index = json.loads(raw)
        return index, self._read(task_id, index)

    def _read(self, task_id: str, index: dict[str, Any]) -> Iterator[bytes]:
        sha = hashlib.sha256()
        if index.get("store", "broker") == "broker":
            count, kept = int(index["chunks"]), keys.task_checkpoint(task_id)
            per_trip = max(1, PIPELINE_BYTES // CHUNK)
            for start in range(0, count, per_trip):
                with self.rq.pipeline(transaction=False) as p:
                    for c in range(start, min(count, start + per_trip)):
                        p.hget(kept, f"c:{c}")
                    for data in p.execute():
                        if data is None:
                            raise LookupError("a chunk of the checkpoint is missing (replaced while it was read?)")
                        sha.update(data)
                        yield data
        else:
            if str(index["store"]).rstrip("/") != self.object_store.rstrip("/"):
                raise LookupError(f"the checkpoint is in {index['store']}, not this worker's GPUMESH_ARTIFACTS")
            store = ObjectStore(self.object_store)
            with store.fs.open(f"{store.root.rstrip('/')}/{safe_path(index['path'])}", "rb") as f:
                while data := f.read(CHUNK):
                    sha.update(data)
                    yield data
        if sha.hexdigest() != index.get("sha256"):
            raise LookupError("the checkpoint does not match its digest (replaced while it was read)")

    def restore(self, task_id: str, dir_fd: int, owner: tuple[int, int] | None = None) -> dict[str, Any] | None:
        """Put the task's newest checkpoint into the directory ``dir_fd``: its index, or None when it has none.
        Read whole (and checked) before a file is written: a checkpoint replaced while it was read restores
        nothing rather than a mix."""
        found = self.newest(task_id)
        if found is None:
            return None
        index, chunks = found
        with tempfile.SpooledTemporaryFile(max_size=64 << 20) as buf:
            for data in chunks:
                buf.write(data)
            buf.seek(0)
            index["files"] = unpack(buf, dir_fd, owner)
        return index
