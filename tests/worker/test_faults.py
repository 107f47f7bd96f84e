"""Reliability under faults, each with real processes, a real Redis and real signals.

Every scenario checks that nothing is lost and nothing is accepted twice; the figures they measure
(seconds from a fault to the task running elsewhere) are printed with `pytest -s`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from gpumesh.store import keys

from ..conftest import ROOT, RedisServer, Workers, gpumesh, pid_alive, wait_until, written
from ..faultproxy import FaultProxy

pytestmark = pytest.mark.faults

SLOW_THEN_FAST = """
import json, os, sys, time
attempt = os.environ["GPUMESH_ATTEMPT"]
open(os.path.join({tmp!r}, "cwd-" + attempt), "w").write(os.getcwd())
open(os.path.join({tmp!r}, "part-" + attempt), "w").write(str(os.getpid()))
os.replace(os.path.join({tmp!r}, "part-" + attempt), os.path.join({tmp!r}, "pid-" + attempt))  # whole or absent
if attempt == "1":
    time.sleep({first})
print(json.dumps({{"attempt": int(attempt), "worker": os.environ["GPUMESH_WORKER_ID"]}}))
"""


def script(tmp: Path, first: float = 120) -> Path:
    path = tmp / "task.py"
    path.write_text(textwrap.dedent(SLOW_THEN_FAST.format(tmp=str(tmp), first=first)))
    return path


def submit_one(env: dict[str, str], path: Path, *args: str) -> tuple[str, str]:
    p = gpumesh("submit", str(path), "--payloads", "-", *args, env=env, input='[{"n": 1}]')
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip()
    return job, keys.task_id(job, 0)


def done_events(r: redis.Redis, tid: str) -> int:
    return sum(1 for _, f in r.xrange(keys.EVENTS) if f["id"] == tid and f["status"] == "done")


def running_attempt(r: redis.Redis, tid: str, attempt: int) -> bool:
    t = r.hgetall(keys.task(tid))
    return t.get("status") in ("running", "done") and int(t.get("attempts", 0)) >= attempt


@pytest.mark.usefixtures("both_modes")
def test_worker_sigkilled_task_re_leased_within_ttl_plus_a_reaper_pass(env, workers: Workers, r: redis.Redis, tmp_path):
    a = workers.start()
    job, tid = submit_one(env, script(tmp_path))
    wait_until(lambda: written(tmp_path / "pid-1"), what="attempt 1")
    b = workers.start()
    sandbox = int((tmp_path / "pid-1").read_text())
    t0 = time.monotonic()
    os.killpg(a.pid, signal.SIGKILL)
    a.wait()
    wait_until(lambda: written(tmp_path / "pid-2"), timeout=30, what="attempt 2 elsewhere")
    relet = time.monotonic() - t0
    wait_until(lambda: r.hget(keys.task(tid), "status") == "done", what="the task to finish")
    print(f"\nSIGKILL of the worker -> task running elsewhere: {relet:.2f} s (lease TTL 2 s, heartbeat 0.4 s)")
    assert not pid_alive(sandbox)
    task_dir = Path((tmp_path / "cwd-1").read_text())
    wait_until(lambda: not task_dir.exists(), timeout=5, what="the killed worker's task directory to be removed")
    assert r.hget(keys.task(tid), "attempts") == "2" and done_events(r, tid) == 1
    assert relet <= 2 + 2 * 0.4 + 1.5  # TTL + a reaper pass (one heartbeat) + start-up slack on a busy 2-core box
    assert b.poll() is None


@pytest.mark.usefixtures("both_modes")
def test_sandbox_killed_alone_fails_the_attempt_at_once_and_retries(env, workers: Workers, r: redis.Redis, tmp_path):
    slow = {"GPUMESH_LEASE_TTL": "20", "GPUMESH_HEARTBEAT_INTERVAL": "1"}
    workers.start(**slow)
    job, tid = submit_one({**env, **slow}, script(tmp_path), "--retry-on", "script")  # a SIGKILL is the script's
    wait_until(lambda: written(tmp_path / "pid-1"), what="attempt 1")
    t0 = time.monotonic()
    os.kill(int((tmp_path / "pid-1").read_text()), signal.SIGKILL)
    wait_until(lambda: r.hget(keys.task(tid), "status") == "done", timeout=15, what="the retry to finish")
    elapsed = time.monotonic() - t0
    print(f"\nsandbox SIGKILL -> retried and done: {elapsed:.2f} s (lease TTL 20 s)")
    assert elapsed < 10, "retried at once, not after the 20 s lease"
    assert r.hget(keys.task(tid), "attempts") == "2"
    assert "--- attempt 1 failed: killed by SIGKILL ---" in gpumesh("logs", tid, env=env).stderr


@pytest.mark.usefixtures("both_modes")
def test_sandbox_over_its_memory_cap_fails_the_attempt_with_the_reason(env, workers: Workers, r: redis.Redis, tmp_path):
    path = tmp_path / "hog.py"
    path.write_text(
        "import os, time\nif os.environ['GPUMESH_ATTEMPT'] == '1':\n    b = bytearray(400 << 20)\n    time.sleep(60)\nprint('{}')\n"
    )
    workers.start(GPUMESH_TASK_MEMORY_MB="150")
    job, tid = submit_one(env, path)
    wait_until(lambda: r.hget(keys.task(tid), "status") == "done", timeout=30, what="the retry to finish")
    assert r.hget(keys.task(tid), "attempts") == "2"
    assert "--- attempt 1 failed: killed: over its memory cap ---" in gpumesh("logs", tid, env=env).stderr


@pytest.fixture
def proxy(redis_server):
    p = FaultProxy(redis_server.port)
    yield p
    p.close()


@pytest.mark.usefixtures("both_modes")
def test_a_delivery_whose_reply_was_lost_runs_once_and_leaves_no_stray_in_rq(env, workers: Workers, r, tmp_path, proxy):
    """The link fails after Redis ran the transaction that delivers a task to its worker and pops it: redis-py
    sends the transaction again. The task runs once, and RQ's lists hold nothing of it afterwards (a stray id
    in the worker's intermediate list is what RQ's maintenance later marks failed: 'stuck in intermediate
    queue', a finished delivery shown failed in rq-dashboard)."""
    w = workers.start(GPUMESH_URL=f"redis://127.0.0.1:{proxy.port}/0")
    wait_until(lambda: r.zcard(keys.WORKERS) == 1, what="the worker to register")
    proxy.lose_reply_after(b"LMOVE")  # the delivery's transaction: its pop rides in it
    job, tid = submit_one(env, script(tmp_path, first=0))
    wait_until(lambda: r.hget(keys.task(tid), "status") == "done", timeout=30, what="the task to finish")
    assert proxy.lost == 1, "the reply was not lost: the scenario did not happen"
    assert r.hget(keys.task(tid), "attempts") == "1" and done_events(r, tid) == 1
    (worker_id,) = r.zrange(keys.WORKERS, 0, -1)
    queue = f"rq:queue:{keys.tier_queue(2)}"
    assert r.lrange(queue, 0, -1) == [] and r.lrange(f"{queue}:intermediate", 0, -1) == []
    assert r.zcard(f"rq:failed:{keys.tier_queue(2)}") == 0
    assert w.poll() is None


