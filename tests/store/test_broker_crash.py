"""A broker SIGKILLed mid-job, again and again: what a crash can do to a job.

The broker here is configured as `gpumesh serve` and docker-compose.yml configure theirs: an append-only
file with ``appendfsync always``, so Redis fsyncs every write before it replies. Each crash is a SIGKILL
(no shutdown, no flush) and a restart on the same port and directory about a second later, shorter than
the lease TTL. Figures (crashes, runs per task) are printed with ``pytest -s``.
"""

from __future__ import annotations

import collections
import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from gpumesh.server.broker_server import local_admin_url
from gpumesh.store import keys

from ..conftest import RedisServer, Serve, Workers, free_port, gpumesh, wait_until, written

TASKS = 40
# 1 s outages against an 8 s lease: on a loaded machine the restart and reconnect stay well inside it
LEASE_ENV = {"GPUMESH_LEASE_TTL": "8", "GPUMESH_HEARTBEAT_INTERVAL": "0.5"}
# Each run appends "index attempt" to runs.txt (one short O_APPEND write: lines never interleave).
TASK = """import json, os, sys, time
p = json.load(sys.stdin)
fd = os.open({runs!r}, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
os.write(fd, ("%d %s\\n" % (p["i"], os.environ["GPUMESH_ATTEMPT"])).encode())
os.close(fd)
time.sleep(0.2)
print(json.dumps({{"i": p["i"]}}))
"""


def sigkill(server: RedisServer) -> None:
    assert server.proc is not None
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(timeout=10)


@dataclass
class Crashed:
    """What a job went through: the crashes, and per task its runs and its accepted results."""

    crashes: int
    outage: float  # seconds the broker stayed down each time
    done_at_crash: list[int]
    runs: collections.Counter[int]  # task index -> times its script started
    attempts: collections.Counter[str]  # GPUMESH_ATTEMPT -> runs that saw it
    accepted: collections.Counter[str]  # task id -> 'done' task events in gpumesh:events
    results: list[int]  # the `i` of each row `gpumesh results` returns
    status: dict[str, Any]
    worker_logs: str

    def summary(self, fsync: str) -> str:
        histogram = collections.Counter(self.runs[i] for i in range(TASKS))
        return (
            f"\nappendfsync {fsync}: {self.crashes} broker crashes (SIGKILL, {self.outage:.0f} s down each), at "
            f"{self.done_at_crash} of {TASKS} tasks done; runs per task {dict(sorted(histogram.items()))} "
            f"(runs: tasks); GPUMESH_ATTEMPT seen {dict(sorted(self.attempts.items()))}"
        )


def crash_mid_job(env: dict[str, str], workers: Workers, tmp_path: Path, fsync: str, outage: float = 1.0) -> Crashed:
    """A job of TASKS tasks through 2 real workers while the broker is SIGKILLed up to 5 times, each time
    down for ``outage`` seconds."""
    (tmp_path / "aof").mkdir()
    server = RedisServer(tmp_path / "aof").start(appendonly=True, fsync=fsync)
    e = {**env, "GPUMESH_URL": server.url, **LEASE_ENV}
    runs_file = tmp_path / "runs.txt"
    path = tmp_path / "t.py"
    path.write_text(TASK.format(runs=str(runs_file)))
    try:
        r2 = server.client()
        for _ in range(2):
            workers.start(client=r2, GPUMESH_URL=server.url, **LEASE_ENV)
        r2.close()
        # Equal workers never run backup copies; --no-speculate says so outright: every run counted is a
        # run the crashes caused, not a straggler's copy.
        p = gpumesh(
            "submit", str(path), "--payloads", "-", "--no-speculate", env=e,
            input=json.dumps([{"i": i} for i in range(TASKS)]),
        )  # fmt: skip
        assert p.returncode == 0, p.stderr
        job = p.stdout.strip()

        def done() -> int:
            c = server.client()
            try:
                return int(c.hget(keys.job(job), "done") or 0)
            finally:
                c.close()

        wait_until(lambda: done() >= 2, what="the job to be under way")
        crashes, done_at_crash = 0, []
        while crashes < 5:
            n = done()
            if n >= TASKS - 2:
                break  # the job is (nearly) over: a crash now tests nothing mid-job
            done_at_crash.append(n)
            sigkill(server)
            crashes += 1
            time.sleep(outage)
            server.start(appendonly=True, fsync=fsync)
            # Let the workers reconnect and make progress before the next crash.
            wait_until(lambda n=n: done() > n, timeout=30, what="progress after the restart")
            time.sleep(0.3)
        p = gpumesh("status", job, "--watch", "--json", env=e, timeout=120)
        status = json.loads(p.stdout)
        rows = json.loads(gpumesh("results", job, "--format", "json", env=e).stdout)
        r2 = server.client()
        accepted = collections.Counter(
            f["id"] for _, f in r2.xrange(keys.EVENTS) if f.get("kind") == "task" and f.get("status") == "done"
        )
        r2.close()
    finally:
        server.stop()
    lines = [line.split() for line in runs_file.read_text().splitlines()]
    return Crashed(
        crashes, outage, done_at_crash, collections.Counter(int(i) for i, _ in lines), collections.Counter(a for _, a in lines),
        accepted, [row["result"]["i"] for row in rows if row.get("result")], status, workers.log(0) + workers.log(1),
    )  # fmt: skip


