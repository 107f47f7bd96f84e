"""A worker credential cannot stop the mesh, run Lua of its own, or act as another worker's lease holder.

Each test performs the attack with the worker credential that a real `gpumesh serve` prints (the
default set-up: no signing) and checks that it fails and that the mesh still works; the table of what
each credential may do (SECURITY.md, "What each credential can do") is run, row by row, as each role.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from gpumesh._version import PROTOCOL
from gpumesh.settings import Settings
from gpumesh.store import keys, protocols, scripts
from gpumesh.store.broker import Broker

from ..conftest import ROOT, free_port, gpumesh, wait_until
from .test_serve_and_local import Serve

pytestmark = pytest.mark.security

EXAMPLE = str(ROOT / "examples/grid_search.py")
PAYLOADS = str(ROOT / "examples/payloads.json")
TABLE = ROOT / "SECURITY.md"  # its section "What each credential can do"


class Mesh:
    """A `gpumesh serve` broker and its credentials: the admin's (from its data dir) and the printed ones."""

    def __init__(self, env: dict[str, str], data: Path, port: int) -> None:
        self.env, self.data, self.port = env, data, port
        self.serve = Serve(env, data, port)
        text = "\n".join(self.serve.lines)
        self.urls = {
            "worker": self.serve.url,
            "submitter": re.search(r"--url '(redis://submitter:[^']+)' --wait", text).group(1),
            "admin": admin_url(data, port),
        }

    def client(self, role: str) -> redis.Redis:
        return redis.Redis.from_url(self.urls[role], decode_responses=True)

    def submit(self, script: str = EXAMPLE, payloads: str = PAYLOADS) -> str:
        p = gpumesh("submit", script, "--payloads", payloads, "--url", self.urls["submitter"], env=self.env)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip()

    def run_burst(self, url: str | None = None) -> subprocess.CompletedProcess[str]:
        return gpumesh("worker", url or self.urls["worker"], "--burst", "--score", "3", env=self.env, timeout=120)

    def status(self, job: str) -> dict[str, Any]:
        p = gpumesh("status", job, "--url", self.urls["submitter"], "--json", env=self.env)
        assert p.returncode == 0, p.stderr
        return dict(json.loads(p.stdout))


def admin_url(data: Path, port: int) -> str:
    admin = json.loads((data / "credentials.json").read_text())["admin"]
    return f"redis://admin:{admin}@127.0.0.1:{port}/0"


@pytest.fixture
def mesh(env: dict[str, str], tmp_path: Path) -> Iterator[Mesh]:
    m = Mesh(env, tmp_path / "broker", free_port())
    yield m
    m.serve.stop()


def libraries(admin: redis.Redis) -> list[str]:
    entries = [dict(zip(e[::2], e[1::2])) if isinstance(e, list) else e for e in admin.function_list()]
    return [str(e["library_name"]) for e in entries]


def refused(client: redis.Redis, *command: str) -> bool:
    try:
        client.execute_command(*command)
    except redis.exceptions.NoPermissionError:
        return True
    return False


# -- item 5: a worker credential cannot stop the mesh -----------------------------------------------------