def _two_tasks_through(proxy: FaultProxy, env, workers: Workers, r, tmp_path: Path):
    """A worker reaching Redis through ``proxy``, running the first of two 0.5 s tasks (each leaves a mark as it
    starts): the second is leased with the first one's completion and starts ahead of its delivery."""
    path = tmp_path / "task.py"
    path.write_text(
        "import json, os, sys, time\n"
        "p = json.load(sys.stdin)\n"
        f"open(os.path.join({str(tmp_path)!r}, 'ran-%d-%d' % (p['n'], os.getpid())), 'w').close()\n"
        "time.sleep(0.5)\n"
        "print(json.dumps(p))\n"
    )
    w = workers.start(GPUMESH_URL=f"redis://127.0.0.1:{proxy.port}/0")
    wait_until(lambda: r.zcard(keys.WORKERS) == 1, what="the worker to register")
    p = gpumesh("submit", str(path), "--payloads", "-", env=env, input='[{"n": 0}, {"n": 1}]')
    assert p.returncode == 0, p.stderr
    wait_until(lambda: list(tmp_path.glob("ran-*")), what="the first task to start")
    return w, p.stdout.strip()


def _each_ran_once(r, tmp_path: Path, tids: list[str]) -> None:
    assert [r.hget(keys.task(t), "attempts") for t in tids] == ["1", "1"]
    assert sorted(f.name.split("-")[1] for f in tmp_path.glob("ran-*")) == ["0", "1"], "each ran once"
    assert sum(done_events(r, t) for t in tids) == 2


