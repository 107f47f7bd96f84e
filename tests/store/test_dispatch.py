"""Placement decided when a worker takes work: the placement rule, requirements, priorities and fair
share, against a real Redis and real worker processes (scores and resources emulated with --score and
--resource)."""

from __future__ import annotations

import json
import re
import signal
import time
from datetime import datetime
from pathlib import Path

import pytest
import redis

from gpumesh import requirements
from gpumesh.errors import UsageError
from gpumesh.models import JobOptions
from gpumesh.store import keys, scripts
from gpumesh.store.broker import Broker

from ..conftest import ROOT, Workers, gpumesh, pid_alive, wait_until

SLEEP = """import json, os, sys, time
p = json.load(sys.stdin)
time.sleep(p.get("sleep", 0) * p.get("cost", 1) / float(os.environ["GPUMESH_WORKER_SCORE"]))
print(json.dumps({"worker": os.environ["GPUMESH_WORKER_ID"], "cost": p.get("cost", 1)}))
"""


def sleep_script(tmp_path: Path) -> Path:
    path = tmp_path / "sleep.py"
    path.write_text(SLEEP)
    return path


def submit(env, script: Path, payloads: list[dict], *args: str) -> str:
    p = gpumesh("submit", str(script), "--payloads", "-", *args, env=env, input=json.dumps(payloads))
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def status(env, job: str) -> dict:
    return json.loads(gpumesh("status", job, "--json", env=env).stdout)


def wait_done(env, job: str, timeout: float = 60) -> dict:
    return wait_until(lambda: (st := status(env, job))["status"] in ("done", "failed") and st, timeout=timeout,
                      what=f"job {job} to end")  # fmt: skip


