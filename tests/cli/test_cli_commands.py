"""The rest of the CLI: watch, retry, output files, top, bench, config, logs -f, the progress bar."""

from __future__ import annotations

import io
import json
import re
import stat
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis
from rich.console import Console

from gpumesh._version import PROTOCOL, __version__
from gpumesh.cli import render
from gpumesh.errors import UsageError
from gpumesh.models import JobStatus, TaskCounts
from gpumesh.settings import Settings
from gpumesh.store import keys, tasklog

from ..conftest import ROOT, MeshWorkers, cli, gpumesh, wait_until

EXAMPLE = str(ROOT / "examples/grid_search.py")
PAYLOADS = str(ROOT / "examples/payloads.json")


@pytest.mark.core
def test_status_watch_follows_to_the_end_with_plain_lines_off_a_terminal(env, mesh_worker: MeshWorkers):
    job = cli("submit", EXAMPLE, "--payloads", PAYLOADS).stdout.strip()
    mesh_worker.start()
    p = cli("status", job, "--watch")
    assert p.returncode == 0
    assert p.stderr.strip().splitlines()[-1] == f"{job} done: 6/6 done, 0 running, 0 queued, 0 failed"
    p = cli("status", job, "--watch", "--json")
    assert json.loads(p.stdout)["status"] == "done" and p.stderr == ""


