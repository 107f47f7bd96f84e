"""The web dashboard as a person sees it in a browser: a real mesh (Redis, `gpumesh worker`
processes), a real `gpumesh dashboard` process and a headless Chromium. Each test asserts what is on the
screen: live workers and their disappearance, progress that moves without a reload, a task's error, the
cancel button that stops running tasks, one timeline bar per attempt in its worker's lane, and what a
read-only credential and hostile task output cannot do. With GPUMESH_SCREENSHOTS=1 the pages' screenshots
refresh docs/screenshots/ (docs/how-to/watch.md shows them).

The live regions are server-sent events swapped into the page about once a second; a marker left on the
window when the page loaded (tests/browser.py) tells an update in place from a reload."""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import signal
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import gpumesh
from gpumesh.server import acl

from .. import browser
from ..browser import Dashboard, click, data, exists, open_page, rows, screenshot
from ..conftest import FAST, RedisServer, Workers, pid_alive, wait_until, written

HEARTBEAT_S = float(FAST["GPUMESH_HEARTBEAT_INTERVAL"])
# A worker is online while its last heartbeat is within 2 heartbeats + 1 s; the page hears of it at its
# next live update (about a second), and a loaded CI machine gets a second more.
GONE_WITHIN_S = 2 * HEARTBEAT_S + 1 + 1 + 1.5

SCRIPT = """import json, os, sys, time
p = json.load(sys.stdin)
print("training with lr", p.get("lr"), flush=True)
if "file" in p:
    open(os.path.join(os.environ["GPUMESH_OUTPUT_DIR"], "model.txt"), "w").write(p["file"])
if "pidfile" in p:
    open(p["pidfile"], "w").write(str(os.getpid()))
time.sleep(p.get("sleep", 0))
if "echo" in p:
    print(p["echo"], flush=True)
    print(p["echo"], file=sys.stderr, flush=True)
if p.get("fail"):
    raise ValueError("bad learning rate")
if p.get("flaky") and os.environ["GPUMESH_ATTEMPT"] == "1":
    raise RuntimeError("flaky: the first attempt fails")
print(json.dumps({"h": p["echo"]} if "echo" in p else {"lr": p.get("lr"), "loss": round(1 / (1 + p["i"]), 4)}))
"""

HOSTILE = "<img src=x onerror=window.__pwned=1>"
HOSTILE_NAME = "<script>window.__pwned=1</script>"


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    d = browser.launch()
    yield d
    browser.quit(d)


@pytest.fixture
def mesh(env: dict[str, str], r: redis.Redis) -> Iterator[gpumesh.Mesh]:
    m = gpumesh.connect(env["GPUMESH_URL"])
    yield m
    m.close()


class Dashboards:
    """The test's `gpumesh dashboard` processes; the browser leaves their pages before they are stopped."""

    def __init__(self, env: dict[str, str], tmp: Path, driver: Any) -> None:
        self.env, self.tmp, self.driver = env, tmp, driver
        self.started: list[Dashboard] = []

    def start(self, url: str | None = None) -> Dashboard:
        d = Dashboard(self.env, url or self.env["GPUMESH_URL"], self.tmp)
        self.started.append(d)
        if d.login:  # as its user does: the address it printed, with its access token
            self.driver.get(d.login)
        return d

    def stop_all(self) -> None:
        self.driver.get("about:blank")
        for d in self.started:
            d.stop()


@pytest.fixture
def dashboards(env: dict[str, str], tmp_path: Path, driver: Any) -> Iterator[Dashboards]:
    ds = Dashboards(env, tmp_path, driver)
    yield ds
    ds.stop_all()


def submit(mesh: gpumesh.Mesh, payloads: list[dict[str, Any]], **options: Any) -> gpumesh.Job:
    return mesh.submit(SCRIPT, payloads, **options)


def first_number(s: str) -> float:
    match = re.search(r"\d+(?:\.\d+)?", s)
    assert match, f"no number in {s!r}"
    return float(match.group())