def test_a_worker_credential_cannot_stop_the_mesh_or_freeze_redis(mesh: Mesh, env: dict[str, str], tmp_path: Path):
    admin, attacker = mesh.client("admin"), mesh.client("worker")
    epoch = admin.get(keys.EPOCH)
    assert epoch, "serve makes the epoch"
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen([sys.executable, "-m", "gpumesh", "worker", mesh.urls["worker"], "--score", "2"],
                                  env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_until(lambda: admin.zcard(keys.WORKERS) == 1, timeout=30, what="the worker to join")
        # gpumesh registers the worker before RQ's loop registers it in rq:workers
        wait_until(lambda: admin.scard("rq:workers") == 1, timeout=30, what="RQ to register the worker")
        name = next(iter(admin.smembers("rq:workers"))).removeprefix("rq:worker:")
        # the attack: a new epoch stops every worker; RQ's shutdown command stops one
        assert refused(attacker, "SET", keys.EPOCH, "stolen")
        assert refused(attacker, "DEL", keys.EPOCH)
        assert refused(attacker, "PUBLISH", f"rq:pubsub:{name}", json.dumps({"command": "shutdown"}))
        # a Lua loop of its own would freeze Redis until SHUTDOWN NOSAVE: none runs
        started = time.monotonic()
        assert refused(attacker, "EVAL", "while true do end", "0")
        assert refused(attacker, "EVAL_RO", "while true do end", "0")
        assert refused(attacker, "SCRIPT", "LOAD", "while true do end")
        assert refused(attacker, "EVALSHA", "0" * 40, "0")
        evil = "#!lua name=evil\nredis.register_function('f', function() while true do end end)"
        assert refused(attacker, "FUNCTION", "LOAD", evil)
        assert refused(attacker, "FUNCTION", "DELETE", scripts.library()[0])
        assert refused(attacker, "FUNCTION", "FLUSH")
        assert refused(attacker, "SCRIPT", "FLUSH")
        assert admin.ping() and time.monotonic() - started < 5, "Redis answers at once"
        assert admin.get(keys.EPOCH) == epoch
        # the worker is still there and still works
        job = mesh.submit()
        wait_until(lambda: admin.hget(keys.job(job), "status") == "done", timeout=60, what="the job to finish")
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()
    finally:
        stop_worker(worker)


FILES_SCRIPT = """import json, os, sys
p = json.load(sys.stdin)
open(os.path.join(os.environ["GPUMESH_OUTPUT_DIR"], "out.txt"), "w").write("file %d" % p["i"])
print(json.dumps(p))
"""


def test_a_worker_credential_cannot_delete_replace_or_rename_another_job_s_keys(mesh: Mesh, tmp_path: Path):
    admin, attacker = mesh.client("admin"), mesh.client("worker")
    (tmp_path / "files.py").write_text(FILES_SCRIPT)
    (tmp_path / "payloads.json").write_text(json.dumps([{"i": i} for i in range(3)]))
    job = mesh.submit(str(tmp_path / "files.py"), str(tmp_path / "payloads.json"))
    tid = keys.task_id(job, 0)
    sha = admin.hget(keys.job(job), "script_sha")
    source = admin.get(keys.script(sha))
    before = {k: admin.dump(k) for k in (keys.job(job), keys.task(tid), keys.job_tasks(job), keys.JOBS)}
    attacks = [
        ("DEL", keys.job(job)), ("UNLINK", keys.task(tid)), ("DEL", keys.job_tasks(job)), ("DEL", keys.JOBS),
        ("RENAME", keys.task(tid), keys.task(keys.task_id(job, 99))), ("RENAMENX", keys.job(job), keys.job("x")),
        ("EXPIRE", keys.job(job), "1"), ("PEXPIRE", keys.task(tid), "1"), ("SET", keys.task(tid), "x"),
        ("COPY", keys.task(keys.task_id(job, 1)), keys.task(tid), "REPLACE"), ("ZREM", keys.JOBS, job),
        ("SET", keys.script(sha), "print('pwned')"), ("DEL", keys.script(sha)), ("APPEND", keys.script(sha), "#"),
        ("SUNIONSTORE", keys.task(tid), "gpumesh:idle"), ("HSET", keys.RESULT_KEYS, "worker", "ed25519:x"),
        ("FLUSHDB",),
    ]  # fmt: skip
    for attack in attacks:
        assert refused(attacker, *attack), attack
    assert {k: admin.dump(k) for k in before} == before
    assert admin.get(keys.script(sha)) == source
    w = mesh.run_burst()
    assert w.returncode == 0, w.stderr
    assert mesh.status(job)["status"] == "done"
    # the worker kept its output files (the one rename a worker may do: staged files to the task's)
    p = gpumesh("pull", job, "--to", str(tmp_path / "got"), "--url", mesh.urls["submitter"], env=mesh.env)
    assert p.returncode == 0, p.stderr
    assert [(tmp_path / "got" / str(i) / "out.txt").read_text() for i in range(3)] == ["file 0", "file 1", "file 2"]


def test_a_job_s_spent_set_takes_only_sadd_from_a_worker(mesh: Mesh):
    admin, attacker = mesh.client("admin"), mesh.client("worker")
    spent = keys.spent("j0b")
    admin.sadd(spent, "*", "0")
    admin.expire(spent, 3600)
    assert attacker.sadd(spent, "1") == 1 and attacker.sismember(spent, "1")
    assert attacker.smembers(spent) == {"*", "0", "1"} and attacker.smismember(spent, ["0", "2"]) == [1, 0]
    for attack in [("SREM", spent, "0"), ("DEL", spent), ("UNLINK", spent), ("EXPIRE", spent, "1"),
                   ("PERSIST", spent), ("RENAME", spent, keys.spent("other")), ("SPOP", spent),
                   ("SMOVE", spent, keys.spent("other"), "0"), ("SET", spent, "x")]:  # fmt: skip
        assert refused(attacker, *attack), attack
    assert admin.smembers(spent) == {"*", "0", "1"} and 3000 < admin.ttl(spent) <= 3600


# -- item 4 (part): lease tokens are never stored readable -------------------------------------------


def test_a_lease_token_is_never_stored_and_what_is_stored_does_not_act_as_holder(mesh: Mesh):
    admin = mesh.client("admin")
    job = mesh.submit()
    tid = keys.task_id(job, 0)
    holder = Broker(Settings.load(url=mesh.urls["worker"]))
    other = Broker(Settings.load(url=mesh.urls["worker"]))  # anyone else with a worker credential
    try:
        lease = scripts.acquire(holder.scripts, holder.r, tid, "holder", 60_000)
        assert isinstance(lease, scripts.Lease)
        assert re.fullmatch(r"[0-9a-f]{32}", lease.token), "a random token, not worker:attempt:time"
        assert "holder" not in lease.token
        everything = []
        for key in admin.scan_iter(count=1000):
            kind = admin.type(key)
            if kind == "string":
                everything.append(admin.get(key) or "")
            elif kind == "hash":
                everything += [f"{f}={v}" for f, v in admin.hgetall(key).items()]
            elif kind == "stream":
                everything += [json.dumps(fields) for _, fields in admin.xrange(key)]
        assert everything and not any(lease.token in value for value in everything), "the token is nowhere in Redis"
        stored = other.r.hget(keys.task(tid), "lease")
        assert stored == other.r.get(keys.lease(tid)) == scripts.token_digest(lease.token)
        # the attack: read the token from the task and complete (or fail) the task with it
        forged = scripts.Lease(**{**lease.__dict__, "token": stored})
        assert scripts.complete(other.scripts, other.r, forged, "thief", '{"forged": 1}', 0.1) == scripts.Outcome(
            False, "stale"
        )
        assert scripts.fail(other.scripts, other.r, forged, "thief", "x", 0.1).accepted is False
        beat = scripts.heartbeat(other.scripts, other.r, "thief", 5000, forged, 60_000, other.epoch())
        assert beat.lease == "lost"
        assert admin.hget(keys.task(tid), "status") == "running"
        assert scripts.complete(holder.scripts, holder.r, lease, "holder", '{"real": 1}', 0.1).accepted
        assert admin.hget(keys.task(tid), "result") == '{"real": 1}'
        assert admin.hget(keys.task(tid), "done_token") == scripts.done_token(lease.token)
        assert scripts.complete(holder.scripts, holder.r, lease, "holder", '{"real": 1}', 0.1).accepted, (
            "a retried winning completion still wins"
        )
    finally:
        holder.close()
        other.close()


# -- functions: loaded by serve, missing ones said in one line ------------------------------------------


def test_a_broker_without_gpumesh_s_functions_or_epoch_is_said_in_one_line_and_load_functions_fixes_it(
    mesh: Mesh, env: dict[str, str]
):
    admin = mesh.client("admin")
    lib = scripts.library()[0]
    assert lib in libraries(admin), "serve loaded the library"
    job = mesh.submit()
    admin.execute_command("FUNCTION", "FLUSH")
    for p in (mesh.run_burst(), gpumesh("submit", EXAMPLE, "--payloads", PAYLOADS, "--url", mesh.urls["submitter"],
                                        env=env)):  # fmt: skip
        assert p.returncode == 3, p.stderr
        assert "lacks gpumesh's Redis functions" in p.stderr and "gpumesh access load-functions" in p.stderr
        said = [line for line in p.stderr.splitlines() if line.strip() and not re.match(r"\d{4}-\d\d-\d\d ", line)]
        assert "Traceback" not in p.stderr and len(said) == 1, p.stderr  # the worker's start-up log lines aside
    admin.delete(keys.EPOCH)
    w = mesh.run_burst()
    assert w.returncode == 3 and "no epoch key" in w.stderr and "Traceback" not in w.stderr, w.stderr
    p = gpumesh("access", "load-functions", "--data-dir", str(mesh.data), env=env)
    assert p.returncode == 0, p.stderr
    assert admin.get(keys.EPOCH) and lib in libraries(admin)
    w = mesh.run_burst()
    assert w.returncode == 0, w.stderr
    assert mesh.status(job)["status"] == "done"


# -- the table of what each credential can do ---------------------------------------------------------


def table() -> list[tuple[list[str], dict[str, bool]]]:
    """The rows of SECURITY.md's "What each credential can do": (command, {role: allowed})."""
    rows = []
    section = TABLE.read_text().split("\n## What each credential can do\n", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`"):
            continue
        verdicts = dict(zip(("admin", "submitter", "worker"), cells[1:4]))
        assert set(verdicts.values()) <= {"yes", "no"}, line
        rows.append((shlex.split(cells[0].strip("`")), {role: v == "yes" for role, v in verdicts.items()}))
    return rows


def dry_run(admin: redis.Redis, user: str, command: list[str]) -> bool:
    verdict = admin.execute_command("ACL", "DRYRUN", user, *command)
    assert verdict == "OK" or "no permissions" in verdict, verdict
    return bool(verdict == "OK")


def test_each_role_can_do_what_the_credentials_table_says_and_no_more(mesh: Mesh, env: dict[str, str]):
    rows = table()
    assert len(rows) >= 40
    admin = mesh.client("admin")
    p = gpumesh("access", "add", "ana", "--data-dir", str(mesh.data), env=env)
    assert p.returncode == 0, p.stderr
    users = {"admin": "admin", "submitter": "submitter", "worker": "worker"}
    clients = {role: mesh.client(role) for role in ("submitter", "worker")}
    wrong = []
    for command, allowed in rows:
        for role, user in users.items():
            if dry_run(admin, user, command) != allowed[role]:
                wrong.append((role, command, allowed[role]))
            # a refusal is refused for real too (running an allowed one could change the broker)
            if role != "admin" and not allowed[role] and command[0] != "DEBUG":
                if not refused(clients[role], *command):
                    wrong.append((role, command, "ran"))
        if dry_run(admin, "worker-ana", command) != allowed["worker"]:
            wrong.append(("worker-ana", command, allowed["worker"]))
    assert not wrong, wrong


def test_serve_upgrades_the_rules_of_an_older_data_dir_and_keeps_the_passwords(env: dict[str, str], tmp_path: Path):
    data, port = tmp_path / "broker", free_port()
    m = Mesh(env, data, port)
    p = gpumesh("access", "add", "ana", "--data-dir", str(data), env=env)
    assert p.returncode == 0, p.stderr
    ana = re.search(r"gpumesh worker '([^']+)'", p.stdout).group(1)
    assert m.serve.stop()[0] == 0
    # what an older gpumesh wrote: the same users with its broad rules
    acl = data / "users.acl"
    old = "~gpumesh:* ~rq:* resetchannels &rq:* -@all +@read +@write +@keyspace +@scripting +@pubsub +@string +@fast"
    lines = []
    for line in acl.read_text().splitlines():
        parts = line.split()
        if parts[1] in ("worker", "worker-ana"):
            secret = [t for t in parts if t.startswith(("#", ">"))]
            line = " ".join(["user", parts[1], "on", *secret, old])
        lines.append(line)
    acl.write_text("\n".join(lines) + "\n")
    m = Mesh(env, data, port)
    try:
        for url in (m.urls["worker"], ana):
            client = redis.Redis.from_url(url, decode_responses=True)
            assert client.ping(), "the password still works"
            assert refused(client, "SET", keys.EPOCH, "x") and refused(client, "EVAL", "return 1", "0")
        w = m.run_burst(ana)
        assert w.returncode == 0, w.stderr
    finally:
        m.serve.stop()


# -- nothing a credential writes into a job or task stops a worker ---------------------------------------

ECHO_SCRIPT = """import json, sys
print(json.dumps(json.load(sys.stdin)))
"""


def start_worker(env: dict[str, str], url: str, log_path: Path, score: str) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "gpumesh", "worker", url, "--score", score], env=env,
                                stdout=log, stderr=subprocess.STDOUT)  # fmt: skip


