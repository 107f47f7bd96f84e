"""A worker whose heartbeat stalls takes no new task (each would be leased again elsewhere at the lease TTL
and killed here), says so once, and takes work again once a heartbeat gets through."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
import redis

from gpumesh.store import keys

from ..conftest import MeshWorkers, Workers, gpumesh, wait_until
from ..store.test_dispatch import sleep_script, submit, wait_done

pytestmark = pytest.mark.faults


def ran_on(env: dict[str, str], job: str) -> list[str]:
    rows = json.loads(gpumesh("results", job, "--format", "json", env=env).stdout)
    assert all(row["status"] == "done" and row["attempts"] == 1 for row in rows), rows
    return [row["result"]["worker"] for row in rows]


def test_a_worker_whose_heartbeat_stalls_takes_no_new_task_and_recovers(
    env: dict[str, str], r: redis.Redis, workers: Workers, mesh_worker: MeshWorkers, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
):  # fmt: skip
    caplog.set_level(logging.INFO, logger="gpumesh.worker")

    def said(text: str) -> list[logging.LogRecord]:
        return [rec for rec in list(caplog.records) if text in rec.getMessage()]

    script = sleep_script(tmp_path)
    workers.start("--name", "healthy", score=1)
    sick = mesh_worker.start(name="sick", score=50)  # the strongest: placement would give it the work
    stall = threading.Event()
    beat = sick._beat
    sick._beat = lambda: stall.wait()  # its heartbeat thread hangs in its next beat
    # Past the lease TTL (2 s in the tests) without a beat, it says it stalled: wait for that, not for a fixed
    # time that a loaded machine may not have given its threads.
    wait_until(lambda: said("no heartbeat has succeeded"), timeout=30, what="the worker to say its heartbeat stalled")
    job = submit(env, script, [{"sleep": 0.2, "cost": 4}] * 4)
    assert wait_done(env, job)["status"] == "done"
    assert sick.worker_id not in ran_on(env, job), "the stalled worker took a task"
    assert len(said("no heartbeat has succeeded")) == 1, [rec.getMessage() for rec in caplog.records]
    sick._beat = beat
    stall.set()  # the hung beat returns; the next one is real
    # The next job is for a worker back in the fleet: one submitted before its first beat got through (its
    # registration lapsed meanwhile) could all be done by the healthy one before the recovered one looks.
    wait_until(lambda: said("heartbeats succeed again") and r.exists(keys.worker(sick.worker_id)), timeout=30,
               what="the worker to say its heartbeats succeed again, registered anew")  # fmt: skip
    again = submit(env, script, [{"sleep": 0.2, "cost": 4}] * 4)
    assert wait_done(env, again)["status"] == "done"
    assert sick.worker_id in ran_on(env, again), "the recovered worker took no task"
    assert len(said("no heartbeat has succeeded")) == 1, [rec.getMessage() for rec in caplog.records]


# Fails on a worker named sick-…; anywhere else it sleeps as long as the payload says and answers.
SICK = """import json, os, sys, time
p = json.load(sys.stdin)
if os.environ["GPUMESH_WORKER_ID"].startswith("sick"):
    sys.exit("this machine is sick")
time.sleep(p.get("sleep", 0))
print(json.dumps({"worker": os.environ["GPUMESH_WORKER_ID"]}))
"""


def test_after_a_failed_attempt_another_live_worker_gets_the_task(
    env: dict[str, str], workers: Workers, tmp_path: Path
):
    """A sick worker that fails whatever it runs does not spend every attempt of a task while a healthy one
    is busy for a moment: the retry waits (up to a lease TTL) for another worker."""
    script = tmp_path / "sick.py"
    script.write_text(SICK)
    workers.start("--name", "healthy", "--resource", "role=healthy", score=1)
    workers.start("--name", "sick", score=50)
    busy = submit(env, script, [{"sleep": 2.5}], "--require", "role=healthy")  # occupies the healthy worker
    wait_until(lambda: json.loads(gpumesh("status", busy, "--json", env=env).stdout)["tasks"]["running"] == 1,
               what="the healthy worker to be busy")  # fmt: skip
    job = submit(env, script, [{}], "--max-attempts", "3", "--retry-on", "script")  # only the sick worker is free
    assert wait_done(env, job)["status"] == "done", gpumesh("results", job, env=env).stdout
    (row,) = json.loads(gpumesh("results", job, "--format", "json", env=env).stdout)
    assert row["result"]["worker"].startswith("healthy") and row["attempts"] >= 2, row
    assert wait_done(env, busy)["status"] == "done"
