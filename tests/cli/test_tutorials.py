"""The README's two machines in four commands and the tutorials, run as written: a real `gpumesh serve --tls`
on every interface, real workers started from the lines it and `access add` print, and the submits, one
machine standing in for two (the worker gets a home, config and directory of its own). Each command a page
tells the reader to type is checked to be on that page, so the page and this test move together."""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import ROOT, free_port, wait_until

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]

EXAMPLE = ["examples/grid_search.py", "--payloads", "examples/payloads.json"]


def page(name: str) -> str:
    return (ROOT / name).read_text()


def on_page(text: str, *commands: str) -> None:
    for command in commands:
        assert command in text, f"the page no longer says {command!r}: change this test with it"


def code_block(text: str, first_line: str) -> str:
    """The fenced block whose first line starts with ``first_line`` (the page's file, as the reader copies it)."""
    for block in re.findall(r"```\w*\n(.*?)```", text, flags=re.S):
        if block.startswith(first_line):
            return block
    raise AssertionError(f"no code block starting with {first_line!r}")


class Machine:
    """Where commands run as on one machine: its own home, config file and working directory."""

    def __init__(self, env: dict[str, str], root: Path, cwd: Path | None = None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.cwd = cwd or root
        self.env = {k: v for k, v in env.items() if k != "GPUMESH_URL"}  # the broker comes from what was pasted
        self.env.update(
            HOME=str(root / "home"), XDG_CACHE_HOME=str(root / "cache"), GPUMESH_CONFIG=str(root / "config.toml")
        )
        self.procs: list[subprocess.Popen[str]] = []

    def run(self, line: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """A `gpumesh …` line as typed, run with this environment's gpumesh."""
        argv = shlex.split(line)
        assert argv[0] == "gpumesh", line
        return subprocess.run(
            [sys.executable, "-m", "gpumesh", *argv[1:]], env=self.env, cwd=self.cwd, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip

    def start(self, line: str, log: Path) -> subprocess.Popen[str]:
        argv = shlex.split(line)
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "gpumesh", *argv[1:]], env=self.env, cwd=self.cwd, stdout=out,
                stderr=subprocess.STDOUT, text=True, start_new_session=True,
            )  # fmt: skip
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


class Broker:
    """`gpumesh serve --tls --host 0.0.0.0` (or the ``args`` given) as a page runs it, and the lines it prints."""

    def __init__(self, machine: Machine, data: Path, args: tuple[str, ...] = ("--tls", "--host", "0.0.0.0")) -> None:
        self.data = data
        scheme = "rediss" if "--tls" in args else "redis"
        argv = ["serve", *args, "--port", str(free_port()), "--data-dir", str(data)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpumesh", *argv], env=machine.env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        assert self.proc.stdout
        lines = []
        for line in self.proc.stdout:
            lines.append(line.strip())
            if line.strip().startswith("gpumesh config init"):
                break
        text = "\n".join(lines)
        worker = re.search(rf"^gpumesh worker '{scheme}://worker:.*$", text, flags=re.M)
        config = re.search(rf"^gpumesh config init --url '{scheme}://submitter:.* --sign-key .*$", text, flags=re.M)
        assert worker and config, (text, self.proc.stderr.read() if self.proc.poll() is not None else "")
        self.worker_line, self.config_line = worker.group(0), config.group(0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.communicate(timeout=30)


def workers_live(machine: Machine, n: int) -> bool:
    ran = machine.run("gpumesh workers --json", timeout=30)
    return ran.returncode == 0 and len(json.loads(ran.stdout)) >= n


def submitted(ran: subprocess.CompletedProcess[str]) -> str:
    assert ran.returncode == 0, ran.stderr
    return ran.stdout.split()[0]


def test_the_readme_s_two_machines_in_four_commands(env, tmp_path: Path):
    readme = page("README.md")
    on_page(
        readme, "gpumesh serve --tls --host 0.0.0.0", "gpumesh worker 'rediss://worker:",
        "gpumesh config init --url 'rediss://submitter:", "gpumesh submit " + " ".join(EXAMPLE) + " --wait",
    )  # fmt: skip
    yours = Machine(env, tmp_path / "yours", cwd=ROOT)
    other = Machine(env, tmp_path / "other")
    broker = Broker(yours, tmp_path / "yours" / "broker")
    try:
        other.start(broker.worker_line, tmp_path / "worker.log")
        init = yours.run(broker.config_line)
        assert init.returncode == 0, init.stderr
        wait_until(lambda: workers_live(yours, 1), timeout=60, what="the other machine's worker to join")
        ran = yours.run("gpumesh submit " + " ".join(EXAMPLE) + " --wait")
        job = submitted(ran)
        rows = json.loads(yours.run(f"gpumesh results {job} --json").stdout)
        assert [row["status"] for row in rows] == ["done"] * 6, (tmp_path / "worker.log").read_text()
        assert all(row["verified"] for row in rows)  # signed by the worker credential serve's line carries
    finally:
        other.stop()
        broker.stop()


def test_add_a_friend_s_pc_as_the_tutorial_says(env, tmp_path: Path):
    tutorial = page("docs/tutorials/friends-pc.md")
    on_page(
        tutorial, "gpumesh serve --tls --host 0.0.0.0", "gpumesh access add ana",
        "gpumesh worker 'rediss://worker-ana:", "gpumesh config init --url 'rediss://submitter:",
        "gpumesh submit " + " ".join(EXAMPLE) + " --wait", "gpumesh access revoke ana",
    )  # fmt: skip
    yours = Machine(env, tmp_path / "yours", cwd=ROOT)
    anas = Machine(env, tmp_path / "ana")
    data = tmp_path / "yours" / "broker"
    broker = Broker(yours, data)
    try:
        added = yours.run(f"gpumesh access add ana --data-dir {data}")  # the data dir serve was given here
        assert added.returncode == 0, added.stderr
        her_line = added.stdout.strip()
        assert her_line.startswith("gpumesh worker 'rediss://worker-ana:") and "@127.0.0.1:" not in her_line
        worker = anas.start(her_line, tmp_path / "ana.log")
        assert yours.run(broker.config_line).returncode == 0
        wait_until(lambda: workers_live(yours, 1), timeout=60, what="Ana's worker to join")
        job = submitted(yours.run("gpumesh submit " + " ".join(EXAMPLE) + " --wait"))
        assert "ana" not in job
        results = yours.run(f"gpumesh results {job} --verify")
        assert results.returncode == 0 and "worker-ana" in results.stdout, results.stdout + results.stderr
        revoked = yours.run(f"gpumesh access revoke ana --data-dir {data}")
        assert revoked.returncode == 0, revoked.stderr
        assert worker.wait(timeout=60) == 3  # her worker is cut off and stops
    finally:
        anas.stop()
        broker.stop()


def test_your_own_training_script_as_the_tutorial_says(env, tmp_path: Path):
    tutorial = page("docs/tutorials/own-script.md")
    on_page(
        tutorial, "gpumesh run train.py --payloads sweep.json --local 2",
        "gpumesh submit train.py --payloads sweep.json --wait", "gpumesh logs JOB",
        "gpumesh pull JOB --to runs/", "gpumesh results JOB --format csv --output results.csv",
    )  # fmt: skip
    work = tmp_path / "project"
    work.mkdir()
    (work / "train.py").write_text(code_block(tutorial, "# train.py"))
    (work / "sweep.json").write_text(code_block(tutorial, "[\n"))
    yours = Machine(env, tmp_path / "yours", cwd=work)
    other = Machine(env, tmp_path / "other")
    broker = Broker(yours, tmp_path / "yours" / "broker")
    try:
        local = yours.run("gpumesh run train.py --payloads sweep.json --local 2")
        assert local.returncode == 0 and local.stdout.count("done") == 3, local.stdout + local.stderr
        other.start(broker.worker_line, tmp_path / "worker.log")
        assert yours.run(broker.config_line).returncode == 0
        wait_until(lambda: workers_live(yours, 1), timeout=60, what="the worker to join")
        job = submitted(yours.run("gpumesh submit train.py --payloads sweep.json --wait"))
        logs = yours.run(f"gpumesh logs {job}")
        assert logs.returncode == 0 and "epoch 0: w=" in logs.stdout + logs.stderr
        pulled = yours.run(f"gpumesh pull {job} --to runs/")
        assert pulled.returncode == 0, pulled.stderr
        models = [json.loads((work / "runs" / str(i) / "model.json").read_text()) for i in range(3)]
        assert all(set(m) == {"w", "b"} for m in models)
        assert yours.run(f"gpumesh results {job} --format csv --output results.csv").returncode == 0
        with open(work / "results.csv") as f:
            rows = list(csv.DictReader(f))
        assert [row["status"] for row in rows] == ["done"] * 3
        assert json.loads(rows[0]["result"])["lr"] == 0.5
    finally:
        other.stop()
        broker.stop()


def test_your_first_job_as_the_tutorial_says(env, tmp_path: Path):
    tutorial = page("docs/tutorials/first-job.md")
    run = "gpumesh run " + " ".join(EXAMPLE) + " --local 2"
    looks = ["gpumesh status JOB", "gpumesh results JOB", "gpumesh logs JOB", "gpumesh workers"]
    on_page(
        tutorial, run, "gpumesh serve\n", "gpumesh worker 'redis://worker:", "gpumesh config init --url 'redis://submitter:",
        "gpumesh submit " + " ".join(EXAMPLE) + " --wait", *looks,
    )  # fmt: skip
    here = Machine(env, tmp_path / "here", cwd=ROOT)
    local = here.run(run)
    assert local.returncode == 0 and local.stdout.count("done") == 6, local.stdout + local.stderr
    broker = Broker(here, tmp_path / "here" / "broker", args=())  # plain `gpumesh serve`: this machine only
    try:
        assert "@127.0.0.1:" in broker.worker_line
        here.start(broker.worker_line, tmp_path / "worker.log")
        assert here.run(broker.config_line).returncode == 0
        wait_until(lambda: workers_live(here, 1), timeout=60, what="the worker to join")
        job = submitted(here.run("gpumesh submit " + " ".join(EXAMPLE) + " --wait"))
        for look in looks:
            ran = here.run(look.replace("JOB", job))
            assert ran.returncode == 0, (look, ran.stderr)
        assert "done" in here.run(f"gpumesh status {job}").stderr + here.run(f"gpumesh status {job}").stdout
    finally:
        here.stop()
        broker.stop()