def stop_worker(worker: subprocess.Popen[bytes]) -> None:
    worker.send_signal(signal.SIGINT)
    try:
        worker.wait(timeout=30)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


def test_malformed_jobs_and_tasks_written_by_a_worker_credential_stop_no_worker(
    mesh: Mesh, env: dict[str, str], tmp_path: Path
):
    admin, attacker = mesh.client("admin"), mesh.client("worker")
    (tmp_path / "echo.py").write_text(ECHO_SCRIPT)
    (tmp_path / "one.json").write_text(json.dumps([{"i": 0}]))
    (tmp_path / "three.json").write_text(json.dumps([{"i": i} for i in range(3)]))
    # the review's attack: a job whose requirement classes are not JSON, ahead of everything in the ready index
    attacker.hset(keys.job("evil"), "classes", "{")
    attacker.zadd(keys.job("evil") + ":pending:0", {"00000000": 1})
    attacker.zadd(keys.READY, {"evil/0": 1e9})
    # a job whose pending set holds something that is no task index
    attacker.hset(keys.job("evil2"), mapping={"classes": "[[]]", "running": 0})
    attacker.zadd(keys.job("evil2") + ":pending:0", {"abc": 1})
    attacker.zadd(keys.READY, {"evil2/0": 1e9})
    # real jobs whose fields the lease carries as numbers are not numbers
    victims = {}
    for where, field, value in [("job", "timeout", "abc"), ("job", "max_attempts", "2.5"),
                                ("job", "expires_at", "soon"), ("task", "index", "zz")]:  # fmt: skip
        job = mesh.submit(str(tmp_path / "echo.py"), str(tmp_path / "one.json"))
        attacker.hset(keys.job(job) if where == "job" else keys.task(keys.task_id(job, 0)), field, value)
        victims[job] = field
    workers = [start_worker(env, mesh.urls["worker"], tmp_path / f"w{i}.log", str(2 + i)) for i in range(2)]
    try:
        wait_until(lambda: admin.zcard(keys.WORKERS) == 2, timeout=30, what="both workers to join")
        attacker.hset(keys.FLEET, "sum", "abc")  # the fleet's counted strength, not a number
        honest = mesh.submit(str(tmp_path / "echo.py"), str(tmp_path / "three.json"))
        wait_until(lambda: admin.hget(keys.job(honest), "status") == "done", timeout=60, what="the honest job")
        for job, field in victims.items():
            tid = keys.task_id(job, 0)
            wait_until(lambda t=tid: admin.hget(keys.task(t), "status") == "failed", timeout=30, what=f"{tid} to fail")
            error = admin.hget(keys.task(tid), "error") or ""
            assert error.startswith("malformed task:") and f"'{field}'" in error, error
            assert mesh.status(job)["status"] == "failed"
        assert admin.zscore(keys.READY, "evil/0") is None and admin.zscore(keys.READY, "evil2/0") is None
        # still alive, and still working
        again = mesh.submit(str(tmp_path / "echo.py"), str(tmp_path / "one.json"))
        wait_until(lambda: admin.hget(keys.job(again), "status") == "done", timeout=60, what="a later job")
        for i, w in enumerate(workers):
            assert w.poll() is None, (tmp_path / f"w{i}.log").read_text()
    finally:
        for w in workers:
            stop_worker(w)


