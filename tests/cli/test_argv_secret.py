"""A worker started from serve's line (the password in its URL) or `join --token` keeps the password off
its command line, which every process on the machine can read, a confined task included."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis

from gpumesh.cli.argv import PLACEHOLDER
from gpumesh.server.broker_server import ROLES, prepare

from ..conftest import RedisServer, Workers, gpumesh, wait_until

pytestmark = pytest.mark.security

# Every command line this task can read on the machine, where it names a broker.
SNOOP = """import json, os, sys
found = []
for pid in os.listdir("/proc"):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            line = f.read().replace(b"\\0", b" ").decode(errors="replace")
    except OSError:
        continue
    if "redis" in line or "--token" in line:
        found.append(line)
print(json.dumps({"cmdlines": found}))
"""


@pytest.fixture
def credential(r: redis.Redis, redis_server: RedisServer) -> Iterator[tuple[str, str]]:
    """A worker credential as `gpumesh access add` makes one, on a broker prepared as serve prepares it."""
    user, password = f"worker-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    r.execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}", *ROLES["worker"])
    prepare(r)
    yield user, password
    r.execute_command("ACL", "DELUSER", user)


def _cmdline(pid: int) -> str:
    return " ".join(psutil.Process(pid).cmdline())


def test_a_worker_s_password_is_on_no_command_line_a_task_can_read(
    env: dict[str, str], workers: Workers, credential: tuple[str, str], redis_server: RedisServer, tmp_path: Path
):
    user, password = credential
    url = f"redis://{user}:{password}@127.0.0.1:{redis_server.port}/0"
    proc = workers.start(url, "--name", "argv")
    worker_line = _cmdline(proc.pid)  # the same process, re-executed
    assert password not in worker_line and PLACEHOLDER in worker_line, worker_line
    script = tmp_path / "snoop.py"
    script.write_text(SNOOP)
    job = gpumesh("submit", str(script), "--payloads", "-", env=env, input="[{}]").stdout.strip()
    wait_until(lambda: json.loads(gpumesh("status", job, "--json", env=env).stdout)["status"] == "done", timeout=30)
    (row,) = json.loads(gpumesh("results", job, "--format", "json", env=env).stdout)
    seen = row["result"]["cmdlines"]
    assert any(PLACEHOLDER in line for line in seen), seen  # the task did read the worker's command line
    assert not [line for line in seen if password in line], seen


def test_join_with_a_token_keeps_the_token_off_its_command_line(
    env: dict[str, str], workers: Workers, r: redis.Redis, credential: tuple[str, str], redis_server: RedisServer
):
    user, password = credential
    joined = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "join", f"127.0.0.1:{redis_server.port}", "--token", f"{user}:{password}",
         "--score", "3", "--name", "joined"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    workers.procs.append(joined)  # stopped at teardown
    wait_until(lambda: r.zcard("gpumesh:workers") >= 1, timeout=20)
    line = _cmdline(joined.pid)
    assert password not in line and PLACEHOLDER in line, line


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def submitter(r: redis.Redis, redis_server: RedisServer) -> Iterator[tuple[str, str]]:
    """A submitter credential as serve makes one."""
    user, password = f"submitter-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    r.execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}", *ROLES["submitter"])
    prepare(r)
    yield user, password
    r.execute_command("ACL", "DELUSER", user)


def test_a_dashboard_metrics_or_status_watch_keeps_the_submitter_s_password_off_its_command_line(
    env: dict[str, str], submitter: tuple[str, str], redis_server: RedisServer, tmp_path: Path
):
    """`gpumesh dashboard --url redis://submitter:PASSWORD@…`, as its help shows, kept the password on its command
    line, which any process on the machine reads (a task of a worker there): each long-running command that takes
    a URL now re-executes itself with it in its environment, and still works."""
    user, password = submitter
    url = f"redis://{user}:{password}@127.0.0.1:{redis_server.port}/0"
    script = tmp_path / "noop.py"
    script.write_text("print(1)\n")
    job = gpumesh("submit", str(script), "--payloads", "-", env=env, input="[{}]").stdout.strip()  # no worker: waits
    clean = {k: v for k, v in env.items() if k != "GPUMESH_URL"}
    commands = {
        "dashboard": ["dashboard", "--url", url, "--port", "0", "--read-only"],
        "metrics": ["metrics", "--url", url, "--port", str(_free_port())],
        "status --watch": ["status", job, "--watch", f"--url={url}"],
    }
    for name, args in commands.items():
        proc = subprocess.Popen([sys.executable, "-m", "gpumesh", *args], env=clean, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
        try:
            wait_until(lambda proc=proc: proc.poll() is not None or PLACEHOLDER in _cmdline(proc.pid), timeout=20)
            assert proc.poll() is None, (name, proc.stderr.read() if proc.stderr else "")
            line = _cmdline(proc.pid)
            assert password not in line and PLACEHOLDER in line, (name, line)
            time.sleep(1)  # it runs on, connected with the password restored
            assert proc.poll() is None, (name, proc.stderr.read() if proc.stderr else "")
        finally:
            proc.kill()
            proc.communicate()
