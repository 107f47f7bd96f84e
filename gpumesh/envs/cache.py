"""The worker's side: build a job's locked environment once per machine, in a cache its workers share.

One folder per lock digest under the cache root. A worker that lacks it takes the digest's file lock and
builds (``uv venv`` + ``uv pip install --require-hashes``, wheels only unless both sides allow builds); others
of the machine wait on the same lock and then find it ready. A build goes to a temporary folder, is made
read-only and renamed into place, so a half-built env is never used. A failed build leaves a marker with uv's
message: the machine does not try that lock again until ``gpumesh envs --prune`` clears it. Workers hold a
shared lock on each env they use; pruning removes the least recently used envs that nobody holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpumesh.envs.lock import check_lock, digest_of, uv_binary

READY = ".gpumesh-env.json"  # written last: a folder without it is not an env
SIZE = ".bytes"  # <env folder name>.bytes: the bytes of its files, counted as it was sealed
BUILDS = "builds.jsonl"  # one line per build (uv venv + uv pip install), kept for `gpumesh envs` and doctor


def default_root() -> Path:
    """The machine's env cache when no --env-cache is given: one per user, in the temp dir."""
    return Path(tempfile.gettempdir()) / f"gpumesh-envs-{os.geteuid()}"


class EnvError(Exception):
    """A build that failed here, with the builder's message."""


@dataclass(frozen=True)
class Env:
    digest: str
    path: Path
    python: str  # the env's interpreter
    site: str  # its site-packages: added by the task's process once it is confined, never before


def _site_of(path: Path) -> str:
    found = sorted(path.glob("lib/python3*/site-packages"))
    return str(found[0]) if found else ""


def _read_only(root: Path) -> int:
    """Nobody writes an env once built: its files 0444 (0555 when executable), its folders 0555. Returns the bytes
    of its files (the cache's size, counted on the way)."""
    total = 0
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                os.chmod(p, 0o555 if st.st_mode & 0o111 else 0o444)
                total += st.st_size
        os.chmod(dirpath, 0o555)
    return total


def _seal(root: Path, owned: bool) -> int:
    """:func:`_read_only` for an env a sandbox user built: root takes it over (``owned``: that user could chmod
    its own files back), and the walk goes by file descriptors, never following a symlink the builder left."""
    total = 0
    for _dirpath, dirnames, filenames, dirfd in os.fwalk(root):
        for name in filenames + dirnames:
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                os.chown(name, 0, 0, dir_fd=dirfd, follow_symlinks=False)
            elif stat.S_ISREG(st.st_mode):
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dirfd)
                try:
                    st = os.fstat(fd)
                    if owned:
                        os.fchown(fd, 0, 0)
                    os.fchmod(fd, 0o555 if st.st_mode & 0o111 else 0o444)
                    total += st.st_size
                finally:
                    os.close(fd)
        if owned:
            os.fchown(dirfd, 0, 0)
        os.fchmod(dirfd, 0o555)
    return total


def _writable(root: Path) -> None:
    for dirpath, _dirs, _files in os.walk(root):
        with contextlib.suppress(OSError):
            os.chmod(dirpath, 0o755)


