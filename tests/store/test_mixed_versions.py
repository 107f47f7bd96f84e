"""Mixed versions on one mesh: the previous release, built from git history into a venv of its own, and this
one work the same jobs whichever of them serves the broker; a broker upgraded in place keeps its jobs; a
client two protocols apart is refused at start in one line."""

from __future__ import annotations

import io
import json
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from gpumesh._version import PROTOCOL, __version__
from gpumesh.store import keys, protocols, scripts
from gpumesh.store.protocols import freeze

from ..conftest import ROOT, Serve, free_port, wait_until

pytestmark = pytest.mark.processes

OLD_REV, OLD_VERSION = protocols.FROZEN_FROM[PROTOCOL - 1]

# Each run of a task leaves a line in a file of its own (so "done once" is counted, not assumed); a gated task
# waits for the gate file first; the result says which gpumesh package the task's process imported.
TASK = r"""
import json, os, sys, time
payload = json.load(sys.stdin)
runs = payload["runs"]
while payload.get("gated") and not os.path.exists(os.path.join(runs, "gate")):
    time.sleep(0.05)
time.sleep(payload.get("sleep", 0))
with open(os.path.join(runs, os.environ["GPUMESH_JOB_ID"] + "-" + os.environ["GPUMESH_TASK_INDEX"]), "a") as f:
    f.write(os.environ["GPUMESH_WORKER_ID"] + "\n")
print(json.dumps({"gpumesh": getattr(sys.modules.get("gpumesh"), "__file__", None)}))
"""


def release_venv(where: Path, package: Path | bytes) -> tuple[tuple[str, ...], Path]:
    """A venv of its own holding one gpumesh release (a package directory, or a ``git archive`` of it), with
    this venv's dependencies reached through a .pth line (nothing installed from an index): (the command that
    runs its Python, its site-packages)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(where), "platbase": str(where)}))
    if isinstance(package, bytes):
        with tarfile.open(fileobj=io.BytesIO(package)) as tar:  # git's archive of this repository
            tar.extractall(site, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(site)
    else:
        shutil.copytree(package, site / "gpumesh", ignore=shutil.ignore_patterns("__pycache__"))
    ours = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}  # a plain path: its .pth files stay unread
    (site / "dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")
    return (str(where / "bin" / "python"), "-P"), site  # -P: never the current directory's gpumesh


@pytest.fixture(scope="module")
def old(tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[str, ...], Path]:
    """The release whose protocol this one serves as the previous, from git history (its frozen library's commit)."""
    got = subprocess.run(["git", "-C", str(ROOT), "archive", OLD_REV, "gpumesh"], capture_output=True)
    if got.returncode != 0:
        pytest.fail(f"this checkout lacks {OLD_REV}, the release of protocol {PROTOCOL - 1}: fetch the whole history "
                    f"(git fetch --unshallow): {got.stderr.decode().strip()}")  # fmt: skip
    return release_venv(tmp_path_factory.mktemp("old-release") / "venv", got.stdout)


class Side:
    """One release's commands: ``python`` runs its interpreter."""

    def __init__(self, python: tuple[str, ...], env: dict[str, str], tmp: Path, label: str) -> None:
        self.python, self.env, self.tmp, self.label = python, env, tmp, label
        self.procs: list[subprocess.Popen[bytes]] = []

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.python, "-m", "gpumesh", *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, cwd=self.tmp)  # fmt: skip

    def submit(self, url: str, payloads: list[dict[str, Any]]) -> str:
        (self.tmp / "task.py").write_text(TASK)
        (self.tmp / "payloads.json").write_text(json.dumps(payloads))
        p = self.run("submit", "task.py", "--payloads", "payloads.json", "--url", url, "--json")
        assert p.returncode == 0, p.stderr
        return str(json.loads(p.stdout)["job_id"])

    def worker(self, url: str, admin: redis.Redis) -> subprocess.Popen[bytes]:
        before = set(admin.zrange(keys.WORKERS, 0, -1))
        log = self.tmp / f"worker-{self.label}-{len(self.procs)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([*self.python, "-m", "gpumesh", "worker", url, "--score", "5", "--name", self.label],
                                    env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    cwd=self.tmp)  # fmt: skip
        self.procs.append(proc)
        wait_until(lambda: set(admin.zrange(keys.WORKERS, 0, -1)) - before or proc.poll() is not None,
                   what=f"the {self.label} worker to register")  # fmt: skip
        assert proc.poll() is None, log.read_text()
        return proc

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def sides(old: tuple[tuple[str, ...], Path], env: dict[str, str], tmp_path: Path) -> Iterator[dict[str, Side]]:
    # leases outlive a broker's restart: a task that runs across one is not run twice
    env = {**env, "GPUMESH_LEASE_TTL": "15", "GPUMESH_HEARTBEAT_INTERVAL": "0.5"}
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    s = {
        "old": Side(old[0], env, tmp_path / "old", "old"),
        "new": Side((sys.executable,), env, tmp_path / "new", "new"),
    }
    yield s
    for side in s.values():
        side.stop()