def test_counters_and_deliveries_a_worker_credential_corrupts_stop_no_worker(
    mesh: Mesh, env: dict[str, str], tmp_path: Path
):
    """The second review's attacks: statistics and job counters that are not numbers (every complete, fail
    and reap raised half-way), an RQ job on a worker's queue that RQ cannot read (RQ's loop quit), and SET
    turning the idle set or a registration into a string."""
    admin, attacker = mesh.client("admin"), mesh.client("worker")
    (tmp_path / "echo.py").write_text(ECHO_SCRIPT)
    (tmp_path / "three.json").write_text(json.dumps([{"i": i} for i in range(3)]))
    for key in (keys.STATS, keys.STATS_DURATION):
        attacker.hset(key, mapping={f: "x" for f in ("done", "failed", "retried", "lease_expired", "count", "sum")})
    assert refused(attacker, "SET", keys.IDLE, "x") and refused(attacker, "SET", keys.worker("w1"), "x")
    worker = start_worker(env, mesh.urls["worker"], tmp_path / "w.log", "2")
    try:
        wait_until(lambda: admin.zcard(keys.WORKERS) == 1, timeout=30, what="the worker to join")
        (worker_id,) = admin.zrange(keys.WORKERS, 0, -1)
        queue = keys.tier_queue(2)
        attacker.hset("rq:job:planted", mapping={"data": "d", "timeout": "zz", "status": "queued"})
        attacker.rpush(f"rq:queue:{queue}", "planted")
        job = mesh.submit(str(tmp_path / "echo.py"), str(tmp_path / "three.json"))
        wait_until(lambda: admin.hget(keys.job(job), "status") == "done", timeout=60, what="the job")
        assert mesh.status(job)["tasks"]["done"] == 3
        assert admin.hget(keys.job(job), "done") == "3", "the job's own counters still count"
        attacker.hset(keys.job(job), "done", "x")  # and a finished job's counter, for the next retry
        again = mesh.submit(str(tmp_path / "echo.py"), str(tmp_path / "three.json"))
        wait_until(lambda: admin.hget(keys.job(again), "status") == "done", timeout=60, what="a later job")
        assert worker.poll() is None, (tmp_path / "w.log").read_text()
    finally:
        stop_worker(worker)


