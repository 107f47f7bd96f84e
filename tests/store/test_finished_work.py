"""What finished work costs the broker (docs/finished-work.md): a done task keeps its hash and a few stream
entries, RQ keeps nothing of a delivery that ended, a job's log is one stream read whole and in order, a big
job is read a page per call, and it is deleted in bounded steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
import redis.connection

import gpumesh
from gpumesh.models import JobOptions
from gpumesh.store import keys, retention, scripts
from gpumesh.store.broker import Broker
from gpumesh.store.reaper import reap_once

from ..conftest import cli, wait_until

NOOP = "print('{}')\n"


def job_bytes(r: redis.Redis, job_id: str) -> int:
    """MEMORY USAGE (exact) of every key a job left: its tasks' and its own."""
    names = [k for k in r.scan_iter(match=f"*{job_id}*", count=10_000)]
    with r.pipeline(transaction=False) as p:
        for k in names:
            p.memory_usage(k, samples=0)
        return sum(int(x or 0) for x in p.execute())


@pytest.mark.core
def test_a_finished_task_costs_its_hash_and_a_few_stream_entries_and_rq_keeps_no_record(
    env, broker: Broker, r: redis.Redis, mesh_worker
):
    """A done no-op task (one line of output) costs under 600 bytes at steady state, measured as what a job of
    400 more tasks adds (the job's fixed keys cancel out); RQ's job hash and result stream and the per-task log
    stream, 11 KB a task before, are not there."""
    mesh_worker.start(name="lean")
    with gpumesh.connect() as mesh:
        small = mesh.submit(NOOP, [{"i": i} for i in range(100)])
        big = mesh.submit(NOOP, [{"i": i} for i in range(500)])
        assert small.wait(timeout=120).status == "done" and big.wait(timeout=240).status == "done"
    wait_until(lambda: not r.keys("rq:job:*"), what="the last delivery's RQ record to go")
    assert not r.keys("rq:results:*") and not r.keys("gpumesh:task:*:log")
    per_task = (job_bytes(r, big.id) - job_bytes(r, small.id)) / 400
    assert per_task < 600, f"{per_task:.0f} bytes a finished task"
    done = r.hgetall(keys.task(keys.task_id(big.id, 7)))
    assert done["status"] == "done" and done["result"] == "{}"
    assert not {"lease", "error", "promoted"} & set(done), "a done task keeps no running task's fields"
    assert [(row.index, row.result) for row in big.results()[:2]] == [(0, {}), (1, {})]  # what readers show


ATTEMPTS = """import json, os, sys
p = json.load(sys.stdin)
attempt = int(os.environ["GPUMESH_ATTEMPT"])
print(f"task {p['i']} try {attempt}", flush=True)
print(f"task {p['i']} warns", file=sys.stderr, flush=True)
if attempt == 1 and p["i"] == 1:
    sys.exit(3)
print(json.dumps(p))
"""


@pytest.mark.core
def test_a_job_s_log_is_whole_in_payload_order_and_a_task_s_follows_it_across_attempts(
    env, mesh_worker, tmp_path: Path
):
    script = tmp_path / "tries.py"
    script.write_text(ATTEMPTS)
    mesh_worker.start(name="logs")
    payloads = json.dumps([{"i": i} for i in range(4)])
    job = cli("submit", str(script), "--payloads", "-", "--retry-on", "all", input=payloads).stdout.strip()
    wait_until(lambda: json.loads(cli("status", job, "--json").stdout)["status"] == "done", timeout=60)

    one = cli("logs", keys.task_id(job, 1))
    assert one.returncode == 0
    out, err = one.stdout.splitlines(), one.stderr.splitlines()
    assert out == ["task 1 try 1", "task 1 try 2", '{"i": 1}'], out  # both attempts, in order
    assert err[0].startswith("--- attempt 1 on ") and err[1] == "task 1 warns", err
    assert any(line.startswith("--- attempt 1 failed: exit code 3") for line in err), err
    assert [line for line in err if line.startswith("--- attempt 2 on ")], err

    whole = cli("logs", job).stdout.splitlines()  # every task's, grouped by task in payload order
    tasks = [line.split("] ", 1)[0].lstrip("[") for line in whole]
    assert tasks == sorted(tasks, key=lambda t: int(t.rsplit("-", 1)[1])), whole
    assert [line.split("] ", 1)[1] for line in whole if line.startswith(f"[{keys.task_id(job, 1)}]")] == [
        "task 1 try 1", "task 1 try 2", '{"i": 1}',
    ]  # fmt: skip
    with gpumesh.connect() as mesh:
        lines = list(mesh.job(job).logs())
    assert sum(1 for _t, stream, _line in lines if stream == "stderr") == 5  # one warning a run, five runs
    assert [t for t, _s, _l in lines] == sorted((t for t, _s, _l in lines), key=lambda t: int(t.rsplit("-", 1)[1]))