def current_tasks(mesh: gpumesh.Mesh) -> dict[str, str | None]:
    return {w.id: w.current_task for w in mesh.workers()}


@pytest.mark.processes
def test_mesh_page_lists_live_workers_and_drops_a_killed_one_without_a_reload(
    driver: Any, workers: Workers, mesh: gpumesh.Mesh, dashboards: Dashboards
):
    strong = workers.start("--name", "lab-a100", "--resource", "dataset=imagenet", score=120)
    workers.start("--name", "laptop", score=8)
    live = {w.name: w for w in mesh.workers()}
    assert set(live) == {"lab-a100", "laptop"}
    dash = dashboards.start()
    assert dash.mode == "may cancel and retry", dash.lines  # the test Redis's default user writes everything
    open_page(driver, dash.url("/"))
    assert exists(driver, "nav a#nav-mesh[href='/']") and exists(driver, "nav a#nav-jobs[href='/jobs']")
    assert exists(driver, "[data-live^='/live/']"), "the workers table is a live region"
    shown = {row["data"]["worker"]: row["cells"] for row in rows(driver, "#workers tr.worker")}
    assert set(shown) == {w.id for w in live.values()}
    for w in live.values():
        cells = shown[w.id]
        assert cells["name"] == w.name
        assert first_number(cells["score"]) == w.score_gflops
        assert cells["task"] == "idle"
        assert cells["device"] == w.device
        assert re.search(r"\d+ s ago", cells["heartbeat"]), cells["heartbeat"]
    assert "dataset=imagenet" in shown[live["lab-a100"].id]["resources"]
    assert "dataset" not in shown[live["laptop"].id]["resources"]
    screenshot(driver, "mesh")

    os.killpg(strong.pid, signal.SIGKILL)
    strong.wait()
    killed = time.monotonic()
    gone = live["lab-a100"].id
    wait_until(lambda: gone not in {row["data"]["worker"] for row in rows(driver, "#workers tr.worker")},
               timeout=GONE_WITHIN_S + 5, interval=0.1, what="the killed worker to leave #workers")  # fmt: skip
    took = time.monotonic() - killed
    assert took <= GONE_WITHIN_S, f"the killed worker stayed on the page {took:.1f} s"
    assert browser.not_reloaded(driver), "the page was reloaded: the live region did not update in place"
    assert [row["data"]["worker"] for row in rows(driver, "#workers tr.worker")] == [live["laptop"].id]
    silent = [row["data"]["worker"] for row in rows(driver, "#silent tr.worker")]
    assert silent in ([], [gone]), silent  # listed as silent until the reaper drops it
    # with an event stream still open, SIGTERM ends the dashboard promptly
    assert dash.stop() < 5, dash.output()
    assert dash.proc.returncode is not None


@pytest.mark.processes
def test_a_running_job_s_progress_advances_without_a_reload(
    driver: Any, workers: Workers, mesh: gpumesh.Mesh, dashboards: Dashboards
):
    workers.start("--name", "only", score=10)
    dash = dashboards.start()
    job = submit(mesh, [{"i": i, "lr": round(0.1 * (i + 1), 2), "sleep": 0.3} for i in range(12)], name="lr sweep")
    open_page(driver, dash.url(f"/jobs/{job.id}"))
    seen: list[int] = []
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        summary = data(driver, "#job-summary")
        assert summary is not None, driver.page_source[:2000]
        done = int(summary["done"])
        if not seen or done != seen[-1]:
            seen.append(done)
        if summary["status"] == "done":
            break
        time.sleep(0.1)
    assert browser.not_reloaded(driver), "the job page was reloaded"
    assert seen[-1] == 12 and summary["total"] == "12" and summary["failed"] == "0", (seen, summary)
    assert seen == sorted(seen), f"progress went backwards: {seen}"
    assert len(seen) >= 3, f"data-done increased fewer than twice while the page stayed open: {seen}"
    wait_until(lambda: len(rows(driver, "#tasks tr.task[data-status='done']")) == 12, what="12 done rows")
    tasks = rows(driver, "#tasks tr.task")
    assert [int(t["data"]["index"]) for t in tasks] == list(range(12))
    results = {res.index: res for res in job.results()}
    for t in tasks:
        res = results[int(t["data"]["index"])]
        assert json.loads(t["cells"]["result"]) == res.result  # short enough not to be truncated
        assert res.worker and res.worker in t["cells"]["worker"], (res.worker, t["cells"])
    assert exists(driver, f"a.log-link[href='/tasks/{results[0].task_id}/logs']")
    assert exists(driver, f"a#timeline-link[href='/jobs/{job.id}/timeline']")
    assert not exists(driver, "#cancel") and not exists(driver, "#retry"), "a done job has nothing to cancel or retry"
    screenshot(driver, "job")


