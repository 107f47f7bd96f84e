"""The machine's project cache: each tree materialised once, shared by all the workers of the machine.

``<cache>/<digest>/`` holds a tree's files, read-only (files 0444, or 0555 when executable; folders 0555),
made by the first worker that needs it while the others wait on ``<cache>/<digest>.lock`` (flock). A worker
holds that lock shared while an attempt runs in the tree, so the bound on the cache's size
(``GPUMESH_PROJECT_CACHE_MB``) removes the least recently used trees that no attempt uses (an exclusive
lock taken without waiting). Every file's bytes are checked against the manifest's SHA-256, and the
manifest against the tree digest the job's signature covers, before the tree is moved into place:
a file changed in the store is refused before any task runs.

The cache's folder is the worker user's, mode 0711: a task (another user, with ``--sandbox-user``) can
reach a tree whose digest it knows but cannot list the others; under Landlock it may read its own tree
alone.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumesh.project import parse_manifest
from gpumesh.store import projects

log = logging.getLogger("gpumesh.worker")

MB = 1 << 20
TOUCH_EVERY_S = 30.0  # how often a tree in use is marked used (its lock file's mtime: the LRU order)


class ProjectError(Exception):
    """A tree that cannot be made here: its manifest or a file is missing, or does not match its digest."""


@dataclass
class Held:
    """A tree an attempt runs in: its folder, held (shared lock) until :meth:`ProjectCache.release`."""

    digest: str
    path: str
    fd: int
    made: str = ""  # what making it here took, when this call made it ("2000 files, 52428800 bytes, in 1.20 s")


def default_root() -> Path:
    return Path(tempfile.gettempdir()) / f"gpumesh-projects-{os.geteuid()}"


class ProjectCache:
    def __init__(self, root: str | Path, cap_mb: float, files: projects.Files, client: Any) -> None:
        self.root = Path(root) if root else default_root()
        self.cap = int(cap_mb * MB)
        self.files = files
        self.client = client  # text client: manifests
        self._touched: dict[str, float] = {}
        self._ready = False

    def _ensure_root(self) -> None:
        """The cache folder, this user's and no one else's to write (it may sit in a shared /tmp)."""
        if self._ready:
            return
        try:
            os.mkdir(self.root, 0o711)
        except FileExistsError:
            pass
        st = os.lstat(self.root)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise ProjectError(f"the project cache {self.root} is not a folder of this user: remove it")
        if stat.S_IMODE(st.st_mode) != 0o711:
            os.chmod(self.root, 0o711)
        self._ready = True

    def acquire(self, digest: str) -> Held:
        """The tree ``digest``, made here if this machine lacks it (another worker making it: wait for it),
        held until :meth:`release`."""
        if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
            raise ProjectError(f"not a tree digest: {digest[:80]!r}")
        self._ensure_root()
        lock = os.open(self.root / f"{digest}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            tree = self.root / digest
            made = ""
            fcntl.flock(lock, fcntl.LOCK_SH)
            if not tree.is_dir():
                fcntl.flock(lock, fcntl.LOCK_EX)  # the first to get here makes it; the others wait here
                if not tree.is_dir():
                    started = time.monotonic()
                    files, size = self._materialise(digest, tree)
                    (self.root / f"{digest}.bytes").write_text(str(size))
                    made = f"{files} files, {size} bytes, in {time.monotonic() - started:.2f} s"
                fcntl.flock(lock, fcntl.LOCK_SH)
                self._evict(keep=digest)
            self._touch(digest, lock)
        except BaseException:
            os.close(lock)
            raise
        return Held(digest, str(tree), lock, made)

    def trees(self) -> list[str]:
        """The digests of the trees this machine holds now (dispatch places a job where its project is held)."""
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        hexdigits = set("0123456789abcdef")
        return [n for n in names if len(n) == 64 and set(n) <= hexdigits and (self.root / n).is_dir()]

    def release(self, held: Held) -> None:
        os.close(held.fd)  # and its lock with it

    def _touch(self, digest: str, fd: int) -> None:
        now = time.monotonic()
        if now - self._touched.get(digest, -TOUCH_EVERY_S) >= TOUCH_EVERY_S:
            os.utime(fd)
            self._touched[digest] = now

    def _materialise(self, digest: str, tree: Path) -> tuple[int, int]:
        manifest = projects.tree_manifest(self.client, digest)
        if manifest is None:
            raise ProjectError(f"project {digest[:12]} is not in the broker (its job was cancelled or deleted?)")
        if hashlib.sha256(manifest.encode()).hexdigest() != digest:
            raise ProjectError(f"project {digest[:12]}: its stored manifest does not match its digest (tampered)")
        try:
            doc = parse_manifest(manifest)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise ProjectError(f"project {digest[:12]}: its manifest cannot be used ({exc})") from None
        work = Path(tempfile.mkdtemp(prefix=f".{digest[:12]}-", dir=self.root))
        try:
            size = self._write_files(doc, work)
            for path, target in doc["links"]:
                dest = work / path
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(target, dest)
            _read_only(work)
            try:
                os.rename(work, tree)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                _remove(work)  # made meanwhile by a worker that did not share our lock file (evicted and made anew)
        except BaseException:
            _remove(work)
            raise
        log.info("project %s: %d files, %d bytes, ready in %s", digest[:12], len(doc["files"]), size, tree)
        return len(doc["files"]), size

    def _write_files(self, doc: dict[str, Any], work: Path) -> int:
        entries = doc["files"]
        by_sha: dict[str, list[tuple[str, int]]] = {}
        sizes: dict[str, int] = {}
        for path, sha, size, executable in entries:
            by_sha.setdefault(sha, []).append((path, int(executable)))
            sizes[sha] = int(size)
        total = 0
        try:
            for sha, data in self.files.read_many(sorted(sizes.items())):
                if len(data) != sizes[sha] or hashlib.sha256(data).hexdigest() != sha:
                    names = ", ".join(p for p, _ in by_sha[sha][:3])
                    raise ProjectError(f"project file {names} does not match its digest in the store (tampered)")
                for path, executable in by_sha[sha]:
                    dest = work / path
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(data)
                    os.chmod(dest, 0o555 if executable else 0o444)
                    total += len(data)
        except LookupError as exc:
            raise ProjectError(str(exc)) from None
        return total

    def _evict(self, keep: str) -> None:
        """Remove least recently used trees no attempt holds until the cache fits its cap."""
        if not self.cap:
            return
        trees = []
        for entry in os.scandir(self.root):
            if entry.name.endswith(".bytes"):
                digest = entry.name.removesuffix(".bytes")
                try:
                    size = int(Path(entry.path).read_text() or 0)
                    used = os.stat(self.root / f"{digest}.lock").st_mtime
                except (OSError, ValueError):
                    continue
                trees.append((used, digest, size))
        total = sum(size for _, _, size in trees)
        for _used, digest, size in sorted(trees):
            if total <= self.cap:
                return
            if digest == keep:
                continue
            if self._remove_tree(digest):
                total -= size

    def _remove_tree(self, digest: str) -> bool:
        try:
            fd = os.open(self.root / f"{digest}.lock", os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False  # an attempt runs in it
        try:
            gone = self.root / f".gone-{digest[:12]}-{os.getpid()}"
            os.rename(self.root / digest, gone)
            (self.root / f"{digest}.bytes").unlink(missing_ok=True)
            _remove(gone)
            log.info("project %s removed from this machine's cache (least recently used)", digest[:12])
            return True
        except OSError:
            return False
        finally:
            os.close(fd)


def _read_only(top: Path) -> None:
    for dirpath, dirnames, _filenames in os.walk(top, topdown=False):
        for name in dirnames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, 0o555)
    os.chmod(top, 0o555)


def _remove(top: Path) -> None:
    """Remove a tree made read-only: its folders made writable again first."""
    if not top.exists():
        return
    for dirpath, dirnames, _filenames in os.walk(top):
        os.chmod(dirpath, 0o755)
        for name in dirnames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, 0o755)
    shutil.rmtree(top, ignore_errors=True)