def assert_each_task_done_and_accepted_once(got: Crashed, job_tasks: list[str]) -> None:
    assert got.status["status"] == "done" and got.status["tasks"]["done"] == TASKS, got.status
    assert got.results == list(range(TASKS)), "every task's result, in order"
    assert sorted(got.accepted) == sorted(job_tasks), "every task accepted"
    assert set(got.accepted.values()) == {1}, f"a task's result accepted more than once: {got.accepted}"


@pytest.mark.faults
def test_broker_sigkilled_repeatedly_with_fsync_always_runs_and_accepts_each_task_once(
    env, workers: Workers, tmp_path: Path
):
    got = crash_mid_job(env, workers, tmp_path, "always")
    print(got.summary("always"))
    assert got.crashes >= 4, f"the job ended before 4 crashes ({got.crashes}: done {got.done_at_crash})"
    assert_each_task_done_and_accepted_once(got, [keys.task_id(got.status["job_id"], i) for i in range(TASKS)])
    twice = {i: got.runs[i] for i in range(TASKS) if got.runs[i] != 1}
    assert not twice, f"with appendfsync always and outages shorter than the lease, a task ran again: {twice}"
    assert "Traceback" not in got.worker_logs
    assert all(w.poll() is None for w in workers.procs), "the workers rode out every crash"


@pytest.mark.faults
def test_broker_sigkilled_repeatedly_with_fsync_everysec_still_accepts_each_task_once(
    env, workers: Workers, tmp_path: Path
):
    # everysec (a Redis's default, and many managed ones') may lose the last second of acknowledged writes:
    # a completion among them is forgotten, and the task runs again. How many is luck, so it is printed, not
    # asserted; what must hold even then is one accepted result per task, each task done.
    got = crash_mid_job(env, workers, tmp_path, "everysec")
    print(got.summary("everysec"))
    assert got.crashes >= 1
    assert_each_task_done_and_accepted_once(got, [keys.task_id(got.status["job_id"], i) for i in range(TASKS)])


@pytest.mark.processes
def test_serve_fsyncs_every_write_by_default_and_everysec_on_request(env, tmp_path: Path):
    policies = []
    for args in ((), ("--fsync", "everysec")):
        data = tmp_path / f"broker-{len(policies)}"
        serve = Serve(env, data, free_port(), *args)
        try:
            admin = redis.Redis.from_url(local_admin_url(data), decode_responses=True)
            policies.append(admin.config_get("appendfsync")["appendfsync"])
            admin.close()
        finally:
            serve.stop()
    assert policies == ["always", "everysec"]
    p = gpumesh("serve", "--fsync", "sometimes", "--data-dir", str(tmp_path / "x"), env=env)
    assert p.returncode == 2 and "sometimes" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.faults
def test_a_report_that_gives_up_in_an_outage_leaves_no_traceback_in_the_worker_log(
    env, workers: Workers, tmp_path: Path
):
    # The broker goes down as the task ends and stays down past the lease (2 s): the worker retries its report,
    # gives up and says so in its own lines; RQ's "exception raised while executing" and its traceback stay
    # out of the default log level. Back up, the task is requeued and done.
    (tmp_path / "aof").mkdir()
    server = RedisServer(tmp_path / "aof").start(appendonly=True, fsync="always")
    e = {**env, "GPUMESH_URL": server.url}
    started = tmp_path / "started"
    script = tmp_path / "t.py"
    script.write_text(
        "import json, os, sys, time\n"
        f"first = not os.path.exists({str(started)!r})\n"
        f"open({str(started)!r}, 'a').write('x')\n"
        "time.sleep(1.5 if first else 0)\n"
        "print(json.dumps(1))\n"
    )
    try:
        c = server.client()
        workers.start(client=c, GPUMESH_URL=server.url)
        c.close()
        p = gpumesh("submit", str(script), "--payloads", "-", env=e, input="[{}]")
        assert p.returncode == 0, p.stderr
        job = p.stdout.strip()
        wait_until(lambda: written(started), what="the task to start")
        sigkill(server)
        wait_until(lambda: "broker unreachable while reporting" in workers.log(0), timeout=30, what="a report retry")
        time.sleep(4)  # past the lease: the report gives up
        server.start(appendonly=True, fsync="always")
        st = gpumesh("status", job, "--watch", "--json", env=e, timeout=120)
        assert json.loads(st.stdout)["status"] == "done", st.stdout + st.stderr
    finally:
        server.stop()
    log = workers.log(0)
    assert "exception raised while executing" not in log and "Traceback" not in log, log
    assert workers.procs[0].poll() is None, "the worker rode out the outage"
