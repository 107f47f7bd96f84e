"""Bad input is one line: exit 2, the problem named, no traceback, nothing written to Redis; and a
result a script prints that cannot be kept fails its task with the reason, never the job's results."""

from __future__ import annotations

import json

import pytest
import redis

from ..conftest import ROOT, cli

pytestmark = pytest.mark.core

EXAMPLE = str(ROOT / "examples/grid_search.py")
PAYLOADS = str(ROOT / "examples/payloads.json")


def nested(depth: int) -> str:
    return '[{"a": ' + "[" * depth + "]" * depth + "}]"


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        (["--payloads", "-"], nested(10_000), "nests deeper than 100 levels"),
        (["--payloads", "-"], nested(150), "nests deeper than 100 levels"),
        (["--payloads", "-"], '[{"a": ' + "9" * 5000 + "}]", "more than 4300 digits; send it as a string"),
        (["--payloads", "-"], '[{"lr": NaN}]', "NaN is not JSON"),
        (["--payloads", "-"], '[{"lr": -Infinity}]', "-Infinity is not JSON"),
        (["--payloads", "-"], '[{"x": 1e400}]', "the number 1e400 is too large for a 64-bit float"),
        (["--payloads", "-"], '[{"x": [-2.5E+999]}]', "the number -2.5E+999 is too large"),
        (["--payloads", "-", "--expires", "inf"], "[{}]", "--expires: must be a finite number of seconds"),
        (["--payloads", "-", "--expires", "1e9"], "[{}]", "from 1 to a year"),
        (["--payloads", "-", "--timeout", "inf"], "[{}]", "--timeout: must be a finite number of seconds"),
        (["--payloads", "-", "--timeout", "1e16"], "[{}]", "at most a year"),
        (["--payloads", "-", "--timeout", "nan"], "[{}]", "--timeout: must be a finite number of seconds"),
        (["--payloads", "-", "--timeout", "0"], "[{}]", "--timeout: must be a finite number of seconds, more than 0"),
        (["--payloads", "-", "--idempotency-key", "\udcff\udcfe"], "[{}]", "--idempotency-key must be text (UTF-8)"),
        (["--payloads", "-", "--idempotency-key", "k" * 201], "[{}]", "--idempotency-key must be 1 to 200"),
    ],
)
def test_bad_submit_input_is_one_line_and_writes_nothing(env, r: redis.Redis, args, stdin, message) -> None:
    p = cli("submit", EXAMPLE, *args, input=stdin)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("error: ") and p.stderr.count("\n") == 1 and message in p.stderr, p.stderr
    assert r.dbsize() == 0


def test_a_payload_at_the_depth_limit_is_accepted(env, r: redis.Redis) -> None:
    p = cli("submit", EXAMPLE, "--payloads", "-", input=nested(98))  # the list, the object and 98 levels
    assert p.returncode == 0, p.stderr


def test_an_unparseable_url_port_is_a_usage_error_without_the_password(env) -> None:
    p = cli("jobs", "--url", "redis://:hunter2@host:abc/0")
    assert p.returncode == 2 and p.stderr.count("\n") == 1
    assert "invalid broker URL" in p.stderr and "hunter2" not in p.stderr and "host:abc" in p.stderr


@pytest.mark.parametrize(
    ("printed", "reason"),
    [
        ("NaN", "cannot be used: NaN is not JSON"),
        ('{"loss": Infinity}', "cannot be used: Infinity is not JSON"),
        ("[" * 600 + "]" * 600, "nests deeper than 100 levels"),
    ],
)
def test_a_result_that_cannot_be_kept_fails_its_task_and_results_still_read(
    env, r: redis.Redis, tmp_path, mesh_worker, printed, reason
) -> None:
    script = tmp_path / "bad_result.py"
    script.write_text(
        f"import sys, json\npayload = json.load(sys.stdin)\nprint({printed!r} if payload['bad'] else 1)\n"
    )
    job = cli("submit", str(script), "--payloads", "-", "--max-attempts", "1", input='[{"bad": true}, {"bad": false}]')
    assert job.returncode == 0, job.stderr
    mesh_worker.burst()
    rows = json.loads(cli("results", job.stdout.strip(), "--format", "json").stdout)
    assert [row["status"] for row in rows] == ["failed", "done"] and rows[1]["result"] == 1
    assert reason in rows[0]["error"], rows[0]["error"]
    for fmt in ("table", "jsonl", "csv"):
        assert cli("results", job.stdout.strip(), "--format", fmt).returncode == 0
