"""Security: least-privilege ACL users, revocable per-person credentials, refusal of foreign code."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from .conftest import ROOT, free_port, gpumesh, wait_until
from .test_serve_and_local import Serve

EXAMPLE = str(ROOT / "examples/grid_search.py")
PAYLOADS = str(ROOT / "examples/payloads.json")

FORBIDDEN = [
    ("CONFIG", "GET", "maxmemory"),
    ("MODULE", "LIST"),
    ("DEBUG", "SLEEP", "0"),
    ("REPLICAOF", "NO", "ONE"),
    ("FLUSHALL",),
    ("KEYS", "*"),
    ("SHUTDOWN", "NOSAVE"),
    ("ACL", "WHOAMI"),
    ("ACL", "SETUSER", "mallory", "on", ">x", "+@all", "~*"),
]


@pytest.fixture
def served(env, tmp_path: Path):
    port = free_port()
    serve = Serve(env, tmp_path / "broker", port)
    text = "\n".join(serve.lines)
    urls = {
        "worker": serve.url,
        "submitter": re.search(r"--url '(redis://submitter:[^']+)' --wait", text).group(1),
    }
    yield serve, urls, tmp_path / "broker", port
    serve.stop()


@pytest.mark.parametrize("role", ["worker", "submitter"])
def test_roles_get_noperm_for_admin_and_dangerous_commands(served, role):
    serve, urls, data, port = served
    client = redis.Redis.from_url(urls[role])
    admin = _admin(data, port)
    for command in FORBIDDEN:
        # ACL DRYRUN gives the ACL verdict even for DEBUG, which Redis 7 disables before asking the ACL
        verdict = admin.execute_command("ACL", "DRYRUN", role, *command)
        assert "no permissions" in verdict, (command, verdict)
        if command[0] != "DEBUG":
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.set("someone-elses-key", "x")  # only gpumesh:* and rq:* keys
    assert client.ping()


def _admin(data: Path, port: int) -> redis.Redis:
    admin = json.loads((data / "credentials.json").read_text())["admin"]
    return redis.Redis.from_url(f"redis://admin:{admin}@127.0.0.1:{port}/0", decode_responses=True)


def test_no_credential_reaches_redis_without_a_password(served):
    _, _, _, port = served
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, username="default", password="").ping()


def test_a_job_runs_end_to_end_with_the_role_credentials(served, env):
    _, urls, _, _ = served
    p = gpumesh("submit", EXAMPLE, "--payloads", PAYLOADS, "--url", urls["submitter"], env=env)
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip()
    w = gpumesh("worker", urls["worker"], "--burst", "--score", "3", env=env, timeout=120)
    assert w.returncode == 0, w.stderr
    st = json.loads(gpumesh("status", job, "--url", urls["submitter"], "--json", env=env).stdout)
    assert st["status"] == "done", w.stderr


def test_a_revoked_person_s_worker_is_disconnected_and_stops(served, env, tmp_path: Path):
    _, urls, data, _ = served
    p = gpumesh("access", "add", "ana", "--data-dir", str(data), env=env)
    assert p.returncode == 0, p.stderr
    ana_url = re.search(r"gpumesh worker '([^']+)'", p.stdout).group(1)
    assert ana_url.startswith("redis://worker-ana:")
    assert gpumesh("access", "list", "--data-dir", str(data), env=env).stdout.split() == ["ana"]
    with open(tmp_path / "ana.log", "wb") as log:
        worker = subprocess.Popen([sys.executable, "-m", "gpumesh", "worker", ana_url, "--score", "2"], env=env,
                                  stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        r = _admin(data, int(urls["worker"].rsplit(":", 1)[1].split("/")[0]))
        wait_until(lambda: r.zcard("gpumesh:workers") == 1, timeout=30, what="ana's worker to join")
        assert gpumesh("access", "revoke", "ana", "--data-dir", str(data), env=env).returncode == 0
        assert worker.wait(timeout=30) == 3
        assert "refused this worker's credentials" in (tmp_path / "ana.log").read_text()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(ana_url).ping()
        assert gpumesh("access", "revoke", "ana", "--data-dir", str(data), env=env).returncode == 4
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGKILL)
            worker.wait()
