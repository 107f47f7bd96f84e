"""What a newcomer meets first: install lines that install this project, deploy files that do
not leak the password or fail on a fresh machine."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib

import pytest

from ..conftest import ROOT, cli

pytestmark = pytest.mark.core

DISTRIBUTION = "gpumesh-pool"
# Third-party distributions an install line may name (the dashboard image's own, what the fixes name).
OTHERS = {"rq-dashboard", "rq", "six", "numpy", "torch", "nvidia-ml-py", "uv"}
PLACES = ["README.md", "SECURITY.md", "docs", "workers", "docker-compose.yml", "gpumesh", "examples", ".ci"]


def install_lines() -> list[tuple[str, str]]:
    found = []
    for place in PLACES:
        path = ROOT / place
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and p.suffix != ".pyc"]
        for f in files:
            for line in f.read_text(errors="replace").splitlines():
                if "pip install" in line:
                    found.append((f"{f.relative_to(ROOT)}", line))
    return found


def requirements(line: str) -> list[str]:
    """What each `pip install` on the line asks for: the words after it, up to a comment, a shell
    operator or the end of the code span (flags dropped, quotes stripped)."""
    out = []
    for part in re.findall(r"pip install ([^`;&|]*)", line):
        for word in part.split():
            if word.startswith(("#", "(", "→")) or word in ("\\", "then", "or", "from", "@"):
                break  # a comment, prose, or the URL part of `NAME @ git+URL`
            word = word.lstrip("'\"(").rstrip("'\",).")
            if word and not word.startswith("-"):
                out.append(word)
    return out


def test_the_distribution_is_named_for_this_project_not_the_other_gpumesh() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["name"] == DISTRIBUTION
    assert meta["scripts"] == {"gpumesh": "gpumesh.cli:main"}  # the command keeps its name


def test_every_install_line_installs_this_project() -> None:
    wrong = []
    lines = install_lines()
    assert len(lines) > 8, "the README, workers/ and the error messages all say how to install"
    for where, line in lines:
        for req in requirements(line):
            name = re.split(r"[\[<>=@ ]", req, maxsplit=1)[0].lower()
            local = req.startswith((".", "/", "dist/", "<"))  # a checkout, a wheel, a path
            if req.startswith(":"):  # an option's value (uv pip install --only-binary :all:), no distribution
                continue
            if not local and name != DISTRIBUTION and name not in OTHERS:
                wrong.append(f"{where}: {req}  ({line.strip()[:80]})")
    assert wrong == [], "install lines naming another distribution (gpumesh on PyPI is another project)"


def test_the_password_file_is_ignored_by_git(tmp_path) -> None:
    ignored = subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=ROOT).returncode
    assert ignored == 0, ".env holds the broker password"
    assert subprocess.run(["git", "check-ignore", "-q", ".env.example"], cwd=ROOT).returncode == 1


def test_the_deploy_files_work_on_a_fresh_machine_and_the_dashboard_is_read_only() -> None:
    unit = (ROOT / "workers" / "gpumesh-worker.service").read_text()
    assert "install -D -m 0600" in unit, "/etc/gpumesh does not exist yet on a fresh machine"
    assert "--disable-delete" in (ROOT / "workers" / "dashboard.Dockerfile").read_text()


DIVIDE = "import json, sys\np = json.load(sys.stdin)\nprint(json.dumps({'ratio': p['a'] / p['b']}))\n"


def test_a_failing_task_says_why_in_submit_wait_status_and_results(env, mesh_worker, tmp_path) -> None:
    script = tmp_path / "divide.py"
    script.write_text(DIVIDE)
    mesh_worker.start()
    payloads = '[{"a": 1, "b": 2}, {"a": 1, "b": 0}, {"a": 3, "b": 1}]'
    ran = cli("submit", str(script), "--payloads", "-", "--wait", "--max-attempts", "1", input=payloads)
    assert ran.returncode == 1
    job = ran.stdout.split()[0]
    assert "task 1 failed: script_error: ZeroDivisionError: division by zero" in ran.stderr
    assert f"its output: gpumesh logs {job}-1" in ran.stderr and f"gpumesh results {job}" in ran.stderr
    status = cli("status", job)
    assert "task 1 failed: script_error: ZeroDivisionError: division by zero" in status.stderr
    table = cli("results", job).stdout
    assert "script_error: ZeroDivisionError: division by zero" in table and "exit code 1" not in table
    error = json.loads(cli("results", job, "--json").stdout)[1]["error"]  # --json is --format json
    assert error.startswith("exit code 1\nTraceback (most recent call last):")
    assert "launcher.py" not in error and 'divide.py", line 3' in error  # gpumesh's own frame is gone


def test_status_watch_off_a_terminal_prints_a_line_when_the_counts_change(env, mesh_worker, tmp_path) -> None:
    script = tmp_path / "slow.py"
    script.write_text("import json, sys, time\njson.load(sys.stdin)\ntime.sleep(2.5)\nprint('{}')\n")
    mesh_worker.start()
    job = cli("submit", str(script), "--payloads", "-", input="[{}]").stdout.strip()
    ran = cli("status", job, "--watch")
    assert ran.returncode == 0
    lines = ran.stderr.splitlines()
    assert 1 <= len(lines) <= 3, lines  # queued/running/done, not one a second
    assert lines[-1].startswith(f"{job} done: 1/1 done")


def test_a_reused_idempotency_key_says_existing_job(env, mesh_worker, tmp_path) -> None:
    script = tmp_path / "ok.py"
    script.write_text("import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n")
    args = ["submit", str(script), "--payloads", "-", "--idempotency-key", "nightly-42"]
    first = cli(*args, input="[{}]")
    again = cli(*args, input="[{}]")
    assert first.returncode == again.returncode == 0 and first.stdout == again.stdout
    assert "submitted job" in first.stderr and "existing job" not in first.stderr
    assert f"existing job {again.stdout.strip()}: the idempotency key was used before" in again.stderr
    assert json.loads(cli(*args, "--json", input="[{}]").stdout)["existing"] is True


def test_join_without_a_port_dials_the_port_serve_uses(env) -> None:
    ran = cli("join", "127.0.0.1", "--token", "sekrit", "--score", "1")
    assert ran.returncode == 3
    assert "redis://worker:***@127.0.0.1:6390/0" in ran.stderr and "sekrit" not in ran.stderr


def test_every_command_shows_an_example_and_explains_every_option() -> None:
    import click

    from gpumesh.cli.main import main

    def walk(cmd: click.Command, path: str):
        yield path, cmd
        if isinstance(cmd, click.Group):  # the way click finds them: the top group loads its commands lazily
            ctx = click.Context(cmd)
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                assert sub is not None, f"{path} {name}"
                yield from walk(sub, f"{path} {name}")

    missing = []
    for path, cmd in walk(main, "gpumesh"):
        if "gpumesh " not in (cmd.help or ""):
            missing.append(f"{path}: no example")
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden and not p.help:
                missing.append(f"{path} {p.opts[0]}: no help")
    assert missing == []


def test_retry_cancelled_resumes_a_cancelled_job(env, mesh_worker, tmp_path) -> None:
    script = tmp_path / "ok.py"
    script.write_text("import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n")
    job = cli("submit", str(script), "--payloads", "-", input='[{"i": 0}, {"i": 1}]').stdout.strip()
    assert cli("cancel", job).returncode == 0  # before any worker took them
    plain = cli("retry", job)
    assert plain.returncode == 0 and f"job {job} has no failed task to retry" in plain.stderr
    mesh_worker.start()
    again = cli("retry", job, "--cancelled", "--wait")
    assert again.returncode == 0, again.stderr
    assert "re-queued 2 failed or cancelled task(s)" in again.stderr
    assert [row["status"] for row in json.loads(cli("results", job, "--json").stdout)] == ["done", "done"]