@pytest.mark.core
def test_retry_requeues_failed_tasks_with_fresh_attempts(env, mesh_worker: MeshWorkers, r: redis.Redis, tmp_path: Path):
    fixed = tmp_path / "fixed"
    script = tmp_path / "flaky.py"
    script.write_text(
        f"import json, os, sys\np = json.load(sys.stdin)\n"
        f"if p['i'] == 1 and not os.path.exists({str(fixed)!r}):\n    sys.exit('not yet')\n"
        "print(json.dumps(p))\n"
    )
    mesh_worker.start()
    p = cli("submit", str(script), "--payloads", "-", "--max-attempts", "2", "--retry-on", "script", "--wait",
            input='[{"i": 0}, {"i": 1}]')  # fmt: skip
    assert p.returncode == 1
    job = p.stdout.split()[0]
    assert r.hget(keys.task(keys.task_id(job, 1)), "attempts") == "2"
    fixed.touch()
    p = cli("retry", job, "--wait", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["requeued"] == 1 and out["status"] == "done" and out["tasks"]["done"] == 2
    assert r.hget(keys.task(keys.task_id(job, 1)), "attempts") == "1"
    p = cli("retry", job)
    assert p.returncode == 0 and "no failed task to retry" in p.stderr


@pytest.mark.core
def test_results_output_file(env, mesh_worker: MeshWorkers, tmp_path: Path):
    mesh_worker.start()
    job = cli("submit", EXAMPLE, "--payloads", PAYLOADS, "--wait").stdout.split()[0]
    out = tmp_path / "results.jsonl"
    p = cli("results", job, "--format", "jsonl", "--output", str(out))
    assert p.returncode == 0 and p.stdout == ""
    assert len(out.read_text().splitlines()) == 6
    p = cli("results", job, "--output", str(out))
    assert p.returncode == 2 and "--output needs --format" in p.stderr


@pytest.mark.core
def test_top_once_shows_workers_and_jobs(env, mesh_worker: MeshWorkers):
    mesh_worker.start(name="box")
    job = cli("submit", EXAMPLE, "--payloads", PAYLOADS, "--wait").stdout.split()[0]
    p = cli("top", "--once")
    assert p.returncode == 0
    assert "workers" in p.stdout and "box-" in p.stdout and "jobs" in p.stdout and job in p.stdout
    assert re.search(rf"{re.escape(__version__)}\s.*\(protocol\s+{PROTOCOL}\)", p.stdout, re.S), p.stdout
    assert "tiers" in p.stdout and "gpumesh-tier-2" in p.stdout, "each tier's queue, with who serves it"


@pytest.mark.core
def test_version_names_the_package_and_the_broker_protocol():
    p = cli("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"gpumesh {__version__} (broker protocol {PROTOCOL})"


@pytest.mark.processes
def test_bench_json_shape(env):
    p = gpumesh("bench", "--json", env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    cap = json.loads(p.stdout)
    assert set(cap) == {"device", "device_name", "memory_bytes", "score_gflops", "backend", "cpu_cores", "ram_gb",
                        "vram_gb", "vram_free_gb", "comparable"}  # fmt: skip
    assert cap["score_gflops"] > 0 and cap["memory_bytes"] > 0


@pytest.mark.processes
def test_config_init_show_and_layering(env, redis_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cfg = Path(env["GPUMESH_CONFIG"])
    secret = "s3cr3t-pw"
    url = f"redis://:{secret}@127.0.0.1:{redis_server.port}/0"
    env_no_url = {k: v for k, v in env.items() if k != "GPUMESH_URL"}
    p = gpumesh("config", "init", "--url", url, env=env_no_url)
    assert p.returncode == 0 and secret not in p.stderr
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o600
    assert gpumesh("config", "init", "--url", url, env=env_no_url).returncode == 2  # no silent overwrite
    shown = json.loads(gpumesh("config", "show", "--json", env=env_no_url).stdout)
    assert shown["url"] == f"redis://:***@127.0.0.1:{redis_server.port}/0" and shown["lease_ttl"] == 2.0
    # flag > environment > config file > defaults
    monkeypatch.delenv("GPUMESH_URL")
    assert Settings.load().url == url
    monkeypatch.setenv("GPUMESH_URL", "redis://127.0.0.1:1/0")
    assert Settings.load().url == "redis://127.0.0.1:1/0"
    assert Settings.load(url="redis://127.0.0.1:2/0").url == "redis://127.0.0.1:2/0"
    cfg.write_text("tiers = 5\nlease_ttl = 60\n")
    assert Settings.load().tiers == 5  # from the file
    assert Settings.load().lease_ttl == 2.0  # GPUMESH_LEASE_TTL beats the file
    assert Settings.load().heartbeat_interval == 0.4 and Settings.load(tiers=2).tiers == 2
    cfg.write_text('tiers = "many"\n')
    with pytest.raises(UsageError, match="invalid setting tiers"):
        Settings.load()


@pytest.mark.core
def test_logs_follow_stops_when_the_task_ends(env, mesh_worker: MeshWorkers, tmp_path: Path):
    script = tmp_path / "chatty.py"
    script.write_text(
        "import time\nfor i in range(5):\n    print(f'line {i}', flush=True)\n    time.sleep(0.3)\nprint('{}')\n"
    )
    mesh_worker.start()
    job = cli("submit", str(script), "--payloads", "-", input="[{}]").stdout.strip()
    p = cli("logs", "-f", job)
    assert p.returncode == 0
    lines = [line.split("] ", 1)[1] for line in p.stdout.splitlines()]
    assert lines == [f"line {i}" for i in range(5)] + ["{}"]


@pytest.mark.core
def test_a_running_task_s_lines_reach_the_broker_while_it_runs(
    env, mesh_worker: MeshWorkers, r: redis.Redis, tmp_path: Path
):
    gate = tmp_path / "gate"
    script = tmp_path / "waits.py"
    script.write_text(
        "import os, time\n"
        "print('begins', flush=True)\n"
        f"while not os.path.exists({str(gate)!r}):\n"
        "    time.sleep(0.02)\n"
        "print('{}')\n"
    )
    mesh_worker.start()
    job = cli("submit", str(script), "--payloads", "-", input="[{}]").stdout.strip()
    tid = keys.task_id(job, 0)
    wait_until(lambda: "begins" in _lines(r, tid), timeout=10, what="the running task's first line in the broker")
    assert json.loads(cli("status", job, "--json").stdout)["tasks"]["running"] == 1  # still running: streamed
    gate.touch()
    wait_until(lambda: json.loads(cli("status", job, "--json").stdout)["status"] == "done", what="the job done")


@pytest.mark.core
def test_every_line_of_a_task_is_in_the_broker_once_its_end_is(
    env, mesh_worker: MeshWorkers, r: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Short tasks' lines go with the report of their end (a completion, or before a failure), not later: here
    the log thread would hold a line for a minute before sending it on its own."""
    monkeypatch.setattr("gpumesh.worker.logship.LINGER_S", 60.0)
    script = tmp_path / "short.py"
    script.write_text(
        "import json, sys\n"
        "p = json.load(sys.stdin)\n"
        "print(f'begins {p[\"i\"]}')\n"
        "print('middle', file=sys.stderr)\n"
        "sys.exit(3) if p['i'] % 5 == 4 else print(json.dumps(p))\n"
    )
    mesh_worker.start()
    payloads = json.dumps([{"i": i} for i in range(20)])
    job = cli("submit", str(script), "--payloads", "-", "--max-attempts", "1", input=payloads).stdout.strip()
    wait_until(lambda: json.loads(cli("status", job, "--json").stdout)["status"] == "failed", what="the job's end")
    for i in range(20):
        got = _lines(r, keys.task_id(job, i))
        assert got[0].startswith("attempt 1 on "), got
        if i % 5 == 4:  # failed: its own lines (the worker's note of the failure follows the report)
            assert sorted(got[1:3]) == sorted([f"begins {i}", "middle"]), got
        else:
            assert sorted(got[1:]) == sorted([f"begins {i}", "middle", json.dumps({"i": i})]), got  # two pipes
            assert got.index(f"begins {i}") < got.index(json.dumps({"i": i})), got


@pytest.mark.core
def test_lines_a_report_took_but_did_not_send_go_back_first_in_line(r: redis.Redis):
    """The completion takes the waiting lines to send in its own round trip; when it fails before they are sent,
    they go back ahead of what came since, and are sent once, in order."""
    from gpumesh.worker.logship import LogShipper

    ship = LogShipper(r, linger=60.0)  # the thread sends nothing on its own within this test
    ship.start()
    ship.put("j1-1", "stdout", "one")
    ship.put("j1-1", "stdout", "two")
    with ship.riding(timeout=5) as lines:
        assert [line for _t, _s, line in lines] == ["one", "two"]
        ship.put("j1-1", "stdout", "three")  # while the report holds the others: it waits behind them
    assert ship.flush(timeout=5)
    assert _lines(r, "j1-1") == ["one", "two", "three"]
    ship.put("j1-2", "stdout", "sent with the report")
    with ship.riding(timeout=5) as lines:
        with r.pipeline() as p:
            tasklog.append(p, lines)
            p.execute()
        lines.clear()  # sent: not again
    assert ship.flush(timeout=5)
    assert _lines(r, "j1-2") == ["sent with the report"] and ship.dropped == 0


def _lines(r: redis.Redis, task_id: str) -> list[str]:
    """A task's lines as the broker keeps them (its job's log, store/tasklog.py)."""
    return [line for _stream, line in tasklog.task_lines(r, task_id)[0]]


@pytest.mark.core
def test_progress_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch):
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=150, highlight=False)
    monkeypatch.setattr(render, "_err", lambda: console)
    now = datetime.now(UTC)

    def job(status: str, **counts: int) -> JobStatus:
        return JobStatus(job_id="j1", name="", status=status, tasks=TaskCounts(total=4, **counts), created_at=now,
                         finished_at=now if status == "failed" else None)  # fmt: skip

    states = iter(
        [
            job("running", queued=2, running=2),
            job("running", running=2, done=1, failed=1),
            job("failed", done=3, failed=1),
        ]
    )
    st = render.follow(lambda: next(states), quiet=False, interval=0.01)
    assert st.status == "failed"
    text = buf.getvalue()
    assert "3/4 done" in text and "1 failed" in text and "ETA" in text and "/s" in text
    assert text.strip().endswith("j1 failed: 3/4 done, 0 running, 0 queued, 1 failed")


@pytest.mark.processes
def test_every_command_has_help(env):
    out = subprocess.run([sys.executable, "-m", "gpumesh", "--help"], capture_output=True, text=True).stdout
    commands = ["serve", "worker", "join", "submit", "run", "status", "jobs", "workers", "top", "results", "logs",
                "cancel", "retry", "bench", "config"]  # fmt: skip
    for name in commands:
        assert f"  {name} " in out, name
        p = gpumesh(name, "--help", env=env)
        assert p.returncode == 0 and p.stdout.startswith(f"Usage: gpumesh {name}"), name