@pytest.mark.processes
def test_the_job_and_jobs_pages_show_a_failed_task_s_error_and_a_done_task_s_files(
    driver: Any, workers: Workers, mesh: gpumesh.Mesh, dashboards: Dashboards
):
    workers.start("--name", "gaming-pc", score=30)
    dash = dashboards.start()
    baseline = submit(mesh, [{"i": i, "lr": 0.5, "file": f"weights {i}"} for i in range(3)], name="baseline")
    baseline.wait(timeout=60)
    open_page(driver, dash.url(f"/jobs/{baseline.id}"))
    links = driver.execute_script("return [...document.querySelectorAll('#tasks a.artifact')].map(a => a.href);")
    assert links == [dash.url(f"/jobs/{baseline.id}/files/{i}/model.txt") for i in range(3)]
    with urllib.request.urlopen(links[1], timeout=10) as download:
        assert download.headers["Content-Disposition"].startswith("attachment"), download.headers
        assert download.read() == b"weights 1"
    with urllib.request.urlopen(dash.url("/healthz"), timeout=10) as health:
        assert health.read().strip() == b"ok"
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(dash.url("/jobs/nosuchjob"), timeout=10)
    assert missing.value.code == 404
    missing.value.close()
    job = submit(mesh, [{"i": 0, "lr": 0.1}, {"i": 1, "lr": 10.0, "fail": True}, {"i": 2, "lr": 0.01}],
                 name="lr sweep")  # fmt: skip
    assert job.wait(timeout=60).status == "failed"
    open_page(driver, dash.url(f"/jobs/{job.id}"))
    summary = data(driver, "#job-summary") or {}
    assert [summary.get(k) for k in ("status", "done", "total", "failed")] == ["failed", "2", "3", "1"], summary
    (failed,) = rows(driver, "#tasks tr.task[data-status='failed']")
    assert failed["data"]["index"] == "1"
    assert "ValueError: bad learning rate" in failed["cells"]["error"], failed["cells"]
    assert "\n" not in failed["cells"]["error"], "the first line of the error, not the traceback"
    assert "script" in failed["cells"]["error-kind"], failed["cells"]
    assert [r["cells"]["error"] for r in rows(driver, "#tasks tr.task[data-status='done']")] == ["", ""]
    assert exists(driver, "#retry") and not exists(driver, "#cancel")

    open_page(driver, dash.url("/jobs"))
    listed = {row["data"]["job"]: row for row in rows(driver, "#jobs tr.job")}
    assert set(listed) == {job.id, baseline.id}
    assert listed[job.id]["data"]["status"] == "failed" and listed[baseline.id]["data"]["status"] == "done"
    assert "ValueError: bad learning rate" in listed[job.id]["cells"]["failure"]
    assert listed[baseline.id]["cells"].get("failure", "") == ""
    assert "2/3" in listed[job.id]["text"] and "3/3" in listed[baseline.id]["text"]
    progress = driver.execute_script(
        "const p = document.querySelector(`#jobs tr.job[data-job='${arguments[0]}'] progress.progress`);"
        "return p && [p.value, p.max];",
        job.id,
    )
    assert progress == [2, 3]
    assert exists(driver, f"#jobs a.job-link[href='/jobs/{job.id}']")
    screenshot(driver, "jobs")