@pytest.mark.usefixtures("both_modes")
def test_a_next_task_s_delivery_whose_reply_was_lost_runs_once_started_ahead(env, workers: Workers, r, tmp_path, proxy):
    """As above for a task leased with the last one's completion, whose attempt starts before its delivery is
    written: the delivery sent again finds that attempt running, which runs once, to its end."""
    w, job = _two_tasks_through(proxy, env, workers, r, tmp_path)
    proxy.lose_reply_after(b"LMOVE")  # the next delivery: the one of the task leased with this one's completion
    tids = [keys.task_id(job, i) for i in range(2)]
    wait_until(lambda: all(r.hget(keys.task(t), "status") == "done" for t in tids), timeout=30,
               what="both tasks to finish")  # fmt: skip
    assert proxy.lost == 1, "the reply was not lost: the scenario did not happen"
    _each_ran_once(r, tmp_path, tids)
    (worker_id,) = r.zrange(keys.WORKERS, 0, -1)
    queue = f"rq:queue:{keys.tier_queue(2)}"
    assert r.lrange(queue, 0, -1) == [] and r.lrange(f"{queue}:intermediate", 0, -1) == []
    assert r.zcard(f"rq:failed:{keys.tier_queue(2)}") == 0
    assert w.poll() is None


@pytest.mark.usefixtures("both_modes")
def test_a_next_task_whose_delivery_an_outage_cuts_off_runs_on_and_runs_once(env, workers: Workers, r, tmp_path, proxy):
    """The broker becomes unreachable after the completion that leased the next task and before that task's
    delivery through RQ got through: the task, started already, is the worker's still (its lease was
    acknowledged). It runs on without RQ's record of it and is reported once the broker is back, once;
    never killed and run again elsewhere after its lease lapses."""
    w, job = _two_tasks_through(proxy, env, workers, r, tmp_path)
    proxy.lose_reply_after(b"LMOVE", then_refuse_for=2.0)  # the next delivery fails, and its retries with it
    tids = [keys.task_id(job, i) for i in range(2)]
    wait_until(lambda: all(r.hget(keys.task(t), "status") == "done" for t in tids), timeout=30,
               what="both tasks to finish")  # fmt: skip
    assert proxy.lost == 1, "the reply was not lost: the scenario did not happen"
    assert "runs on without RQ's record of it" in workers.log(0), workers.log(0)
    _each_ran_once(r, tmp_path, tids)
    assert w.poll() is None


def test_a_dispatch_whose_reply_was_lost_leases_one_task_not_two(env, workers: Workers, r, tmp_path, proxy):
    """The link fails after dispatch leased a task to the worker: redis-py sends the call again. The answer is
    the task leased the first time (same token), not a second one, so no task sits leased to a worker that
    never heard of it until its lease lapses and the reaper requeues it."""
    w = workers.start(GPUMESH_URL=f"redis://127.0.0.1:{proxy.port}/0", GPUMESH_LEASE_TTL="30")
    wait_until(lambda: r.zcard(keys.WORKERS) == 1, what="the worker to register")
    # past its first dispatch, which found nothing: it waits on its wake list
    wait_until(lambda: r.scard(keys.IDLE) == 1, what="the worker's first dispatch to find nothing")
    proxy.lose_reply_after(b"dispatch")
    p = gpumesh("submit", str(script(tmp_path, first=0)), "--payloads", "-", env=env, input='[{"n": 1}, {"n": 2}]')
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip()
    tids = [keys.task_id(job, i) for i in range(2)]
    wait_until(lambda: all(r.hget(keys.task(t), "status") == "done" for t in tids), timeout=20,
               what="both tasks to finish, neither waiting out a lease")  # fmt: skip
    assert proxy.lost == 1, "the reply was not lost: the scenario did not happen"
    assert [r.hget(keys.task(t), "attempts") for t in tids] == ["1", "1"]
    assert w.poll() is None


