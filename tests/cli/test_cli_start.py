"""The CLI starts fast: ``gpumesh --help`` imports click and the command table, not the
modules that talk to Redis or render tables; guarded by the modules it imports, never by timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click
import pytest

HEAVY = ("redis", "rq", "rich", "pydantic", "asyncio", "psutil", "gpumesh.api", "gpumesh.models", "gpumesh.store")


def _modules_after(*argv: str) -> set[str]:
    code = (
        "import json, sys\n"
        "from gpumesh.cli import main\n"
        f"try:\n    main({list(argv)!r}, prog_name='gpumesh')\nexcept SystemExit:\n    pass\n"
        "print(json.dumps(sorted(sys.modules)), file=sys.stderr)\n"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "Commands:" in ran.stdout or argv != ("--help",), ran.stdout + ran.stderr
    return set(json.loads(ran.stderr.strip().splitlines()[-1]))


@pytest.mark.core
def test_help_imports_no_redis_rich_or_pydantic():
    loaded = _modules_after("--help")
    heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY or m.startswith(HEAVY))
    assert heavy == [], f"`gpumesh --help` imported {heavy}"
    assert "gpumesh.cli.jobs" not in loaded and "gpumesh.cli.doctor" not in loaded


@pytest.mark.core
def test_the_command_list_is_what_the_commands_themselves_say():
    from gpumesh.cli.main import COMMANDS, main

    ctx = click.Context(main, info_name="gpumesh")
    lazy = click.HelpFormatter(width=100)
    main.format_commands(ctx, lazy)
    for name in main.list_commands(ctx):  # load every command, then let click list them its own way
        assert main.get_command(ctx, name) is not None
    eager = click.HelpFormatter(width=100)
    click.Group.format_commands(main, ctx, eager)
    assert lazy.getvalue() == eager.getvalue()
    assert set(COMMANDS) == set(main.commands)


@pytest.mark.core
def test_a_command_s_own_help_still_shows_its_examples():
    from ..conftest import cli

    ran = cli("submit", "--help")
    assert ran.returncode == 0 and "Examples:" in ran.stdout and "--retry-on" in ran.stdout
    ran = cli("nosuchcommand")
    assert ran.returncode == 2 and "No such command 'nosuchcommand'" in ran.stderr


@pytest.mark.core
def test_status_json_reads_the_job_with_redis_alone_no_pydantic_rich_or_rq(broker, env):
    """`status JOB --json` (what a pipeline polls) reads one job: no models, settings object, tables, RQ,
    submit or file machinery; the full path's modules stay unimported."""
    from gpumesh.models import JobOptions

    job = broker.submit("print(1)", "s.py", [{"i": 0}], JobOptions()).job_id
    code = (
        "import json, sys\n"
        "from gpumesh.cli import main\n"
        f"try:\n    main(['status', {job!r}, '--json'], prog_name='gpumesh')\nexcept SystemExit:\n    pass\n"
        "print(json.dumps(sorted(sys.modules)), file=sys.stderr)\n"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert json.loads(ran.stdout)["job_id"] == job, ran.stdout + ran.stderr
    loaded = json.loads(ran.stderr.strip().splitlines()[-1])
    unwanted = ("rich", "pydantic", "rq", "gpumesh.models", "gpumesh.api", "gpumesh.settings", "gpumesh.cli.jobs",
                "gpumesh.cli.helpers", "gpumesh.store.broker", "gpumesh.store.artifacts", "gpumesh.store.submit")  # fmt: skip
    assert sorted(m for m in loaded if m.split(".")[0] in unwanted or m.startswith(unwanted)) == []


@pytest.mark.core
def test_status_json_says_what_the_python_api_says_for_a_job_in_every_state(broker, r, env):
    """The fast path prints what ``Job.status()`` models, field for field: queued with nobody to run it, waiting
    for a requirement or a trusted signer, running, done (named, with a priority), failed by kind, cancelled."""
    from gpumesh.models import JobOptions
    from gpumesh.store import scripts

    from ..conftest import gpumesh
    from ..store.test_dispatch import register

    def submit(n: int = 1, **options) -> tuple[str, list[str]]:
        res = broker.submit("print(1)", "s.py", [{"i": i} for i in range(n)], JobOptions(**options))
        return res.job_id, broker.task_ids(res.job_id)

    def check(state: str, job: str) -> dict:
        ran = gpumesh("status", job, "--json", env=env)
        assert ran.returncode == 0, ran.stderr
        fast = json.loads(ran.stdout)
        assert fast == broker.job_status(job, waiting=True).model_dump(mode="json"), state
        if fast["status"] in ("done", "failed", "cancelled"):  # --watch takes the full path: the same document
            assert json.loads(gpumesh("status", job, "--json", "--watch", env=env).stdout) == fast, state
        return fast

    nobody, _ = submit(2)
    seen = {"queued, no worker live": check("queued, no worker live", nobody)}
    register(r, "cpu-box", 1.0, trusts="k1")  # runs only jobs signed by key k1
    jobs = {"waiting for a requirement": submit(requires=("vram_gb>=40",))[0]}
    jobs["waiting for a trusted signer"] = submit()[0]
    running, (tid,) = submit()
    scripts.acquire(broker.scripts, r, tid, "cpu-box", 60_000)
    jobs["running"] = running
    done, (tid,) = submit(name="sweep", priority=5)
    lease = scripts.acquire(broker.scripts, r, tid, "cpu-box", 60_000)
    scripts.complete(broker.scripts, r, lease, "cpu-box", "1", 0.1)
    jobs["done"] = done
    failed, (tid,) = submit(max_attempts=1, retry_on="script,lost")
    lease = scripts.acquire(broker.scripts, r, tid, "cpu-box", 60_000)
    scripts.fail(broker.scripts, r, lease, "cpu-box", "exit code 1", 0.1)
    jobs["failed"] = failed
    jobs["cancelled"] = submit(3)[0]
    broker.cancel(jobs["cancelled"])
    for state, job in jobs.items():
        register(r, "cpu-box", 1.0, trusts="k1")  # its heartbeat: live for the lease TTL (2 s here)
        seen[state] = check(state, job)
    assert seen["queued, no worker live"]["waiting_for"] == [{"requires": [], "tasks": 2, "signer": None}]
    assert seen["waiting for a requirement"]["waiting_for"] == [
        {"requires": ["vram_gb>=40"], "tasks": 1, "signer": None}
    ]
    assert seen["waiting for a trusted signer"]["waiting_for"] == [{"requires": [], "tasks": 1, "signer": "unsigned"}]
    assert (seen["done"]["name"], seen["done"]["priority"], seen["done"]["status"]) == ("sweep", 5, "done")
    assert seen["done"]["finished_at"].endswith("Z") and seen["done"]["created_at"].endswith("Z")
    assert seen["failed"]["failed_by_kind"] == {"script": 1} and seen["failed"]["retry_on"] == ["script", "lost"]
    assert seen["cancelled"]["tasks"]["cancelled"] == 3
    assert seen["running"]["tasks"]["running"] == 1 and seen["running"]["waiting_for"] == []


@pytest.mark.core
def test_status_json_refuses_a_bad_setting_in_one_line_as_every_command_does(broker, env):
    from gpumesh.models import JobOptions

    from ..conftest import gpumesh

    job = broker.submit("print(1)", "s.py", [{"i": 0}], JobOptions()).job_id
    config = Path(env["GPUMESH_CONFIG"])
    cases = [
        ({"GPUMESH_LEASE_TTL": "soon"}, ""), ({"GPUMESH_LEASE_TTL": "-1"}, ""),
        ({"GPUMESH_URL": "http://nowhere"}, ""),
        ({"GPUMESH_LEASE_TTL": "0.5"}, ""),  # shorter than two heartbeats (0.4 s here)
        ({"GPUMESH_LEASE_TTL": "\uff13\uff10"}, ""),  # full-width digits: Python's float() reads 30, Settings not
        ({}, "lease_ttl = \"soon\"\n"), ({}, "leese_ttl = 30\n"),  # not a number; a key no setting has
    ]  # fmt: skip
    for bad, text in cases:
        if text:
            config.write_text(text)
        base = {k: v for k, v in env.items() if not (text and k == "GPUMESH_LEASE_TTL")}  # else over the file's
        ran = gpumesh("status", job, "--json", env={**base, **bad})
        config.unlink(missing_ok=True)
        assert ran.returncode == 2, (bad, text, ran.stderr)
        assert ran.stdout == "" and len(ran.stderr.strip().splitlines()) == 1, (bad, text, ran.stderr)
        assert ran.stderr.startswith("error: ") and "Traceback" not in ran.stderr
    config.write_text(f"url = {json.dumps(env['GPUMESH_URL'])}\nlease_ttl = 60\n")  # what the fast path reads
    ran = gpumesh("status", job, "--json", env={k: v for k, v in env.items() if k != "GPUMESH_URL"})
    assert ran.returncode == 0 and json.loads(ran.stdout)["job_id"] == job, ran.stderr


@pytest.mark.core
def test_the_settings_the_fast_path_knows_are_every_setting():
    from gpumesh.layers import DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_LEASE_TTL, DEFAULT_URL, NAMES
    from gpumesh.settings import Settings

    assert set(NAMES) == set(Settings.model_fields)
    fields = Settings.model_fields
    assert (fields["url"].default, fields["lease_ttl"].default, fields["heartbeat_interval"].default) == (
        DEFAULT_URL, DEFAULT_LEASE_TTL, DEFAULT_HEARTBEAT_INTERVAL,
    )  # fmt: skip