@pytest.mark.processes
def test_cancel_from_the_job_page_stops_the_running_tasks(
    driver: Any, workers: Workers, mesh: gpumesh.Mesh, dashboards: Dashboards, tmp_path: Path
):
    workers.start("--name", "a", score=20)
    workers.start("--name", "b", score=10)
    dash = dashboards.start()
    assert dash.mode == "may cancel and retry"
    pidfiles = [tmp_path / f"pid-{i}" for i in range(3)]
    job = submit(mesh, [{"i": i, "sleep": 30, "pidfile": str(f)} for i, f in enumerate(pidfiles)], name="long",
                 speculate=False)  # fmt: skip
    wait_until(lambda: all(current_tasks(mesh).values()), what="both workers to run a task")

    def two_running() -> list[int] | None:
        pids = [int(t) for t in map(written, pidfiles) if t]
        return pids if len(pids) == 2 else None

    pids = wait_until(two_running, what="two tasks to start")
    open_page(driver, dash.url(f"/jobs/{job.id}"))
    assert data(driver, "#job-summary")["status"] == "running"
    assert not exists(driver, "#retry"), "nothing failed or was cancelled yet"
    clicked = time.monotonic()
    click(driver, "form[action$='/cancel'] button#cancel")
    wait_until(lambda: (data(driver, "#job-summary") or {}).get("status") == "cancelled", timeout=10,
               what="the job page to say cancelled")  # fmt: skip
    assert driver.current_url.rstrip("/") == dash.url(f"/jobs/{job.id}"), "303 back to the job page"
    assert job.status().status == "cancelled"
    wait_until(lambda: not any(map(pid_alive, pids)), timeout=5, what="the running tasks to be killed")
    assert time.monotonic() - clicked < 6
    wait_until(lambda: not any(current_tasks(mesh).values()), timeout=5,
               what="the workers to stop showing the cancelled tasks as their current task")  # fmt: skip
    assert not exists(driver, "#cancel") and exists(driver, "#retry"), "cancelled tasks may be retried"
    assert {r["data"]["status"] for r in rows(driver, "#tasks tr.task")} == {"cancelled"}
    open_page(driver, dash.url("/"))
    assert [r["cells"]["task"] for r in rows(driver, "#workers tr.worker")] == ["idle", "idle"]


def legend_keys(driver: Any) -> dict[str, dict[str, str]]:
    """The timeline legend's keys as the browser drew them: per outcome, its key's fill, the colour under
    it (a pattern's own) and its pattern's mark ("plain" for a colour alone)."""
    return driver.execute_script("""
        const keys = {};
        for (const g of document.querySelectorAll('svg#timeline g.legend g.key')) {
          const rect = g.querySelector('rect'), fill = rect.getAttribute('fill');
          const id = (fill.match(/^url\\(#(.+)\\)$/) || [])[1];
          const tile = id && document.getElementById(id);
          keys[g.dataset.outcome] = {
            fill, mark: tile ? tile.dataset.mark : 'plain',
            colour: getComputedStyle(tile ? tile.querySelector('rect') : rect).fill,
            shown: g.getBoundingClientRect().width > 0 ? 'yes' : 'no'};
        }
        return keys;
    """)


def _lab(rgb: str) -> tuple[float, float, float]:
    """CIELAB (D65) of a computed ``rgb(r, g, b)``."""
    r, g, b = (int(v) / 255 for v in re.findall(r"\d+", rgb)[:3])
    r, g, b = ((c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4) for c in (r, g, b))
    x, y, z = ((0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047, 0.2126 * r + 0.7152 * g + 0.0722 * b,
               (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883)  # fmt: skip
    f = [v ** (1 / 3) if v > 0.008856 else 7.787 * v + 16 / 116 for v in (x, y, z)]
    return 116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])


