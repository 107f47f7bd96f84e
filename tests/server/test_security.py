"""Security: least-privilege ACL users, revocable per-person credentials, refusal of foreign code."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from ..conftest import ROOT, free_port, gpumesh, wait_until
from .test_serve_and_local import Serve

pytestmark = pytest.mark.security

EXAMPLE = str(ROOT / "examples/grid_search.py")
PAYLOADS = str(ROOT / "examples/payloads.json")

FORBIDDEN = [
    ("CONFIG", "GET", "maxmemory"),
    ("MODULE", "LIST"),
    ("DEBUG", "SLEEP", "0"),
    ("REPLICAOF", "NO", "ONE"),
    ("FLUSHALL",),
    ("KEYS", "*"),
    ("SHUTDOWN", "NOSAVE"),
    ("ACL", "WHOAMI"),
    ("ACL", "SETUSER", "mallory", "on", ">x", "+@all", "~*"),
]


@pytest.fixture
def served(env, tmp_path: Path):
    port = free_port()
    serve = Serve(env, tmp_path / "broker", port)
    text = "\n".join(serve.lines)
    urls = {
        "worker": serve.url,
        "submitter": re.search(r"--url '(redis://submitter:[^']+)' --wait", text).group(1),
    }
    yield serve, urls, tmp_path / "broker", port
    serve.stop()


@pytest.mark.parametrize("role", ["worker", "submitter"])
def test_roles_get_noperm_for_admin_and_dangerous_commands(served, role):
    serve, urls, data, port = served
    client = redis.Redis.from_url(urls[role])
    admin = _admin(data, port)
    for command in FORBIDDEN:
        # ACL DRYRUN gives the ACL verdict even for DEBUG, which Redis 7 disables before asking the ACL
        verdict = admin.execute_command("ACL", "DRYRUN", role, *command)
        assert "no permissions" in verdict, (command, verdict)
        if command[0] != "DEBUG":
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.set("someone-elses-key", "x")  # only gpumesh:* and rq:* keys
    assert client.ping()


def _admin(data: Path, port: int) -> redis.Redis:
    admin = json.loads((data / "credentials.json").read_text())["admin"]
    return redis.Redis.from_url(f"redis://admin:{admin}@127.0.0.1:{port}/0", decode_responses=True)


def test_no_credential_reaches_redis_without_a_password(served):
    _, _, _, port = served
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, username="default", password="").ping()


def test_a_job_runs_end_to_end_with_the_role_credentials(served, env):
    _, urls, _, _ = served
    p = gpumesh("submit", EXAMPLE, "--payloads", PAYLOADS, "--url", urls["submitter"], env=env)
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip()
    w = gpumesh("worker", urls["worker"], "--burst", "--score", "3", env=env, timeout=120)
    assert w.returncode == 0, w.stderr
    st = json.loads(gpumesh("status", job, "--url", urls["submitter"], "--json", env=env).stdout)
    assert st["status"] == "done", w.stderr


def test_a_revoked_person_s_worker_is_disconnected_and_stops(served, env, tmp_path: Path):
    _, urls, data, _ = served
    p = gpumesh("access", "add", "ana", "--data-dir", str(data), env=env)
    assert p.returncode == 0, p.stderr
    ana_url = re.search(r"gpumesh worker '([^']+)'", p.stdout).group(1)
    assert ana_url.startswith("redis://worker-ana:")
    assert gpumesh("access", "list", "--data-dir", str(data), env=env).stdout.split() == ["ana"]
    with open(tmp_path / "ana.log", "wb") as log:
        worker = subprocess.Popen([sys.executable, "-m", "gpumesh", "worker", ana_url, "--score", "2"], env=env,
                                  stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        r = _admin(data, int(urls["worker"].rsplit(":", 1)[1].split("/")[0]))
        wait_until(lambda: r.zcard("gpumesh:workers") == 1, timeout=30, what="ana's worker to join")
        assert gpumesh("access", "revoke", "ana", "--data-dir", str(data), env=env).returncode == 0
        assert worker.wait(timeout=30) == 3
        assert "refused this worker's credentials" in (tmp_path / "ana.log").read_text()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(ana_url).ping()
        assert gpumesh("access", "revoke", "ana", "--data-dir", str(data), env=env).returncode == 4
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGKILL)
            worker.wait()


# -- signed jobs ---------------------------------------------------------------------------------


@pytest.fixture
def signing_keys(env, tmp_path: Path) -> tuple[Path, Path]:
    p = gpumesh("keys", "generate", "--dir", str(tmp_path / "keys"), env=env)
    assert p.returncode == 0, p.stderr
    priv, pub = (Path(line) for line in p.stdout.split())
    assert oct(priv.stat().st_mode & 0o777) == "0o600"
    return priv, pub


def _marker_script(tmp_path: Path) -> Path:
    path = tmp_path / "touch.py"
    path.write_text(
        f"import json, os, sys\np = json.load(sys.stdin)\nopen(os.path.join({str(tmp_path)!r}, 'ran-%s' % p['i']), 'w').close()\nprint(json.dumps(p))\n"
    )
    return path


def test_a_worker_that_trusts_keys_runs_only_validly_signed_tasks(env, signing_keys, tmp_path: Path, r: redis.Redis):
    from gpumesh.store import keys as k

    priv, pub = signing_keys
    script = _marker_script(tmp_path)
    signed = gpumesh(
        "submit",
        str(script),
        "--payloads",
        "-",
        "--sign-key",
        str(priv),
        env=env,
        input='[{"i": "ok"}, {"i": "tampered"}]',
    ).stdout.strip()
    unsigned = gpumesh("submit", str(script), "--payloads", "-", env=env, input='[{"i": "unsigned"}]').stdout.strip()
    expired = gpumesh("submit", str(script), "--payloads", "-", "--sign-key", str(priv), "--expires", "1", env=env,
                      input='[{"i": "expired"}]').stdout.strip()  # fmt: skip
    # someone with write access edits a signed payload, and copies a signature into another job
    r.hset(k.task(k.task_id(signed, 1)), "payload", '{"i": "evil"}')
    copied = gpumesh("submit", str(script), "--payloads", "-", env=env, input='[{"i": "ok"}]').stdout.strip()
    r.hset(k.task(k.task_id(copied, 0)), mapping={"sig": r.hget(k.task(k.task_id(signed, 0)), "sig")})
    r.hset(k.job(copied), mapping={f: r.hget(k.job(signed), f) for f in ("key_id", "expires_at")})
    time.sleep(1.2)  # the expired job's validity ends
    w = gpumesh("worker", "--burst", "--score", "2", "--trust", str(pub), env=env, timeout=120)
    assert w.returncode == 0, w.stderr
    ran = sorted(p.name for p in tmp_path.glob("ran-*"))
    assert ran == ["ran-ok"], ran

    def error(job: str, i: int = 0) -> dict:
        return json.loads(gpumesh("results", job, "--format", "json", env=env).stdout)[i]

    assert error(signed, 0)["status"] == "done"
    for job, i, why in [
        (signed, 1, "signature: does not match the task"),
        (expired, 0, "signature: the job expired"),
        (copied, 0, "signature: does not match the task"),
    ]:
        row = error(job, i)
        assert row["status"] == "failed" and row["error"].startswith(why) and row["attempts"] == 1, row
    # an unsigned task is never given to a trusting worker: it waits for one that runs unsigned work
    assert error(unsigned, 0)["status"] == "queued" and error(unsigned, 0)["attempts"] == 0


def test_a_tampered_script_never_runs_even_without_signing(env, workers, r: redis.Redis, tmp_path: Path):
    from gpumesh.store import keys as k

    script = _marker_script(tmp_path)
    job = gpumesh("submit", str(script), "--payloads", "-", env=env, input='[{"i": 1}]').stdout.strip()
    sha = r.hget(k.job(job), "script_sha")
    r.set(k.script(sha), "import os\nos.system('touch /tmp/pwned-by-gpumesh-test')\n")
    workers.start()
    wait_until(lambda: r.hget(k.task(k.task_id(job, 0)), "status") == "failed", what="the refusal")
    assert r.hget(k.task(k.task_id(job, 0)), "error") == "the script in the broker does not match its hash (tampered)"
    assert not list(tmp_path.glob("ran-*"))


# -- the sandbox cannot read the broker's credentials --------------------------------------------

PEEK = """
import json, os
def ppid(pid):
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
def cmdline(pid):
    return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
