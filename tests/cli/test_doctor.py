"""``gpumesh doctor``: what a user reads about this machine and the broker, and the exit code."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from gpumesh import capability
from gpumesh.cli import doctor
from gpumesh.extras import install_hint
from gpumesh.models import Capability
from gpumesh.sandbox import runner as sandbox
from gpumesh.sandbox import tree
from gpumesh.settings import Settings

from ..conftest import ROOT, MeshWorkers, RedisServer, cli, free_port

pytestmark = pytest.mark.core

MACHINE = (
    "python",
    "gpumesh",
    "distribution",
    "device",
    "torch",
    "nvidia-smi",
    "numpy",
    "cache",
    "landlock",
    "namespaces",
    "cgroup",
)
BROKER = ("broker", "persistence", "maxmemory-policy", "acl", "clock", "workers")


def checks(stdout: str) -> dict[str, tuple[str, str, str | None]]:
    """The human output as {check: (status, detail, fix)}: a status line, then its fix line if any."""
    found: dict[str, tuple[str, str, str | None]] = {}
    last = ""
    for line in stdout.splitlines():
        words = line.split(maxsplit=2)
        if words and words[0] in ("ok", "warn", "fail"):
            last = words[1]
            found[last] = (words[0], words[2] if len(words) > 2 else "", None)
        elif line.strip().startswith("fix: ") and last:
            status, detail, _ = found[last]
            found[last] = (status, detail, line.strip().removeprefix("fix: "))
    return found


def doctor_json(*args: str) -> tuple[int, dict[str, dict[str, str | None]]]:
    p = cli("doctor", "--json", *args)
    rows = json.loads(p.stdout)  # one JSON document and nothing else
    assert isinstance(rows, list) and "Traceback" not in p.stderr
    return p.returncode, {row["check"]: row for row in rows}


@pytest.fixture
def no_torch_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timing tests time the broker check: importing torch, where it is installed, takes seconds of its own."""
    monkeypatch.setattr(doctor, "probe_torch", lambda: None)


def test_against_the_test_broker_it_passes_and_names_the_broker_and_its_version(env, r: redis.Redis):
    p = cli("doctor")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    found = checks(p.stdout)
    assert set(MACHINE + BROKER) <= set(found), p.stdout
    assert all(status in ("ok", "warn") for status, _, _ in found.values()), p.stdout
    status, detail, fix = found["broker"]
    assert status == "ok" and fix is None
    info = r.info("server")
    assert "reachable" in detail and (info.get("valkey_version") or info["redis_version"]) in detail
    assert found["python"][0] == "ok"
    assert found["maxmemory-policy"][:2] == ("ok", "noeviction (no maxmemory)")
    assert found["acl"] == ("ok", "default: admin (all commands), no password", None)
    assert found["clock"][0] == "ok" and "the broker" in found["clock"][1]
    for name in ("landlock", "cgroup"):
        assert found[name][0] in ("ok", "warn") and found[name][1]
    if found["landlock"][0] == "ok":
        assert found["landlock"][1].startswith("ABI ")
    # every warning says how to fix it
    assert all(fix for status, _, fix in found.values() if status != "ok"), p.stdout
    assert p.stdout.rstrip().splitlines()[-1].startswith(f"{len(found)} checks: 0 failed")


def test_json_is_a_list_of_checks_with_their_fields(env, r: redis.Redis):
    code, rows = doctor_json()
    assert code == 0
    assert set(MACHINE + BROKER) <= set(rows)
    for row in rows.values():
        assert set(row) == {"check", "status", "detail", "fix"}
        assert row["status"] in ("ok", "warn", "fail") and row["detail"]
        assert (row["fix"] is None) == (row["status"] == "ok"), row
    assert rows["broker"]["status"] == "ok"


def test_an_unreachable_broker_is_a_fail_line_and_the_machine_checks_still_run(env, no_torch_probe):
    url = f"redis://:hunter2-doctor@127.0.0.1:{free_port()}/0"  # nothing listens there
    start = time.monotonic()
    p = cli("doctor", "--url", url)
    elapsed = time.monotonic() - start
    assert p.returncode == 1 and "Traceback" not in p.stderr
    found = checks(p.stdout)
    status, detail, fix = found["broker"]
    assert status == "fail" and "cannot reach the broker" in detail and "127.0.0.1" in detail
    assert fix and "gpumesh serve" in fix
    assert set(MACHINE) <= set(found)  # the machine checks still ran
    assert not set(BROKER[1:]) & set(found)  # and the broker's others, which would only repeat it, did not
    assert "hunter2-doctor" not in p.stdout + p.stderr and ":***@" in detail
    assert elapsed < doctor.SOCKET_TIMEOUT + 5


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) and never answers: a hung broker."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield s.getsockname()[1]


