"""A worker started from serve's line (the password in its URL) or `join --token` keeps the password off
its command line, which every process on the machine can read, a confined task included."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis

from gpumesh.cli.argv import PLACEHOLDER
from gpumesh.server.broker_server import ROLES, prepare

from .conftest import RedisServer, Workers, gpumesh, wait_until

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