def test_a_backup_whose_reply_was_lost_runs_on_the_worker_that_started_it(env, workers: Workers, r, tmp_path, proxy):
    """The link fails after speculate started a backup copy: redis-py sends the call again. The answer is the
    backup that call started, so the strong worker runs it. Before, the resend answered 'has a backup', and a
    copy that never ran held the task's backup slot for a whole lease (30 s here)."""
    from ..store.test_speculation import SLEEPER

    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text(SLEEPER.format(tmp=str(tmp_path)))
    workers.start(score=1)
    p = gpumesh("submit", str(sleeper), "--payloads", "-", "--speculate", env=env, input='[{"work": 60}]')
    assert p.returncode == 0, p.stderr
    tid = keys.task_id(p.stdout.strip(), 0)
    wait_until(lambda: any(tmp_path.glob("pid-*")), what="the weak worker to start the script")
    proxy.lose_reply_after(b"_speculate")  # the function's name in the FCALL, not a job field's
    workers.start(score=10, GPUMESH_URL=f"redis://127.0.0.1:{proxy.port}/0", GPUMESH_LEASE_TTL="30")
    # 60 work units: 6 s on the strong worker, 60 s on the weak one
    wait_until(lambda: r.hget(keys.task(tid), "status") == "done", timeout=25, what="the backup copy to win")
    assert proxy.lost == 1, "the reply was not lost: the scenario did not happen"
    task = r.hgetall(keys.task(tid))
    strong = [w for w, score in r.zrange(keys.SCORES, 0, -1, withscores=True) if score == 10]
    assert json.loads(task["result"])["worker"] == strong[0], "the strong worker's backup produced the result"
    assert r.hget(keys.STATS, "speculated") == "1", "one backup started, not two"


def _partition_scenario(env, workers: Workers, tmp_path: Path, proxy: FaultProxy, cut: float, first: float):
    """Worker A reaches Redis through the proxy and holds the task; worker B is direct. Cut A off for `cut` s."""
    ttl = {"GPUMESH_LEASE_TTL": "3", "GPUMESH_HEARTBEAT_INTERVAL": "0.5"}
    a = workers.start(GPUMESH_URL=f"redis://127.0.0.1:{proxy.port}/0", **ttl)
    job, tid = submit_one(env, script(tmp_path, first=first))
    wait_until(lambda: written(tmp_path / "pid-1"), what="attempt 1 on the proxied worker")
    workers.start(**ttl)
    sandbox = int((tmp_path / "pid-1").read_text())
    proxy.partition()
    t0 = time.monotonic()
    time.sleep(cut)
    proxy.heal()
    return a, tid, sandbox, t0


def test_partition_longer_than_the_lease_moves_the_task_and_rejects_the_late_worker(env, workers, r, tmp_path, proxy):
    a, tid, sandbox, t0 = _partition_scenario(env, workers, tmp_path, proxy, cut=6, first=9)
    # while cut off, the old worker killed its own attempt once its lease could have lapsed
    assert not pid_alive(sandbox)
    wait_until(lambda: r.hget(keys.task(tid), "status") == "done", timeout=20, what="the task to finish elsewhere")
    task = r.hgetall(keys.task(tid))
    assert task["attempts"] == "2" and json.loads(task["result"])["attempt"] == 2
    assert done_events(r, tid) == 1
    time.sleep(2)  # the healed worker reports nothing for the lost attempt
    assert done_events(r, tid) == 1 and r.hget(keys.task(tid), "attempts") == "2"
    assert "is not reported" in workers.log(0)
    assert a.poll() is None, "the partitioned worker survives and keeps working"


def test_partition_shorter_than_the_lease_changes_nothing(env, workers, r, tmp_path, proxy):
    a, tid, sandbox, t0 = _partition_scenario(env, workers, tmp_path, proxy, cut=1.0, first=3)
    wait_until(lambda: r.hget(keys.task(tid), "status") == "done", timeout=20, what="the task to finish")
    task = r.hgetall(keys.task(tid))
    assert task["attempts"] == "1" and json.loads(task["result"])["attempt"] == 1
    assert not (tmp_path / "pid-2").exists()


@pytest.mark.usefixtures("both_modes")
def test_worker_paused_past_the_lease_then_resumed_loses_the_task_cleanly(env, workers: Workers, r, tmp_path):
    a = workers.start()
    job, tid = submit_one(env, script(tmp_path, first=6))
    wait_until(lambda: written(tmp_path / "pid-1"), what="attempt 1")
    workers.start()
    sandbox = int((tmp_path / "pid-1").read_text())
    frozen = [psutil.Process(a.pid), *psutil.Process(a.pid).children(recursive=True)]
    for p in frozen:  # a laptop lid closing: the worker and its task stop together
        p.suspend()
    wait_until(lambda: written(tmp_path / "pid-2"), timeout=20, what="attempt 2 elsewhere")
    time.sleep(0.5)
    for p in frozen:
        p.resume()
    wait_until(lambda: r.hget(keys.task(tid), "status") == "done", timeout=20, what="the task to finish")
    wait_until(lambda: not pid_alive(sandbox), timeout=10, what="the resumed worker to kill its stale attempt")
    time.sleep(1.5)
    task = r.hgetall(keys.task(tid))
    assert task["attempts"] == "2" and json.loads(task["result"])["attempt"] == 2 and done_events(r, tid) == 1
    assert a.poll() is None