def admin_of(data: Path, port: int) -> redis.Redis:
    password = json.loads((data / "credentials.json").read_text())["admin"]
    return redis.Redis.from_url(f"redis://admin:{password}@127.0.0.1:{port}/0", decode_responses=True)


def submit_url(serve: Serve) -> str:
    found = re.search(r"--url '(redis://submitter:[^']+)' --wait", "\n".join(serve.lines))
    assert found
    return found.group(1)


def results(side: Side, url: str, job: str) -> list[dict[str, Any]]:
    p = side.run("results", job, "--format", "json", "--url", url)
    assert p.returncode == 0, p.stderr
    return list(json.loads(p.stdout))


def ended(admin: redis.Redis, job: str) -> None:
    wait_until(lambda: admin.hget(keys.job(job), "status") in ("done", "failed", "cancelled"), timeout=60,
               what=f"job {job} to end")  # fmt: skip


def done_once(rows: list[dict[str, Any]], runs: Path, job: str, n: int) -> None:
    """Every task of ``job`` is done, and ran once (one line in its run file)."""
    assert [r["status"] for r in rows] == ["done"] * n, rows
    assert [len((runs / f"{job}-{i}").read_text().split()) for i in range(n)] == [1] * n


def test_the_previous_release_and_this_one_share_a_broker_either_serves_and_an_upgrade_in_place_keeps_the_jobs(
    old: tuple[tuple[str, ...], Path], sides: dict[str, Side], tmp_path: Path
):
    old_site = old[1]
    runs = tmp_path / "runs"
    runs.mkdir()
    library = subprocess.run([*old[0], "-c", "from gpumesh.store import scripts; print(scripts.library()[1], end='')"],
                             capture_output=True, text=True, check=True, cwd=tmp_path).stdout  # fmt: skip
    previous = protocols.frozen(PROTOCOL - 1)
    assert previous is not None and library == previous.code, "the frozen library is what that release loads"
    assert freeze.built(OLD_REV, ROOT) == (None, previous.name, previous.code), "and what freeze.py makes of it"

    # 1. A broker the previous release serves: its worker and this one's (which calls the previous protocol's
    # functions, the only ones there), jobs from both sides' submitters.
    data, port = tmp_path / "broker", free_port()
    serve = Serve(sides["old"].env, data, port, python=sides["old"].python)
    admin = admin_of(data, port)
    try:
        url, sub = serve.url, submit_url(serve)
        sides["old"].worker(url, admin)
        sides["new"].worker(url, admin)
        jobs = {side: sides[side].submit(sub, [{"runs": str(runs), "sleep": 0.1}] * 6) for side in ("old", "new")}
        for job in jobs.values():
            ended(admin, job)
            done_once(results(sides["old"], sub, job), runs, job, 6)
        finished = {job: results(sides["new"], sub, job) for job in jobs.values()}
        log = "\n".join(p.read_text() for p in sides["new"].tmp.glob("worker-*.log"))
        assert f"serves gpumesh protocol {PROTOCOL - 1}, not this gpumesh's {PROTOCOL}" in log, log

        # 2. The broker is upgraded with jobs done, running and queued: a job of which five tasks are done and one
        # runs (it waits at a gate), and a job of which one task runs on the other worker and three are queued.
        half = sides["old"].submit(sub, [{"runs": str(runs)}] * 5 + [{"runs": str(runs), "gated": True}])
        wait_until(lambda: admin.hget(keys.job(half), "done") == "5", timeout=60, what="five tasks done")
        queued = sides["new"].submit(sub, [{"runs": str(runs), "gated": True}] * 4)
        wait_until(lambda: admin.hmget(keys.job(queued), "running", "queued") == ["1", "3"], what="one task running")
        assert admin.hget(keys.job(half), "running") == "1"
    finally:
        code, stderr = serve.stop()
        admin.close()
    assert code == 0, stderr
    serve = Serve(sides["new"].env, data, port)  # this release's serve, same data dir
    admin = admin_of(data, port)
    try:
        assert serve.url == url
        (runs / "gate").touch()
        jobs["new after"] = sides["new"].submit(sub, [{"runs": str(runs)}] * 4)
        jobs["old after"] = sides["old"].submit(sub, [{"runs": str(runs)}] * 4)
        for job, n in ((half, 6), (queued, 4), (jobs["new after"], 4), (jobs["old after"], 4)):
            ended(admin, job)
            done_once(results(sides["old"], sub, job), runs, job, n)
        for job, rows in finished.items():  # finished under the previous protocol, read alike under this one
            assert results(sides["new"], sub, job) == rows

        # Each task ran in the package of the worker that took it: the old release's children import the old one.
        workers = json.loads(sides["new"].run("workers", "--json", "--url", sub).stdout)
        by_id = {w["id"]: w for w in workers}
        assert sorted((w["name"], w["version"]) for w in workers) == [("new", __version__), ("old", OLD_VERSION)]
        # the old registration predates the field: its release's protocol
        assert next(w for w in workers if w["name"] == "old")["protocol"] == PROTOCOL - 1
        new_id = next(i for i in by_id if by_id[i]["name"] == "new")
        wait_until(lambda: admin.hget(keys.worker(new_id), "protocol") == str(PROTOCOL),
                   what="this release's worker to call its own protocol's functions once the broker serves them")  # fmt: skip
        ran_by: dict[str, set[str]] = {"old": set(), "new": set()}
        for job in [*jobs.values(), half, queued]:
            for row in results(sides["new"], sub, job):
                side = by_id[row["worker"]]["name"]
                ran_by[side].add(str(Path(row["result"]["gpumesh"]).parent.parent))
        assert ran_by == {"old": {str(old_site)}, "new": {str(ROOT)}}, ran_by
        doctor = sides["new"].run("doctor", "--json", "--url", sub)
        (line,) = [line for line in json.loads(doctor.stdout) if line["check"] == "versions"]
        assert line["status"] == "warn" and f"serves protocol {PROTOCOL - 1}-{PROTOCOL}" in line["detail"], line
        assert f"{OLD_VERSION} (protocol {PROTOCOL - 1}) on 1" in line["detail"], line
        assert f"{__version__} (protocol {PROTOCOL}) on 1" in line["detail"], line
        assert libraries(admin) == sorted([scripts.library()[0], previous.name])
    finally:
        for side in sides.values():
            side.stop()
        serve.stop()
        admin.close()