def test_a_broker_that_never_answers_fails_within_the_socket_timeout(env, silent_port: int, no_torch_probe):
    start = time.monotonic()
    code, rows = doctor_json("--url", f"redis://127.0.0.1:{silent_port}/0")
    elapsed = time.monotonic() - start
    assert code == 1
    assert rows["broker"]["status"] == "fail" and "Timeout" in str(rows["broker"]["detail"])
    assert set(MACHINE) <= set(rows)
    assert doctor.SOCKET_TIMEOUT - 0.5 < elapsed < doctor.SOCKET_TIMEOUT + 5  # no hang, and no retries


def test_an_evicting_maxmemory_policy_warns_and_names_noeviction(env, r: redis.Redis):
    r.config_set("maxmemory-policy", "allkeys-lru")
    try:
        p = cli("doctor")
    finally:
        r.config_set("maxmemory-policy", "noeviction")
    assert p.returncode == 0  # a warning, not a failure
    status, detail, fix = checks(p.stdout)["maxmemory-policy"]
    assert status == "warn" and detail.startswith("allkeys-lru, not noeviction")
    assert fix and "CONFIG SET maxmemory-policy noeviction" in fix


def test_persistence_off_warns_and_snapshots_are_enough(env, r: redis.Redis):
    _, rows = doctor_json()  # the test broker runs with --save '' --appendonly no
    assert rows["persistence"]["status"] == "warn" and "loses the queue" in str(rows["persistence"]["detail"])
    assert "appendonly yes" in str(rows["persistence"]["fix"])
    r.config_set("save", "3600 1")
    try:
        _, rows = doctor_json()
    finally:
        r.config_set("save", "")
    assert rows["persistence"]["status"] == "ok" and "RDB snapshots only" in str(rows["persistence"]["detail"])


def test_a_live_worker_shows_in_the_workers_line(env, r: redis.Redis, mesh_worker: MeshWorkers):
    _, rows = doctor_json()
    assert rows["workers"]["status"] == "warn" and rows["workers"]["detail"].startswith("none live")
    assert str(rows["workers"]["fix"]).startswith("Start one: gpumesh worker redis://127.0.0.1:")
    mesh_worker.start(name="doctor-probe", score=42)
    status, detail, fix = checks(cli("doctor").stdout)["workers"]
    assert status == "ok" and fix is None
    assert detail.startswith("1 live: doctor-probe (") and "42 GFLOP/s" in detail


def test_a_restricted_user_is_told_apart_and_refused_config_is_cannot_tell(env, r: redis.Redis, redis_server):
    r.acl_setuser(
        "doctor-ro", enabled=True, passwords=["+s3cret-doctor"], keys=["gpumesh:*", "rq:*"],
        commands=["-@all", "+@read", "+@connection", "+info", "+time"],
    )  # fmt: skip
    try:
        code, rows = doctor_json("--url", f"redis://doctor-ro:s3cret-doctor@127.0.0.1:{redis_server.port}/0")
    finally:
        r.acl_deluser("doctor-ro")
    assert code == 0
    assert rows["broker"]["status"] == "ok" and "redis://doctor-ro:***@" in str(rows["broker"]["detail"])
    assert rows["acl"]["status"] == "ok" and str(rows["acl"]["detail"]).startswith("doctor-ro: restricted")
    for name in ("persistence", "maxmemory-policy"):
        assert rows[name]["status"] == "warn" and rows[name]["detail"] == "cannot tell (CONFIG refused)"
    assert "s3cret-doctor" not in json.dumps(rows)


def test_wrong_credentials_are_a_fail_line_naming_the_password(env, redis_server: RedisServer):
    code, rows = doctor_json("--url", f"redis://nobody:wrong@127.0.0.1:{redis_server.port}/0")
    assert code == 1
    assert rows["broker"]["status"] == "fail" and "refused the credentials" in str(rows["broker"]["detail"])
    assert "password" in str(rows["broker"]["fix"])


def test_clock_skew_warns_over_a_second_and_fails_over_thirty(r: redis.Redis):
    assert doctor.clock_line(r).status == "ok"
    ahead = doctor.clock_line(r, now=lambda: time.time() + 5)
    assert ahead.status == "warn" and ahead.detail.startswith("this machine is 5.0")
    assert "ahead of the broker" in ahead.detail and "NTP" in str(ahead.fix)
    behind = doctor.clock_line(r, now=lambda: time.time() - 60)
    assert behind.status == "fail" and "behind the broker" in behind.detail


def test_a_cached_benchmark_is_the_device_line(env, probed_capability: Capability):
    settings = Settings.load()
    capability.save(settings.cache_dir, probed_capability)
    _, rows = doctor_json()
    assert rows["device"]["status"] == "ok"
    assert str(rows["device"]["detail"]).startswith(f"{probed_capability.device} {probed_capability.device_name}")
    assert rows["cache"] == {"check": "cache", "status": "ok", "detail": f"{settings.cache_dir} writable", "fix": None}


