"""A dashboard that may write cannot be driven by a process of its machine without its access token.

The attack: a validly submitted task, run by a real `gpumesh worker` on the dashboard's machine, reads a job page
over loopback, takes its form token, and POSTs cancel with an Origin it sets itself. The Host, form-token and
Origin checks stop browsers only; the access token, printed once and kept in a file only its user reads (as
Jupyter does), stops the task.
"""

from __future__ import annotations

import http.cookiejar
import json
import re
import stat
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from ..browser import Dashboard
from ..conftest import Workers, gpumesh, wait_until

pytestmark = pytest.mark.security

ATTACK = """
import json, re, sys, urllib.error, urllib.request
p = json.load(sys.stdin)
base, victim = p["base"], p["victim"]
said = {}
page = urllib.request.urlopen(f"{base}/jobs/{victim}", timeout=10).read().decode()
found = re.search(r'name="csrf" value="([^"]+)"', page)
said["form_token"] = bool(found)
for action in ("cancel", "retry"):
    body = ("csrf=" + (found.group(1) if found else "guess")).encode()
    req = urllib.request.Request(f"{base}/jobs/{victim}/{action}", data=body, method="POST",
                                 headers={"Origin": base, "Referer": base + "/"})
    try:
        said[action] = urllib.request.urlopen(req, timeout=10).status
    except urllib.error.HTTPError as exc:
        said[action] = exc.code
print(json.dumps(said))
"""


def _status(env: dict[str, str], job: str) -> str:
    return str(json.loads(gpumesh("status", job, "--json", env=env).stdout)["status"])


def test_a_task_on_the_dashboard_s_machine_cannot_cancel_another_submitter_s_job(
    env: dict[str, str], workers: Workers, tmp_path: Path
):
    dash = Dashboard(env, env["GPUMESH_URL"], tmp_path)
    try:
        assert dash.mode == "may cancel and retry" and dash.login, dash.output()
        token = urllib.parse.parse_qs(urllib.parse.urlsplit(dash.login).query)["token"][0]
        (token_file,) = (tmp_path / "cache").glob("gpumesh/dashboard/dashboard-*.token")
        assert token_file.read_text().strip() == token and str(token_file) in "\n".join(dash.lines)
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
        victim_script = tmp_path / "victim.py"
        victim_script.write_text("print(1)\n")
        victim = gpumesh("submit", str(victim_script), "--payloads", "-", "--require", "dataset=never-here",
                         env=env, input="[{}]").stdout.strip()  # fmt: skip
        assert _status(env, victim) == "queued"
        workers.start()
        attack = tmp_path / "attack.py"
        attack.write_text(ATTACK)
        payload = json.dumps([{"base": dash.base, "victim": victim}])
        job = gpumesh("submit", str(attack), "--payloads", "-", env=env, input=payload).stdout.strip()
        wait_until(lambda: _status(env, job) in ("done", "failed"), timeout=60, what="the attacker's task")
        (row,) = json.loads(gpumesh("results", job, "--format", "json", env=env).stdout)
        assert row["status"] == "done", (row, workers.log(0))
        assert row["result"] == {"form_token": False, "cancel": 403, "retry": 403}, row
        assert _status(env, victim) == "queued", "the task cancelled another submitter's job"

        # What shows the attack can succeed: the person who started it, with the token it printed, cancels.
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
        with opener.open(dash.login, timeout=10) as res:
            assert res.url == dash.base + "/", "the token leaves the address once its cookie is set"
        page = opener.open(f"{dash.base}/jobs/{victim}", timeout=10).read().decode()
        found = re.search(r'name="csrf" value="([^"]+)"', page)
        assert found, "its holder sees the cancel form"
        req = urllib.request.Request(f"{dash.base}/jobs/{victim}/cancel", data=f"csrf={found.group(1)}".encode(),
                                     method="POST", headers={"Origin": dash.base})  # fmt: skip
        opener.open(req, timeout=10).close()
        assert _status(env, victim) == "cancelled"
    finally:
        dash.stop()
    assert not token_file.exists(), "the token file goes with the dashboard"
