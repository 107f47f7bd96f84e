"""End to end with real `gpumesh worker` processes, a real Redis and real signals.

Every test runs against both executors: fresh (a new interpreter per task) and warm (--warm)."""

from __future__ import annotations

import http.server
import json
import os
import signal
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.webhook import Webhook

from gpumesh.store import keys
from gpumesh.store.broker import EXECUTOR

from ..conftest import ROOT, Workers, gpumesh, pid_alive, wait_until, written

pytestmark = pytest.mark.usefixtures("both_modes")


def write_script(tmp: Path, body: str) -> Path:
    path = tmp / "task.py"
    path.write_text(textwrap.dedent(body))
    return path


def job_of(stdout: str) -> str:
    return stdout.strip().splitlines()[-1]


@pytest.mark.processes
def test_grid_search_example_through_submit_wait(env, workers: Workers):
    workers.start()
    p = gpumesh("submit", str(ROOT / "examples/grid_search.py"), "--payloads", str(ROOT / "examples/payloads.json"),
                "--wait", "--json", env=env)  # fmt: skip
    assert p.returncode == 0, p.stderr
    st = json.loads(p.stdout)
    assert st["status"] == "done" and st["tasks"]["done"] == 6 and st["tasks"]["total"] == 6
    assert set(st) == {
        "job_id",
        "name",
        "status",
        "priority",
        "tasks",
        "created_at",
        "finished_at",
        "waiting_for",
        "failed_by_kind",
        "retry_on",
    }
    res = json.loads(gpumesh("results", st["job_id"], "--format", "json", env=env).stdout)
    assert [row["index"] for row in res] == list(range(6))
    assert all(row["status"] == "done" and row["attempts"] == 1 for row in res)
    assert res[0]["result"]["loss"] < 0.05  # lr 0.5, 80 epochs fits y = 3x - 2
    assert set(res[0]) == {"index", "task_id", "status", "result", "error", "error_kind", "attempts", "worker", "duration_s",
                           "artifacts", "skipped_artifacts", "verified", "signed_by"}  # fmt: skip
    assert res[0]["artifacts"] == [] and res[0]["skipped_artifacts"] == []  # the example writes no files


@pytest.mark.faults
def test_worker_sigkilled_mid_task_is_re_leased_and_finishes_elsewhere(env, workers: Workers, r: redis.Redis, tmp_path):
    script = write_script(tmp_path, f"""
        import json, os, sys, time
        attempt = os.environ["GPUMESH_ATTEMPT"]
        open(os.path.join({str(tmp_path)!r}, "pid-" + attempt), "w").write(str(os.getpid()))
        if attempt == "1":
            time.sleep(120)
        print(json.dumps({{"attempt": attempt, "worker": os.environ["GPUMESH_WORKER_ID"]}}))
        """)  # fmt: skip
    a = workers.start()
    b = workers.start()
    job = job_of(gpumesh("submit", str(script), "--payloads", "-", env=env, input='[{"n": 1}]').stdout)
    tid = keys.task_id(job, 0)
    wait_until(lambda: written(tmp_path / "pid-1"), what="attempt 1 to start")
    holder = r.hget(keys.task(tid), "worker")
    victim = a if int(r.hget(keys.worker(holder), "pid")) == a.pid else b
    sandbox_pid = int((tmp_path / "pid-1").read_text())
    killed_at = time.monotonic()
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    wait_until(lambda: not pid_alive(sandbox_pid), timeout=8, what="the dead worker's sandbox to die")
    wait_until(lambda: r.hget(keys.task(tid), "status") == "done", timeout=30, what="the task to finish elsewhere")
    elapsed = time.monotonic() - killed_at
    task = r.hgetall(keys.task(tid))
    assert task["attempts"] == "2"
    assert json.loads(task["result"])["attempt"] == "2"
    assert task["worker"] != holder
    done_events = [f for _, f in r.xrange(keys.EVENTS) if f["id"] == tid and f["status"] == "done"]
    assert len(done_events) == 1, "exactly one result accepted"
    assert elapsed < 15