def test_rq_suspension_written_by_a_worker_credential_pauses_no_worker(mesh: Mesh, env: dict[str, str]):
    attacker = mesh.client("worker")
    job = mesh.submit()
    assert attacker.set("rq:suspended", "1"), "RQ's keys are a worker's to write"
    w = mesh.run_burst()  # RQ would end a burst worker at once, its job not run
    assert w.returncode == 0, w.stderr
    assert mesh.status(job)["status"] == "done"
    assert "suspended" not in w.stderr


def test_tier_window_rq_jobs_a_worker_credential_plants_strand_no_task(mesh: Mesh, tmp_path: Path):
    """A string planted where a tier's window writes a waiting task's RQ job: dispatch took the task out of its
    pending set, then failed writing the entry, and the task stayed queued for ever (its job never ended)."""
    admin, attacker = mesh.client("admin"), mesh.client("worker")
    (tmp_path / "echo.py").write_text(ECHO_SCRIPT)
    (tmp_path / "three.json").write_text(json.dumps([{"i": i} for i in range(3)]))
    job = mesh.submit(str(tmp_path / "echo.py"), str(tmp_path / "three.json"))
    for i in range(3):
        assert attacker.set("rq:job:" + keys.rq_waiting_id(keys.task_id(job, i)), "x")
    w = mesh.run_burst()
    assert w.returncode == 0, w.stderr
    assert "WRONGTYPE" not in w.stderr
    assert mesh.status(job)["status"] == "done"
    assert admin.hget(keys.job(job), "done") == "3"


def test_tier_queues_a_worker_credential_turns_into_strings_stop_no_tier(mesh: Mesh, tmp_path: Path):
    """Every worker of a tier delivers through the tier's RQ queue: a string SET there (or on its intermediate
    list, or on a delivery's predictable RQ job id) failed each delivery, and the whole tier ran nothing."""
    admin, attacker = mesh.client("admin"), mesh.client("worker")
    (tmp_path / "echo.py").write_text(ECHO_SCRIPT)
    (tmp_path / "three.json").write_text(json.dumps([{"i": i} for i in range(3)]))
    job = mesh.submit(str(tmp_path / "echo.py"), str(tmp_path / "three.json"))
    for tier in range(3):
        assert attacker.set("rq:queue:" + keys.tier_queue(tier), "x")
        assert attacker.set("rq:queue:" + keys.tier_queue(tier) + ":intermediate", "x")
    assert attacker.set("rq:job:" + keys.rq_job_id(keys.task_id(job, 1), 1), "x")
    w = mesh.run_burst()
    assert w.returncode == 0, w.stderr
    assert mesh.status(job)["status"] == "done"
    assert admin.hget(keys.job(job), "done") == "3"


def test_envs_a_worker_holds_reach_their_holders_set_under_serve_s_rules(mesh: Mesh):
    """Dispatch leaves a job's heaviest task to the strongest worker holding its env: env_held records the
    holders, which a worker credential must be allowed to write (it was refused, silently)."""
    admin, worker = mesh.client("admin"), mesh.client("worker")
    b = Broker(Settings.load(url=mesh.urls["worker"]))
    worker.hset(keys.worker("holder"), mapping={"score": "3"})
    digest = "ab" * 32
    tree = "cd" * 32  # a project tree's holders, too
    assert scripts.env_held(b.scripts, b.r, "holder", [digest], [], 60_000, trees=[tree])
    for short in (digest[:16], tree[:16]):
        assert admin.zscore(keys.env_holders(short), "holder") == 3.0
        assert 0 < admin.pttl(keys.env_holders(short)) <= 86_400_000, "it goes a day after it was last named"


def test_kept_output_files_cannot_be_renamed_away_and_deleted(mesh: Mesh, tmp_path: Path):
    admin, attacker = mesh.client("admin"), mesh.client("worker")
    (tmp_path / "files.py").write_text(FILES_SCRIPT)
    (tmp_path / "payloads.json").write_text(json.dumps([{"i": 0}]))
    job = mesh.submit(str(tmp_path / "files.py"), str(tmp_path / "payloads.json"))
    w = mesh.run_burst()  # keeps its files: the staged -> kept RENAME a worker may do
    assert w.returncode == 0, w.stderr
    kept = keys.task_files(keys.task_id(job, 0))
    assert admin.exists(kept)
    for attack in [
        ("RENAME", kept, kept + ":x"),
        ("RENAMENX", kept, kept + ":x"),
        ("DEL", kept),
        ("COPY", kept, kept + ":y"),
    ]:
        assert refused(attacker, *attack), attack
    assert admin.exists(kept) and not admin.exists(kept + ":x")
    p = gpumesh("pull", job, "--to", str(tmp_path / "got"), "--url", mesh.urls["submitter"], env=mesh.env)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "got" / "0" / "out.txt").read_text() == "file 0"


def test_serve_s_functions_replace_every_other_gpumesh_library(mesh: Mesh, env: dict[str, str]):
    """Every gpumesh library but this protocol's and the previous one's (which serve keeps for workers one
    version behind) goes, when no live worker calls it."""
    admin, attacker = mesh.client("admin"), mesh.client("worker")
    previous = protocols.frozen(PROTOCOL - 1)
    assert previous is not None
    lib = scripts.library()[0]
    old = "#!lua name=gpumesh_0ld\nredis.register_function('gpumesh_0ld_dispatch', function() return 'old' end)"
    admin.function_load(old)
    admin.function_load("#!lua name=theirs\nredis.register_function('theirs_f', function() return 1 end)")
    assert attacker.fcall("gpumesh_0ld_dispatch", 0) == "old", "an old library is anyone's to call"
    p = gpumesh("access", "load-functions", "--data-dir", str(mesh.data), env=env)
    assert p.returncode == 0, p.stderr
    assert sorted(libraries(admin)) == sorted([lib, previous.name, "theirs"]), "only gpumesh's older libraries go"
    with pytest.raises(redis.ResponseError, match="(?i)function not found"):
        attacker.fcall("gpumesh_0ld_dispatch", 0)
    admin.function_load(old)
    assert mesh.serve.stop()[0] == 0
    mesh.serve = Serve(env, mesh.data, mesh.port)  # serve does the same at its start
    assert sorted(libraries(admin)) == sorted([lib, previous.name, "theirs"])
    w = mesh.run_burst()
    assert w.returncode == 0, w.stderr
