"""What a person watching the mesh in rq-dashboard sees: only real runs count as finished (a stale or
duplicate delivery is dropped before RQ starts it), each delivery says which task of which job it
carries and how its attempt ended, and a worker whose access is revoked stops with one line."""

from __future__ import annotations

import json
import re
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from rq.job import Job
from rq.queue import Queue
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.worker import Worker

import gpumesh
from gpumesh.server.broker_server import ROLES, prepare
from gpumesh.store import keys, scripts
from gpumesh.store.broker import Broker, delivery_label
from gpumesh.store.reaper import reap_once

from ..conftest import RedisServer, Workers, wait_until

SCRIPT = """import json, os, sys, time
p = json.load(sys.stdin)
time.sleep(p.get("sleep", 0))
while p.get("until") and not os.path.exists(p["until"]):  # runs until the test has seen it run
    time.sleep(0.01)
if p.get("fail"):
    raise ValueError("bad learning rate")
print(json.dumps(p))
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "task.py"
    path.write_text(SCRIPT)
    return path


def rq_job(broker: Broker, task_id: str, attempt: int = 1) -> Job:
    return Job.fetch(keys.rq_job_id(task_id, attempt), connection=broker.rq, serializer=JSONSerializer)


def registries(broker: Broker, worker_id: str) -> dict[str, int]:
    """The counts rq-dashboard shows for a worker's queue."""
    name, rq = keys.tier_queue(2), broker.rq
    return {
        "queued": len(Queue(name, connection=rq, serializer=JSONSerializer)),
        "started": StartedJobRegistry(name, connection=rq, serializer=JSONSerializer).count,
        "finished": FinishedJobRegistry(name, connection=rq, serializer=JSONSerializer).count,
        "failed": FailedJobRegistry(name, connection=rq, serializer=JSONSerializer).count,
    }


