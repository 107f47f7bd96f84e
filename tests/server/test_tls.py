"""`gpumesh serve --tls`: a CA made at the first start, lines that pin it, and clients that check it
before they send anything. Real brokers, a real tunnel stand-in, real impostors."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import ssl
import stat
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from ..conftest import ROOT, Serve, free_port, gpumesh

pytestmark = pytest.mark.security

EXAMPLE = str(ROOT / "examples/grid_search.py")
PAYLOADS = str(ROOT / "examples/payloads.json")


def via(url: str, port: int) -> str:
    """The same URL, dialled at 127.0.0.1:port (a tunnel's address: another name, another port)."""
    parts = urlsplit(url)
    creds = parts.netloc.rpartition("@")[0]
    return parts._replace(netloc=f"{creds}@127.0.0.1:{port}").geturl()


def password_of(url: str) -> str:
    password = urlsplit(url).password
    assert password
    return password


class Tunnel:
    """A TCP relay to 127.0.0.1:target that keeps every byte the client sent (what a tunnel sees)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.from_client = bytearray()
        self.connections = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                conn.close()
                continue
            upstream.settimeout(None)
            self._sockets += [conn, upstream]
            threading.Thread(target=self._pump, args=(conn, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, conn, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(65536):
                if record:
                    with self._lock:
                        self.from_client += data
                dst.sendall(data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)  # pass the end on, as TCP does
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()
        for s in self._sockets:
            s.close()


class Impostor:
    """A TLS server with a certificate from another CA (someone between a client and its broker): it
    completes handshakes and keeps whatever the client sends inside TLS afterwards."""

    def __init__(self, tmp: Path) -> None:
        from gpumesh.server import tls

        tmp.mkdir()
        files = tls.ensure(tmp, ["127.0.0.1"])  # a real gpumesh CA, just not the pinned one
        self.ca = files.ca
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(files.chain, files.key)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.handshakes = 0
        self.received = bytearray()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        try:
            with self.ctx.wrap_socket(conn, server_side=True) as tls:
                self.handshakes += 1
                while data := tls.recv(65536):
                    self.received += data
        except (OSError, ssl.SSLError):
            pass

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def tls_served(env, tmp_path: Path):
    serve = Serve(env, tmp_path / "broker", free_port(), "--tls")
    yield serve
    serve.stop()


def test_serve_tls_makes_a_ca_and_prints_lines_that_pin_it(tls_served: Serve):
    tls_dir = tls_served.data_dir / "tls"
    fingerprint = urlsplit(tls_served.worker_url).query.removeprefix("ca_fingerprint=")
    assert tls_served.worker_url.startswith("rediss://worker:")
    assert tls_served.submit_url.startswith("rediss://submitter:")
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", fingerprint)
    ca_der = ssl.PEM_cert_to_DER_cert((tls_dir / "ca.pem").read_text())
    assert fingerprint == "sha256:" + hashlib.sha256(ca_der).hexdigest()
    assert f"CA fingerprint {fingerprint}" in "\n".join(tls_served.lines)
    for key in ("ca.key", "server.key"):
        assert stat.S_IMODE((tls_dir / key).stat().st_mode) == 0o600


def test_a_job_runs_end_to_end_over_tls_through_a_tunnel(tls_served: Serve, env, tmp_path: Path):
    """Worker and submitter use the printed lines, dialled through a relay with another address, as
    through ngrok: the job finishes, and nothing the relay carried shows a password or a command."""
    tunnel = Tunnel(int(urlsplit(tls_served.worker_url).port or 0))
    try:
        worker_url, submit_url = via(tls_served.worker_url, tunnel.port), via(tls_served.submit_url, tunnel.port)
        submit = subprocess.Popen(
            [sys.executable, "-m", "gpumesh", "submit", EXAMPLE, "--payloads", PAYLOADS, "--url", submit_url, "--wait",
             "--json"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        w = gpumesh("worker", worker_url, "--burst", "--score", "2", env=env, timeout=120)
        assert w.returncode == 0, w.stderr
        out, stderr = submit.communicate(timeout=60)
        assert submit.returncode == 0, stderr
        assert json.loads(out)["status"] == "done"
    finally:
        tunnel.close()
    seen = bytes(tunnel.from_client)
    assert tunnel.connections >= 2 and len(seen) > 1000
    for secret in (password_of(worker_url), password_of(submit_url)):
        assert secret.encode() not in seen
    assert b"AUTH" not in seen and b"EVALSHA" not in seen and b"FCALL" not in seen
    cached = list((tmp_path / "cache" / "gpumesh" / "ca").glob("*.pem"))  # the CA, fetched once and kept
    assert [p.read_text() for p in cached] == [(tls_served.data_dir / "tls" / "ca.pem").read_text()]


def test_a_plain_client_is_refused_and_told_to_use_rediss(tls_served: Serve, env):
    plain = tls_served.submit_url.replace("rediss://", "redis://", 1).partition("?")[0]
    p = gpumesh("jobs", "--url", plain, env=env)
    assert p.returncode == 3
    assert p.stderr.count("\n") == 1 and "rediss://" in p.stderr and password_of(plain) not in p.stderr


def test_a_wrong_fingerprint_is_refused_before_anything_is_sent(tls_served: Serve, env):
    url = tls_served.submit_url
    wrong = url[:-4] + ("0000" if not url.endswith("0000") else "1111")
    p = gpumesh("jobs", "--url", wrong, env=env)
    assert p.returncode == 3, p.stderr
    assert p.stderr.count("\n") == 1 and "does not present the CA the URL pins" in p.stderr
    assert password_of(url) not in p.stderr


def test_a_broker_with_another_ca_never_sees_the_password(tls_served: Serve, env, tmp_path: Path):
    """Someone in between with a CA of their own: first contact (nothing cached) and a client that has
    already fetched the real CA are both refused, and the impostor receives not one byte inside TLS."""
    impostor = Impostor(tmp_path / "impostor")
    try:
        first = gpumesh("jobs", "--url", via(tls_served.submit_url, impostor.port), env=env)
        assert first.returncode == 3 and "does not present the CA the URL pins" in first.stderr
        assert gpumesh("jobs", "--url", tls_served.submit_url, env=env).returncode == 0  # fetches and caches the CA
        cached = gpumesh("jobs", "--url", via(tls_served.submit_url, impostor.port), env=env)
        assert cached.returncode == 3 and "certificate verify failed" in cached.stderr, cached.stderr
        wrong_ca = tls_served.submit_url.partition("?")[0] + f"?ssl_ca_certs={impostor.ca}"  # a wrong CA file
        assert gpumesh("jobs", "--url", wrong_ca, env=env).returncode == 3
    finally:
        impostor.close()
    assert impostor.handshakes >= 1 and bytes(impostor.received) == b""


def test_join_with_the_ca_fingerprint_runs_a_worker(tls_served: Serve, env):
    parts = urlsplit(tls_served.worker_url)
    fingerprint = parts.query.removeprefix("ca_fingerprint=")
    address = f"127.0.0.1:{parts.port}"
    bad = gpumesh("join", address, "--token", f"worker:{parts.password}", "--ca-fingerprint", "sha256:abc", env=env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "64 hex digits" in bad.stderr
    job = gpumesh("submit", EXAMPLE, "--payloads", PAYLOADS, "--url", tls_served.submit_url, env=env)
    assert job.returncode == 0, job.stderr
    w = gpumesh("join", address, "--token", f"worker:{parts.password}", "--ca-fingerprint", fingerprint,
                "--burst", "--score", "2", env=env, timeout=120)  # fmt: skip
    assert w.returncode == 0, w.stderr
    st = gpumesh("status", job.stdout.strip(), "--url", tls_served.submit_url, "--json", env=env)
    assert json.loads(st.stdout)["status"] == "done"


def test_the_python_api_takes_the_pinned_url(tls_served: Serve, env, monkeypatch: pytest.MonkeyPatch):
    import gpumesh as api

    monkeypatch.setenv("XDG_CACHE_HOME", env["XDG_CACHE_HOME"])
    with api.connect(tls_served.submit_url) as mesh:
        assert mesh.workers() == []


def test_public_without_tls_is_refused_before_anything_starts(env, tmp_path: Path):
    data = tmp_path / "broker"
    p = gpumesh("serve", "--public", "--port", str(free_port()), "--data-dir", str(data), env=env)
    assert p.returncode == 2 and p.stderr.count("\n") == 1
    assert "--tls" in p.stderr and "--insecure-public" in p.stderr
    assert not data.exists()  # refused before the broker (and so any tunnel) started


def test_tls_is_added_to_a_plain_data_dir_and_kept_across_restarts(env, tmp_path: Path):
    data, port = tmp_path / "broker", free_port()
    plain = Serve(env, data, port)
    assert plain.worker_url.startswith("redis://")
    job = gpumesh("submit", EXAMPLE, "--payloads", PAYLOADS, "--url", plain.submit_url, env=env).stdout.strip()
    assert plain.stop()[0] == 0

    secured = Serve(env, data, port, "--tls")  # the same passwords and jobs, now over TLS only
    assert secured.worker_url.startswith("rediss://")
    assert password_of(secured.worker_url) == password_of(plain.worker_url)
    st = gpumesh("status", job, "--url", secured.submit_url, "--json", env=env)
    assert st.returncode == 0 and json.loads(st.stdout)["status"] == "queued"
    assert gpumesh("jobs", "--url", plain.submit_url, env=env).returncode == 3
    assert secured.stop()[0] == 0

    again = Serve(env, data, port)  # no flag: the data dir's mode, the same CA, the same lines
    assert again.worker_url == secured.worker_url
    assert again.stop()[0] == 0

    off = Serve(env, data, port, "--no-tls")
    assert off.worker_url == plain.worker_url
    assert off.stop()[0] == 0


def test_tls_with_a_server_built_without_it_says_so_in_one_line(env, tmp_path: Path):
    bare = {**env, "PATH": str(Path(sys.executable).parent)}  # no redis-server: the server extra's Valkey, no TLS
    p = gpumesh("serve", "--tls", "--port", str(free_port()), "--data-dir", str(tmp_path / "b"), env=bare)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "has no TLS built in" in p.stderr, p.stderr


def test_public_on_a_tls_data_dir_with_no_tls_is_refused(env, tmp_path: Path):
    data = tmp_path / "broker"
    Serve(env, data, free_port(), "--tls").stop()
    p = gpumesh("serve", "--public", "--no-tls", "--port", str(free_port()), "--data-dir", str(data), env=env)
    assert p.returncode == 2 and "--insecure-public" in p.stderr
    assert "tls-port" in (data / "redis.conf").read_text()  # never rewritten: nothing started


def test_access_on_a_tls_data_dir_dials_only_that_broker(tls_served: Serve, env):
    """`gpumesh access` reads the data dir's redis.conf: it must never take the TLS broker's `port 0`
    for "unset" and send the admin password to Redis's default port instead."""
    port = urlsplit(tls_served.worker_url).port
    p = gpumesh("access", "list", "--data-dir", str(tls_served.data_dir), env=env)
    assert p.returncode == 0 or f"127.0.0.1:{port}/" in p.stderr, p.stderr
    assert ":6379" not in p.stderr