@pytest.mark.processes
def test_always_failing_script_runs_once_by_default_and_max_attempts_with_retry_on_script(
    env, workers: Workers, r: redis.Redis, tmp_path
):
    runs = tmp_path / "runs"
    script = write_script(tmp_path, f"""
        import os, sys
        with open({str(runs)!r}, "a") as f:
            f.write(os.environ["GPUMESH_ATTEMPT"] + "\\n")
        print("something broke on attempt " + os.environ["GPUMESH_ATTEMPT"], file=sys.stderr)
        sys.exit(3)
        """)  # fmt: skip
    workers.start()
    p = gpumesh("submit", str(script), "--payloads", "-", "--max-attempts", "3", "--wait", env=env, input="[{}]")
    assert p.returncode == 1, p.stderr
    assert runs.read_text().split() == ["1"]  # a script error is not retried by default
    assert "task 0 failed: script_error: exit code 3" in p.stderr
    job = p.stdout.split()[0]
    assert "not retried: the job does not retry script failures" in gpumesh("logs", job, env=env).stderr
    runs.unlink()
    p = gpumesh("submit", str(script), "--payloads", "-", "--max-attempts", "3", "--retry-on", "script", "--wait",
                env=env, input="[{}]")  # fmt: skip
    assert p.returncode == 1, p.stderr
    assert runs.read_text().split() == ["1", "2", "3"]
    job = p.stdout.split()[0]
    (row,) = json.loads(gpumesh("results", job, "--format", "json", env=env).stdout)
    assert row["status"] == "failed" and row["attempts"] == 3 and row["error_kind"] == "script_error"
    assert row["error"].startswith("exit code 3")
    assert "something broke on attempt 3" in row["error"]
    st = json.loads(gpumesh("status", job, "--json", env=env).stdout)
    assert st["status"] == "failed" and st["tasks"]["failed"] == 1
    assert st["failed_by_kind"] == {"script": 1} and st["retry_on"] == ["script"]
    assert "1 failed (script 1)" in gpumesh("status", job, env=env).stdout


@pytest.mark.processes
def test_bad_result_line_fails_the_attempt_with_a_clear_error(env, workers: Workers, tmp_path):
    script = write_script(tmp_path, "print('not json at all')\n")
    workers.start()
    p = gpumesh("submit", str(script), "--payloads", "-", "--max-attempts", "1", "--wait", env=env, input="[{}]")
    assert p.returncode == 1
    (row,) = json.loads(gpumesh("results", p.stdout.split()[0], "--format", "json", env=env).stdout)
    assert row["error"] == "the last stdout line is not JSON: 'not json at all'"


@pytest.mark.processes
def test_cancel_kills_running_within_a_heartbeat_and_queued_never_run(env, workers: Workers, r: redis.Redis, tmp_path):
    script = write_script(tmp_path, f"""
        import json, os, sys, time
        p = json.load(sys.stdin)
        open(os.path.join({str(tmp_path)!r}, "ran-%d" % p["i"]), "w").write(str(os.getpid()))
        time.sleep(p["sleep"])
        print("{{}}")
        """)  # fmt: skip
    # a worker alone takes the lightest task first: the long one
    payloads = [{"i": 0, "sleep": 120, "cost": 1}] + [{"i": i, "sleep": 0, "cost": 100} for i in range(1, 6)]
    workers.start()
    job = job_of(gpumesh("submit", str(script), "--payloads", "-", env=env, input=json.dumps(payloads)).stdout)
    wait_until(lambda: written(tmp_path / "ran-0"), what="the long task to start")
    pid = int((tmp_path / "ran-0").read_text())
    t0 = time.monotonic()
    p = gpumesh("cancel", job, "--json", env=env)
    assert p.returncode == 0 and json.loads(p.stdout)["status"] == "cancelled"
    wait_until(lambda: not pid_alive(pid), timeout=10, what="the running task to be killed")
    assert time.monotonic() - t0 < 0.4 + 2.5  # one heartbeat (0.4 s) plus process start-up slack
    time.sleep(1.5)  # the worker now drains the cancelled deliveries
    assert sorted(f.name for f in tmp_path.glob("ran-*")) == ["ran-0"]
    st = json.loads(gpumesh("status", job, "--json", env=env).stdout)
    assert st["tasks"] == {"total": 6, "queued": 0, "running": 0, "done": 0, "failed": 0, "cancelled": 6}
    assert r.hget(keys.task(keys.task_id(job, 0)), "attempts") == "1"