worker = os.getppid()  # script -> launcher -> worker, or script -> supervisor -> zygote -> worker (--warm)
while "gpumesh worker" not in cmdline(worker):
    worker = ppid(worker)
seen = {"uid": os.getuid(), "env": sorted(k for k in os.environ if "URL" in k or "PASS" in k)}
for name, path in [("worker_environ", f"/proc/{worker}/environ"), ("config", os.environ.get("PEEK_CONFIG", ""))]:
    try:
        seen[name] = "secret" in open(path, "rb").read().decode(errors="replace")
    except (PermissionError, FileNotFoundError) as exc:
        seen[name] = type(exc).__name__
seen["worker_cmdline_has_secret"] = "secret" in open(f"/proc/{worker}/cmdline").read()
# what root runs: a copy of the launcher that the task's user could write, or write next to, would be a way in
import glob, tempfile
copies = glob.glob(os.path.join(tempfile.gettempdir(), "*", "_gpumesh_launcher.py"))
copies += glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_gpumesh_launcher.py"))
seen["writable_launcher"] = [c for c in copies if os.access(c, os.W_OK) or os.access(os.path.dirname(c), os.W_OK)]
print(json.dumps(seen))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
    reason="--sandbox-user needs a root worker and a Python the task user can read; CI here runs as root",
)
@pytest.mark.usefixtures("both_modes")
def test_sandbox_user_keeps_the_worker_s_secrets_out_of_reach(env, workers, r: redis.Redis, tmp_path: Path):
    import pwd

    nobody = pwd.getpwnam("nobody")
    cfg = tmp_path / "config.toml"
    cfg.write_text('url = "redis://:secret@127.0.0.1:1/0"\n')
    cfg.chmod(0o600)
    script = tmp_path / "peek.py"
    script.write_text(PEEK)
    extra = {"GPUMESH_WORKER_SECRET_MARKER": "secret"}  # stands in for a URL with a password in the environment
    # The task user must be able to read its interpreter: this machine's venv lives under /root (0700).
    extra["GPUMESH_SANDBOX_PYTHON"] = "/usr/bin/python3"
    workers.start("--sandbox-user", "nobody", **extra)
    job = gpumesh("submit", str(script), "--payloads", "-", env=env, input="[{}]").stdout.strip()
    wait_until(lambda: json.loads(gpumesh("status", job, "--json", env=env).stdout)["status"] in ("done", "failed"))
    (row,) = json.loads(gpumesh("results", job, "--format", "json", env=env).stdout)
    assert row["status"] == "done", row
    seen = row["result"]
    assert seen["uid"] == nobody.pw_uid and seen["env"] == []
    assert seen["worker_environ"] == "PermissionError" and seen["worker_cmdline_has_secret"] is False
    assert seen["writable_launcher"] == []  # the launcher root runs is never where the task's user may write
    # a task's own error still comes back whole (its traceback needs modules the zygote loaded for it)
    script.write_text("open('/proc/1/environ').read()\n")
    job = gpumesh("submit", str(script), "--payloads", "-", "--max-attempts", "1", env=env, input="[{}]").stdout.strip()
    wait_until(lambda: json.loads(gpumesh("status", job, "--json", env=env).stdout)["status"] == "failed")
    (row,) = json.loads(gpumesh("results", job, "--format", "json", env=env).stdout)
    assert row["error"].startswith("exit code 1") and "PermissionError" in row["error"], row


