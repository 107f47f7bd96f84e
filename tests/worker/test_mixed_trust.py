"""A mesh of trusting and plain workers: an unsigned task goes to a worker that runs
unsigned work, never to one started with --trust, and submit says when no live worker would take it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..conftest import Workers, gpumesh, wait_until

pytestmark = pytest.mark.processes


@pytest.fixture
def keypair(env, tmp_path: Path) -> tuple[Path, Path]:
    p = gpumesh("keys", "generate", "--dir", str(tmp_path / "keys"), env=env)
    assert p.returncode == 0, p.stderr
    priv, pub = (Path(line) for line in p.stdout.split())
    return priv, pub


def script(tmp_path: Path) -> Path:
    path = tmp_path / "who.py"
    path.write_text("import json, os, sys\njson.load(sys.stdin)\nprint(json.dumps(os.environ['GPUMESH_WORKER_ID']))\n")
    return path


def test_unsigned_tasks_run_on_the_plain_worker_and_none_fails(env, workers: Workers, keypair, tmp_path, r):
    _priv, pub = keypair
    workers.start("--name", "trusting", "--trust", str(pub), score=10)
    workers.start("--name", "plain", score=1)
    payloads = json.dumps([{"i": i} for i in range(6)])
    ran = gpumesh("submit", str(script(tmp_path)), "--payloads", "-", "--wait", env=env, input=payloads)
    assert ran.returncode == 0, ran.stderr  # all 6 done (5 of 6 used to fail on the trusting worker)
    rows = json.loads(gpumesh("results", ran.stdout.split()[0], "--json", env=env).stdout)
    assert [row["status"] for row in rows] == ["done"] * 6 and all(row["attempts"] == 1 for row in rows)
    assert {row["worker"] for row in rows} == {row["result"] for row in rows}
    trusting = next(
        w for w in r.zrange("gpumesh:workers", 0, -1) if r.hget(f"gpumesh:worker:{w}", "name") == "trusting"
    )
    assert trusting not in {row["worker"] for row in rows}


def test_submit_warns_when_only_trusting_workers_are_live_and_a_signed_job_runs(env, workers, keypair, tmp_path, r):
    priv, pub = keypair
    workers.start("--trust", str(pub))
    unsigned = gpumesh("submit", str(script(tmp_path)), "--payloads", "-", env=env, input='[{"i": 0}]')
    assert unsigned.returncode == 0
    assert "runs only signed tasks (started with --trust), and this job is not signed" in unsigned.stderr
    job = unsigned.stdout.strip()
    status = gpumesh("status", job, env=env)
    assert "this job is not signed: submit it with --sign-key KEY" in status.stdout
    signed = gpumesh("submit", str(script(tmp_path)), "--payloads", "-", "--sign-key", str(priv), "--wait",
                     env=env, input='[{"i": 1}]')  # fmt: skip
    assert signed.returncode == 0, signed.stderr
    assert json.loads(gpumesh("status", job, "--json", env=env).stdout)["tasks"]["queued"] == 1  # still waiting
    workers.start()  # a plain worker joins: the unsigned task runs
    wait_until(lambda: json.loads(gpumesh("status", job, "--json", env=env).stdout)["status"] == "done", timeout=30,
               what="the unsigned task to run on the plain worker")  # fmt: skip
