"""The web dashboard (gpumesh.dashboard) without a browser: each page against a real broker and
an in-process worker, everything a task or a submitter can set coming back escaped, a worker credential
getting a read-only view that refuses writes, the form token and same-origin checks, artifact downloads
as attachments, and the timeline's SVG drawn from attempts alone."""

from __future__ import annotations

import html
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
from starlette.testclient import TestClient

import gpumesh
from gpumesh._version import PROTOCOL
from gpumesh.dashboard import timeline
from gpumesh.dashboard.app import create_app
from gpumesh.extras import install_hint
from gpumesh.server.broker_server import ROLES, prepare
from gpumesh.settings import Settings
from gpumesh.store import keys
from gpumesh.store.broker import Broker

from ..conftest import ROOT, MeshWorkers, RedisServer, cli, free_port

EVIL = "<script>alert(1)</script>"
FILE = "out <script>x.txt"  # a file name cannot hold the "/" of "</script>"
SCRIPT = f"""import json, os, sys
p = json.load(sys.stdin)
print("log line {EVIL}")
print("to stderr {EVIL}", file=sys.stderr)
with open(os.path.join(os.environ["GPUMESH_OUTPUT_DIR"], "{FILE}"), "w") as f:
    f.write("bytes of " + str(p["i"]))
if p.get("fail"):
    raise ValueError("bad {EVIL}")
print(json.dumps({{"echo": p["tag"]}}))
"""
ORIGIN = {"origin": "http://testserver"}


@pytest.fixture
def mesh(broker: Broker) -> Iterator[gpumesh.Mesh]:
    with gpumesh.connect() as m:
        yield m


@pytest.fixture
def ran(mesh: gpumesh.Mesh, mesh_worker: MeshWorkers) -> gpumesh.Job:
    """A job of three tasks (one failing) that a live worker named like an attack has run."""
    mesh_worker.start(name=f"w{EVIL}", score=7)
    payloads = [{"i": 0, "tag": EVIL}, {"i": 1, "tag": EVIL}, {"i": 2, "tag": EVIL, "fail": True}]
    job = mesh.submit(SCRIPT, payloads, name=f"job {EVIL}", priority=3)
    job.wait(timeout=60)
    return job


def role_url(r: redis.Redis, redis_server: RedisServer, role: str) -> str:
    """A credential of ``role`` on the test Redis, as `gpumesh access add` makes one."""
    user, password = f"{role}-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    r.execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}", *ROLES[role])
    prepare(r)  # gpumesh's functions and the epoch, which these credentials may not make
    return f"redis://{user}:{password}@127.0.0.1:{redis_server.port}/0"


def no_raw_markup(text: str) -> None:
    assert "<script>alert" not in text and "&lt;script&gt;" in text


@pytest.mark.core
def test_pages_show_the_mesh_and_escape_what_tasks_and_submitters_set(ran: gpumesh.Job, mesh: gpumesh.Mesh):
    client = TestClient(create_app(mesh))
    page = client.get("/")
    assert page.status_code == 200 and 'id="nav-mesh"' in page.text and 'id="nav-jobs"' in page.text
    (worker,) = mesh.workers()
    assert (
        f'<tr class="worker" data-worker="{html.escape(worker.id)}">' in page.text
        and 'data-live="/live/workers"' in page.text
    )
    assert worker.device == "cpu" and '<td class="gpu">—</td>' in page.text, "a processor is not shown as a GPU"
    assert f'<td class="release">{gpumesh.__version__} (protocol {PROTOCOL})</td>' in page.text
    # each tier's RQ queue, and the one the lone worker serves (the top tier) names it
    assert 'id="tiers"' in page.text and f"<code>gpumesh-tier-2</code></td><td>{html.escape(worker.name)}" in page.text
    no_raw_markup(page.text)

    jobs = client.get("/jobs").text
    assert f'<tr class="job" data-job="{ran.id}" data-status="failed">' in jobs
    assert f'<a class="job-link" href="/jobs/{ran.id}">' in jobs and 'value="2" max="3"' in jobs
    assert re.search(r'class="failure">exit code 1 · ValueError: bad &lt;script&gt;', jobs), re.findall(
        'class="failure">.*', jobs
    )
    no_raw_markup(jobs)

    job = client.get(f"/jobs/{ran.id}").text
    assert 'data-status="failed" data-done="2" data-total="3" data-failed="1"' in job
    assert len(re.findall(r'<tr class="task" data-index="\d" data-status="(done|failed)">', job)) == 3
    assert 'id="timeline-link"' in job and f'href="/tasks/{ran.id}-0/logs"' in job
    assert 'id="cancel"' not in job and 'id="retry"' in job, "ended: no cancel; a failed task: retry"
    assert "&#34;echo&#34;" in job or "&quot;echo&quot;" in job, "the result's JSON, escaped"
    no_raw_markup(job)

    log = client.get(f"/tasks/{ran.id}-0/logs").text
    assert 'data-ended="1"' in log and '<span class="line stream-stdout">log line &lt;script&gt;' in log
    assert '<span class="line stream-stderr">to stderr &lt;script&gt;' in log
    no_raw_markup(log)

    svg = client.get(f"/jobs/{ran.id}/timeline.svg")
    assert svg.headers["content-type"].startswith("image/svg+xml")
    assert svg.text.count('<rect class="attempt ') == len(ran.attempts()) == 3
    no_raw_markup(client.get(f"/jobs/{ran.id}/timeline").text)