def test_without_a_sandbox_user_a_same_user_script_can_read_the_worker_s_environment(env, workers, tmp_path: Path):
    """What SECURITY.md warns about: the task's own environment is clean, /proc/<worker>/environ is not."""
    script = tmp_path / "peek.py"
    script.write_text(PEEK)
    workers.start("--no-isolation", GPUMESH_WORKER_SECRET_MARKER="secret")
    job = gpumesh("submit", str(script), "--payloads", "-", env=env, input="[{}]").stdout.strip()
    wait_until(lambda: json.loads(gpumesh("status", job, "--json", env=env).stdout)["status"] == "done")
    (row,) = json.loads(gpumesh("results", job, "--format", "json", env=env).stdout)
    assert row["result"]["env"] == [] and row["result"]["worker_environ"] is True


def test_sandbox_user_must_exist_and_not_be_root(env):
    assert "no user named" in gpumesh("worker", "--sandbox-user", "no-such-user-xyz", env=env).stderr
    assert "must not be root" in gpumesh("worker", "--sandbox-user", "root", env=env).stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="--sandbox-user needs a root worker; CI and this machine run as root")
def test_sandbox_user_that_cannot_read_the_interpreter_is_refused_at_start(env, tmp_path: Path):
    hidden = tmp_path / "private"  # 0700 and root's: nobody cannot reach the interpreter linked inside
    hidden.mkdir(mode=0o700)
    (hidden / "python").symlink_to(sys.executable)
    p = gpumesh("worker", "--sandbox-user", "nobody", env={**env, "GPUMESH_SANDBOX_PYTHON": str(hidden / "python")})
    assert p.returncode == 2, p.stderr
    assert "cannot run" in p.stderr and "GPUMESH_SANDBOX_PYTHON" in p.stderr