def register(r: redis.Redis, worker: str, score: float, **resources: object) -> None:
    """A worker as the dispatcher sees it (for the script-level tests)."""
    r.hset(keys.worker(worker), mapping={"resources": json.dumps({"device": "cpu", **resources}), "score": score})
    r.zadd(keys.SCORES, {worker: score})
    sec, usec = r.time()
    r.zadd(keys.WORKERS, {worker: sec * 1000 + usec // 1000})  # live: heartbeat now
    r.hset(keys.FLEET, "dirty", 1)


def take(broker: Broker, r: redis.Redis, worker: str, score: float) -> scripts.Lease | scripts.Prepare | str:
    return scripts.dispatch(broker.scripts, r, worker, 60_000, score)


# -- requirements: one rule set, in Python and in Lua ----------------------------------------------

CASES = [
    ("vram_gb>=40", {"vram_gb": 80}, True),
    ("vram_gb>=40", {"vram_gb": "24"}, False),
    ("vram_gb>=40", {}, False),
    ("vram_gb>=40", {"vram_gb": "lots"}, False),
    ("vram_gb<=24", {"vram_gb": 24}, True),
    ("gpu~a100", {"gpu": "NVIDIA A100-SXM4-80GB"}, True),
    ("gpu~A100", {"gpu": "nvidia h100"}, False),
    ("device=cuda", {"device": "CUDA"}, True),
    ("device=cuda", {"device": "cpu"}, False),
    ("device!=cpu", {"device": "cuda"}, True),
    ("device!=cpu", {}, True),
    ("cpu_cores=8", {"cpu_cores": 8.0}, True),
    ("cpu_cores=8", {"cpu_cores": "8"}, True),
    ("dataset=imagenet", {"dataset": "ImageNet"}, True),
    ("ram_gb~62", {"ram_gb": 62.0}, True),  # a probed float prints as Lua prints it
    ("ram_gb=62", {"ram_gb": 62.0}, True),
    ("vram_gb>=40", {"vram_gb": "inf"}, False),  # decimals only, on both sides
    ("vram_gb>=40", {"vram_gb": "0x40"}, False),
    ("vram_gb>=40", {"vram_gb": 40.5}, True),
]


@pytest.mark.core
def test_requirements_mean_the_same_in_python_and_in_the_dispatcher(broker: Broker, r: redis.Redis):
    lib = scripts._source("wake").split("\n-- wake:")[0]
    check = r.register_script(lib + "\nreturn meets_all(cjson.decode(ARGV[1]), cjson.decode(ARGV[2])) and 1 or 0")
    for expr, resources, expected in CASES:
        req = requirements.parse(expr)
        assert requirements.meets(req, resources) is expected, (expr, resources)
        lua = check(args=[json.dumps([[req.key, req.op, req.value]]), json.dumps(resources)])
        assert bool(lua) is expected, (expr, resources, "lua")


@pytest.mark.parametrize(
    "expr", ["vram_gb>>40", "vram_gb>=forty", "=cuda", "gpu~", "no operator", "a b=c", "k=v=w", ""]
)
@pytest.mark.core
def test_a_malformed_requirement_is_refused_with_one_line(expr: str):
    with pytest.raises(UsageError, match="expected KEY=VALUE"):
        requirements.parse(expr)


@pytest.mark.parametrize(
    "expr, meant", [("vram_gb>40", "vram_gb>=40"), ("vram_gb=>40", "vram_gb>=40"), ("ram_gb<8", "ram_gb<=8"),
                    ("ram_gb=<8", "ram_gb<=8")],
)  # fmt: skip
@pytest.mark.core
def test_a_comparison_written_gt_or_lt_is_refused_with_the_one_it_likely_meant(expr: str, meant: str):
    with pytest.raises(UsageError, match=f"did you mean '{re.escape(meant)}'"):
        requirements.parse(expr)
    assert str(requirements.parse(meant)) == meant


@pytest.mark.processes
def test_malformed_requirements_exit_2_and_write_nothing(env, r: redis.Redis):
    script = ROOT / "examples/grid_search.py"
    before = r.dbsize()
    p = gpumesh("submit", str(script), "--payloads", "-", "--require", "vram_gb>>40", env=env, input='[{"lr": 1}]')
    assert p.returncode == 2 and "--require" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    p = gpumesh("submit", str(script), "--payloads", "-", env=env, input='[{"lr": 1, "requires": ["gpu"]}]')
    assert p.returncode == 2 and "payloads on stdin[0].requires" in p.stderr, p.stderr
    p = gpumesh("submit", str(script), "--payloads", "-", env=env, input='[{"lr": 1, "requires": "gpu~a"}]')
    assert p.returncode == 2 and "must be a list" in p.stderr
    p = gpumesh("submit", str(script), "--payloads", "-", "--priority", "x", env=env, input='[{"lr": 1}]')
    assert p.returncode == 2
    assert r.dbsize() == before, "nothing was written"


@pytest.mark.processes
@pytest.mark.parametrize("resource", ["trusts=mine", "vram_gb", "=80", "vram gb=80"])
def test_a_resource_a_worker_may_not_declare_is_refused_with_one_line(env, r: redis.Redis, resource: str):
    """`trusts` is what --trust publishes: declared by hand it made a worker run only signed tasks, unsaid."""
    p = gpumesh("worker", "--resource", resource, "--score", "1", env=env)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert "--resource" in p.stderr and ("--trust KEY" in p.stderr) == resource.startswith("trusts")
    assert r.zcard(keys.WORKERS) == 0, "no worker joined"


@pytest.mark.processes
def test_submit_says_what_it_queued_and_at_which_priority(env):
    script = ROOT / "examples/grid_search.py"
    p = gpumesh("submit", str(script), "--payloads", "-", "--priority", "5", env=env, input='[{"lr": 1}, {"lr": 2}]')
    assert p.returncode == 0, p.stderr
    assert f"submitted job {p.stdout.strip()}: 2 tasks at priority 5" in p.stderr, p.stderr
    assert "tier" not in p.stderr, "no placement is forecast at submit: a worker decides when it asks"
    shown = gpumesh("status", p.stdout.strip(), env=env)
    assert shown.stdout.startswith(f"{p.stdout.strip()} queued (priority 5): 0/2 done"), shown.stdout


# -- the placement rule, one dispatch at a time ------------------------------------------------------


@pytest.mark.core
def test_the_strongest_takes_the_heaviest_and_a_lone_worker_the_lightest(broker: Broker, r: redis.Redis):
    costs = [1, 16, 2, 8, 4, 1, 1, 1]
    job = broker.submit("print(1)", "t.py", [{"cost": c} for c in costs], JobOptions()).job_id
    register(r, "weak", 1.0)
    lone = take(broker, r, "weak", 1.0)
    assert isinstance(lone, scripts.Lease) and costs[lone.index] == 1, "alone: the lightest first"
    for w, s in (("w2", 2.0), ("w4", 4.0), ("w8", 8.0)):
        register(r, w, s)  # the fleet forms: the very next placement sees it
    weak = take(broker, r, "weak", 1.0)
    strong = take(broker, r, "w8", 8.0)
    assert isinstance(strong, scripts.Lease) and costs[strong.index] == 16, "the heaviest to the strongest"
    # within its horizon: cost <= score * max(queued cost / fleet score, heaviest / strongest) = 1 * 33/15
    assert isinstance(weak, scripts.Lease) and costs[weak.index] == 2, "the weakest takes light work"
    mid = take(broker, r, "w4", 4.0)  # now 15 queued: 4 * max(15/15, 8/8) = 4
    assert isinstance(mid, scripts.Lease) and costs[mid.index] == 4
    assert status_counts(broker, job)["running"] == 4


def status_counts(broker: Broker, job: str) -> dict:
    return broker.job_status(job).tasks.model_dump()


@pytest.mark.core
def test_a_completion_leases_the_worker_s_next_task_in_the_same_round_trip_and_a_resend_no_second(
    broker: Broker, r: redis.Redis
):
    """complete(then=...) also dispatches the worker's next task (one round trip where the worker would ask
    right after): placed against the fleet as it is at that moment, like any dispatch. Sent again (redis-py
    resends a call whose reply was lost), it answers with the same next task and leases no other."""
    job = broker.submit("print(1)", "t.py", [{"i": i} for i in range(3)], JobOptions()).job_id
    register(r, "w", 5.0)
    first = take(broker, r, "w", 5.0)
    assert isinstance(first, scripts.Lease)
    then = scripts.Next(60_000, 5.0, scripts.new_token())
    done = scripts.complete(broker.scripts, r, first, "w", '{"ok": 1}', 0.1, 5.0, then=then)
    assert done.accepted and done.status == "done"
    following = done.next
    assert isinstance(following, scripts.Lease) and following.index != first.index
    again = scripts.complete(broker.scripts, r, first, "w", '{"ok": 1}', 0.1, 5.0, then=then)
    assert isinstance(again.next, scripts.Lease) and again.next.task_id == following.task_id
    assert again.next.token == following.token
    counts = status_counts(broker, job)
    assert (counts["done"], counts["running"], counts["queued"]) == (1, 1, 1), counts
    last = scripts.complete(broker.scripts, r, following, "w", "{}", 0.1, 5.0, then=scripts.Next(60_000, 5.0, "t2"))
    assert isinstance(last.next, scripts.Lease)
    none_left = scripts.complete(
        broker.scripts, r, last.next, "w", "{}", 0.1, 5.0, then=scripts.Next(60_000, 5.0, "t3")
    )
    assert none_left.accepted and isinstance(none_left.next, str), "nothing left: the fleet version, as dispatch says"
    assert broker.job_status(job).status == "done"


@pytest.mark.core
def test_equal_workers_never_idle_while_work_waits(broker: Broker, r: redis.Redis):
    broker.submit("print(1)", "t.py", [{"i": i} for i in range(3)], JobOptions())
    for w in ("a", "b", "c"):
        register(r, w, 5.0)
    got = [take(broker, r, w, 5.0) for w in ("a", "b", "c")]
    assert all(isinstance(g, scripts.Lease) for g in got)
    assert sorted(g.index for g in got) == [0, 1, 2]  # type: ignore[union-attr]
    assert isinstance(take(broker, r, "d", 5.0), str), "nothing left for a fourth worker"
    assert r.sismember(keys.IDLE, "d"), "a worker that found nothing waits to be woken"


@pytest.mark.core
def test_a_task_that_failed_on_a_worker_is_left_to_the_others_and_what_remains_stays_takeable(
    broker: Broker, r: redis.Redis
):
    options = JobOptions(max_attempts=3, retry_on="script")
    job = broker.submit("print(1)", "t.py", [{"cost": 5}, {"cost": 1}, {"cost": 1}], options).job_id
    for w in ("a", "b"):
        register(r, w, 5.0)
    first = take(broker, r, "a", 5.0)
    assert isinstance(first, scripts.Lease) and first.index == 0  # the heaviest, to an equal strongest
    scripts.fail(broker.scripts, r, first, "a", "exit code 1", 0.1, avoid_ms=60_000)
    again = take(broker, r, "a", 5.0)  # the heaviest waits for b: a takes a light one
    assert isinstance(again, scripts.Lease) and again.index != 0
    other = take(broker, r, "b", 5.0)
    assert isinstance(other, scripts.Lease) and (other.index, other.attempt) == (0, 2)
    last = take(broker, r, "a", 5.0)  # the pending set kept its last member through both takes
    assert isinstance(last, scripts.Lease) and {first.index, again.index, last.index} == {0, 1, 2}
    assert isinstance(take(broker, r, "a", 5.0), str) and not r.exists(keys.pending(job, 0))
    assert not r.zscore(keys.READY, f"{job}/0"), "a drained job leaves the ready index"


@pytest.mark.core
def test_a_worker_never_gets_what_it_may_not_run_and_priority_comes_first(broker: Broker, r: redis.Redis):
    low = broker.submit("print(1)", "t.py", [{"i": 0}, {"i": 1}], JobOptions()).job_id
    gpu = broker.submit(
        "print(1)", "t.py", [{"i": 0}, {"i": 1, "requires": ["gpu~a100"]}],
        JobOptions(priority=5, requires=("vram_gb>=40",)),
    ).job_id  # fmt: skip
    register(r, "cpu", 100.0)
    register(r, "h100", 10.0, device="cuda", gpu="NVIDIA H100", vram_gb=80)
    first = take(broker, r, "h100", 10.0)
    assert isinstance(first, scripts.Lease) and first.job_id == gpu and first.index == 0, "priority 5 first"
    second = take(broker, r, "h100", 10.0)
    assert isinstance(second, scripts.Lease) and second.job_id == low, "the A100 task is not for an H100"
    cpu = take(broker, r, "cpu", 100.0)
    assert isinstance(cpu, scripts.Lease) and cpu.job_id == low
    assert isinstance(take(broker, r, "h100", 10.0), str), "nothing else it may run"
    waiting = broker.job_status(gpu, waiting=True).waiting_for
    assert [w.model_dump() for w in waiting] == [{"requires": ["gpu~a100", "vram_gb>=40"], "tasks": 1, "signer": None}]


@pytest.mark.core
def test_jobs_of_equal_priority_share_the_workers(broker: Broker, r: redis.Redis):
    big = broker.submit("print(1)", "t.py", [{"i": i} for i in range(50)], JobOptions()).job_id
    for w in ("a", "b", "c", "d"):
        register(r, w, 1.0)
    assert isinstance(take(broker, r, "a", 1.0), scripts.Lease)
    assert isinstance(take(broker, r, "b", 1.0), scripts.Lease)
    small = broker.submit("print(1)", "t.py", [{"i": i} for i in range(4)], JobOptions()).job_id
    c, d = take(broker, r, "c", 1.0), take(broker, r, "d", 1.0)
    assert isinstance(c, scripts.Lease) and isinstance(d, scripts.Lease)
    assert {c.job_id, d.job_id} == {small}, "the job with fewer running tasks goes first"
    assert status_counts(broker, big)["running"] == 2 and status_counts(broker, small)["running"] == 2


@pytest.mark.core
def test_a_lone_worker_takes_a_small_job_s_task_before_the_rest_of_a_big_one(broker: Broker, r: redis.Redis):
    """Alone, the worker's own task has just ended whenever it asks: every job runs nothing then, and the
    oldest won every tie (a one-task job waited for all six of a job ahead of it)."""
    big = broker.submit("print(1)", "t.py", [{"i": i} for i in range(6)], JobOptions()).job_id
    register(r, "solo", 1.0)
    first = take(broker, r, "solo", 1.0)
    assert isinstance(first, scripts.Lease) and first.job_id == big
    small = broker.submit("print(1)", "t.py", [{"i": 0}], JobOptions()).job_id
    second = scripts.complete(broker.scripts, r, first, "solo", "{}", 0.1, 1.0, then=scripts.Next(60_000, 1.0, "t2"))
    assert isinstance(second.next, scripts.Lease) and second.next.job_id == small, "the small job's task next"
    third = scripts.complete(
        broker.scripts, r, second.next, "solo", "{}", 0.1, 1.0, then=scripts.Next(60_000, 1.0, "t3")
    )
    assert isinstance(third.next, scripts.Lease) and third.next.job_id == big, "then the big job again"


# -- real workers ----------------------------------------------------------------------------------


def stop(workers: Workers) -> None:
    for p in workers.procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in workers.procs:
        p.wait(timeout=30)


@pytest.mark.processes
def test_the_heaviest_shard_goes_to_the_strongest_when_workers_start_and_submit_at_once(
    env, workers: Workers, r: redis.Redis
):
    """The first version ran the heaviest grid-search shard on the weak worker in 3 of 3 rounds."""
    example, payloads = ROOT / "examples/grid_search.py", json.loads((ROOT / "examples/payloads.json").read_text())
    for _round in range(3):
        r.flushall()
        workers.start("--name", "weak", score=1)
        workers.start("--name", "strong", score=50)
        job = submit(env, example, payloads)
        assert wait_done(env, job)["status"] == "done"
        tasks = [r.hgetall(keys.task(keys.task_id(job, i))) for i in range(len(payloads))]
        first = {}
        for p, t in sorted(zip(payloads, tasks), key=lambda pt: float(pt[1]["started_at"])):
            first.setdefault(t["worker"].split("-")[0], p["cost"])
        assert first == {"strong": 8, "weak": 1}, first
        stop(workers)


@pytest.mark.processes
def test_a_worker_told_to_stop_during_a_task_finishes_it_and_leaves_the_next_one_queued(
    env, workers: Workers, r: redis.Redis, tmp_path: Path
):
    """A completion may lease the worker's next task in the same round trip; a worker that is stopping must
    not keep one: the next task stays queued (or is handed back), its attempts unspent, for another worker."""
    proc = workers.start(score=1)
    job = submit(env, sleep_script(tmp_path), [{"sleep": 1.5, "i": 0}, {"sleep": 1.5, "i": 1}])
    first = wait_until(lambda: [i for i in (0, 1) if r.hget(keys.task(keys.task_id(job, i)), "status") == "running"],
                       what="a task to start")  # fmt: skip
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)  # a warm shutdown: the running task is finished first
    assert proc.wait(timeout=30) == 0, workers.log(0)
    ran, other = keys.task_id(job, first[0]), keys.task_id(job, 1 - first[0])
    assert r.hget(keys.task(ran), "status") == "done"
    assert r.hmget(keys.task(other), "status", "attempts") in (["queued", "0"], ["queued", None]), workers.log(0)
    assert not r.exists(keys.lease(other))


MARKS = """import json, os, sys, time
p = json.load(sys.stdin)
tag = "%d-%d" % (p["i"], os.getpid())
open(os.path.join({tmp!r}, "start-" + tag), "w").close()
time.sleep(p["sleep"])
open(os.path.join({tmp!r}, "end-" + tag), "w").close()
print(json.dumps({{"i": p["i"]}}))
"""


@pytest.mark.processes
@pytest.mark.usefixtures("both_modes")
def test_a_next_task_started_ahead_of_its_delivery_is_killed_and_handed_back_when_the_delivery_fails(
    env, workers: Workers, r: redis.Redis, tmp_path: Path
):
    """The task leased with a completion starts at once, before RQ's delivery of it is written: a delivery that
    then fails (here: what a credential wrote where RQ keeps its set of queues) kills that attempt with its
    tree and hands the task back, its attempt unspent. Once the queue can be written again, the task runs to
    its end once."""
    path = tmp_path / "marks.py"
    path.write_text(MARKS.format(tmp=str(tmp_path)))
    proc = workers.start()
    job = submit(env, path, [{"i": 0, "sleep": 1.0}, {"i": 1, "sleep": 1.0}])
    started = wait_until(lambda: list(tmp_path.glob("start-*")), what="the first task to start")
    other = 1 - int(started[0].name.split("-")[1])
    (worker_id,) = r.zrange(keys.WORKERS, 0, -1)
    queue = "rq:queues"  # a delivery adds its queue there (the tier's own keys are repaired: test_worker_credential)
    r.set(queue, "not a set")  # every delivery to this worker fails from now on
    ahead = wait_until(
        lambda: list(tmp_path.glob(f"start-{other}-*")), what="the next task to start ahead of its delivery"
    )
    pid = int(ahead[0].name.rsplit("-", 1)[1])
    wait_until(lambda: not pid_alive(pid), timeout=10, what="the attempt whose delivery failed to be killed")
    assert r.type(queue) == "string", "killed while its delivery could not be written"
    assert not (tmp_path / f"end-{other}-{pid}").exists()
    tid = keys.task_id(job, other)
    logs = gpumesh("logs", tid, env=env)
    assert "stopped before its delivery and handed back" in logs.stdout + logs.stderr, logs
    r.delete(queue)
    assert wait_done(env, job)["status"] == "done"
    assert len(list(tmp_path.glob(f"end-{other}-*"))) == 1, "it ran to its end once"
    assert r.hget(keys.task(tid), "attempts") == "1", "the attempt stopped ahead of its delivery was not spent"
    assert proc.poll() is None, workers.log(0)


@pytest.mark.processes
def test_a_worker_that_joins_after_the_submit_takes_work_at_once(env, workers: Workers, r: redis.Redis, tmp_path: Path):
    """The first version left it idle while all four tasks ran on the other worker (12.1 s, not 6.5 s)."""
    workers.start("--warm", score=1)
    job = submit(env, sleep_script(tmp_path), [{"sleep": 2, "i": i} for i in range(4)])
    workers.start("--warm", score=1)
    joined = time.time()  # registered: its first task must start at once, while three wait for the first worker
    st = wait_done(env, job)
    assert st["status"] == "done"
    rows = json.loads(gpumesh("results", job, "--format", "json", env=env).stdout)
    assert len({row["worker"] for row in rows}) == 2, "both workers ran tasks"
    tasks = [r.hgetall(keys.task(keys.task_id(job, i))) for i in range(4)]
    first_worker = min(tasks, key=lambda t: float(t["started_at"]))["worker"]
    late = min(float(t["started_at"]) for t in tasks if t["worker"] != first_worker)
    assert late - joined < 2.0, f"the worker that joined started its first task {late - joined:.1f} s after joining"


@pytest.mark.processes
def test_tasks_no_live_worker_can_run_wait_say_why_and_run_when_one_joins(env, workers: Workers, tmp_path: Path):
    workers.start(score=5)
    p = gpumesh("submit", str(sleep_script(tmp_path)), "--payloads", "-", "--require", "vram_gb>=40",
                env=env, input=json.dumps([{"i": 0}, {"i": 1, "requires": ["gpu~a100"]}, {"i": 2}]))  # fmt: skip
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip()
    assert "3 task(s)" not in p.stderr and "wait for a worker with" in p.stderr, p.stderr
    time.sleep(1.0)  # the cpu worker had its chance
    st = status(env, job)
    assert st["tasks"]["queued"] == 3 and st["status"] == "queued"
    assert sorted(st["waiting_for"], key=lambda w: w["tasks"]) == [
        {"requires": ["gpu~a100", "vram_gb>=40"], "tasks": 1, "signer": None},
        {"requires": ["vram_gb>=40"], "tasks": 2, "signer": None},
    ]
    human = gpumesh("status", job, env=env).stdout
    assert "2 task(s) wait for a worker with vram_gb>=40" in human
    workers.start("--resource", "vram_gb=80", "--resource", "gpu=NVIDIA H100", score=5)
    wait_until(lambda: status(env, job)["tasks"]["done"] == 2, what="the two tasks an H100 with 80 GB may run")
    st = status(env, job)
    assert st["tasks"]["queued"] == 1 and st["waiting_for"] == [
        {"requires": ["gpu~a100", "vram_gb>=40"], "tasks": 1, "signer": None}
    ]
    workers.start("--resource", "vram_gb=80", "--resource", "gpu=A100-SXM4", score=5)
    assert wait_done(env, job)["status"] == "done"
    rows = json.loads(gpumesh("results", job, "--format", "json", env=env).stdout)
    workers_json = {w["id"]: w for w in json.loads(gpumesh("workers", "--json", env=env).stdout)}
    for row in rows:
        assert float(workers_json[row["worker"]]["resources"]["vram_gb"]) >= 40


@pytest.mark.processes
def test_a_small_job_behind_a_big_one_starts_at_once_and_priority_goes_first(
    env, workers: Workers, r: redis.Redis, tmp_path: Path
):
    """The first version made a 4-task job wait 17.1 s for a 300-task job ahead of it."""
    script = sleep_script(tmp_path)
    workers.start("--warm", score=1)
    workers.start("--warm", score=1)
    big = submit(env, script, [{"sleep": 0.1, "i": i} for i in range(300)])
    wait_until(lambda: status(env, big)["tasks"]["done"] >= 4, what="the big job to be under way")
    t0 = time.monotonic()
    small = submit(env, script, [{"sleep": 0.1, "i": i} for i in range(4)])
    assert wait_done(env, small, timeout=30)["status"] == "done"
    latency = time.monotonic() - t0
    assert latency < 3.0, f"the small job took {latency:.1f} s behind the big one"
    urgent = submit(env, script, [{"sleep": 0.1, "i": i} for i in range(20)], "--priority", "5")
    assert wait_done(env, urgent, timeout=30)["status"] == "done"
    st = status(env, urgent)
    assert st["priority"] == 5
    # until its last task started, a worker that asked got priority 5 work, never the big job's
    last_urgent = max(float(r.hget(keys.task(keys.task_id(urgent, i)), "started_at")) for i in range(20))
    # from the moment the job was visible (a big-job task dispatched just before may still be starting)
    start = datetime.fromisoformat(st["created_at"]).timestamp() + 0.05
    started = [float(s) for s in (r.hget(keys.task(keys.task_id(big, i)), "started_at") for i in range(300)) if s]
    assert not [s for s in started if start < s < last_urgent], "no big-job task started while priority 5 waited"
    rows = json.loads(gpumesh("results", urgent, "--format", "json", env=env).stdout)
    assert len({row["worker"] for row in rows}) == 2, "the urgent job ran on the whole fleet"
    assert {j["job_id"]: j["priority"] for j in json.loads(gpumesh("jobs", "--json", env=env).stdout)}[urgent] == 5


@pytest.mark.core
def test_cancel_and_retention_leave_nothing_of_a_job_behind(r: redis.Redis, env):
    from gpumesh.settings import Settings
    from gpumesh.store.reaper import reap_once

    b = Broker(Settings.load(job_retention=1))
    payloads = [{"i": 0}, {"i": 1, "requires": ["gpu~a100"]}, {"i": 2, "cost": 3}]
    job = b.submit("print(1)", "t.py", payloads, JobOptions(requires=("device=cpu",))).job_id
    register(r, "w", 1.0)
    lease = take(b, r, "w", 1.0)
    assert isinstance(lease, scripts.Lease)
    assert b.cancel(job).status == "cancelled"
    assert not r.keys(f"gpumesh:job:{job}:pending:*") and r.zcard(keys.READY) == 0, "nothing left to dispatch"
    assert isinstance(take(b, r, "w", 1.0), str)
    time.sleep(1.2)
    assert reap_once(b)["jobs_pruned"] == 1
    assert not r.keys(f"gpumesh:*{job}*"), r.keys(f"gpumesh:*{job}*")
    b.close()


@pytest.mark.core
def test_a_project_job_s_heaviest_task_waits_for_the_strongest_worker_holding_its_tree(broker: Broker, r: redis.Redis):
    """A job with a project (and no env): its heaviest task is left to the strongest worker whose machine holds the
    tree, not to a stronger one that would fetch it first; while no one holds it, to the strongest worker."""
    costs = [1, 16, 2, 8, 1, 1]
    job = broker.submit("print(1)", "t.py", [{"cost": c} for c in costs], JobOptions()).job_id
    tree = "ab" * 32
    r.hset(keys.job(job), "project", tree)  # what a submit with a project records: its tree's digest
    for w, s in (("holder", 2.0), ("strong", 8.0), ("weak", 1.0)):
        register(r, w, s)
    first = take(broker, r, "holder", 2.0)
    assert isinstance(first, scripts.Lease) and costs[first.index] != 16, "no holder yet: the heaviest waits"
    assert scripts.env_held(broker.scripts, r, "holder", [], [], 60_000, trees=[tree])
    assert 0 < r.pttl(keys.env_holders(tree[:16])) <= 86_400_000, "a tree no one names again goes within a day"
    held = take(broker, r, "holder", 2.0)
    assert isinstance(held, scripts.Lease) and costs[held.index] == 16, "the heaviest to the strongest holder"


@pytest.mark.core
def test_env_jobs_go_to_workers_holding_the_env_and_others_prepare_it_first(broker: Broker, r: redis.Redis):
    """A job in an env: a worker whose machine lacks the env is told to prepare it (it leases nothing), unless a
    job of the same priority runs there now; the job's heaviest task waits for the strongest worker that holds
    the env, not for a stronger one that would build it first; a failed build leaves the job to the others."""
    from gpumesh.envs.lock import Lock

    env = Lock("gmtiny==1.0 --hash=sha256:" + "0" * 64 + "\n")
    costs = [1, 16, 2, 8]
    job = broker.submit("print(1)", "t.py", [{"cost": c} for c in costs], JobOptions(), env=env).job_id
    for w, s in (("holder", 2.0), ("strong", 8.0), ("weak", 1.0)):
        register(r, w, s, envs="yes")
    assert scripts.env_held(broker.scripts, r, "holder", [env.digest], [], 60_000)
    told = take(broker, r, "strong", 8.0)
    assert isinstance(told, scripts.Prepare) and (told.env, told.job_id) == (env.digest, job)
    assert status_counts(broker, job)["running"] == 0, "preparing is not leasing"
    held = take(broker, r, "holder", 2.0)
    assert isinstance(held, scripts.Lease) and costs[held.index] == 16, "the heaviest to the strongest holder"
    plain = broker.submit("print(1)", "t.py", [{"i": 0}], JobOptions()).job_id
    other = take(broker, r, "strong", 8.0)
    assert isinstance(other, scripts.Lease) and other.job_id == plain, "what it can run now goes first"
    assert isinstance(take(broker, r, "strong", 8.0), scripts.Prepare)
    assert not scripts.env_failed(broker.scripts, r, job, "strong", env.digest, "no wheel for gmtiny")
    assert isinstance(take(broker, r, "strong", 8.0), str), "a machine that failed the build leaves it to others"
    assert not scripts.env_failed(broker.scripts, r, job, "weak", env.digest, "no wheel for gmtiny"), "holder left"