@pytest.fixture
def dashboard(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> Any:
    """rq-dashboard itself (as `rq-dashboard -j` runs it), answering in this process: its JSON views."""
    import rq_dashboard.web as web  # in the test extra: never skipped
    from rq_dashboard.cli import make_flask_app

    monkeypatch.setattr(web.config, "serializer", JSONSerializer)  # what its -j flag sets
    app = make_flask_app(None, None, None, "")
    app.config["RQ_DASHBOARD_REDIS_URL"] = [redis_server.url]
    web.setup_rq_connection(app)
    client = app.test_client()

    def get(path: str) -> Any:
        resp = client.get(f"/0/data/{path}")
        assert resp.status_code == 200, resp.data[:500]
        return json.loads(resp.data)

    return get


# -- 1. only real runs count ------------------------------------------------------------------------


@pytest.mark.core
def test_stale_and_duplicate_deliveries_never_run_and_count_nowhere(env, broker, mesh_worker, script, dashboard):
    """A worker pops only the delivery it has just pushed to the front of its tier's queue: stale entries at the
    head (deliveries of a cancelled job's tasks, one twice) are never run, and the tier's window, rebuilt as the
    worker takes work, lists them no more."""
    w = mesh_worker.start(name="dash")
    queue = broker.queue(2)
    with gpumesh.connect() as mesh:
        # A cancelled job whose tasks never ran here: deliveries of them on the tier's queue are stale, and the
        # first is there twice (a duplicate: Broker.deliver lists a delivery once, whatever resends it).
        gone = mesh.submit(script, [{"i": i} for i in range(3)], requires=["nowhere=1"])
        assert gone.cancel().status == "cancelled"
        stale = [
            scripts.Lease(task_id=keys.task_id(gone.id, i), token="stale", attempt=1, job_id=gone.id, index=i,
                          payload="{}", script_sha="", script_name="task.py", timeout=60)
            for i in range(3)
        ]  # fmt: skip
        for lease in [stale[0], *stale]:
            broker.deliver(queue, lease)
        assert registries(broker, w.worker_id)["queued"] == 3
        broker.rq.rpush(queue.key, keys.rq_job_id(stale[0].task_id, 1))
        assert registries(broker, w.worker_id)["queued"] == 4

        job = mesh.submit(script, [{"i": i} for i in range(4)])  # the stale ones sit at the head
        assert job.wait(timeout=60).status == "done"

    # A delivery's record goes as its run ends (gpumesh keeps the outcome): RQ counts the runs on the worker.
    # The last run's records reach Redis a few ms after its end, which a wait on the job's stream can beat.
    empty = {"queued": 0, "started": 0, "finished": 0, "failed": 0}
    wait_until(lambda: registries(broker, w.worker_id) == empty, what="the queue drained and the last run's records")
    for lease in stale:  # never started: RQ shows no run of them
        assert Job.fetch(keys.rq_job_id(lease.task_id, 1), connection=broker.rq).get_status() == "queued"
    for i in range(4):
        assert not Job.exists(keys.rq_job_id(keys.task_id(job.id, i), 1), connection=broker.rq)
    (seen,) = [q for q in dashboard("queues.json")["queues"] if q["name"] == queue.name]
    assert seen["finished_job_registry_count"] == 0 and seen["failed_job_registry_count"] == 0
    assert seen["count"] == 0
    (shown,) = dashboard("workers.json")["workers"]
    assert shown["successful_job_count"] == 4, "the four real runs count, the dropped deliveries do not"


@pytest.mark.security
def test_an_unreadable_rq_job_a_credential_planted_is_dropped_and_rq_s_maintenance_survives_one(
    env, broker, mesh_worker, script
):
    """What a worker credential writes into RQ's keys: a job RQ's parser asserts on, at the head of a worker's
    queue (its pop takes it before the worker's next delivery) and in the queue's intermediate list (where
    RQ's maintenance reads). The worker drops the first, maintenance passes over the second, and it works on."""
    w = mesh_worker.start(name="maint")
    queue, conn = broker.queue(2), broker.rq
    for name in ("planted", "planted-too"):
        conn.hset(f"rq:job:{name}", mapping={"data": "d", "timeout": "zz", "status": "queued"})
    conn.rpush(queue.key, "planted")
    conn.rpush(queue.intermediate_queue_key, "planted-too")
    with gpumesh.connect() as mesh:
        assert mesh.submit(script, [{"i": 0}]).wait(timeout=60).status == "done"
        assert b"planted" not in conn.lrange(queue.intermediate_queue_key, 0, -1), "dropped, and gone from there"
        w.last_cleaned_at = None  # RQ's maintenance runs at the top of the worker's next turn
        assert mesh.submit(script, [{"i": 1}]).wait(timeout=60).status == "done"
        wait_until(lambda: w.last_cleaned_at is not None, what="RQ's maintenance to run")
        assert mesh.submit(script, [{"i": 2}]).wait(timeout=60).status == "done", "the worker works on"
    assert mesh_worker.thread is not None and mesh_worker.thread.is_alive()


# -- 2. a delivery says what it carries and how it ended ---------------------------------------------


@pytest.mark.core
def test_a_delivery_says_its_job_task_cost_and_requirements_while_it_runs_and_goes_when_it_ends(
    env, broker, mesh_worker, script, dashboard, tmp_path: Path
):
    """What rq-dashboard shows of a delivery while it is queued or running; once its run has ended RQ keeps
    nothing of it (gpumesh keeps the outcome), and the worker's RQ record counts the run."""
    w = mesh_worker.start(name="dash", resources={"pool": "a", "zone": "x"})
    release = tmp_path / "seen-running"
    payloads = [{"i": 0, "cost": 2.5, "requires": ["zone=x"], "until": str(release)}, {"i": 1, "fail": True}]
    with gpumesh.connect() as mesh:
        job = mesh.submit(
            script, payloads, name="sweep", requires=["pool=a"], max_attempts=2, timeout=600, retry_on="all"
        )
        ok = keys.task_id(job.id, 0)
        wait_until(lambda: Job.exists(keys.rq_job_id(ok, 1), connection=broker.rq)
                   and rq_job(broker, ok).get_status() == "started", what="task 0's delivery to run")  # fmt: skip
        running = rq_job(broker, ok)
        assert (
            running.description == f'task 0 of job "sweep" ({job.id}): attempt 1 of 2, cost 2.5, requires pool=a zone=x'
        )
        assert running.get_meta() == {
            "job": "sweep", "job_id": job.id, "task_id": ok, "task_index": 0, "attempt": 1, "max_attempts": 2,
            "cost": 2.5, "requires": ["pool=a", "zone=x"], "backup": False, "timeout_s": 600.0,
        }  # fmt: skip
        page = dashboard(f"job/{running.id}.json")  # rq-dashboard's job page
        assert page["description"] == running.description and page["status"] == "started"
        assert json.loads(page["metadata"])["requires"] == ["pool=a", "zone=x"]
        listed = dashboard(f"jobs/{keys.tier_queue(2)}/started/50/asc/1.json")["jobs"]
        assert [j["description"] for j in listed] == [running.description]
        release.write_text("")
        assert job.wait(timeout=60).status == "failed"
    # The last run's records reach Redis a few ms after its end, which a wait on the job's stream can beat.
    bad = keys.task_id(job.id, 1)
    deliveries = [keys.rq_job_id(tid, attempt) for tid, attempt in ((ok, 1), (bad, 1), (bad, 2))]
    wait_until(lambda: not any(Job.exists(d, connection=broker.rq) for d in deliveries), what="the runs' records")
    wait_until(lambda: registries(broker, w.worker_id)["started"] == 0, what="the last run's start")
    for delivery in deliveries:
        assert not broker.rq.exists(f"rq:results:{delivery}")
    assert registries(broker, w.worker_id) == {"queued": 0, "started": 0, "finished": 0, "failed": 0}
    (shown,) = dashboard("workers.json")["workers"]
    assert shown["successful_job_count"] == 3, "each attempt ran: RQ counts each"


@pytest.mark.core
def test_rq_shows_the_worker_busy_while_it_runs_and_idle_once_it_waits_with_a_fresh_heartbeat(
    env, broker, r, mesh_worker, script, dashboard
):
    """RQ's record of a worker is written at most once a second from its loop, and its idle state only when it
    waits: what rq-dashboard shows is still the worker's state, and a heartbeat a few seconds old at most."""
    w = mesh_worker.start(name="dash")

    def state() -> str:
        return str(Worker.find_by_key(w.key, connection=broker.rq, serializer=JSONSerializer).get_state())

    wait_until(lambda: state() == "idle", what="a new worker to be shown idle")
    with gpumesh.connect() as mesh:
        quick = mesh.submit(script, [{"i": i} for i in range(30)])  # back to back: no idle write between them
        assert quick.wait(timeout=60).status == "done"
        wait_until(lambda: state() == "idle", timeout=5, what="the worker shown idle once it waits")
        (shown,) = dashboard("workers.json")["workers"]
        assert shown["state"] == "idle" and shown["name"] == w.worker_id and shown["successful_job_count"] == 30
        job = mesh.submit(script, [{"sleep": 60}])
        tid = keys.task_id(job.id, 0)
        wait_until(lambda: r.hget(keys.task(tid), "status") == "running", what="the task to start")
        wait_until(lambda: state() == "busy", timeout=5, what="the worker shown busy")
        job.cancel()
        wait_until(lambda: state() == "idle", timeout=5, what="the worker shown idle again")
    beat = Worker.find_by_key(w.key, connection=broker.rq, serializer=JSONSerializer).last_heartbeat
    assert beat is not None and abs(time.time() - beat.timestamp()) < 5, beat
    assert registries(broker, w.worker_id) == {"queued": 0, "started": 0, "finished": 0, "failed": 0}


@pytest.mark.processes
def test_a_worker_stopped_during_its_last_task_leaves_rq_s_record_of_the_run_whole(env, r, broker, workers, script):
    """RQ's records of a run (its start, its success) are sent while the next attempt runs, or when the worker
    finds nothing to run. A worker told to stop (SIGTERM) during a task finishes it and sends them before RQ
    deletes its own record: rq-dashboard shows the run finished, and nothing left started."""
    proc = workers.start("--name", "last")
    (wid,) = r.zrange(keys.WORKERS, 0, -1)
    with gpumesh.connect() as mesh:
        job = mesh.submit(script, [{"sleep": 1.5}])
        wait_until(lambda: registries(broker, wid)["started"] == 1, what="RQ to show the run started")
        proc.send_signal(signal.SIGTERM)  # a warm shutdown: the task is finished first
        assert proc.wait(timeout=30) == 0, workers.log(0)
        assert job.status().status == "done"
    assert registries(broker, wid) == {"queued": 0, "started": 0, "finished": 0, "failed": 0}
    assert not Job.exists(keys.rq_job_id(keys.task_id(job.id, 0), 1), connection=broker.rq)  # ended: gone
    (record,) = r.keys("rq:worker:*")  # RQ keeps a dead worker's record a minute, marked with its death
    assert r.hget(record, "death") and r.hget(record, "successful_job_count") == "1" and r.ttl(record) > 0


@pytest.mark.core
def test_a_cancelled_attempt_says_so(env, broker, r, mesh_worker, script):
    """The killed attempt's end is gpumesh's to tell (the attempts a job's timeline draws); RQ's record of its
    delivery goes once the run has ended, as any other's."""
    w = mesh_worker.start(name="dash")
    with gpumesh.connect() as mesh:
        job = mesh.submit(script, [{"sleep": 60}])
        tid = keys.task_id(job.id, 0)
        wait_until(lambda: r.hget(keys.task(tid), "status") == "running", what="the task to start")
        # a worker may start the task ahead of its delivery's record (RQ's job), which follows within ms
        wait_until(lambda: Job.exists(keys.rq_job_id(tid, 1), connection=broker.rq), what="the delivery's record")
        assert rq_job(broker, tid).description == f"task 0 of job {job.id}: attempt 1 of 3, cost 1"
        job.cancel()
        wait_until(lambda: not Job.exists(keys.rq_job_id(tid, 1), connection=broker.rq),
                   what="the killed attempt's record to go")  # fmt: skip
    assert [(a.attempt, a.outcome) for a in broker.attempts(job.id)] == [(1, "cancelled")]
    assert registries(broker, w.worker_id) == {"queued": 0, "started": 0, "finished": 0, "failed": 0}


@pytest.mark.core
def test_a_backup_copy_says_so():
    lease = scripts.Lease(task_id="j1-3", token="t", attempt=2, job_id="j1", index=3, payload='{"cost": 4}',
                          script_sha="", script_name="s.py", timeout=60, max_attempts=3, backup=True,
                          backup_mode="straggler")  # fmt: skip
    description, meta = delivery_label(lease, "", ())
    assert description == "task 3 of job j1: attempt 2 of 3, cost 4, backup copy"
    assert meta["backup"] is True and meta["backup_mode"] == "straggler" and meta["cost"] == 4
    json.dumps(meta)  # RQ stores meta with the JSON serializer


# -- 3. a revoked worker ------------------------------------------------------------------------------


@pytest.fixture
def worker_user(r: redis.Redis, redis_server: RedisServer) -> Iterator[tuple[str, str]]:
    """A per-person worker credential on the test Redis, as `gpumesh access add` makes one: (user, URL)."""
    user, password = f"worker-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    r.execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}", *ROLES["worker"])
    prepare(r)  # what serve does at start: gpumesh's functions and the epoch, which a worker may not make
    yield user, f"redis://{user}:{password}@127.0.0.1:{redis_server.port}/0"
    r.execute_command("ACL", "DELUSER", user)