def assert_outcomes_told_apart(keys: dict[str, dict[str, str]]) -> None:
    """Every outcome a colour of its own, far from every other's (CIELAB ΔE76); retried, lost and handed back
    (once three oranges) far apart; and those, with failed, a pattern each besides, for colour-blind readers."""
    outcomes = ["running", "done", "failed", "retried", "lost", "handed back", "cancelled", "superseded"]
    assert set(outcomes) <= set(keys) and all(keys[o]["shown"] == "yes" for o in outcomes), keys
    lab = {o: _lab(keys[o]["colour"]) for o in outcomes}
    for i, a in enumerate(outcomes):
        for b in outcomes[i + 1 :]:
            far = 40 if {a, b} <= {"retried", "lost", "handed back"} else 25
            assert math.dist(lab[a], lab[b]) >= far, (a, b, keys[a]["colour"], keys[b]["colour"])
    marked = ["failed", "retried", "lost", "handed back"]
    marks = [keys[o]["mark"] for o in marked]
    assert "plain" not in marks and len(set(marks)) == len(marks), {o: keys[o]["mark"] for o in outcomes}
    assert keys["done"]["mark"] == "plain"


@pytest.mark.processes
def test_the_timeline_draws_one_bar_per_attempt_in_its_worker_s_lane(
    driver: Any, workers: Workers, mesh: gpumesh.Mesh, dashboards: Dashboards
):
    workers.start("--name", "lab-a100", score=40)
    workers.start("--name", "gaming-pc", score=25)
    scores = {w.id: w.score_gflops for w in mesh.workers()}
    dash = dashboards.start()
    payloads = [{"i": i, "lr": round(0.05 * (i + 1), 2), "sleep": 0.6} for i in range(8)]
    payloads[3]["flaky"] = True
    job = submit(mesh, payloads, name="timeline", retry_on="script", max_attempts=3, speculate=False)
    assert job.wait(timeout=60).status == "done"
    attempts = job.attempts()
    assert len(attempts) == 9 and all(a.ended_at is not None for a in attempts), attempts
    assert {(a.attempt, a.outcome) for a in attempts if a.index == 3} == {(1, "retried"), (2, "done")}
    assert len({a.worker for a in attempts}) == 2, "both workers ran tasks (a lane each)"

    open_page(driver, dash.url(f"/jobs/{job.id}/timeline"))
    drawn = driver.execute_script("""
        return [...document.querySelectorAll('svg#timeline g.lane')].map(g => ({
          worker: g.dataset.worker, top: g.getBoundingClientRect().top,
          rects: [...g.querySelectorAll('rect.attempt')].map(r => ({
            ...r.dataset, cls: r.getAttribute('class'), fill: r.getAttribute('fill'), x: r.getBoundingClientRect().left,
            width: r.getBoundingClientRect().width, title: (r.querySelector('title') || {}).textContent || ''}))}));
    """)
    lanes = {lane["worker"]: lane for lane in drawn}
    assert set(lanes) == set(scores), "one lane per worker"
    by_top = [lane["worker"] for lane in sorted(drawn, key=lambda lane: lane["top"])]
    assert by_top == sorted(scores, key=lambda w: -scores[w]), "strongest on top"
    bars = {(int(r["task"]), int(r["attempt"])): (lane["worker"], r) for lane in drawn for r in lane["rects"]}
    assert sum(len(lane["rects"]) for lane in drawn) == len(attempts), "one bar per attempt, no more"
    assert set(bars) == {(a.index, a.attempt) for a in attempts}
    for a in attempts:
        worker, rect = bars[(a.index, a.attempt)]
        assert worker == a.worker, f"task {a.index} attempt {a.attempt} drawn in the wrong lane"
        assert rect["copy"] == a.copy
        assert f"outcome-{a.outcome.replace(' ', '-')}" in rect["cls"].split(), (rect["cls"], a.outcome)
        assert rect["width"] >= 2
        assert a.outcome in rect["title"] and str(a.index) in rect["title"], rect["title"]
    started = {(a.index, a.attempt): a.started_at or 0.0 for a in attempts}
    for lane in drawn:  # x by start time: the lane's bars in the order their attempts started
        xs = [r["x"] for r in sorted(lane["rects"], key=lambda r: started[(int(r["task"]), int(r["attempt"]))])]
        assert xs == sorted(xs), (lane["worker"], xs)
    first, retry = bars[(3, 1)][1], bars[(3, 2)][1]
    assert retry["x"] >= first["x"] + first["width"] - 1, "the retry starts after the failed attempt ended"
    assert exists(driver, "svg#timeline text"), "lane labels and a time axis"
    keys = legend_keys(driver)
    assert_outcomes_told_apart(keys)
    for a in attempts:  # each bar drawn as its outcome's key shows it
        assert bars[(a.index, a.attempt)][1]["fill"] == keys[a.outcome]["fill"], (a.outcome, keys[a.outcome])
    screenshot(driver, "timeline")

    svg = urllib.request.urlopen(dash.url(f"/jobs/{job.id}/timeline.svg"), timeout=10)
    assert "svg" in svg.headers["Content-Type"] and b"<svg" in svg.read()

    retried = next(res for res in job.results() if res.index == 3)
    open_page(driver, dash.url(f"/tasks/{retried.task_id}/logs"))
    wait_until(lambda: data(driver, "#log") and data(driver, "#log").get("ended") == "1", timeout=10,
               what="the finished task's log to say it ended")  # fmt: skip
    lines = driver.execute_script(
        "return [...document.querySelectorAll('#log span.line')].map(s => [s.getAttribute('class'), s.textContent]);"
    )
    joined = "\n".join(t for _, t in lines)
    assert "RuntimeError: flaky: the first attempt fails" in joined
    assert joined.count("training with lr 0.2") == 2, "both attempts' output"
    assert any("stream-gpumesh" in c.split() for c, _ in lines), "the worker's notes"
    assert any("stream-stderr" in c.split() for c, _ in lines) and any("stream-stdout" in c.split() for c, _ in lines)
    screenshot(driver, "logs")


