"""Shared by the benchmark scripts: a private redis-server, Markdown tables, and docs/benchmarks.md sections."""

from __future__ import annotations

import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from gpumesh.server.broker_server import free_port

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"


class PrivateRedis:
    """A redis-server on a free loopback port, in a temp dir of its own (``tmp``, also the benchmark's
    scratch space, removed by ``stop``), never the machine's own."""

    def __init__(self) -> None:
        self.tmp = tmp = Path(tempfile.mkdtemp(prefix="gpumesh-bench-"))
        self.port = free_port()
        self.proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(tmp), "--maxmemory-policy", "noeviction"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        self.url = f"redis://127.0.0.1:{self.port}/0"
        client = redis.Redis.from_url(self.url)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        client.close()

    def db(self, n: int) -> str:
        return self.url[:-1] + str(n)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


def start_worker(
    url: str,
    score: float,
    *args: str,
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
    cwd: str | None = None,
) -> subprocess.Popen[bytes]:
    """``cwd``: where it runs; outside the checkout when PYTHONPATH names another revision (revision_tree)."""
    return subprocess.Popen(
        [*prefix, sys.executable, "-m", "gpumesh", "worker", "--score", str(score), "--log-level", "WARNING", *args],
        env={**os.environ, **(env or {}), "GPUMESH_URL": url}, start_new_session=True, cwd=cwd,
    )  # fmt: skip


def stop(procs: Sequence[subprocess.Popen[bytes]], sig: int = signal.SIGKILL) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def rounds(xs: Sequence[float], fmt: str = "{:.2f}") -> str:
    return ", ".join(fmt.format(x) for x in xs)


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{os.cpu_count()} cores ({cpu}), 10⁷ `x += 1` in a Python function in {python_speed():.2f} s, "
        f"Python {platform.python_version()}, {platform.system()} {platform.release()}"
    )


def python_speed() -> float:
    """Seconds this machine takes for 10⁷ ``x += 1`` in a Python function: its speed, named with its CPU."""
    t0 = time.perf_counter()
    x = 0
    for _ in range(10**7):
        x += 1
    return time.perf_counter() - t0


def publish(name: str, title: str, body: str, command: str) -> None:
    """Print the section and write it into docs/benchmarks.md between its markers (other sections kept)."""
    section = (
        f"<!-- {name}:begin -->\n## {title}\n\n{body}\n\nReproduce: `{command}`  \n"
        f"Measured on {machine()}.\n<!-- {name}:end -->"
    )
    print(section)
    DOC.parent.mkdir(exist_ok=True)
    text = (
        DOC.read_text() if DOC.exists() else "# gpumesh benchmarks\n\nEach section is written by the script it names.\n"
    )
    pattern = re.compile(rf"<!-- {name}:begin -->.*?<!-- {name}:end -->", re.S)
    text = pattern.sub(lambda _m: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section + "\n"
    DOC.write_text(text)


def tiny_wheel(folder: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """A minimal pure-Python wheel (``files``: path in the wheel -> text, with its metadata and RECORD), to serve
    from a local --find-links folder: envs built without the public index."""
    import base64
    import hashlib
    import zipfile

    dist = f"{name}-{version}.dist-info"
    entries = {
        **files,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: gpumesh-bench\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},"
        f"{len(t.encode())}"
        for path, t in entries.items()
    ]
    entries[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, t in entries.items():
            z.writestr(path, t)
    return wheel


def revision_tree(rev: str, dest: Path) -> Path:
    """The package ``gpumesh/`` as it was at git revision ``rev``, extracted under ``dest`` (returned), to run
    through PYTHONPATH=dest from a working directory outside the checkout (sys.path[0] would otherwise put
    the checkout's own gpumesh/ first)."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "gpumesh"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest
