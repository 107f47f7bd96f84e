"""The CLI contract: exit codes, one-line errors that leave Redis untouched, JSON shapes, human output."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from gpumesh._version import PROTOCOL, __version__
from gpumesh.cli import main
from gpumesh.store import keys

from ..conftest import ROOT, MeshWorkers, RedisServer, cli, free_port, gpumesh

EXAMPLE = str(ROOT / "examples/grid_search.py")
PAYLOADS = str(ROOT / "examples/payloads.json")


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        (["--payloads", "-"], "{oops", "payloads on stdin is not valid JSON"),
        (["--payloads", "-"], '{"lr": 1}', "must be a JSON list of objects"),
        (["--payloads", "-"], "[]", "empty list"),
        (["--payloads", "-"], "[1]", "payloads on stdin[0] must be a JSON object"),
        (["--payloads", "-"], '[{"cost": -1}]', "cost must be a positive number"),
        (["--payloads", "/nonexistent.json"], None, "payloads file /nonexistent.json does not exist"),
        (["--payloads", "-", "--max-attempts", "0"], "[{}]", "--max-attempts"),
        (["--payloads", "-", "--timeout", "-5"], "[{}]", "--timeout"),
    ],
)
@pytest.mark.processes
def test_bad_submit_input_exits_2_with_one_line_and_writes_nothing(env, r: redis.Redis, args, stdin, message):
    p = gpumesh("submit", EXAMPLE, *args, env=env, input=stdin)
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("error: ") and message in p.stderr
    assert "Traceback" not in p.stderr
    assert r.dbsize() == 0


@pytest.mark.processes
def test_missing_or_broken_script_exits_2(env, r: redis.Redis, tmp_path: Path):
    p = gpumesh("submit", str(tmp_path / "nope.py"), "--payloads", PAYLOADS, env=env)
    assert p.returncode == 2 and "script" in p.stderr and "does not exist" in p.stderr
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    p = gpumesh("submit", str(broken), "--payloads", PAYLOADS, env=env)
    assert p.returncode == 2 and "syntax error at line 1" in p.stderr
    assert r.dbsize() == 0


@pytest.mark.processes
def test_unreachable_broker_exits_3_within_seconds(env):
    t0 = time.monotonic()
    p = gpumesh("status", "abc", "--url", f"redis://127.0.0.1:{free_port()}/0", env=env)
    assert p.returncode == 3
    assert "cannot reach the broker" in p.stderr and p.stderr.count("\n") == 1
    assert time.monotonic() - t0 < 10


@pytest.mark.security
def test_wrong_password_exits_3_and_never_prints_the_password(env, tmp_path: Path):
    server = RedisServer(tmp_path, password="right-horse").start()
    try:
        p = gpumesh(
            "submit",
            EXAMPLE,
            "--payloads",
            PAYLOADS,
            "--url",
            server.url.replace("right-horse", "wrong-battery"),
            env=env,
        )
        assert p.returncode == 3, p.stderr
        assert "refused the credentials" in p.stderr and "wrong-battery" not in p.stderr
        assert server.client().dbsize() == 0
        p = gpumesh("jobs", "--url", server.url.replace(":right-horse@", "@"), env=env)
        assert p.returncode == 3
    finally:
        server.stop()


@pytest.mark.processes
def test_bad_url_is_a_usage_error(env):
    p = gpumesh("jobs", "--url", "http://example.invalid", env=env)
    assert p.returncode == 2 and "must start with redis://" in p.stderr


@pytest.mark.parametrize("command", [["status", "nope"], ["results", "nope"], ["cancel", "nope"], ["logs", "nope"]])
@pytest.mark.processes
def test_unknown_job_exits_4(env, r: redis.Redis, command):
    p = gpumesh(*command, env=env)
    assert p.returncode == 4, p.stderr
    assert "no job" in p.stderr or "no task" in p.stderr


@pytest.mark.processes
def test_debug_shows_the_traceback(env):
    p = gpumesh("--debug", "status", "nope", env=env)
    assert p.returncode != 0 and "Traceback" in p.stderr


@pytest.mark.processes
def test_submit_json_shape_and_tier_counts(env, r: redis.Redis):
    p = gpumesh("submit", EXAMPLE, "--payloads", PAYLOADS, "--name", "sweep", "--json", env=env)
    assert p.returncode == 0
    out = json.loads(p.stdout)
    assert set(out) == {"job_id", "tasks", "tiers", "priority", "waiting_for", "existing"} and out["tasks"] == 6
    assert out["existing"] is False
    assert sum(out["tiers"].values()) == 6 and out["priority"] == 0
    assert out["waiting_for"] == [{"requires": [], "tasks": 6, "signer": None}], "no worker is live to run any of them"
    assert "no worker is live" in gpumesh("status", out["job_id"], env=env).stdout
    assert r.zcard(keys.pending(out["job_id"], 0)) == 6
    st = json.loads(gpumesh("status", out["job_id"], "--json", env=env).stdout)
    assert st["name"] == "sweep" and st["status"] == "queued" and st["tasks"]["queued"] == 6


@pytest.mark.processes
def test_submit_of_10000_shards_writes_everything(env, r: redis.Redis, tmp_path: Path):
    payloads = tmp_path / "many.json"
    payloads.write_text(json.dumps([{"i": i, "cost": 1 + i % 7} for i in range(10_000)]))
    p = gpumesh("submit", EXAMPLE, "--payloads", str(payloads), "--json", env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    job = json.loads(p.stdout)["job_id"]
    assert r.llen(keys.job_tasks(job)) == 10_000
    assert r.zcard(keys.pending(job, 0)) == 10_000
    assert r.hget(keys.task(keys.task_id(job, 9_999)), "payload") == '{"i": 9999, "cost": 4}'


@pytest.mark.core
def test_workers_json_shape(env, mesh_worker: MeshWorkers):
    mesh_worker.start(name="gpu-box", score=12.5)
    rows = json.loads(cli("workers", "--json").stdout)
    assert len(rows) == 1
    row = rows[0]
    assert set(row) == {"id", "name", "hostname", "device", "device_name", "score_gflops", "tier", "state",
                        "current_task", "last_heartbeat", "resources", "version", "protocol"}  # fmt: skip
    assert (row["version"], row["protocol"]) == (__version__, PROTOCOL)
    assert row["resources"]["device"] == "cpu" and row["resources"]["cpu_cores"] >= 1
    assert row["name"] == "gpu-box" and row["score_gflops"] == 12.5 and row["device"] in ("cpu", "cuda", "mps")
    assert row["state"] == "idle" and row["tier"] == 2


@pytest.mark.core
def test_results_formats_and_logs(env, mesh_worker: MeshWorkers):
    mesh_worker.start()
    p = cli("submit", EXAMPLE, "--payloads", PAYLOADS, "--wait")
    assert p.returncode == 0, p.stderr
    job = p.stdout.split()[0]
    lines = cli("results", job, "--format", "jsonl").stdout.splitlines()
    assert [json.loads(line)["index"] for line in lines] == list(range(6))
    csv_out = cli("results", job, "--format", "csv").stdout.splitlines()
    header = "index,task_id,status,result,error,error_kind,attempts,worker,duration_s,artifacts,skipped_artifacts,verified,signed_by"
    assert csv_out[0] == header and len(csv_out) == 7
    logs = cli("logs", keys.task_id(job, 0))
    assert "lr=0.5 epochs=80 on " in logs.stderr
    assert '"loss"' in logs.stdout


@pytest.mark.core
def test_human_output_renders(env, broker):
    runner = CliRunner()
    res = runner.invoke(main, ["submit", EXAMPLE, "--payloads", PAYLOADS, "--name", "demo"])
    assert res.exit_code == 0, res.output
    job = res.stdout.strip()
    res = runner.invoke(main, ["status", job])
    assert res.exit_code == 0 and f"{job} queued: 0/6 done" in res.stdout and "[demo]" in res.stdout
    res = runner.invoke(main, ["jobs"])
    assert job in res.stdout and "demo" in res.stdout
    res = runner.invoke(main, ["cancel", job])
    assert "cancelled" in res.stdout
