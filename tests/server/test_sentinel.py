"""A broker that fails over: ``redis+sentinel://`` URLs, and a real failover mid-job.

The failover test runs a primary (append-only file), a replica (``replicaof``, read-only) and three
Sentinels (quorum 2), all real redis-server processes on free loopback ports; two real workers and a
waiting ``submit --wait`` know only the Sentinel URL. The primary is SIGKILLed mid-job: the figures
(kill -> replica promoted, kill -> job moving again, runs per task) are printed with ``pytest -s``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import redis

import gpumesh as gpumesh_api
from gpumesh.errors import UsageError
from gpumesh.server.metrics import MeshCollector
from gpumesh.store import keys, sentinel
from gpumesh.store.connection import client, mask_url, translate

from ..conftest import Workers, cli, find_binary, free_port, gpumesh, wait_until

SERVICE = "gpumesh-test"


# -- URLs ---------------------------------------------------------------------------------------------


GOOD = {
    "redis+sentinel://h1:26379,h2:26380,h3/svc": ((("h1", 26379), ("h2", 26380), ("h3", 26379)), "svc", 0, None, None),
    "redis+sentinel://:p%40ss@10.0.0.1:5000/svc/3": ((("10.0.0.1", 5000),), "svc", 3, None, "p@ss"),
    "redis+sentinel://worker:tok@[::1]:26379,[fe80::1]/my%20svc/": (
        (("::1", 26379), ("fe80::1", 26379)),
        "my svc",
        0,
        "worker",
        "tok",
    ),  # fmt: skip
}

BAD = {
    "redis+sentinel://h1:26379": "no service name",
    "redis+sentinel://h1:26379/": "no service name",
    "redis+sentinel:///svc": "no Sentinel address",
    "redis+sentinel://:pw@/svc": "no Sentinel address",
    "redis+sentinel://h1:abc/svc": "the port must be a number",
    "redis+sentinel://h1:0/svc": "the port must be a number",
    "redis+sentinel://h1:70000,h2:1/svc": "the port must be a number",
    "redis+sentinel://h1:,h2:1/svc": "the port must be a number",
    "redis+sentinel://h1:1,,h2:1/svc": "has no host",
    "redis+sentinel://[::1:1/svc": "is not HOST:PORT",
    "redis+sentinel://h1:1/svc/x": "the database must be a number",
    "redis+sentinel://h1:1/svc/0/extra": "too many path parts",
    "redis+sentinel://h1:1/svc?sentinel_auth=maybe": "sentinel_auth is broker",
    "redis+sentinel://h1:1/svc?ssl_ca_certs=/ca.pem": "use rediss+sentinel://",
    "redis+sentinel://h1:1/svc?socket_timeout=1": "unknown option 'socket_timeout'",
    "rediss+sentinel://h1:1/svc?ca_fingerprint=sha256:00": "ca_fingerprint pins",
}


@pytest.mark.core
def test_sentinel_urls_parse_into_sentinels_service_db_and_credentials():
    for url, (hosts, service, db, user, password) in GOOD.items():
        got = sentinel.parse(url, url)
        assert (got.sentinels, got.service, got.db, got.username, got.password) == (hosts, service, db, user, password)
        assert not got.tls and not got.sentinel_auth
    tls = sentinel.parse("rediss+sentinel://:pw@h:1/s?sentinel_auth=broker&ssl_cert_reqs=none&ssl_ca_certs=/c", "")
    assert tls.tls and tls.sentinel_auth and tls.options == {"ssl_cert_reqs": "none", "ssl_ca_certs": "/c"}
    assert mask_url("redis+sentinel://u:secret@h1:1,[::1]:2/svc/0") == "redis+sentinel://u:***@h1:1,[::1]:2/svc/0"
    for url, why in BAD.items():
        with pytest.raises(UsageError, match="invalid Sentinel URL") as caught:
            client(url, decode=True, socket_timeout=1, retries=0)
        assert why in str(caught.value) and "\n" not in str(caught.value), (url, str(caught.value))
    with pytest.raises(UsageError) as caught:
        client("redis+sentinel://:hunter2@h1:x/svc", decode=True, socket_timeout=1, retries=0)
    assert "hunter2" not in str(caught.value) and ":***@" in str(caught.value)


@pytest.mark.core
def test_cli_refuses_a_malformed_sentinel_url_in_one_line_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUMESH_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for url in ("redis+sentinel://h1:26379", "redis+sentinel://h1:abc/svc", "redis+sentinel:///svc"):
        for args in (["jobs", "--url", url], ["status", "j1", "--url", url]):
            res = cli(*args)
            assert res.returncode == 2, (args, res.stdout, res.stderr)
            assert res.stderr.startswith("error: invalid Sentinel URL") and res.stderr.count("\n") == 1, res.stderr
            assert "Traceback" not in res.stderr
        monkeypatch.setenv("GPUMESH_URL", url)
        res = cli("workers")
        assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
        monkeypatch.delenv("GPUMESH_URL")


@pytest.mark.core
def test_sentinels_that_do_not_answer_are_exit_3_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUMESH_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    url = f"redis+sentinel://:pw@127.0.0.1:{free_port()},127.0.0.1:{free_port()}/{SERVICE}"
    t0 = time.monotonic()
    res = cli("jobs", "--url", url)
    assert res.returncode == 3 and res.stderr.count("\n") == 1, res.stderr
    assert f"names a healthy primary for service '{SERVICE}'" in res.stderr and "pw@" not in res.stderr
    assert time.monotonic() - t0 < 10


# -- a real failover ------------------------------------------------------------------------------


class Node:
    """One redis-server (a data node or, with ``--sentinel``, a Sentinel) on a free loopback port."""

    def __init__(self, directory: Path, *args: str, conf: str | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.dir, self.port, self.args, self.conf = directory, free_port(), args, conf
        self.proc: subprocess.Popen[bytes] | None = None
        self.password: str | None = None

    def start(self) -> Node:
        exe = find_binary()
        if self.conf is not None:  # a Sentinel rewrites its config file: each has its own
            path = self.dir / "sentinel.conf"
            path.write_text(f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n{self.conf}")
            argv = [exe, str(path), "--sentinel"]
        else:
            argv = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--dir", str(self.dir),
                    "--maxmemory-policy", "noeviction", *self.args]  # fmt: skip
        with open(self.dir / "log", "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        wait_until(self._answers, timeout=10, what=f"redis-server on {self.port}")
        return self

    def start_with_password(self, password: str) -> Node:
        self.password = password
        return self.start()

    def _answers(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, (self.dir / "log").read_text()
        try:
            with self.client() as c:
                return bool(c.ping())
        except redis.ConnectionError:
            return False

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password, decode_responses=True, socket_timeout=5)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)


TASK = """
import json, os, sys, time
p = json.load(sys.stdin)
with open(os.path.join({tmp!r}, "runs"), "a") as f:
    f.write(f"{{p['i']}}\\n")