def size_of(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


class EnvCache:
    """The machine's environments under ``root`` (``--env-cache``), at most ``max_mb`` of them kept."""

    def __init__(
        self, root: str | Path, max_mb: int = 20_000, allow_builds: bool = False, python: str = "",
        user: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        self.root = Path(root).expanduser()
        self.user = user  # (uid, gid) the builds run as (worker --sandbox-user): never root when there is one
        self.python = python or sys.executable  # what envs are made on: the tasks' interpreter (a sandbox user's)
        self.max_mb = max_mb
        self.allow_builds = allow_builds
        self._held: dict[str, int] = {}  # digest -> fd holding its shared lock (this worker uses it)
        self._root_ok = False

    def _trusted_root(self) -> None:
        """The cache folder must be this user's and no one else's to write: the default sits in a shared temp
        dir, where another local user could make it first and plant an env that other jobs would then run."""
        if self._root_ok:
            return
        try:
            st = os.lstat(self.root)
        except FileNotFoundError:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o755)
            st = os.lstat(self.root)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise EnvError(
                f"the env cache {self.root} is not a folder that only this user ({os.geteuid()}) may write: remove "
                "it, or give the worker --env-cache DIR"
            )
        self._root_ok = True

    def path(self, digest: str) -> Path:
        return self.root / digest[:32]

    def ready(self, digest: str) -> Env | None:
        self._trusted_root()
        p = self.path(digest)
        if not (p / READY).is_file():
            return None
        return Env(digest, p, str(p / "bin" / "python"), _site_of(p))

    def known(self) -> tuple[list[str], list[str]]:
        """(ready, failed): the envs of this machine, by the first 32 characters of their digests (folder names),
        read from the folder's listing alone: what its workers advertise to dispatch."""
        ready, failed = [], []
        with contextlib.suppress(OSError, EnvError):
            self._trusted_root()
            for p in self.root.iterdir():
                if p.name.endswith(".failed"):
                    failed.append(p.name.removesuffix(".failed"))
                elif (p / READY).is_file():
                    ready.append(p.name)
        return ready, failed

    def failed(self, digest: str) -> str | None:
        try:
            return (self.root / f"{digest[:32]}.failed").read_text()
        except OSError:
            return None

    @contextlib.contextmanager
    def _locked(self, digest: str) -> Iterator[None]:
        self._trusted_root()
        # The build's lock, apart from the in-use lock (.lock) that holders keep shared for as long as they run.
        fd = os.open(self.root / f"{digest[:32]}.build", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # another worker of this machine builds it: wait for its end
            yield
        finally:
            os.close(fd)

    def ensure(self, digest: str, text: str, requires_python: str = "", allow_builds: bool = False) -> Env:
        """The env of this lock on this machine: found, waited for, or built here. EnvError says why not."""
        if digest_of(text, requires_python, allow_builds) != digest:
            raise EnvError("the lock does not match its digest (tampered)")
        why = check_lock(text)
        if why:
            raise EnvError(why)
        if allow_builds and not self.allow_builds:
            raise EnvError("the job allows source builds, and this worker does not (worker --allow-builds)")
        env = self.ready(digest)
        if env is None:
            with self._locked(digest):
                env = self.ready(digest)
                if env is None:
                    failed = self.failed(digest)
                    if failed is not None:
                        raise EnvError(failed)
                    env = self._build(digest, text, requires_python, allow_builds)
        self.hold(env)
        self.evict()
        return env

    def _build(self, digest: str, text: str, requires_python: str, allow_builds: bool) -> Env:
        uv = uv_binary()
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{digest[:12]}-", dir=self.root))
        started = time.monotonic()
        env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}  # the worker's index settings (UV_*) stay: the owner's
        env.pop("VIRTUAL_ENV", None)
        as_user: dict[str, object] = {}
        if self.user is not None:  # built as the sandbox user: uv and whatever it reads never run as root
            uid, gid = self.user
            os.chown(tmp, uid, gid)
            env["UV_CACHE_DIR"] = str(self._user_cache(uid, gid))
            as_user = {"user": uid, "group": gid, "extra_groups": []}
        lockfile = tmp / "lock.txt"
        lockfile.write_text(text)
        try:
            python = self.python  # the worker advertises its minor version: a job's requires-python chose it
            steps = [
                [uv, "venv", "--quiet", "--relocatable", "--no-python-downloads", "--python", python, str(tmp / "v")],
                [uv, "pip", "install", "--quiet", "--require-hashes", "--no-deps", "--link-mode", "copy",
                 *([] if allow_builds else ["--only-binary", ":all:"]),
                 "--python", str(tmp / "v" / "bin" / "python"), "-r", str(lockfile)],
            ]  # fmt: skip
            for cmd in steps:
                proc = subprocess.run(
                    cmd,
                    capture_output=True,
                    text=True,
                    env=env,
                    timeout=3600,
                    cwd=tmp,
                    **as_user,  # type: ignore[call-overload]
                )
                if proc.returncode != 0:
                    msg = (proc.stderr.strip() or proc.stdout.strip() or f"uv exited with {proc.returncode}")[-4000:]
                    self._record(digest, time.monotonic() - started, False)
                    (self.root / f"{digest[:32]}.failed").write_text(msg)
                    raise EnvError(msg)
            # The bytecode, compiled here: tasks cannot write into their read-only env, so without it every attempt
            # would compile each module it imports again (seconds for scipy). Not uv's --compile-bytecode, which
            # starts the env's interpreter with its site (a wheel's .pth would run here, unconfined): the base
            # interpreter without site (-I -S) compiles the files and runs none of them. Best effort: a file that
            # does not compile is compiled (or fails) where a task imports it.
            site = _site_of(tmp / "v")
            if site:
                subprocess.run([python, "-I", "-S", "-m", "compileall", "-q", "-j", "0", site], capture_output=True,
                               env=env, timeout=3600, cwd=tmp, **as_user)  # type: ignore[call-overload]  # fmt: skip
            final = self.path(digest)
            (tmp / "v" / READY).write_text(
                json.dumps({"digest": digest, "built": time.time(), "requires_python": requires_python,
                            "packages": [ln.split(" ")[0] for ln in text.splitlines() if ln and ln[0] not in " #-"]})
            )  # fmt: skip
            size = _read_only(tmp / "v") if self.user is None else _seal(tmp / "v", owned=True)
            # its size beside it, for the bound on the cache (evict), which would otherwise walk every env again
            (self.root / f"{digest[:32]}{SIZE}").write_text(str(size))
            os.rename(tmp / "v", final)
            self._record(digest, time.monotonic() - started, True)
        except subprocess.TimeoutExpired as exc:
            raise EnvError(f"the build ran past {exc.timeout:.0f} s") from None
        finally:
            if os.geteuid() != 0:  # root removes it whatever its modes (and never chmods what a builder left)
                _writable(tmp)
            shutil.rmtree(tmp, ignore_errors=True)
        env_ = self.ready(digest)
        assert env_ is not None
        return env_

    def _user_cache(self, uid: int, gid: int) -> Path:
        """uv's cache for builds as the sandbox user: one of that user's own, beside the envs (the worker owner's
        is root's, which that user cannot write)."""
        cache = self.root / f".uv-cache-{uid}"
        with contextlib.suppress(FileExistsError):
            os.mkdir(cache, 0o700)
        st = os.lstat(cache)
        if not stat.S_ISDIR(st.st_mode):
            raise EnvError(f"{cache} is not a folder; remove it")
        if st.st_uid != uid:
            os.chown(cache, uid, gid, follow_symlinks=False)
        return cache

    def _record(self, digest: str, seconds: float, ok: bool) -> None:
        uid = self.user[0] if self.user else os.geteuid()  # as whom uv ran
        line = json.dumps(
            {"digest": digest, "seconds": round(seconds, 3), "ok": ok, "at": time.time(), "pid": os.getpid(),
             "uid": uid}
        )  # fmt: skip
        with open(self.root / BUILDS, "a") as f:
            f.write(line + "\n")

    def hold(self, env: Env) -> None:
        """Mark ``env`` in use by this worker (a shared lock on it) and as just used (for the LRU order)."""
        if env.digest not in self._held:
            fd = os.open(self.root / f"{env.digest[:32]}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_SH)
            self._held[env.digest] = fd
        with contextlib.suppress(OSError):
            os.utime(self.root / f"{env.digest[:32]}.lock")

    def release_all(self) -> None:
        for fd in self._held.values():
            os.close(fd)
        self._held.clear()

    def entries(self) -> list[dict[str, object]]:
        """The envs here: digest, size, last use, packages, whether a worker holds it; failed builds too."""
        out: list[dict[str, object]] = []
        if not self.root.is_dir():
            return out
        for p in sorted(self.root.iterdir()):
            if p.is_dir() and (p / READY).is_file():
                try:
                    meta = json.loads((p / READY).read_text())
                except (OSError, ValueError):
                    meta = {}
                lockf = self.root / f"{p.name}.lock"
                out.append({"digest": meta.get("digest", p.name), "state": "ready", "bytes": self._size(p),
                            "last_used": lockf.stat().st_mtime if lockf.exists() else p.stat().st_mtime,
                            "in_use": self._in_use(lockf), "packages": meta.get("packages", [])})  # fmt: skip
            elif p.name.endswith(".failed"):
                out.append({"digest": p.name.removesuffix(".failed"), "state": "failed", "bytes": 0,
                            "last_used": p.stat().st_mtime, "in_use": False, "error": p.read_text()[-300:]})  # fmt: skip
        return out

    def _size(self, env: Path) -> int:
        """The bytes of an env's files: as its build counted them, else counted now."""
        with contextlib.suppress(OSError, ValueError):
            return int((self.root / f"{env.name}{SIZE}").read_text())
        return size_of(env)

    def _in_use(self, lockf: Path) -> bool:
        if not lockf.exists():
            return False
        fd = os.open(lockf, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def remove(self, name: str) -> bool:
        """Remove one env (by its folder name) unless a worker holds it or builds it."""
        p = self.root / name
        fd = os.open(self.root / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            (p / READY).chmod(0o644) if (p / READY).exists() else None
            _writable(p)
            shutil.rmtree(p, ignore_errors=True)
            (self.root / f"{name}{SIZE}").unlink(missing_ok=True)
            return True
        finally:
            os.close(fd)

    def evict(self, limit_mb: int | None = None) -> list[str]:
        """Remove least recently used envs nobody holds until the cache is within ``limit_mb`` (the setting)."""
        limit = (self.max_mb if limit_mb is None else limit_mb) << 20
        ready = [e for e in self.entries() if e["state"] == "ready"]
        total = sum(int(str(e["bytes"])) for e in ready)
        removed = []
        for e in sorted(ready, key=lambda e: float(str(e["last_used"]))):
            if total <= limit:
                break
            name = str(e["digest"])[:32]
            if not e["in_use"] and self.remove(name):
                total -= int(str(e["bytes"]))
                removed.append(name)
        return removed

    def prune(self) -> list[str]:
        """``gpumesh envs --prune``: every env nobody holds, and every failed build's marker."""
        removed = self.evict(0)
        if self.root.is_dir():
            for p in self.root.glob("*.failed"):
                p.unlink(missing_ok=True)
                removed.append(p.name)
        return removed