# -- TLS -------------------------------------------------------------------------------------------


def _make_tls(tmp: Path) -> tuple[Path, Path, Path]:
    """A CA made at test time and a server certificate for 127.0.0.1 that it signs."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpumesh test CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    paths = tmp / "ca.pem", tmp / "server.pem", tmp / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


def test_rediss_end_to_end_with_a_ca_made_at_test_time(env, tmp_path: Path):
    from gpumesh.server.broker_server import find_binary

    tls = tmp_path / "tls"  # not at the top of the tasks' write path (a key there: the worker refuses it)
    tls.mkdir()
    ca, cert, key = _make_tls(tls)
    port = free_port()
    server = subprocess.Popen(
        [find_binary(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
         "--tls-auth-clients", "no", "--requirepass", "tls-secret", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        url = f"rediss://:tls-secret@127.0.0.1:{port}/0?ssl_ca_certs={ca}"
        e = {**env, "GPUMESH_URL": url}
        wait_until(lambda: gpumesh("jobs", env=e).returncode == 0, timeout=15, what="the TLS broker")
        job = gpumesh("submit", EXAMPLE, "--payloads", PAYLOADS, env=e).stdout.strip()
        w = gpumesh("worker", "--burst", "--score", "2", env=e, timeout=120)
        assert w.returncode == 0, w.stderr
        assert json.loads(gpumesh("status", job, "--json", env=e).stdout)["status"] == "done"
        plain = gpumesh("jobs", "--url", f"redis://:tls-secret@127.0.0.1:{port}/0", env=env)
        assert plain.returncode == 3  # the port speaks only TLS
        untrusted = gpumesh("jobs", "--url", f"rediss://:tls-secret@127.0.0.1:{port}/0", env=env)
        assert untrusted.returncode == 3 and "certificate" in untrusted.stderr.lower()
    finally:
        server.terminate()
        server.wait()


def test_a_job_written_with_a_worker_credential_never_runs_on_a_trusting_worker(
    served, env, signing_keys, tmp_path: Path
):
    """A leaked worker credential cannot submit (it may not write scripts or the job index), nor sign: trusting
    workers run only the signed job."""
    _, urls, _, _ = served
    priv, pub = signing_keys
    script = _marker_script(tmp_path)
    forged = gpumesh(
        "submit", str(script), "--payloads", "-", "--url", urls["worker"], env=env, input='[{"i": "forged"}]'
    )
    assert forged.returncode == 3 and "no permissions" in forged.stderr, forged.stderr  # NOPERM, one line
    signed = gpumesh("submit", str(script), "--payloads", "-", "--url", urls["submitter"], "--sign-key", str(priv),
                     env=env, input='[{"i": "signed"}]')  # fmt: skip
    w = gpumesh("worker", urls["worker"], "--burst", "--score", "2", "--trust", str(pub), env=env, timeout=120)
    assert w.returncode == 0, w.stderr
    assert sorted(p.name for p in tmp_path.glob("ran-*")) == ["ran-signed"]
    assert signed.returncode == 0
