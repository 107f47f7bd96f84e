"""Deployment and monitoring: the compose file, several GPUs under a supervisor, rq-dashboard,
Prometheus metrics and JSON logs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest
import redis

from gpumesh.store import keys

from ..conftest import ROOT, Workers, free_port, gpumesh, wait_until

EXAMPLE = str(ROOT / "examples/grid_search.py")
PAYLOADS = str(ROOT / "examples/payloads.json")


def compose_command() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.mark.skipif(compose_command() is None, reason="neither `docker compose` nor docker-compose is installed")
@pytest.mark.processes
def test_docker_compose_config_accepts_the_file(tmp_path: Path):
    cmd = compose_command()
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPUMESH_")}
    ok = subprocess.run([*cmd, "-f", str(ROOT / "docker-compose.yml"), "config"], cwd=ROOT, capture_output=True, text=True,
                        env={**base, "GPUMESH_REDIS_PASSWORD": "pw-from-env"})  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "redis:7.4.2-alpine" in ok.stdout and "noeviction" in ok.stdout and "appendonly yes" in ok.stdout
    assert "driver: nvidia" in ok.stdout and "worker" in ok.stdout
    worker = ok.stdout.split("\n  worker:\n", 1)[1]
    assert "profiles:\n    - worker" in worker, "`docker compose up` alone starts broker and dashboard only"
    missing = subprocess.run([*cmd, "-f", str(ROOT / "docker-compose.yml"), "config"], cwd=tmp_path, capture_output=True,
                             text=True, env=base)  # fmt: skip
    assert missing.returncode != 0 and "GPUMESH_REDIS_PASSWORD" in missing.stderr


@pytest.mark.core
def test_compose_sentinel_profile_is_a_replica_and_three_sentinels_with_quorum_2():
    import yaml

    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    profiled = {name for name, svc in services.items() if "sentinel" in svc.get("profiles", [])}
    assert profiled == {"redis-replica", "sentinel-1", "sentinel-2", "sentinel-3"}
    assert "profiles" not in services["redis"], "`docker compose up` alone still starts the one broker"
    replica = " ".join(services["redis-replica"]["command"])
    assert "--replicaof redis 6379" in replica and "--replica-read-only yes" in replica and "masterauth" in replica
    assert "masterauth" in " ".join(services["redis"]["command"]), "a failed primary rejoins as a replica"
    ports = set()
    for name in ("sentinel-1", "sentinel-2", "sentinel-3"):
        svc = services[name]
        conf = " ".join(svc["command"])
        assert svc["hostname"] == name and "--sentinel" in conf
        assert "sentinel monitor gpumesh redis 6379 2" in conf and "auth-pass gpumesh" in conf
        assert "requirepass" in conf, "a Sentinel anyone can reach without a password can redirect every client"
        ports.add(svc["ports"][0])
    assert len(ports) == 3, "each Sentinel on its own host port"


@pytest.mark.faults
def test_gpus_runs_one_supervised_worker_per_device_and_restarts_a_crashed_one(env, r: redis.Redis, tmp_path: Path):
    with open(tmp_path / "sup.log", "wb") as log:
        sup = subprocess.Popen(
            [sys.executable, "-m", "gpumesh", "worker", "--gpus", "0,1", "--score", "5", "--name", "box"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_until(lambda: r.zcard(keys.WORKERS) == 2, timeout=30, what="two workers")
        names = sorted(r.hget(keys.worker(w), "name") for w in r.zrange(keys.WORKERS, 0, -1))
        assert names == ["box-gpu0", "box-gpu1"]
        children = psutil.Process(sup.pid).children()
        assert sorted(c.environ()["CUDA_VISIBLE_DEVICES"] for c in children) == ["0", "1"]
        victim = next(c for c in children if c.environ()["CUDA_VISIBLE_DEVICES"] == "1")
        victim.kill()
        wait_until(
            lambda: any(c.pid != victim.pid and c.environ().get("CUDA_VISIBLE_DEVICES") == "1" for c in psutil.Process(sup.pid).children()),
            timeout=20, what="the crashed GPU 1 worker to be restarted",
        )  # fmt: skip
        wait_until(lambda: len({r.hget(keys.worker(w), "name") for w in r.zrange(keys.WORKERS, 0, -1)} & {"box-gpu1"}) == 1,
                   timeout=20, what="the restarted worker to register")  # fmt: skip
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(timeout=30) == 0
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert r.zcard(keys.WORKERS) <= 1  # the killed one's stale registration may linger until it expires
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)


@pytest.mark.processes
def test_gpus_rejects_a_bad_list(env):
    p = gpumesh("worker", "--gpus", "0,0", env=env)
    assert p.returncode == 2 and "--gpus takes all, none or distinct GPU indices" in p.stderr


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as resp:  # loopback only
        return resp.read()


@pytest.mark.processes
def test_rq_dashboard_sees_the_mesh(env, workers: Workers, redis_server):
    workers.start()
    job = gpumesh("submit", EXAMPLE, "--payloads", PAYLOADS, "--wait", env=env).stdout.split()[0]
    port = free_port()
    dash = subprocess.Popen(
        [shutil.which("rq-dashboard") or str(Path(sys.executable).parent / "rq-dashboard"), "-j",
         "--redis-url", redis_server.url, "--bind", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}/0/data"
        wait_until(lambda: _try(lambda: _get(f"{base}/queues.json")), timeout=30, what="rq-dashboard to answer")
        queues = json.loads(_get(f"{base}/queues.json"))["queues"]
        (wid,) = workers.r.zrange("gpumesh:workers", 0, -1)
        assert {q["name"] for q in queues} >= {f"gpumesh-tier-{k}" for k in range(3)}, "a queue per tier"
        # a delivery's record goes as its run ends (gpumesh keeps the outcome); the worker counts the runs
        assert sum(q["finished_job_registry_count"] for q in queues) == 0
        ws = json.loads(_get(f"{base}/workers.json"))["workers"]
        assert len(ws) == 1 and ws[0]["name"].startswith(os.uname().nodename[:3])
        assert ws[0]["queues"] == ["gpumesh-tier-2"], "a lone worker serves the top tier"
        assert ws[0]["successful_job_count"] == 6 and not workers.r.keys("rq:job:*")
        assert not workers.r.keys("rq:results:*")
        rows = json.loads(gpumesh("results", job, "--json", env=env).stdout)  # the outcome: gpumesh's to keep
        assert [row["status"] for row in rows] == ["done"] * 6
    finally:
        os.killpg(dash.pid, signal.SIGTERM)
        dash.communicate(timeout=10)


def _try(fn) -> bool:
    try:
        fn()
        return True
    except OSError:
        return False


def _scrape(port: int) -> dict[str, float]:
    out = {}
    for line in _get(f"http://127.0.0.1:{port}/metrics").decode().splitlines():
        if line.startswith("gpumesh_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.mark.processes
def test_metrics_endpoint_matches_the_jobs_that_ran(env, workers: Workers, tmp_path: Path):
    workers.start("--name", "m1", score=4)
    assert gpumesh("submit", EXAMPLE, "--payloads", PAYLOADS, "--wait", env=env).returncode == 0
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nsys.exit(2)\n")
    assert (
        gpumesh(
            "submit",
            str(bad),
            "--payloads",
            "-",
            "--max-attempts",
            "2",
            "--retry-on",
            "script",
            "--wait",
            env=env,
            input="[{}]",
        ).returncode
        == 1
    )
    gpumesh(
        "submit", str(bad), "--payloads", "-", "--retry-on", "all", env=env, input="[{}, {}, {}]"
    )  # 3 attempts each
    port = free_port()
    exporter = subprocess.Popen([sys.executable, "-m", "gpumesh", "metrics", "--port", str(port)], env=env,
                                stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    try:
        wait_until(lambda: _try(lambda: _get(f"http://127.0.0.1:{port}/metrics")), timeout=20, what="the exporter")
        wait_until(
            lambda: _scrape(port).get('gpumesh_tasks_total{outcome="failed"}', 0) == 4, timeout=30, what="all failures"
        )
        m = _scrape(port)
        assert m['gpumesh_tasks_total{outcome="done"}'] == 6
        assert m['gpumesh_tasks_total{outcome="failed"}'] == 4  # 1 + 3 tasks, each out of attempts
        assert m['gpumesh_tasks_total{outcome="retried"}'] == 1 + 3 * 2  # attempts that failed with attempts left
        assert m['gpumesh_tasks_total{outcome="lease_expired"}'] == 0
        assert m['gpumesh_failed_attempts_total{kind="script"}'] == 2 + 3 * 3  # every failed attempt, by its kind
        assert m['gpumesh_failed_attempts_total{kind="memory"}'] == 0
        assert (
            m["gpumesh_task_duration_seconds_count"] == 6 and m['gpumesh_task_duration_seconds_bucket{le="+Inf"}'] == 6
        )
        assert m['gpumesh_workers{device="cpu",tier="2"}'] == 1
        assert sum(v for k, v in m.items() if k.startswith("gpumesh_queue_depth")) == 0
        assert 0 < m["gpumesh_broker_rtt_seconds"] < 1
    finally:
        os.killpg(exporter.pid, signal.SIGTERM)
        exporter.communicate(timeout=10)


@pytest.mark.security
def test_json_logs_one_object_per_line_and_no_secret(env, tmp_path: Path):
    from ..conftest import RedisServer

    (tmp_path / "r").mkdir()
    server = RedisServer(tmp_path / "r", password="do-not-log-me").start()
    try:
        e = {**env, "GPUMESH_URL": server.url}
        job = gpumesh("submit", EXAMPLE, "--payloads", PAYLOADS, env=e).stdout.strip()
        p = gpumesh("worker", "--burst", "--score", "2", "--log-format", "json", env=e, timeout=120)
        assert p.returncode == 0, p.stderr
        lines = p.stderr.strip().splitlines()
        records = [json.loads(line) for line in lines]
        assert {"ts", "level", "logger", "message"} <= set(records[0])
        assert any(f"done {job}-0" in r["message"] for r in records)
        assert "do-not-log-me" not in p.stderr and "***" in p.stderr
    finally:
        server.stop()