AOF_ENV = ("GPUMESH_URL", "GPUMESH_LEASE_TTL", "GPUMESH_HEARTBEAT_INTERVAL")


def aof_broker(env: dict[str, str], tmp_path: Path) -> tuple[RedisServer, dict[str, str], Path]:
    """A broker with an append-only file (restartable without losing its data), the environment that
    points at it with short leases, and a task script that takes 0.3 s and echoes its payload."""
    (tmp_path / "aof").mkdir()
    server = RedisServer(tmp_path / "aof").start(appendonly=True)
    e = {**env, "GPUMESH_URL": server.url, "GPUMESH_LEASE_TTL": "4", "GPUMESH_HEARTBEAT_INTERVAL": "0.5"}
    path = tmp_path / "t.py"
    path.write_text("import json, sys, time\np = json.load(sys.stdin)\ntime.sleep(0.3)\nprint(json.dumps(p))\n")
    return server, e, path


def test_redis_restart_with_aof_mid_job_loses_nothing(env, workers: Workers, tmp_path: Path):
    server, e, path = aof_broker(env, tmp_path)
    try:
        r2 = server.client()
        for _ in range(2):
            workers.start(client=r2, **{k: v for k, v in e.items() if k in AOF_ENV})
        job = gpumesh(
            "submit", str(path), "--payloads", "-", env=e, input=json.dumps([{"i": i} for i in range(30)])
        ).stdout.strip()
        wait_until(lambda: int(r2.hget(keys.job(job), "done") or 0) >= 5, what="the job to be under way")
        r2.close()
        server.stop()
        time.sleep(1.0)
        server.start(appendonly=True)
        r2 = server.client()
        p = gpumesh("status", job, "--watch", "--json", env=e, timeout=120)
        st = json.loads(p.stdout)
        assert st["status"] == "done" and st["tasks"]["done"] == 30, st
        rows = json.loads(gpumesh("results", job, "--format", "json", env=e).stdout)
        assert [row["result"]["i"] for row in rows] == list(range(30))
        dones = [f["id"] for _, f in r2.xrange(keys.EVENTS) if f["status"] == "done" and f["kind"] == "task"]
        assert len(dones) == len(set(dones)) == 30, "each task's result accepted once"
        logs = workers.log(0) + workers.log(1)
        assert "NOSCRIPT" not in logs and "Traceback" not in logs
        assert all(p.poll() is None for p in workers.procs)
        r2.close()
    finally:
        server.stop()


def test_redis_restarted_empty_makes_workers_stop_without_phantom_results(env, workers: Workers, tmp_path: Path):
    (tmp_path / "r").mkdir()
    server = RedisServer(tmp_path / "r").start()
    try:
        client = server.client()
        w = workers.start(client=client, GPUMESH_URL=server.url)
        e = {**env, "GPUMESH_URL": server.url}
        job, tid = submit_one(e, script(tmp_path, first=60))
        wait_until(lambda: written(tmp_path / "pid-1"), what="attempt 1")
        sandbox = int((tmp_path / "pid-1").read_text())
        server.stop()
        server.start()  # no persistence: the broker comes back empty
        assert w.wait(timeout=30) == 3
        assert "the broker lost its data" in workers.log(0)
        assert not pid_alive(sandbox)
        client = server.client()
        assert not client.keys("gpumesh:task:*") and not client.keys("gpumesh:job:*"), "no phantom results"
        client.close()
    finally:
        server.stop()