def test_no_cached_benchmark_warns_with_the_command_that_makes_one(env, r: redis.Redis):
    _, rows = doctor_json()
    assert rows["device"]["status"] == "warn" and "no benchmark cached yet" in str(rows["device"]["detail"])
    assert "gpumesh bench --save" in str(rows["device"]["fix"])


def test_a_cache_dir_that_cannot_be_made_warns(env, r: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    _, rows = doctor_json()
    assert rows["cache"]["status"] == "warn" and "is not a directory" in str(rows["cache"]["detail"])
    assert "GPUMESH_CACHE_DIR" in str(rows["cache"]["fix"])


def test_the_other_project_named_gpumesh_3x_installed_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    info = tmp_path / "gpumesh-3.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gpumesh\nVersion: 3.1.0\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "top_level.txt").write_text("gpumesh\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    line = doctor.distribution_line()
    assert line.status == "warn" and line.detail.startswith("gpumesh 3.1.0 is installed: that is another project")
    assert line.fix == f"Run pip uninstall gpumesh, then reinstall this project: {install_hint()}"
    assert "-m pip install -e" in line.fix and str(ROOT) in line.fix  # this checkout, not a name on the index


def test_python_below_3_11_fails():
    line = doctor.python_line((3, 10, 12))
    assert line.status == "fail" and "3.10.12" in line.detail and "3.11" in str(line.fix)
    assert doctor.python_line((3, 11, 0)).status == "ok"


def test_own_cgroup_is_read_from_proc_self_cgroup():
    """The worker's cgroup on v1 is its own in the pids hierarchy (doctor reads it through the same probe), not
    the memory controller's where the two differ."""
    proc = "8:pids:/lab/job-2\n4:memory:/lab/job-1\n2:cpu,cpuacct:/lab\n0::/user.slice/doctor.scope\n"
    assert tree.own_cgroup(proc, v2=True) == "/sys/fs/cgroup/user.slice/doctor.scope"
    assert tree.own_cgroup(proc, v2=False) == "/sys/fs/cgroup/pids/lab/job-2"
    assert tree.own_cgroup("0::/\n", v2=False) is None


def test_doctor_names_the_cgroup_an_attempt_of_a_worker_here_runs_in(env):
    """What doctor says of cgroups is where a worker started here puts its attempts: an attempt that ran reads
    its own cgroup, and doctor names that cgroup's parent (or warns, where the attempt had none)."""
    shown = "import pathlib; print(pathlib.Path('/proc/self/cgroup').read_text().replace(chr(10), ';'))"
    limits = sandbox.Limits(timeout=30, memory_bytes=0)
    out = sandbox.run(shown, "t.py", "{}", {}, limits, lambda s, line: None, lambda: None)
    assert out.returncode == 0, list(out.stderr_tail)
    rows = [row.split(":", 2) for row in (out.last_line or "").split(";") if "gpumesh-attempt-" in row]
    code, found = doctor_json()
    line = found["cgroup"]
    if not rows:
        assert line["status"] == "warn" and "could not make a cgroup per attempt" in line["detail"], line
        return
    _, controllers, path = rows[0]
    parent = str(Path(tree.CGROUP_ROOT, controllers, path.lstrip("/")).parent)
    assert line["status"] == "ok", line
    assert f"makes a cgroup per attempt in {parent}" in line["detail"], (line, rows)


def test_a_check_that_breaks_is_a_fail_line_not_a_traceback(env, r: redis.Redis, monkeypatch: pytest.MonkeyPatch):
    def broken() -> doctor.Line:
        raise RuntimeError("boom")

    monkeypatch.setattr(doctor, "landlock_line", broken)
    p = cli("doctor")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    found = checks(p.stdout)
    assert found["landlock"][:2] == ("fail", "the check itself failed: RuntimeError: boom")
    assert found["broker"][0] == "ok"  # the others still ran


def test_help_shows_an_example_and_every_option(env):
    p = cli("doctor", "--help")
    assert p.returncode == 0
    assert "gpumesh doctor --url redis://" in p.stdout
    assert "--url URL" in p.stdout and "Broker URL" in p.stdout
    assert "--json" in p.stdout and "one JSON document" in p.stdout


def test_persistence_says_what_the_fsync_policy_means_for_a_crash(env, r: redis.Redis):
    r.config_set("appendonly", "yes")
    try:
        r.config_set("appendfsync", "everysec")
        _, rows = doctor_json()
        everysec = rows["persistence"]
        r.config_set("appendfsync", "always")
        _, rows = doctor_json()
        always = rows["persistence"]
    finally:
        r.config_set("appendonly", "no")
        r.config_set("appendfsync", "everysec")
    assert everysec["status"] == "warn", everysec
    assert "appendfsync everysec" in str(everysec["detail"]) and "run again" in str(everysec["detail"])
    assert "CONFIG SET appendfsync always" in str(everysec["fix"])
    assert always["status"] == "ok" and "survives a crash" in str(always["detail"]), always