@pytest.mark.processes
def test_sigterm_finishes_the_current_task_then_exits(env, workers: Workers, r: redis.Redis, tmp_path):
    script = write_script(tmp_path, f"""
        import json, os, sys, time
        p = json.load(sys.stdin)
        open(os.path.join({str(tmp_path)!r}, "ran-%d" % p["i"]), "w").write("")
        time.sleep(1.5)
        print(json.dumps(p))
        """)  # fmt: skip
    w = workers.start()
    job = job_of(
        gpumesh("submit", str(script), "--payloads", "-", env=env, input='[{"i": 0}, {"i": 1, "cost": 2}]').stdout
    )
    wait_until(lambda: (tmp_path / "ran-0").exists(), what="the first task to start")
    # The task's processes, and the spare interpreter (fresh) or the zygote (warm) waiting beside them.
    helpers = psutil.Process(w.pid).children(recursive=True)
    assert len(helpers) >= 2
    w.send_signal(signal.SIGTERM)
    assert w.wait(timeout=20) == 0
    assert r.hget(keys.task(keys.task_id(job, 0)), "status") == "done"
    assert r.hget(keys.task(keys.task_id(job, 1)), "status") == "queued"
    assert not (tmp_path / "ran-1").exists()
    assert r.zcard(keys.WORKERS) == 0, "a stopped worker unregisters"
    for p in helpers:
        wait_until(lambda p=p: not pid_alive(p.pid), timeout=5, what=f"{p.pid} to end with its worker")


@pytest.mark.security
def test_worker_refuses_an_rq_job_that_is_not_gpumesh_s_executor(env, workers: Workers, r: redis.Redis, tmp_path):
    marker = tmp_path / "pwned"
    conn = redis.Redis.from_url(env["GPUMESH_URL"])
    workers.start()
    (wid,) = r.zrange(keys.WORKERS, 0, -1)
    q = Queue(keys.tier_queue(2), connection=conn, serializer=JSONSerializer)
    evil = q.enqueue("os.system", f"touch {marker}")  # into the tier queue it serves, ahead of its next delivery
    script = write_script(tmp_path, "import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n")
    p = gpumesh("submit", str(script), "--payloads", "-", "--wait", env=env, input='[{"i": 0}]')
    assert p.returncode == 0, p.stderr
    assert not marker.exists()
    # it pops only its own delivery, pushed to the front in the same step: what else sits there never runs
    assert Job.fetch(evil.id, connection=conn, serializer=JSONSerializer).get_status() == "queued"
    # and one that reaches it all the same (RQ's pop of a queue a credential filled) is refused by name
    from gpumesh.worker.worker import refusal

    assert "not gpumesh's executor" in (refusal(evil) or "")