def test_broker_out_of_memory_fails_submit_cleanly(env, tmp_path: Path):
    (tmp_path / "r").mkdir()
    server = RedisServer(tmp_path / "r").start()
    try:
        client = server.client()
        client.config_set("maxmemory", 3 * 1024 * 1024)
        e = {**env, "GPUMESH_URL": server.url}
        before = client.dbsize()
        payloads = json.dumps([{"blob": "x" * 2000, "i": i} for i in range(4000)])
        p = gpumesh(
            "submit",
            str(Path(__file__).parent.parent.parent / "examples/grid_search.py"),
            "--payloads",
            "-",
            env=e,
            input=payloads,
        )
        assert p.returncode == 3, p.stderr
        assert "out of memory" in p.stderr and "nothing was written" in p.stderr and p.stderr.count("\n") == 1
        assert client.dbsize() == before and not client.keys("gpumesh:job:*")
        client.close()
    finally:
        server.stop()


def test_worker_warns_when_the_broker_may_evict_queue_data(env, workers: Workers, r: redis.Redis):
    r.config_set("maxmemory-policy", "allkeys-lru")
    try:
        workers.start()
        wait_until(lambda: "maxmemory-policy is allkeys-lru" in workers.log(0), what="the warning")
    finally:
        r.config_set("maxmemory-policy", "noeviction")


def test_submit_retried_with_the_same_idempotency_key_creates_one_job(env, r: redis.Redis, tmp_path: Path):
    path = script(tmp_path)
    args = ["submit", str(path), "--payloads", "-", "--idempotency-key", "ci-run-42", "--json"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "gpumesh", *args], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(5)
    ]
    outs = [json.loads(p.communicate('[{"n": 1}, {"n": 2}]', timeout=60)[0]) for p in procs]
    assert len({o["job_id"] for o in outs}) == 1 and all(o["tasks"] == 2 for o in outs)
    assert r.zcard(keys.JOBS) == 1 and r.llen(keys.job_tasks(outs[0]["job_id"])) == 2
    assert r.zcard(keys.pending(outs[0]["job_id"], 0)) == 2 and not r.keys("rq:job:*"), "no duplicate tasks"
    p = gpumesh(*args, env=env, input='[{"n": 3}]')
    assert p.returncode == 2 and "was already used for job" in p.stderr


@pytest.mark.faults
def test_a_broker_that_accepts_but_never_answers_fails_a_command_within_seconds(env, tmp_path: Path):
    # A stopped Redis (SIGSTOP: connections are accepted, nothing is answered) used to hold every
    # command for about 93 s: each handshake command and each retry waited its own socket timeout.
    server = RedisServer(tmp_path).start()
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        for command in (
            ["jobs"],
            ["status", "abc"],
            ["submit", str(ROOT / "examples/grid_search.py"), "--payloads", "-"],
        ):
            t0 = time.monotonic()
            p = gpumesh(*command, "--url", server.url, env=env, input="[{}]")
            took = time.monotonic() - t0
            assert p.returncode == 3, p.stderr
            assert p.stderr.count("\n") == 1 and "cannot reach the broker" in p.stderr
            assert took < 20, f"{command[0]} took {took:.1f} s"
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()