@pytest.mark.security
def test_headers_forbid_inline_script_and_framing_and_pages_hold_no_secret(
    r: redis.Redis, redis_server: RedisServer, ran: gpumesh.Job
):
    url = role_url(r, redis_server, "submitter")
    password = url.split(":")[2].split("@")[0]
    with gpumesh.connect(url) as mesh:
        client = TestClient(create_app(mesh))
        pages = [client.get(p).text for p in ("/", "/jobs", f"/jobs/{ran.id}", f"/jobs/{ran.id}/timeline")]
        assert all(password not in page for page in pages) and "redis://" in pages[0]  # the URL, masked
        res = client.get("/jobs")
        assert "default-src 'self'" in res.headers["content-security-policy"]
        assert res.headers["x-frame-options"] == "DENY" and res.headers["x-content-type-options"] == "nosniff"
        assert "<script>" not in res.text.replace('<script src="/static/dashboard.js" defer></script>', "")
        assert client.get("/healthz").text == "ok"
        assert client.get("/static/dashboard.js").status_code == 200
        unknown = client.get("/jobs/nosuchjob")
        assert unknown.status_code == 404 and "nosuchjob" in unknown.text and "Traceback" not in unknown.text
        assert client.get("/live/job/nosuchjob").status_code == 404


@pytest.mark.security
def test_artifacts_download_as_attachments_from_the_index_only(ran: gpumesh.Job, mesh: gpumesh.Mesh, r: redis.Redis):
    client = TestClient(create_app(mesh))
    job = client.get(f"/jobs/{ran.id}").text
    links = re.findall(r'<a class="artifact" href="([^"]+)"', job)
    assert len(links) == 2, job  # the done tasks' files; the failed one's were not kept
    res = client.get(links[0])
    assert res.status_code == 200 and res.content == b"bytes of 0"
    disposition = res.headers["content-disposition"]
    assert disposition.startswith('attachment; filename="out_script_x.txt"'), disposition
    assert res.headers["content-type"] == "application/octet-stream"
    for path in ("/etc/passwd", "../../etc/passwd", "out.txt", f"{FILE}.x"):
        assert client.get(f"/jobs/{ran.id}/files/0/{path}").status_code == 404, path
    assert client.get(f"/jobs/{ran.id}/files/2/out%20x.txt").status_code == 404  # the failed task stored none
    r.hset(keys.task_files(keys.task_id(ran.id, 0)), "0:0", b"bytes of 9")  # same size, another checksum
    damaged = client.get(links[0])
    assert damaged.status_code == 502 and "checksum" in damaged.text and b"bytes of" not in damaged.content


