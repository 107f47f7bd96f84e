"""What a newcomer follows: the lines `serve` and `access add` print reach the broker from another machine,
examples say which broker they assume and work against it, and install hints name a command that works."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from gpumesh.extras import DISTRIBUTION, extra_requirements, install_command, install_hint
from gpumesh.server.broker_server import is_loopback, lan_address

from ..conftest import ROOT, Serve, free_port, gpumesh


@pytest.mark.security
def test_access_add_on_a_broker_for_every_interface_prints_an_address_another_machine_reaches(env, tmp_path: Path):
    data = tmp_path / "broker"
    serve = Serve(env, data, free_port(), "--host", "0.0.0.0")
    try:
        p = gpumesh("access", "add", "ana", "--data-dir", str(data), env=env)
        assert p.returncode == 0, p.stderr
        line = re.search(r"gpumesh worker '([^']+)' --trust ed25519:", p.stdout)
        assert line, p.stdout
        host = urlsplit(line.group(1)).hostname
        assert host is not None and not is_loopback(host), p.stdout  # 127.0.0.1 reaches nothing from her machine
        assert host == lan_address() == urlsplit(serve.worker_url).hostname  # where serve's own worker line points
        assert "from this machine only" not in p.stderr
        ana = redis.Redis.from_url(line.group(1))  # her credential, through that address
        assert ana.ping() is True
        ana.close()
    finally:
        serve.stop()


@pytest.mark.security
def test_access_add_on_a_loopback_broker_says_its_line_reaches_this_machine_only(env, tmp_path: Path):
    data = tmp_path / "broker"
    serve = Serve(env, data, free_port())
    try:
        p = gpumesh("access", "add", "ana", "--data-dir", str(data), env=env)
        assert p.returncode == 0, p.stderr
        assert "@127.0.0.1:" in p.stdout
        assert "it reaches the broker from this machine only" in p.stderr and "--host 0.0.0.0" in p.stderr
    finally:
        serve.stop()


@pytest.mark.core
def test_an_install_hint_names_the_checkout_the_git_url_or_the_extra_s_own_requirements():
    requires = ["redis[hiredis]>=5.0", 'prometheus-client>=0.20; extra == "metrics"', 'torch; extra == "gpu"']
    editable = {"url": "file:///home/ana/src/gpumesh", "dir_info": {"editable": True}}
    assert install_command("metrics", editable, requires, None) == ["-e", "/home/ana/src/gpumesh[metrics]"]
    wheel_dir = {"url": "file:///home/ana/src/gpumesh", "dir_info": {}}
    assert install_command("gpu", wheel_dir, requires, None) == ["/home/ana/src/gpumesh[gpu]"]
    git = {"url": "https://example.org/lab/gpumesh.git", "vcs_info": {"vcs": "git", "commit_id": "abc123"}}
    assert install_command("metrics", git, requires, None) == [
        f"{DISTRIBUTION}[metrics] @ git+https://example.org/lab/gpumesh.git@abc123"
    ]
    assert install_command("metrics", None, requires, None) == ["prometheus-client>=0.20"]  # a wheel, wherever from
    assert extra_requirements("gpu", requires) == ["torch"]
    # Here, the test environment is this checkout installed editable (the README's test command)
    assert install_hint("tunnel") == f"{sys.executable} -m pip install -e '{ROOT}[tunnel]'"


# `pip install 'gpumesh-pool[x]'` (or the bare name) asks the package index, where gpumesh-pool is not published.
FROM_THE_INDEX = re.compile(
    rf"""pip install [^`;&|#]*?(?<![\w/.-]){DISTRIBUTION}(\[[\w,]+\])?(?![\w\[-])(?!['"]?\s*@)"""
)
SCANNED = ["README.md", "SECURITY.md", "CONTRIBUTING.md", "docs", "workers", "gpumesh", "examples", "benchmarks"]


@pytest.mark.core
def test_no_install_line_asks_the_package_index_for_the_unpublished_distribution():
    wrong = []
    for place in SCANNED:
        path = ROOT / place
        files = (
            [path]
            if path.is_file()
            else [p for p in path.rglob("*") if p.is_file() and p.suffix in (".md", ".py", ".sh", ".txt", "")]
        )
        for f in files:
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                if FROM_THE_INDEX.search(line):
                    wrong.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert wrong == [], "gpumesh-pool is not on the package index: name the checkout or the git form"
    assert FROM_THE_INDEX.search("pip install 'gpumesh-pool[metrics]'")  # what it catches
    assert not FROM_THE_INDEX.search("pip install 'gpumesh-pool[server] @ git+https://example.org/x.git'")


# Where a URL with an empty user (`redis://:PASSWORD@…`) may appear: it fits only a broker with one password
# (the compose file's requirepass), and `gpumesh serve` refuses it. Each such example must say so.
EXAMPLE_PLACES = ["README.md", "SECURITY.md", "docs", "workers", "examples"]


def _lines_with_an_empty_user(text: str) -> list[tuple[int, str, str]]:
    lines = text.splitlines()
    found = []
    for n, line in enumerate(lines):
        if re.search(r"rediss?://:", line):
            found.append((n + 1, line, "\n".join(lines[max(0, n - 2) : n + 1])))
    return found


@pytest.mark.core
def test_every_example_of_a_one_password_url_says_it_is_for_the_compose_broker():
    from gpumesh.cli import reference

    texts = {"--help": reference.render()}
    for place in EXAMPLE_PLACES:
        path = ROOT / place
        for f in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
            if f.suffix not in (".png", ".ipynb") and f.name != "cli.md":  # cli.md is the --help, read above
                texts[str(f.relative_to(ROOT))] = f.read_text(errors="replace")
    unsaid = [
        f"{where}:{n}: {line.strip()[:100]}"
        for where, text in texts.items()
        for n, line, context in _lines_with_an_empty_user(text)
        if "compose" not in context.lower()
    ]
    assert unsaid == [], "an example with an empty user fails against `gpumesh serve`: say it is the compose broker's"


def _env_file(text: str, values: dict[str, str]) -> dict[str, str]:
    """The uncommented KEY=VALUE lines of an env file, with its placeholders filled in."""
    out = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            for placeholder, real in values.items():
                value = value.replace(placeholder, real)
            out[key.strip()] = value.strip()
    return out


@pytest.mark.processes
def test_the_worker_env_example_runs_a_serve_broker_s_signed_job_and_its_compose_form_is_refused_there(
    env, tmp_path: Path
):
    import json

    from gpumesh.signing import inline, public_key

    data, port = tmp_path / "broker", free_port()
    serve = Serve(env, data, port)
    try:
        creds = json.loads((data / "credentials.json").read_text())
        filled = _env_file(
            (ROOT / "workers" / "worker.env.example").read_text(),
            {
                "PASSWORD": creds["worker"], "BROKER_HOST": "127.0.0.1", ":6390/": f":{port}/",
                "ed25519:PUBLIC_KEY_FROM_THE_LINE": inline(public_key(data / "signing.pub")),
            },
        )  # fmt: skip
        assert set(filled) == {"GPUMESH_URL", "GPUMESH_TRUSTED_KEYS"}
        job = gpumesh("submit", str(ROOT / "examples/grid_search.py"), "--payloads", "-", "--url", serve.submit_url,
                      "--sign-key", str(data / "signing.key"), input='[{"lr": 0.1, "epochs": 5}]', env=env)  # fmt: skip
        assert job.returncode == 0, job.stderr
        worker = gpumesh("worker", "--burst", "--score", "1", env={**env, **filled}, timeout=120)
        assert worker.returncode == 0, worker.stderr
        st = gpumesh("status", job.stdout.strip(), "--url", serve.submit_url, "--json", env=env)
        assert json.loads(st.stdout)["status"] == "done", worker.stderr
        compose_form = f"redis://:{creds['worker']}@127.0.0.1:{port}/0"  # the commented-out line's form
        refused = gpumesh("worker", compose_form, "--burst", "--score", "1", env=env, timeout=60)
        assert refused.returncode == 3 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    finally:
        serve.stop()