@pytest.mark.faults
def test_a_worker_starting_removes_what_dead_workers_on_this_machine_left_behind(env, workers, r: redis.Redis):
    # A worker killed just before an attempt starts or just after it ends leaves the attempt's directory:
    # no launcher is left to remove it. The directory carries the worker's pid (and pid namespace); the
    # next worker on the machine removes it.
    make = (
        "import os, tempfile; ns = os.stat('/proc/self/ns/pid').st_ino; "
        "print(tempfile.mkdtemp(prefix='gpumesh-task-%d.%d-' % (ns, os.getpid())))"
    )
    dead = Path(subprocess.run([sys.executable, "-c", make], capture_output=True, text=True, check=True).stdout.strip())
    (dead / "output").mkdir()
    (dead / "output" / "checkpoint.bin").write_bytes(b"x" * 1000)
    alive = subprocess.Popen(
        [sys.executable, "-c", make + "; import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True
    )
    assert alive.stdout is not None
    held = Path(alive.stdout.readline().strip())
    try:
        workers.start()
        wait_until(lambda: not dead.exists(), timeout=20, what="the dead worker's directory to be removed")
        assert held.is_dir(), "a live process's directory is left alone"
    finally:
        alive.kill()
        alive.communicate()
        subprocess.run(["rm", "-rf", str(held)], check=False)


@pytest.mark.faults
def test_submit_wait_rides_out_a_broker_restart(env, workers: Workers, tmp_path: Path):
    # The first version's `submit --wait` exited 3 after a 1 s outage while the job went on to finish.
    server, e, path = aof_broker(env, tmp_path)
    try:
        r2 = server.client()
        workers.start(client=r2, **{k: v for k, v in e.items() if k in AOF_ENV})
        payloads = tmp_path / "payloads.json"
        payloads.write_text(json.dumps([{"i": i} for i in range(20)]))
        waiting = subprocess.Popen(
            [sys.executable, "-m", "gpumesh", "submit", str(path), "--payloads", str(payloads), "--wait"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=e, text=True,
        )  # fmt: skip
        under_way = lambda: any(int(r2.hget(keys.job(j), "done") or 0) >= 3 for j in r2.zrange(keys.JOBS, 0, -1))  # noqa: E731
        wait_until(under_way, what="the job to be under way")
        r2.close()
        server.stop()
        time.sleep(2.0)
        server.start(appendonly=True)
        out, err = waiting.communicate(timeout=90)
        assert waiting.returncode == 0, err
        assert out.strip().endswith(" done")
        assert err.count("broker unreachable") == 1 and err.count("broker reachable again") == 1, err
        assert "Traceback" not in err
    finally:
        server.stop()


def test_rq_s_bookkeeping_during_a_broker_outage_does_not_end_the_worker(mesh_worker, r: redis.Redis):
    # RQ's loop quits on any error it meets between deliveries ("found an unhandled exception, quitting");
    # a failover or outage that falls on its heartbeat must not take the worker down with it.
    from gpumesh.server.broker_server import free_port

    worker = mesh_worker.build()
    # nobody listens there; no retries of its own (redis-py 7's default ones alone take over 10 s)
    worker.connection = redis.Redis(port=free_port(), socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    t0 = time.monotonic()
    worker.heartbeat()
    worker.run_maintenance_tasks()
    assert time.monotonic() - t0 < 10


def test_status_watch_logs_follow_and_top_ride_out_a_broker_restart(env, workers: Workers, tmp_path: Path):
    import pty

    server, e, path = aof_broker(env, tmp_path)
    try:
        r2 = server.client()
        workers.start(client=r2, **{k: v for k, v in e.items() if k in AOF_ENV})
        job = gpumesh("submit", str(path), "--payloads", "-", env=e, input=json.dumps([{"i": i} for i in range(20)]))
        job_id = job.stdout.strip()
        gpm = [sys.executable, "-m", "gpumesh"]
        main_fd, term = pty.openpty()  # top's live view runs only on a terminal
        followers = {
            "status --watch": subprocess.Popen([*gpm, "status", job_id, "--watch"], stdout=subprocess.DEVNULL,
                                               stderr=subprocess.PIPE, env=e, text=True),
            "logs -f": subprocess.Popen([*gpm, "logs", job_id, "-f"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        env=e, text=True),
            "top": subprocess.Popen([*gpm, "top", "--interval", "0.3"], stdout=term, stderr=subprocess.PIPE, env=e,
                                    text=True),
        }  # fmt: skip
        os.close(term)
        drain = threading.Thread(target=lambda: _drain(main_fd), daemon=True)
        drain.start()
        wait_until(lambda: int(r2.hget(keys.job(job_id), "done") or 0) >= 3, what="the job to be under way")
        # Each one reached the broker before it goes (on a slow machine the job may be under way sooner)
        wait_until(lambda: all(_connected(p.pid, server.port) for p in followers.values()),
                   what="status, logs and top to reach the broker")  # fmt: skip
        r2.close()
        server.stop()
        time.sleep(2.0)
        server.start(appendonly=True)
        r2 = server.client()
        wait_until(lambda: r2.hget(keys.job(job_id), "status") == "done", timeout=90, what="the job to end")
        time.sleep(1.0)  # top's next refresh sees the broker back
        followers["top"].send_signal(signal.SIGINT)
        for name, proc in followers.items():
            _, said = proc.communicate(timeout=60)
            assert proc.returncode == 0, (name, said)
            assert said.count("broker unreachable") == 1 and said.count("broker reachable again") == 1, (name, said)
            assert "Traceback" not in said, (name, said)
        r2.close()
    finally:
        server.stop()


def _connected(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds an open TCP connection to ``port`` on loopback."""
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED for c in conns)


def _drain(fd: int) -> None:
    """Read what top draws on its terminal until it closes (a full pty would block it)."""
    try:
        while os.read(fd, 65536):
            pass
    except OSError:
        pass