@pytest.mark.security
def test_a_worker_credential_sees_no_button_and_may_not_cancel(
    mesh: gpumesh.Mesh, r: redis.Redis, redis_server: RedisServer
):
    job = mesh.submit("import json\nprint(json.dumps(1))\n", [{"i": 0}], name="queued")  # no worker: stays queued
    with gpumesh.connect(role_url(r, redis_server, "worker")) as as_worker:
        client = TestClient(create_app(as_worker))  # probes: read-only
        page = client.get(f"/jobs/{job.id}").text
        assert "read-only" in page and 'id="cancel"' not in page and 'id="retry"' not in page
        assert f'action="/jobs/{job.id}/cancel"' not in page
        token = client.app.state.view.csrf  # type: ignore[attr-defined]
        for action in ("cancel", "retry"):
            res = client.post(f"/jobs/{job.id}/{action}", data={"csrf": token}, headers=ORIGIN, follow_redirects=False)
            assert res.status_code == 403 and "read-only" in res.text
    assert job.status().status == "queued"


@pytest.mark.security
def test_a_submitter_credential_cancels_with_the_token_from_this_host_only(
    mesh: gpumesh.Mesh, r: redis.Redis, redis_server: RedisServer
):
    job = mesh.submit("import json\nprint(json.dumps(1))\n", [{"i": 0}, {"i": 1}])
    with gpumesh.connect(role_url(r, redis_server, "submitter")) as as_submitter:
        client = TestClient(create_app(as_submitter))
        page = client.get(f"/jobs/{job.id}").text
        assert "may cancel and retry" in page and '<button id="cancel"' in page and 'id="retry"' not in page
        token = re.search(r'name="csrf" value="([^"]+)"', page).group(1)  # type: ignore[union-attr]
        url = f"/jobs/{job.id}/cancel"
        refused = [
            client.post(url, data={}, headers=ORIGIN),
            client.post(url, data={"csrf": "x" + token}, headers=ORIGIN),
            client.post(url, data={"csrf": token}, headers={"origin": "http://evil.example"}),
            client.post(url, data={"csrf": token}, headers={"referer": "http://evil.example/jobs"}),
            client.post(url, data={"csrf": token}),  # neither Origin nor Referer
        ]
        assert [res.status_code for res in refused] == [403] * 5
        assert job.status().status == "queued"
        res = client.post(url, data={"csrf": token}, headers=ORIGIN, follow_redirects=False)
        assert res.status_code == 303 and res.headers["location"] == f"/jobs/{job.id}"
        assert job.status().status == "cancelled"
        page = client.get(f"/jobs/{job.id}").text
        assert 'id="cancel"' not in page and '<button id="retry"' in page
        res = client.post(f"/jobs/{job.id}/retry", data={"csrf": token}, headers=ORIGIN, follow_redirects=False)
        assert res.status_code == 303 and job.status().tasks.queued == 2


@pytest.mark.core
def test_an_unreachable_broker_is_one_masked_line_not_a_traceback(env):
    url = f"redis://:hunter2-secret@127.0.0.1:{free_port()}/0"
    mesh = gpumesh.Mesh(Broker(Settings.load(url=url), retries=1, health_check=False))
    client = TestClient(create_app(mesh, may_write=False))
    for path in ("/", "/jobs", "/jobs/abc"):
        res = client.get(path)
        assert res.status_code == 503 and "broker unreachable: " in res.text, res.text
        assert "hunter2" not in res.text and "Traceback" not in res.text


@pytest.mark.core
def test_a_task_s_live_log_stream_ends_once_the_task_has(ran: gpumesh.Job, mesh: gpumesh.Mesh):
    client = TestClient(create_app(mesh))
    with client.stream("GET", f"/live/logs/{ran.id}-1") as res:
        assert res.headers["content-type"].startswith("text/event-stream")
        body = "".join(res.iter_text())
    assert "event: lines" in body and "log line &lt;script&gt;" in body and body.endswith("event: end\ndata: \n\n")
    assert "<script>alert" not in body


