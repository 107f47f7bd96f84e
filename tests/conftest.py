"""Fixtures: a real redis-server on a free port (never the machine's own 6379), real worker processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from gpumesh.errors import UsageError
from gpumesh.server.broker_server import find_binary, free_port  # noqa: F401 - re-exported for the tests
from gpumesh.settings import Settings
from gpumesh.store.broker import Broker

ROOT = Path(__file__).resolve().parent.parent
FAST = {"GPUMESH_LEASE_TTL": "2", "GPUMESH_HEARTBEAT_INTERVAL": "0.4"}


class RedisServer:
    def __init__(self, tmp: Path, password: str | None = None, port: int | None = None) -> None:
        self.port = port or free_port()
        self.password = password
        self.dir = tmp
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, appendonly: bool = False) -> RedisServer:
        try:
            exe = find_binary()  # redis-server on PATH, else the Valkey of the server extra
        except UsageError:
            if os.environ.get("CI"):
                raise
            pytest.skip("neither redis-server nor gpumesh[server] is installed")
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--dir", str(self.dir),
                "--appendonly", "yes" if appendonly else "no", "--maxmemory-policy", "noeviction"]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert self.proc.stdout
        deadline = time.monotonic() + 10
        for line in self.proc.stdout:
            if b"Ready to accept connections" in line:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
        else:
            raise RuntimeError("redis-server exited at start")
        self.proc.stdout.close()
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def r(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def env(redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Environment for gpumesh processes: the test broker, short TTLs, a private cache and config."""
    values = {
        "GPUMESH_URL": redis_server.url,
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "GPUMESH_CONFIG": str(tmp_path / "config.toml"),
        **FAST,
    }
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    return {**os.environ, **values}


@pytest.fixture
def broker(r: redis.Redis, env: dict[str, str]) -> Iterator[Broker]:
    b = Broker(Settings.load())
    yield b
    b.close()


class Workers:
    """Real `gpumesh worker` processes, each in its own process group, stopped at teardown."""

    def __init__(self, env: dict[str, str], r: redis.Redis, tmp: Path) -> None:
        self.env, self.r, self.tmp = env, r, tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.mode_args: list[str] = []  # ["--warm"] to run the same test against the warm executor

    def start(
        self, *args: str, score: float = 10, wait: bool = True, client: redis.Redis | None = None, **extra_env: str
    ) -> subprocess.Popen[bytes]:
        """Start a worker; wait until it registers on ``client`` (the test Redis unless given)."""
        r = client or self.r
        before = r.zcard("gpumesh:workers")
        with open(self.tmp / f"worker-{len(self.procs)}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "gpumesh", "worker", "--score", str(score), *self.mode_args, *args],
                env={**self.env, **extra_env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.procs.append(proc)
        if wait:
            deadline = time.monotonic() + 20
            while r.zcard("gpumesh:workers") <= before:
                assert proc.poll() is None, self.log(len(self.procs) - 1)
                assert time.monotonic() < deadline, "worker did not register"
                time.sleep(0.05)
        return proc

    def log(self, i: int) -> str:
        return (self.tmp / f"worker-{i}.log").read_text()

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture
def workers(env: dict[str, str], r: redis.Redis, tmp_path: Path) -> Iterator[Workers]:
    w = Workers(env, r, tmp_path)
    yield w
    w.stop_all()


@pytest.fixture(params=["fresh", "warm"])
def both_modes(request: pytest.FixtureRequest, workers: Workers) -> str:
    """Run a test against both executors: a new interpreter per task, and tasks forked from a warm zygote."""
    workers.mode_args = ["--warm"] if request.param == "warm" else []
    return request.param


def gpumesh(
    *args: str, env: dict[str, str], input: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a user would, in a subprocess (exit codes are the contract)."""
    return subprocess.run(
        [sys.executable, "-m", "gpumesh", *args], env=env, input=input, capture_output=True, text=True, timeout=timeout
    )


def wait_until(predicate, timeout: float = 20, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def written(path: Path) -> str | None:
    """A file's text once a task has written it; None before. It may exist and still be empty: a task's
    open() creates it before its write() fills it, so wait for this, not for exists()."""
    try:
        return path.read_text() or None
    except FileNotFoundError:
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