def libraries(admin: redis.Redis) -> list[str]:
    entries = [dict(zip(e[::2], e[1::2])) if isinstance(e, list) else e for e in admin.function_list()]
    return sorted(str(e["library_name"]) for e in entries)


def test_two_protocols_apart_either_way_exits_at_start_in_one_line_naming_both_and_which_to_upgrade(
    env: dict[str, str], tmp_path: Path
):
    """A later release, two protocols on (this package with its protocol moved), against this release's broker,
    and this release against the later one's broker; then this release's load-functions on the later broker
    keeps the later library while a later worker calls it."""
    later = tmp_path / "later"
    shutil.copytree(ROOT / "gpumesh", later, ignore=shutil.ignore_patterns("__pycache__"))
    version = later / "_version.py"
    text = re.sub(r"(?m)^PROTOCOL = \d+", f"PROTOCOL = {PROTOCOL + 2}", version.read_text())
    text = re.sub(r"(?m)^OLDEST_PROTOCOL = \d+", f"OLDEST_PROTOCOL = {PROTOCOL + 1}", text)
    version.write_text(text.replace(f'__version__ = "{__version__}"', '__version__ = "9.0.0"'))
    python, _ = release_venv(tmp_path / "venv", later)
    sides = {"later": Side(python, env, tmp_path, "later"), "this": Side((sys.executable,), env, tmp_path, "this")}
    data, port = tmp_path / "broker", free_port()
    (tmp_path / "task.py").write_text(TASK)
    (tmp_path / "payloads.json").write_text("[{}]")
    serves: list[Serve] = []
    try:
        for serving, client, fix in (("this", "later", "upgrade the broker's gpumesh"),
                                     ("later", "this", "upgrade gpumesh on this machine")):  # fmt: skip
            if serves:
                serves[-1].stop()
            serves.append(Serve(env, data, port, python=sides[serving].python))
            serve, admin = serves[-1], admin_of(data, port)
            before = admin.dbsize()
            for args in (("worker", serve.url, "--score", "5"), ("submit", "task.py", "--payloads", "payloads.json",
                                                                 "--url", submit_url(serve))):  # fmt: skip
                p = sides[client].run(*args)
                said = [line for line in p.stderr.splitlines() if not re.match(r"\d{4}-\d\d-\d\d ", line)]
                assert p.returncode == 3 and len(said) == 1 and fix in said[0], p.stderr
                served = f"{PROTOCOL - 1}-{PROTOCOL}" if serving == "this" else f"{PROTOCOL + 2}"
                assert f"serves gpumesh protocol {served}" in said[0] and "speaks protocol" in said[0], said
            assert admin.dbsize() == before and admin.zcard(keys.WORKERS) == 0, "nothing written"

        # The later broker downgraded while a later worker runs: this release's load-functions serves its own two
        # protocols again, and keeps the later one's library for as long as a live worker calls it.
        later_worker = sides["later"].worker(serve.url, admin)
        later_lib = f"gpumesh_p{PROTOCOL + 2}"
        p = sides["this"].run("access", "load-functions", "--data-dir", str(data))
        assert p.returncode == 0 and f"kept {later_lib} (still called by live worker later-" in p.stderr, p.stderr
        previous = protocols.frozen(PROTOCOL - 1)
        assert previous is not None
        assert libraries(admin) == sorted([later_lib, scripts.library()[0], previous.name])
        sides["later"].stop()
        assert later_worker.returncode == 0
        p = sides["this"].run("access", "load-functions", "--data-dir", str(data))
        assert p.returncode == 0 and "kept" not in p.stderr, p.stderr
        assert libraries(admin) == sorted([scripts.library()[0], previous.name])
    finally:
        sides["later"].stop()
        if serves:
            serves[-1].stop()