@pytest.mark.processes
def test_the_command_says_where_it_listens_and_stops_at_once_with_streams_open(env: dict[str, str], broker: Broker):
    args = [sys.executable, "-m", "gpumesh", "dashboard", "--port", "0"]
    with subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            found = re.fullmatch(r"gpumesh dashboard: (http://127\.0\.0\.1:\d+/) \(may cancel and retry\)\n", line)
            assert found, line
            base = found.group(1)
            with urllib.request.urlopen(base + "healthz", timeout=5) as res:
                assert res.read() == b"ok"
            # a page of another site whose name resolves to 127.0.0.1 (DNS rebinding) is answered nothing
            rebound = urllib.request.Request(base + "jobs", headers={"Host": "attacker.example:80"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(rebound, timeout=5)
            refused.value.close()
            assert refused.value.code == 400
            with urllib.request.urlopen(base + "live/workers", timeout=5) as live:  # an open event stream
                assert live.readline().startswith(b"data: ")
                started = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                _out, err = proc.communicate(timeout=10)
                assert time.monotonic() - started < 3, "open event streams held the server up"
            assert "Traceback" not in err, err
        finally:
            proc.kill()


@pytest.mark.core
def test_without_its_extra_the_command_says_what_to_install(env: dict[str, str], monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delitem(sys.modules, "gpumesh.dashboard.app", raising=False)
    for name in [m for m in sys.modules if m.partition(".")[0] == "starlette"] + ["starlette"]:
        monkeypatch.setitem(sys.modules, name, None)  # what an install without the extra finds
    ran = cli("dashboard")
    assert ran.returncode == 2, ran.stderr
    assert ran.stderr.strip() == f"gpumesh dashboard needs its extra: {install_hint('dashboard')}"
    assert f"{ROOT}[dashboard]" in ran.stderr  # this checkout's extra: the name is not on the package index


@dataclass(frozen=True)
class FakeAttempt:
    index: int
    task_id: str
    attempt: int
    worker: str
    copy: str
    started_at: float | None
    ended_at: float | None
    outcome: str
    kind: str | None = None


@pytest.mark.core
def test_timeline_draws_one_rect_per_attempt_in_lanes_strongest_first():
    attempts = [
        FakeAttempt(0, "j-0", 1, "weak", "primary", 100.0, 160.0, "superseded"),
        FakeAttempt(0, "j-0", 1, "strong", "backup", 120.0, 130.0, "done"),
        FakeAttempt(1, "j-1", 1, "strong", "primary", 100.0, 100.001, "failed", "script"),
        FakeAttempt(2, "j-2", 2, f"gone{EVIL}", "primary", 150.0, None, "running"),
        FakeAttempt(3, "j-3", 1, "weak", "primary", 140.0, 150.0, "handed back"),
        FakeAttempt(4, "j-4", 1, "weak", "primary", None, None, "running"),  # start not recorded: not drawn
    ]
    lanes = [timeline.Lane("weak", "laptop", 2.0), timeline.Lane("strong", f"a100{EVIL}", 900.0)]
    svg = timeline.render(attempts, lanes, now=200.0)
    assert svg.startswith('<svg id="timeline"') and svg.count('<rect class="attempt ') == 5
    order = re.findall(r'<g class="lane" data-worker="([^"]+)">', svg)
    assert order == ["strong", "weak", "gone&lt;script&gt;alert(1)&lt;/script&gt;"]
    assert "<script>" not in svg and "a100&lt;script&gt;" in svg
    backup = re.search(
        r'<rect class="attempt outcome-done backup" data-task="0" data-attempt="1" data-copy="backup"[^>]*>', svg
    )
    assert backup and "stroke-dasharray" in backup.group(0)
    tiny = re.search(r'data-task="1"[^>]* width="([\d.]+)"', svg)
    assert tiny and float(tiny.group(1)) == timeline.MIN_BAR
    running = re.search(r'data-task="2"[^>]* x="([\d.]+)" y="[\d.]+" width="([\d.]+)"', svg)
    assert running and abs(float(running.group(1)) + float(running.group(2)) - (timeline.WIDTH - 10)) < 0.2
    assert 'class="attempt outcome-handed-back"' in svg and "<title>task 1 (j-1), attempt 1" in svg
    assert timeline.render([], lanes, now=0.0).count("<rect class=") == 0


@pytest.mark.security
def test_a_job_id_is_not_a_task_s_log_and_a_cr_forges_no_event(ran: gpumesh.Job, mesh: gpumesh.Mesh):
    """/tasks/ID/logs reads one task's log: a job's id there (every task's log, re-read twice a second) is
    404. And a CR in what a task prints or a job is named (a progress bar's) ends no SSE data line early."""
    from gpumesh.dashboard.app import sse

    client = TestClient(create_app(mesh))
    assert client.get(f"/tasks/{ran.id}/logs").status_code == 404
    assert client.get(f"/live/logs/{ran.id}").status_code == 404
    assert client.get(f"/tasks/{ran.id}-0/logs").status_code == 200
    frame = sse("progress 10%\rprogress 50%\r\revent: end\rdata: x\r\nlast", event="lines")
    fields = [line.partition(":")[0] for line in re.split(r"\r\n|\r|\n", frame.rstrip("\n"))]
    assert fields == ["event"] + ["data"] * 6, frame


@pytest.mark.security
def test_garbage_a_credential_writes_into_a_job_or_a_registration_breaks_no_page(
    ran: gpumesh.Job, mesh: gpumesh.Mesh, r: redis.Redis
):
    other = mesh.submit("print(1)", [{"i": 0}], name="fine")
    r.hset(keys.job(ran.id), mapping={"created_at": "x", "priority": "high"})  # any worker credential may
    for w, fields in (("w-bad", {"resources": "{not json"}), ("w-far", {"last_heartbeat": "1e300"}),
                      ("w-deep", {"resources": "[" * 100_000})):  # fmt: skip
        r.hset(keys.worker(w), mapping={"name": w, **fields})
        r.zadd(keys.WORKERS, {w: time.time() * 1000})
        r.zadd(keys.SCORES, {w: 1.0})
    failed = next(t for t in r.lrange(keys.job_tasks(ran.id), 0, -1) if r.hget(keys.task(t), "status") == "failed")
    r.hset(keys.task(failed), "duration", "x")  # the failure the jobs page shows, unreadable
    client = TestClient(create_app(mesh))
    jobs = client.get("/jobs")
    assert jobs.status_code == 200 and other.id in jobs.text
    assert client.get("/").status_code == 200


@pytest.mark.core
def test_timeline_svg_is_well_formed_xml_whatever_names_hold_and_caps_its_lanes():
    from xml.dom import minidom

    attempts = [FakeAttempt(i, f"j-{i}", 1, f"w\x01{i % 300}", "primary", 100.0 + i, 101.0 + i, "done")
                for i in range(600)]  # fmt: skip
    svg = timeline.render(attempts, [], now=1000.0)
    minidom.parseString(svg)  # raises on a control character XML cannot hold
    assert svg.count('class="lane"') == timeline.MAX_LANES and "not drawn" in svg


@pytest.mark.core
def test_the_jobs_page_names_a_task_that_is_failed_now_after_a_retry(broker: Broker, r: redis.Redis):
    """Tasks 0 and 1 fail, the job is retried, task 0 then completes and task 1 fails again: the failure
    shown is task 1's (the job's list of failures still names task 0 first), and task 1 is listed once."""
    from gpumesh.models import JobOptions
    from gpumesh.store import scripts

    job = broker.submit("print(1)", "s.py", [{"i": 0}, {"i": 1}], JobOptions(max_attempts=1)).job_id
    t0, t1 = broker.task_ids(job)
    for t, why in ((t0, "zero broke"), (t1, "one broke")):
        lease = scripts.acquire(broker.scripts, r, t, "w", 30_000)
        assert isinstance(lease, scripts.Lease)
        scripts.fail(broker.scripts, r, lease, "w", why, 0.1)
    broker.retry(job)
    scripts.complete(broker.scripts, r, scripts.acquire(broker.scripts, r, t0, "w", 30_000), "w", "1", 0.1)
    scripts.fail(broker.scripts, r, scripts.acquire(broker.scripts, r, t1, "w", 30_000), "w", "one broke again", 0.1)
    assert broker.first_failures([job])[job].task_id == t1
    with gpumesh.connect() as mesh:
        failed, n = mesh.job(job).failures()
        assert [f.task_id for f in failed] == [t1] and n == 1
        page = TestClient(create_app(mesh)).get("/jobs").text
    assert "one broke again" in page and "zero broke" not in page