@pytest.mark.security
def test_a_refused_rq_job_calls_no_webhook_its_writer_chose(env, workers: Workers, r: redis.Redis, tmp_path):
    """Whoever can write RQ's keys can give a job webhooks: RQ would call them from the worker's machine
    (any URL it reaches) when the job fails. A job the worker refuses is recorded failed, and nothing more."""
    hits: list[str] = []

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            hits.append(self.path)
            self.send_response(204)
            self.end_headers()

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        conn = redis.Redis.from_url(env["GPUMESH_URL"])
        workers.start()
        (wid,) = r.zrange(keys.WORKERS, 0, -1)
        q = Queue(keys.tier_queue(2), connection=conn, serializer=JSONSerializer)
        url = f"http://127.0.0.1:{server.server_port}"
        evil = [
            q.enqueue("os.getpid", webhooks=[Webhook(f"{url}/not-ours", "failed")]),
            q.enqueue(EXECUTOR, "some-task", webhooks=[Webhook(f"{url}/ours-with-a-hook", "failed")]),
        ]
        script = write_script(tmp_path, "import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n")
        p = gpumesh("submit", str(script), "--payloads", "-", "--wait", env=env, input='[{"i": 0}]')
        assert p.returncode == 0, p.stderr
        for job in evil:  # never popped: a worker pops only its own delivery
            assert Job.fetch(job.id, connection=conn, serializer=JSONSerializer).get_status() == "queued"
        time.sleep(0.5)  # RQ would send a webhook right after it records a failure
        assert hits == []
        from gpumesh.worker.worker import refusal

        assert "carry no webhooks" in (refusal(evil[1]) or ""), "and refused, should RQ's pop reach one"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.processes
def test_heavy_tasks_land_on_the_strong_worker(env, workers: Workers, r: redis.Redis, tmp_path):
    script = write_script(tmp_path, """
        import json, os, sys, time
        p = json.load(sys.stdin)
        time.sleep(0.2 * p["cost"] / float(os.environ["GPUMESH_WORKER_SCORE"]))
        print(json.dumps(os.environ["GPUMESH_WORKER_ID"]))
        """)  # fmt: skip
    workers.start("--name", "weak", score=1)
    workers.start("--name", "strong", score=9)
    payloads = [{"cost": 9}] * 3 + [{"cost": 1}] * 3
    p = gpumesh("submit", str(script), "--payloads", "-", "--json", env=env, input=json.dumps(payloads))
    sub = json.loads(p.stdout)
    assert sub["tiers"] == {"0": 3, "2": 3}  # the forecast: 27/30 of the cost to the strong worker
    wait_until(lambda: json.loads(gpumesh("status", sub["job_id"], "--json", env=env).stdout)["status"] == "done")
    res = json.loads(gpumesh("results", sub["job_id"], "--format", "json", env=env).stdout)
    heavy = {row["result"].rsplit("-", 1)[0] for row in res[:3]}
    assert heavy == {"strong"}


@pytest.mark.processes
def test_second_sigterm_hands_the_task_back_at_once_without_spending_an_attempt(
    env, workers: Workers, r: redis.Redis, tmp_path
):
    script = write_script(tmp_path, f"""
        import json, os, time
        open(os.path.join({str(tmp_path)!r}, "pid-%s" % os.environ["GPUMESH_ATTEMPT"]), "w").write(str(os.getpid()))
        time.sleep(120)
        print("{{}}")
        """)  # fmt: skip
    w = workers.start()
    job = job_of(gpumesh("submit", str(script), "--payloads", "-", env=env, input="[{}]").stdout)
    tid = keys.task_id(job, 0)
    wait_until(lambda: written(tmp_path / "pid-1"), what="the task to start")
    sandbox = int((tmp_path / "pid-1").read_text())
    w.send_signal(signal.SIGTERM)
    wait_until(lambda: "SIGTERM: stopping after the current task" in workers.log(0), what="the first signal's line")
    w.send_signal(signal.SIGTERM)  # within a second of the first: taken for the same stop, and said so
    wait_until(lambda: "taken for the same stop" in workers.log(0), what="the second signal's line")
    time.sleep(1.2)
    assert w.poll() is None, "the first SIGTERM waits for the task"
    w.send_signal(signal.SIGTERM)
    w.wait(timeout=20)
    log = workers.log(0)
    assert f"SIGTERM again: stopping now; {tid} goes back to the queue" in log, log
    assert "Traceback" not in log and "exception raised" not in log, "a stop is not the task's failure"
    wait_until(lambda: not pid_alive(sandbox), timeout=10, what="the task to be killed")
    task = r.hgetall(keys.task(tid))
    assert task["status"] == "queued" and task["attempts"] == "0", task
    assert r.zcard(keys.pending(job, 0)) == 1, "the task waits for another worker"