def test_a_release_that_changes_a_script_but_not_the_protocol_works_beside_this_one(
    env: dict[str, str], tmp_path: Path
):
    """Another build of this protocol (a comment added to a script: other bytes, the same contract) runs its
    worker and submitter against this release's serve, which loaded its own code of the same functions."""
    patched = tmp_path / "patched"
    shutil.copytree(ROOT / "gpumesh", patched, ignore=shutil.ignore_patterns("__pycache__"))
    dispatch = patched / "store" / "lua" / "dispatch.lua"
    dispatch.write_text("-- a comment a later build added\n" + dispatch.read_text())
    python, _ = release_venv(tmp_path / "venv", patched)
    theirs = json.loads(subprocess.run([*python, "-c", "import json; from gpumesh.store import scripts; "
                                        "print(json.dumps(scripts.library()))"], capture_output=True, text=True,
                                       check=True, cwd=tmp_path).stdout)  # fmt: skip
    assert theirs[0] == scripts.library()[0] and theirs[1] != scripts.library()[1], "same name, other code"
    side = Side(python, env, tmp_path, "patched")
    data, port = tmp_path / "broker", free_port()
    serve = Serve(env, data, port)
    admin = admin_of(data, port)
    runs = tmp_path / "runs"
    runs.mkdir()
    try:
        side.worker(serve.url, admin)
        job = side.submit(submit_url(serve), [{"runs": str(runs)}] * 3)
        ended(admin, job)
        done_once(results(side, submit_url(serve), job), runs, job, 3)
        loaded = admin.fcall_ro(f"{scripts.library()[0]}_version", 0)
        assert loaded.split()[1] in scripts.library()[1], "the broker runs the code its serve loaded"
    finally:
        side.stop()
        serve.stop()
        admin.close()
