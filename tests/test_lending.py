"""Lenders in control: a worker pauses when its owner needs the machine (--lend, --pause-when), keeps to the
limits its owner set (--max-task-hours, --accept-from, --cpu-cores, --max-vram-gb), records what ran on the
machine (`gpumesh lent`), and hands a paused task back without spending an attempt. Real workers, a real Redis,
real signals; the probes read fixtures (a flag file, a command) in place of a desktop and a GPU."""

from __future__ import annotations

import json
import os
import stat
import textwrap
import time
from pathlib import Path

import pytest
import redis

from gpumesh.store import keys

from .conftest import Workers, gpumesh, wait_until, written

FAST_PROBE = {"GPUMESH_PAUSE_PROBE_INTERVAL": "0.2", "GPUMESH_STOP_GRACE": "2"}

# A task that counts, a step every 0.1 s, writes where it got to, and on SIGTERM says so before it exits.
COUNTER = """
import json, os, signal, sys, time
tmp = {tmp!r}
attempt = os.environ["GPUMESH_ATTEMPT"]
def term(*_):
    open(os.path.join(tmp, "term-" + attempt), "w").write(str(time.time()))
    sys.exit(1)
signal.signal(signal.SIGTERM, term)
open(os.path.join(tmp, "pid-" + attempt), "w").write(str(os.getpid()))
for i in range({steps}):
    time.sleep(0.1)
print(json.dumps({{"worker": os.environ["GPUMESH_WORKER_ID"], "attempt": int(attempt)}}))
"""


def counter(tmp: Path, steps: int = 40) -> Path:
    path = tmp / "count.py"
    path.write_text(textwrap.dedent(COUNTER.format(tmp=str(tmp), steps=steps)))
    return path


def submit_one(env: dict[str, str], path: Path, *args: str) -> tuple[str, str]:
    p = gpumesh("submit", str(path), "--payloads", "-", *args, env=env, input='[{"n": 1}]')
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip()
    return job, keys.task_id(job, 0)


def workers_json(env: dict[str, str]) -> list[dict]:
    p = gpumesh("workers", "--json", env=env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.processes
def test_a_pause_hands_the_task_back_unspent_and_it_runs_elsewhere(env, workers: Workers, r: redis.Redis, tmp_path):
    flag = tmp_path / "owner-is-back"
    lender = workers.start("--name", "lender", "--pause-when", f"test -e {flag}", **FAST_PROBE)
    job, tid = submit_one(env, counter(tmp_path, steps=60), "--max-attempts", "1")
    wait_until(lambda: written(tmp_path / "pid-1"), what="attempt 1 on the lender")
    t0 = time.time()
    flag.write_text("")
    wait_until(lambda: written(tmp_path / "term-1"), timeout=10, what="SIGTERM to the paused task")
    term_after = float((tmp_path / "term-1").read_text()) - t0
    wait_until(lambda: r.hget(keys.task(tid), "status") == "queued", timeout=10, what="the task handed back")
    queued_after = time.time() - t0
    shown = {w["name"]: w for w in workers_json(env)}["lender"]
    assert shown["state"] == "paused" and shown["paused"].startswith("--pause-when"), shown
    assert "paused: --pause-when" in gpumesh("workers", env=env).stdout
    workers.start("--name", "other")
    wait_until(lambda: r.hget(keys.task(tid), "status") == "done", timeout=30, what="the task done elsewhere")
    print(f"\npause -> SIGTERM in the task: {term_after:.2f} s; -> queued again: {queued_after:.2f} s")
    result = json.loads(r.hget(keys.task(tid), "result"))
    assert result["worker"].startswith("other-")  # the paused lender took nothing more
    st = json.loads(gpumesh("status", job, "--json", env=env).stdout)
    assert st["status"] == "done" and st["paused_handbacks"] == 1 and st["paused_lost_s"] > 0  # --max-attempts 1 held
    assert "handed back by pauses" in gpumesh("status", job, env=env).stdout
    flag.unlink()
    wait_until(lambda: not {w["name"]: w for w in workers_json(env)}["lender"]["paused"], timeout=10,
               what="the lender to resume")  # fmt: skip
    assert lender.poll() is None
    log = workers.log(0)
    assert "paused: --pause-when" in log and "resumed" in log