def revoke_mid_task(r: redis.Redis, workers: Workers, script: Path, user: str, url: str, how: str) -> tuple[str, str]:
    """Start a worker with the user's credential, give it a long task, revoke the user while it runs;
    (the worker's id, the task id)."""
    proc = workers.start(url, "--name", "ana", score=2)
    with gpumesh.connect() as mesh:
        job = mesh.submit(script, [{"sleep": 60}])
    tid = keys.task_id(job.id, 0)
    wait_until(lambda: r.hget(keys.task(tid), "status") == "running", what="ana's worker to run the task")
    (wid,) = r.zrange(keys.WORKERS, 0, -1)
    # "running" is set at dispatch; revoke only once RQ has started the delivery too
    started = StartedJobRegistry(keys.tier_queue(2), connection=r, serializer=JSONSerializer)
    wait_until(lambda: started.count == 1, what="RQ to start ana's delivery")
    if how == "deleted":
        r.execute_command("ACL", "DELUSER", user)  # what `gpumesh access revoke` does
    else:  # disabled: its connections must be closed too, or they go on working
        r.execute_command("ACL", "SETUSER", user, "off")
        r.execute_command("CLIENT", "KILL", "USER", user)
    assert proc.wait(timeout=30) == 3
    return wid, tid


@pytest.mark.processes
@pytest.mark.parametrize("how", ["deleted", "disabled"])
def test_a_revoked_worker_exits_3_with_one_line(env, r, workers: Workers, script, worker_user, how):
    user, url = worker_user
    revoke_mid_task(r, workers, script, user, url, how)
    lines = [line for line in workers.log(0).splitlines() if line.strip()]
    assert "Traceback" not in workers.log(0), workers.log(0)
    assert not [line for line in lines if re.search(r"\b(ERROR|CRITICAL)\b", line)], workers.log(0)
    said = [line for line in lines if "access revoked" in line]
    assert said == [lines[-1]], workers.log(0)
    assert lines[-1].startswith("error: access revoked: the broker refused this worker's credentials")
    assert "gpumesh access add" in lines[-1]


