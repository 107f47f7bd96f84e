"""The CLI starts fast (issue 18 item 3): ``gpumesh --help`` imports click and the command table, not the
modules that talk to Redis or render tables; guarded by the modules it imports, never by timing."""

from __future__ import annotations

import json
import subprocess
import sys

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
    from .conftest import cli

    ran = cli("submit", "--help")
    assert ran.returncode == 0 and "Examples:" in ran.stdout and "--retry-on" in ran.stdout
    ran = cli("nosuchcommand")
    assert ran.returncode == 2 and "No such command 'nosuchcommand'" in ran.stderr


@pytest.mark.core
def test_status_json_loads_no_rich_and_nothing_of_submit_or_artifacts(broker, env):
    """`status JOB --json` (what a pipeline polls) reads one job: no tables, no submit or file machinery,
    and the models it does not use stay unbuilt."""
    from gpumesh.models import JobOptions

    job = broker.submit("print(1)", "s.py", [{"i": 0}], JobOptions()).job_id
    code = (
        "import json, sys\n"
        "from gpumesh.cli import main\n"
        f"try:\n    main(['status', {job!r}, '--json'], prog_name='gpumesh')\nexcept SystemExit:\n    pass\n"
        "from gpumesh import models\n"
        "built = [n for n in ('Capability', 'TaskResult', 'JobOptions') if getattr(models, n).__pydantic_complete__]\n"
        "print(json.dumps([sorted(sys.modules), built]), file=sys.stderr)\n"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert json.loads(ran.stdout)["job_id"] == job, ran.stdout + ran.stderr
    loaded, built = json.loads(ran.stderr.strip().splitlines()[-1])
    unwanted = ("rich", "gpumesh.store.artifacts", "gpumesh.store.submit", "rq")
    assert sorted(m for m in loaded if m.startswith(unwanted)) == []
    assert built == [], f"models built though status never uses them: {built}"