def post(dash: Dashboard, path: str, token: str | None, origin: str | None, referer: str | None = None) -> int:
    """POST a form to the dashboard as a script outside the browser would; returns the HTTP status."""
    form = urllib.parse.urlencode({} if token is None else {"csrf": token}).encode()
    headers = {k: v for k, v in (("Origin", origin), ("Referer", referer)) if v is not None}
    request = urllib.request.Request(dash.url(path), data=form, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code


def worker_credential(r: redis.Redis, redis_server: RedisServer) -> tuple[str, str]:
    """An ACL user with a worker's rules on the test Redis: (its URL, its password)."""
    password = secrets.token_hex(16)
    r.execute_command("ACL", "SETUSER", "dash-worker", "reset", "on", f">{password}", *acl.WORKER)
    return f"redis://dash-worker:{password}@127.0.0.1:{redis_server.port}/0", password


@pytest.mark.security
def test_a_worker_credential_s_dashboard_offers_no_cancel_and_no_dashboard_takes_a_forged_one(
    driver: Any, workers: Workers, mesh: gpumesh.Mesh, dashboards: Dashboards, r: redis.Redis,
    redis_server: RedisServer,
):  # fmt: skip
    url, password = worker_credential(r, redis_server)
    try:
        workers.start("--name", "busy", score=10)
        job = submit(mesh, [{"i": 0, "sleep": 30}], name="long")
        wait_until(lambda: job.status().status == "running" and any(current_tasks(mesh).values()),
                   what="the task to run")  # fmt: skip
        dash = dashboards.start(url)
        assert dash.mode == "read-only", dash.lines
        open_page(driver, dash.url(f"/jobs/{job.id}"))
        assert data(driver, "#job-summary")["status"] == "running"
        for selector in ("#cancel", "#retry", "form[action$='/cancel']", "form[action$='/retry']"):
            assert not exists(driver, selector), f"a read-only dashboard shows {selector}"
        assert password not in driver.page_source
        # the browser asks, from the page itself (same origin, with the token if the page holds one)
        token = driver.execute_script("const e = document.querySelector('[name=csrf]'); return e ? e.value : '';")
        status, reason = driver.execute_async_script(
            """
            const done = arguments[arguments.length - 1];
            fetch(arguments[0], {method: 'POST', body: new URLSearchParams({csrf: arguments[1]}), redirect: 'manual'})
              .then(async r => done([r.status, await r.text()]), e => done([0, String(e)]));
            """,
            f"/jobs/{job.id}/cancel",
            token,
        )
        assert status == 403, (status, reason)
        assert reason.strip() and "\n" not in reason.strip(), f"a one-line reason: {reason!r}"
        assert "read-only" in reason, reason
        # a client outside the browser, from the dashboard's own origin, is refused the same way
        assert post(dash, f"/jobs/{job.id}/cancel", token, origin=dash.base) == 403

        # a dashboard that may cancel still refuses a forged request: no token, a wrong one, another site
        writer = dashboards.start()
        open_page(driver, writer.url(f"/jobs/{job.id}"))
        assert exists(driver, "#cancel")
        real = driver.execute_script("return document.querySelector('#cancel').form.elements.csrf.value;")
        assert real and real not in driver.current_url
        cancel = f"/jobs/{job.id}/cancel"
        assert post(writer, cancel, None, origin=writer.base) == 403, "no token"
        assert post(writer, cancel, real[::-1], origin=writer.base) == 403, "a wrong token"
        assert post(writer, cancel, real, origin="http://evil.example") == 403, "another site's page"
        assert post(writer, cancel, real, origin=None, referer="http://evil.example/page") == 403, "another site's page"
        assert post(writer, cancel, real, origin=dash.base) == 403, "the other dashboard's origin"
        time.sleep(2 * HEARTBEAT_S + 0.5)  # a cancel would have stopped it within a heartbeat
        assert job.status().status == "running" and any(current_tasks(mesh).values()), "the job kept running"
        open_page(driver, dash.url("/"))
        assert len(rows(driver, "#workers tr.worker")) == 1 and password not in driver.page_source
    finally:
        r.execute_command("ACL", "DELUSER", "dash-worker")


@pytest.mark.security
def test_what_tasks_and_jobs_say_is_shown_as_text_never_run(
    driver: Any, workers: Workers, mesh: gpumesh.Mesh, dashboards: Dashboards
):
    workers.start("--name", "w", score=10)
    dash = dashboards.start()
    job = submit(mesh, [{"i": 0, "echo": HOSTILE, "sleep": 1.5}, {"i": 1, "echo": HOSTILE, "fail": True}],
                 name=HOSTILE_NAME)  # fmt: skip
    task = job.results()[0].task_id
    # the log page of a running task: its lines arrive as live appends
    open_page(driver, dash.url(f"/tasks/{task}/logs"))
    assert (data(driver, "#log") or {}).get("ended") != "1", "opened before the task printed"
    wait_until(lambda: (data(driver, "#log") or {}).get("ended") == "1", timeout=30, what="the task's log to end")
    shown = driver.execute_script(
        "return [...document.querySelectorAll('#log span.line')].map(s => s.textContent.trim());"
    )
    assert shown.count(HOSTILE) >= 2, shown  # its stdout and its stderr line, as text
    job.wait(timeout=60)
    # (page, the text it shows, whether it is live: an update swaps in a fragment, escaped as well)
    pages = [("/jobs", HOSTILE_NAME, True), (f"/jobs/{job.id}", HOSTILE, True),
             (f"/jobs/{job.id}/timeline", None, False), (f"/tasks/{task}/logs", HOSTILE, False)]  # fmt: skip
    for path, literal, live in pages:
        open_page(driver, dash.url(path))
        if live:
            assert browser.await_live_swap(driver), f"{path} has no live region"
        assert driver.execute_script("return typeof window.__pwned;") == "undefined", f"{path} ran task HTML"
        assert not exists(driver, "img[src='x']"), f"{path} made an element of task text"
        assert not driver.execute_script("return [...document.scripts].some(s => s.text.includes('__pwned'));")
        if literal is not None:
            assert literal in driver.find_element("css selector", "body").text, f"{path} does not show {literal!r}"