@pytest.mark.processes
def test_the_reaper_fails_the_delivery_a_revoked_worker_left_started(env, r, broker, workers, script, worker_user):
    user, url = worker_user
    wid, tid = revoke_mid_task(r, workers, script, user, url, "deleted")
    assert registries(broker, wid)["started"] == 1  # the worker could not record anything once revoked
    time.sleep(broker.settings.worker_ttl + 0.5)  # its registration lapses: the reaper counts it dead
    assert wid in {w.name for w in Worker.all(connection=broker.rq)}, "RQ still lists the dead worker"
    assert reap_once(broker)["workers_dropped"] == 1
    assert registries(broker, wid)["started"] == 0
    assert wid not in {w.name for w in Worker.all(connection=broker.rq)}, "`rq info` no longer shows it"
    assert not r.exists(f"rq:worker:{wid}")
    assert rq_job(broker, tid).get_status() == "failed"


# -- 4. rq-dashboard as gpumesh ships it unpickles nothing ---------------------------------------------


class _Planted:
    """What a credential that may write RQ's keys stores as a job's data: a pickle that runs a command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


@pytest.mark.core
def test_rq_dashboard_as_gpumesh_runs_it_reads_busy_workers_and_unpickles_nothing(
    env, broker, r, mesh_worker, script, worker_user, monkeypatch, tmp_path: Path
):
    """rq-dashboard 0.9.0 reads a busy worker's current job with pickle, whatever -j says: a worker credential
    plants a job whose data is a pickle, and an execution naming it; opening the workers page would run it.
    `python -m gpumesh.server.rq_dashboard` (the compose file's rq-dashboard) reads it as JSON instead."""
    import pickle

    from rq import serializers

    from gpumesh.server import rq_dashboard

    for name in ("dumps", "loads"):  # restored after the test: json_only changes this process for good
        monkeypatch.setattr(serializers.DefaultSerializer, name, serializers.DefaultSerializer.__dict__[name])
    rq_dashboard.json_only()
    import rq_dashboard.web as web
    from rq_dashboard.cli import make_flask_app

    monkeypatch.setattr(web.config, "serializer", JSONSerializer)
    app = make_flask_app(None, None, None, "")
    app.config["RQ_DASHBOARD_REDIS_URL"] = [broker.settings.url]
    web.setup_rq_connection(app)
    client = app.test_client()

    mesh_worker.start(name="dash")
    with gpumesh.connect() as mesh:
        job = mesh.submit(script, [{"sleep": 60}])
        tid = keys.task_id(job.id, 0)
        wait_until(lambda: r.hget(keys.task(tid), "status") == "running", what="the task to start")
        wait_until(lambda: StartedJobRegistry(keys.tier_queue(2), connection=broker.rq).count == 1,
                   what="RQ to start the delivery")  # fmt: skip
        resp = client.get("/0/data/workers.json")
        assert resp.status_code == 200, resp.data[:300]  # with RQ's pickle default: a 500 for every busy worker
        (shown,) = json.loads(resp.data)["workers"]
        assert shown["state"] == "busy" and f"task 0 of job {job.id}" in shown["current_job"]["description"]
        job.cancel()

    user, url = worker_user
    planter = redis.Redis.from_url(url)
    marker = tmp_path / "ran"
    planter.hset("rq:job:planted", mapping={"data": pickle.dumps(_Planted(marker)), "status": "started",
                                            "created_at": "2026-12-01T00:00:00.000000Z", "origin": "q"})  # fmt: skip
    planter.hset("rq:worker:planted", mapping={"state": "busy", "birth": "2026-12-01T00:00:00.000000Z",
                                               "queues": "q", "last_heartbeat": "2026-12-01T00:00:00.000000Z"})  # fmt: skip
    planter.sadd("rq:workers", "rq:worker:planted")
    planter.sadd("rq:worker:planted:executions", "planted:e1")
    planter.hset("rq:execution:planted:e1", mapping={"job_id": "planted", "id": "e1", "created_at": time.time(),
                                                     "last_heartbeat": time.time(), "worker_name": "planted"})  # fmt: skip
    client.get("/0/data/workers.json")  # the planted job cannot be read: an error page, nothing more
    assert not marker.exists(), "rq-dashboard ran what a worker credential planted"


# -- the worker's success record is RQ's, in one round trip -------------------------------------------------

_TIMES = re.compile(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z?")


def _masked(field: bytes, value: bytes) -> bytes:
    """A result entry's value, but for its times and the execution's random id (kept: whether it is one)."""
    if _TIMES.fullmatch(value) or field.endswith(b"_at"):
        return b"<time>"
    if field == b"execution_id":
        return b"<an execution id>" if re.fullmatch(rb"[0-9a-f]{32}", value) else value
    return value


def _server_ms(client: redis.Redis) -> int:
    sec, usec = client.time()
    return sec * 1000 + usec // 1000


def _snapshot(client: redis.Redis, since_ms: int) -> dict[str, Any]:
    """Every key RQ left (name, type, whether it expires and roughly when, counted from ``since_ms``, the server's
    time as the run began, not from this read: on a loaded machine a read may come a minute later) and its
    contents, timestamps and durations masked: what rq-dashboard and `rq info` read."""
    out: dict[str, Any] = {}
    for name in sorted(client.keys("*")):
        kind = client.type(name)
        expires_at = client.pexpiretime(name)
        ttl = -1 if expires_at < 0 else (expires_at - since_ms) / 1000
        if kind == b"hash":
            varying = (b"last_heartbeat", b"birth", b"started_at", b"ended_at", b"ip_address")
            fields = client.hgetall(name)
            body: Any = {
                f: (b"<varies>" if f in varying else b"<time>" if _TIMES.fullmatch(v) else v)
                for f, v in fields.items()
                if f != b"total_working_time"
            }
            if b"total_working_time" in fields:  # a duration: there, and more than nothing
                body[b"total_working_time"] = float(fields[b"total_working_time"]) > 0
        elif kind == b"zset":  # members, and whether each expires (RQ scores an entry by when it does, or +inf)
            body = [
                (m, "forever" if s == float("inf") else "expires")
                for m, s in client.zrange(name, 0, -1, withscores=True)
            ]
        elif kind == b"list":
            body = client.lrange(name, 0, -1)
        elif kind == b"set":
            body = sorted(client.smembers(name))
        elif kind == b"stream":
            body = [sorted((f, _masked(f, v)) for f, v in entry.items()) for _id, entry in client.xrange(name)]
        else:
            body = kind
        out[name.decode()] = (kind, "persists" if ttl == -1 else round(ttl, -2), body)
    return out


@pytest.mark.core
@pytest.mark.parametrize("result_ttl", [None, 0, -1], ids=["default", "zero", "forever"])
def test_a_worker_records_a_finished_run_as_rq_does(redis_server: RedisServer, result_ttl):
    """MeshWorker._record_success is RQ's handle_job_success without the read of the job's dependents: run
    one job through each, in two databases of one server, and the keys they leave are the same."""
    from rq.worker import SimpleWorker

    from gpumesh.worker.worker import MeshWorker

    class RQs(SimpleWorker):
        def _install_signal_handlers(self) -> None:
            pass  # RQ's SIGINT and SIGTERM handlers would outlive the test in pytest's own process

        # Nor RQ's command channel (pub/sub: it writes no key): its thread, stopped with a join of a second,
        # could leave the connection to a minute-long read (under pytest-xdist it did, and every TTL moved).
        def subscribe(self) -> None:
            pass

        def unsubscribe(self) -> None:
            pass

    class Recorded(RQs):
        def handle_job_success(self, job, queue, started_job_registry, execution):  # type: ignore[no-untyped-def]
            with self.connection.pipeline() as p:  # the worker sends it later, as it is: here at once
                MeshWorker._record_success(self, job, execution, p)  # type: ignore[arg-type]
                p.execute()

    dbs = [redis.Redis.from_url(redis_server.url, db=db) for db in (2, 3)]  # RQ's own, ours
    states = []
    try:
        for client, worker_class in zip(dbs, (RQs, Recorded)):
            client.flushdb()
            q = Queue("parity", connection=client, serializer=JSONSerializer)
            q.enqueue_call("builtins.len", args=([1, 2, 3],), job_id="j1", result_ttl=result_ttl)
            w = worker_class([q], connection=client, name="w1", serializer=JSONSerializer)
            began = _server_ms(client)
            assert w.work(burst=True)
            job = Job.fetch("j1", connection=client, serializer=JSONSerializer) if client.exists("rq:job:j1") else None
            states.append((_snapshot(client, began), job.get_status() if job else None, job and job.return_value()))
    finally:
        for client in dbs:
            client.flushdb()
            client.close()
    rq_state, ours = states
    differ = {k: (rq_state[0].get(k), ours[0].get(k)) for k in rq_state[0].keys() | ours[0].keys()
              if rq_state[0].get(k) != ours[0].get(k)}  # fmt: skip
    assert not differ and ours[1:] == rq_state[1:], differ
    if result_ttl == 0:
        assert rq_state[1] is None, "result_ttl=0: the job is gone once it ran"
    else:
        assert rq_state[1] == "finished" and rq_state[2] == 3