time.sleep(0.3)
print(json.dumps(p))
"""


def primary_of(s: redis.Redis) -> tuple[str, int] | None:
    found = s.sentinel_get_master_addr_by_name(SERVICE)
    return (found[0], int(found[1])) if found else None


def libraries(c: redis.Redis) -> list[str]:
    """The Redis Functions libraries a server holds (FUNCTION LIST answers flat name/value lists)."""
    return [entry[entry.index("library_name") + 1] for entry in c.function_list()]


def runs(tmp: Path) -> list[int]:
    path = tmp / "runs"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def cluster(tmp: Path, nodes: list[Node], down_after_ms: int = 1000) -> tuple[Node, Node, list[Node]]:
    """A primary (append-only), its read-only replica and three Sentinels (quorum 2) that all know both,
    appended to ``nodes`` as they start (the caller stops them)."""
    primary = Node(tmp / "primary", "--appendonly", "yes", "--appendfsync", "everysec").start()
    nodes.append(primary)
    replica = Node(tmp / "replica", "--replicaof", "127.0.0.1", str(primary.port),
                   "--replica-read-only", "yes", "--appendonly", "yes").start()  # fmt: skip
    nodes.append(replica)
    conf = (
        f"sentinel monitor {SERVICE} 127.0.0.1 {primary.port} 2\n"
        f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
        f"sentinel failover-timeout {SERVICE} 4000\n"
        f"sentinel parallel-syncs {SERVICE} 1\n"
    )
    sentinels = []
    for i in range(3):
        sentinels.append(Node(tmp / f"sentinel-{i}", conf=conf).start())
        nodes.append(sentinels[-1])
    wait_until(lambda: replica.client().info("replication")["master_link_status"] == "up", what="replication")
    for s in sentinels:  # each Sentinel knows the replica and the two others: a failover can be agreed
        c = s.client()
        wait_until(lambda c=c: c.sentinel_master(SERVICE)["num-other-sentinels"] == 2, timeout=30,
                   what="the Sentinels to find each other")  # fmt: skip
        wait_until(lambda c=c: len(c.sentinel_slaves(SERVICE)) == 1, timeout=30, what="the replica")
    return primary, replica, sentinels


def sentinel_url(sentinels: list[Node]) -> str:
    return "redis+sentinel://" + ",".join(f"127.0.0.1:{s.port}" for s in sentinels) + f"/{SERVICE}/0"


@pytest.mark.faults
def test_a_client_holding_a_connection_to_the_demoted_primary_writes_to_the_new_one(tmp_path: Path):
    nodes: list[Node] = []
    try:
        primary, replica, sentinels = cluster(tmp_path, nodes)
        c = client(sentinel_url(sentinels), decode=True, socket_timeout=5, retries=2)
        plain = client(f"redis://127.0.0.1:{primary.port}/0", decode=True, socket_timeout=5, retries=1)
        assert c.set("k", "before") and plain.set("k2", "x")
        assert sentinels[0].client().sentinel_failover(SERVICE)  # the old primary lives on, as a replica
        wait_until(lambda: primary_of(sentinels[0].client()) == ("127.0.0.1", replica.port), timeout=30,
                   what="the failover")  # fmt: skip
        wait_until(lambda: primary.client().info("replication")["role"] == "slave", timeout=30, what="the demotion")
        t0 = time.monotonic()
        assert c.set("k", "after")  # its pooled connection answers READONLY: retried against the new primary
        assert replica.client().get("k") == "after" and time.monotonic() - t0 < 5
        with pytest.raises(redis.exceptions.ReadOnlyError) as caught:  # a plain URL has nowhere else to go
            plain.set("k2", "y")
        said = str(translate(caught.value, f"redis://:pw@127.0.0.1:{primary.port}/0"))
        assert "is a read-only replica" in said and "redis+sentinel://" in said and "pw" not in said
    finally:
        for n in reversed(nodes):
            n.stop()


@pytest.mark.faults
def test_primary_sigkilled_mid_job_fails_over_and_the_job_ends_done(env, workers: Workers, tmp_path: Path):
    nodes: list[Node] = []
    try:
        primary, replica, sentinels = cluster(tmp_path, nodes)
        s0 = sentinels[0].client()
        assert primary_of(s0) == ("127.0.0.1", primary.port)

        url = sentinel_url(sentinels)
        e = {**env, "GPUMESH_URL": url, "GPUMESH_LEASE_TTL": "4", "GPUMESH_HEARTBEAT_INTERVAL": "0.5"}
        load = gpumesh("access", "load-functions", "--url", f"redis://127.0.0.1:{primary.port}/0", env=e)
        assert load.returncode == 0, load.stderr
        lib = sorted(libraries(primary.client()))  # this protocol's, and the previous one's
        assert len(lib) == 2 and all(name.startswith("gpumesh_") for name in lib), lib
        wait_until(lambda: sorted(libraries(replica.client())) == lib, what="FUNCTION LOAD to reach the replica")

        first = primary.client()
        for _ in range(2):
            workers.start(client=first, **e)
        path = tmp_path / "t.py"
        path.write_text(TASK.format(tmp=str(tmp_path)))
        (tmp_path / "payloads.json").write_text(json.dumps([{"i": i} for i in range(30)]))
        submit = subprocess.Popen(
            [sys.executable, "-m", "gpumesh", "submit", str(path), "--payloads", str(tmp_path / "payloads.json"),
             "--wait"],
            env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        jobs = lambda: [k for k in first.scan_iter("gpumesh:job:*") if k.count(":") == 2]  # noqa: E731
        job = wait_until(lambda: next(iter(jobs()), None), what="the job")
        job_id = job.removeprefix("gpumesh:job:")
        wait_until(lambda: int(first.hget(job, "done") or 0) >= 6, timeout=30, what="the job to be under way")
        done_at_kill = int(first.hget(job, "done") or 0)
        primary.stop(signal.SIGKILL)
        t0 = time.monotonic()

        promoted = wait_until(lambda: primary_of(s0) == ("127.0.0.1", replica.port), timeout=30,
                              what="the replica to be promoted")  # fmt: skip
        assert promoted
        promoted_after = time.monotonic() - t0
        new = replica.client()
        assert new.info("replication")["role"] == "master"
        done_promoted = int(new.hget(job, "done") or 0)
        wait_until(lambda: int(new.hget(job, "done") or 0) > done_promoted, timeout=60, what="the job to move again")
        moving_after = time.monotonic() - t0

        out, errs = submit.communicate(timeout=120)
        assert submit.returncode == 0, (out, errs)
        assert out.strip() == f"{job_id} done", (out, errs)
        said = [line for line in errs.splitlines() if "broker" in line]
        assert len(said) == 2 and "reachable again" in said[1], errs  # once that it waits, once that it is back
        print("\nsubmit --wait said:", " / ".join(said))

        rows = json.loads(gpumesh("results", job_id, "--format", "json", env=e).stdout)
        assert [row["status"] for row in rows] == ["done"] * 30
        assert [row["result"]["i"] for row in rows] == list(range(30)), "every result, in payload order"
        dones = Counter(f["id"] for _, f in new.xrange(keys.EVENTS) if f["status"] == "done" and f["kind"] == "task")
        assert len(dones) == 30 and set(dones.values()) == {1}, f"each task's result accepted once: {dones}"
        ran = Counter(runs(tmp_path))
        assert set(ran) == set(range(30))
        twice = sorted(i for i, n in ran.items() if n > 1)
        print(
            f"\nSentinel failover: SIGKILL of the primary ({done_at_kill}/30 done) -> replica promoted "
            f"{promoted_after:.2f} s -> job moving again {moving_after:.2f} s (down-after 1000 ms, quorum 2); "
            f"tasks run more than once: {len(twice)} {twice} (runs {sum(ran.values())} for 30 tasks)"
        )
        with gpumesh_api.connect(url) as mesh:  # the Python API and the metrics exporter, after the failover
            assert mesh.job(job_id).status().status == "done"
            assert mesh.broker.redis.connection_pool.get_master_address() == ("127.0.0.1", replica.port)
            families = {m.name: m for m in MeshCollector(mesh.broker).collect()}
            assert any(s.value == 30 for m in families.values() for s in m.samples if "done" in str(s.labels)), families
        logs = workers.log(0) + workers.log(1)
        assert "Traceback" not in logs and "NOSCRIPT" not in logs and "function not found" not in logs.lower()
        assert all(p.poll() is None for p in workers.procs), logs
        assert set(lib) <= set(libraries(new)), "the functions loaded before the failover are on the new primary"
    finally:
        workers.stop_all()
        for n in reversed(nodes):
            n.stop()


@pytest.mark.processes
def test_sentinels_with_a_password_are_asked_with_the_broker_s_when_the_url_says_so(tmp_path: Path):
    nodes: list[Node] = []
    try:
        primary = Node(tmp_path / "primary", "--requirepass", "pw").start_with_password("pw")
        nodes.append(primary)
        conf = (
            f"requirepass pw\nsentinel monitor {SERVICE} 127.0.0.1 {primary.port} 1\nsentinel auth-pass {SERVICE} pw\n"
        )
        guard = Node(tmp_path / "sentinel", conf=conf).start_with_password("pw")
        nodes.append(guard)
        url = f"redis+sentinel://:pw@127.0.0.1:{guard.port}/{SERVICE}/0"
        with pytest.raises(redis.RedisError) as refused:  # asked without a password: refused, and said so
            client(url, decode=True, socket_timeout=3, retries=0).ping()
        said = str(translate(refused.value, url))
        assert "sentinel_auth=broker" in said and "pw" not in said.replace("sentinel_auth", ""), said
        asked = client(url + "?sentinel_auth=broker", decode=True, socket_timeout=3, retries=0)
        assert asked.set("k", "v") and asked.get("k") == "v"
    finally:
        for n in reversed(nodes):
            n.stop()


@pytest.mark.faults
def test_one_shot_commands_wait_for_the_promotion_when_the_primary_dies(env, tmp_path: Path):
    # The primary SIGKILLed: until its Sentinels promote the replica (down-after 4 s here, then the
    # election; long enough that the commands, slow to start on a loaded machine, start before it ends),
    # they name a primary that refuses connections, then none. status, results and jobs started at once
    # wait for the promotion and answer, instead of exiting 3; a service no Sentinel monitors still does.
    nodes: list[Node] = []
    try:
        primary, replica, sentinels = cluster(tmp_path, nodes, down_after_ms=4000)
        url = sentinel_url(sentinels)
        e = {**env, "GPUMESH_URL": url}
        script = tmp_path / "t.py"
        script.write_text("print(1)\n")
        p = gpumesh("submit", str(script), "--payloads", "-", env=e, input="[{}]")
        assert p.returncode == 0, p.stderr
        job = p.stdout.strip()
        wait_until(lambda: replica.client().exists(keys.job(job)), what="the job to reach the replica")
        primary.stop(signal.SIGKILL)
        t0 = time.monotonic()
        commands = [["status", job], ["results", job, "--format", "json"], ["jobs"]]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "gpumesh", *args],
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for args in commands
        ]
        outs = [proc.communicate(timeout=90) for proc in procs]
        took = time.monotonic() - t0
        for args, proc, (out, errs) in zip(commands, procs, outs):
            assert proc.returncode == 0, (args, out, errs)
            assert job in out, (args, out, errs)
            assert "waiting up to" in errs and "promote a replica" in errs and "reachable again" in errs, errs
        assert primary_of(sentinels[0].client()) == ("127.0.0.1", replica.port)
        print(f"\nthree one-shot commands started at the primary's SIGKILL answered after {took:.1f} s")
        t0 = time.monotonic()
        other = gpumesh("jobs", "--url", url.replace(f"/{SERVICE}/", "/no-such-service/"), env=e)
        assert other.returncode == 3 and other.stderr.count("\n") == 1, other.stderr
        assert "no-such-service" in other.stderr and time.monotonic() - t0 < 10
    finally:
        for n in reversed(nodes):
            n.stop()