class Sent:
    """Commands this process sends to Redis (each counted once, pipelined or not)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        self.names: dict[str, int] = {}
        pack = redis.connection.AbstractConnection.pack_command

        def counting(conn, *args):  # type: ignore[no-untyped-def]
            self.n += 1
            name = str(args[0]).upper()
            self.names[name] = self.names.get(name, 0) + 1
            return pack(conn, *args)

        monkeypatch.setattr(redis.connection.AbstractConnection, "pack_command", counting)


@pytest.mark.core
def test_results_of_a_big_job_stream_a_page_per_call(env, broker: Broker, monkeypatch: pytest.MonkeyPatch):
    """`results --format jsonl` of 20,000 tasks: every row, in payload order, in a few dozen commands (a page of
    tasks per call), not one or more per task."""
    n = 20_000
    job = broker.submit(NOOP, "noop.py", [{"i": i} for i in range(n)], JobOptions()).job_id
    sent = Sent(monkeypatch)
    out = cli("results", job, "--format", "jsonl")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [row["index"] for row in rows] == list(range(n)) and {row["status"] for row in rows} == {"queued"}
    assert sent.n < n / 100, f"{sent.n} commands for {n} tasks: {sent.names}"
    as_json = json.loads(cli("results", job, "--format", "json").stdout)  # streamed too, one JSON list
    assert [row["index"] for row in as_json] == list(range(n))


@pytest.mark.core
def test_a_big_job_is_deleted_in_steps_that_resume_and_leave_nothing(env, broker: Broker, r: redis.Redis):
    """Pruning deletes a job a step of retention.STEP tasks at a time: it leaves the jobs index at once, a pass
    whose budget runs out leaves it in gpumesh:pruning, the next pass goes on, and at the end no key of it is
    left."""
    n = 3 * retention.STEP + 10
    job = broker.submit(NOOP, "noop.py", [{"i": i} for i in range(n)], JobOptions()).job_id
    lease = scripts.dispatch(broker.scripts, broker.r, "w", 30_000, 1.0)
    assert isinstance(lease, scripts.Lease)
    with r.pipeline() as p:  # a line of its log, as a worker writes it
        from gpumesh.store import tasklog

        tasklog.append(p, [(lease.task_id, "stdout", "hello")])
        p.execute()
    assert broker.cancel(job).status == "cancelled"
    broker.settings = broker.settings.model_copy(update={"job_retention": 0.001})
    # Past its retention by the broker's clock, which the reaper reads: the cancel may have ended it in the same ms.
    ended_ms = float(r.hget(keys.job(job), "finished_at")) * 1000
    wait_until(lambda: broker.server_ms() > ended_ms + 5, what="a few ms to pass on the broker's clock")
    first = reap_once(broker, prune_budget=0)  # one step, then the budget is spent
    assert first["jobs_pruned"] == 0
    assert job not in r.zrange(keys.JOBS, 0, -1) and r.zrange(keys.PRUNING, 0, -1) == [job]
    assert r.llen(keys.job_tasks(job)) == n - retention.STEP and not r.exists(keys.task(keys.task_id(job, n - 1)))
    assert cli("jobs", "--json").stdout.strip() == "[]", "a job being deleted is listed no more"
    passes = 1
    while r.exists(keys.job(job)):
        reap_once(broker, prune_budget=0)
        passes += 1
        assert passes < 10
    assert passes == 4  # three steps of STEP tasks, then the last 10 and the job's own keys
    assert not list(r.scan_iter(match=f"*{job}*")) and not r.exists(keys.PRUNING)
