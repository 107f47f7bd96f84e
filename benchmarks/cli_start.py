"""How fast the CLI answers : `gpumesh --help` and `gpumesh status JOB --json`, side by side
with the peer (K4 gpumesh 3.2.0 from PyPI, installed into its own venv under the benchmark's temp dir, or
the one --peer-venv names), alternating, medians.

    python benchmarks/cli_start.py [--runs 15] [--peer-venv DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PrivateRedis, med, publish, stop, table  # noqa: E402

from gpumesh.server.broker_server import free_port  # noqa: E402

PEER = "gpumesh==3.2.0"


def peer_venv(where: Path) -> Path:
    """The peer's `gpumesh` command, installed into ``where`` unless it is there already."""
    exe = where / "bin" / "gpumesh"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
        subprocess.run([str(where / "bin" / "pip"), "install", "-q", PEER], check=True)
    return exe


class PeerMesh:
    """The peer's mesh on this machine, as its README runs it: a coordinator (`serve`, its own database
    under ``home``), `join` workers and `submit --wait`. Shared by peer.py and first_result.py."""

    TOKEN = "bench-token"

    def __init__(self, exe: Path, home: Path) -> None:
        self.exe, self.port = exe, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "HOME": str(home), "GPUMESH_TOKEN": self.TOKEN, "GPUMESH_COLOR": "0"}
        self.env.pop("GPUMESH_URL", None)
        self.procs = [self._start("serve", "--port", str(self.port), "--db", str(home / "db.sqlite"), "--token",
                                  self.TOKEN, "--no-discovery", "--no-self-worker")]  # fmt: skip

    def _start(self, *args: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([str(self.exe), *args], env=self.env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip

    def wait_up(self, timeout: float = 60) -> None:
        """Until the coordinator answers HTTP (an error status is an answer too)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(self.url + "/", timeout=1)
                return
            except OSError as exc:
                if getattr(exc, "code", None):
                    return
                assert time.monotonic() < deadline and self.procs[0].poll() is None, (
                    "the peer's coordinator did not start"
                )
                time.sleep(0.05)

    def join(self, n: int) -> None:
        self.procs += [self._start("join", self.url, "--token", self.TOKEN) for _ in range(n)]

    def submit_wait(self, script: Path, payloads: Path) -> None:
        done = subprocess.run([str(self.exe), "submit", str(script), "--payloads", str(payloads), "--wait", "--url",
                               self.url, "--token", self.TOKEN], env=self.env, capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr

    def stop(self) -> None:
        stop(self.procs)


def timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--peer-venv", type=Path, help="a venv with the peer installed (default: make one)")
    args = ap.parse_args()
    broker = PrivateRedis()
    try:
        peer = peer_venv(args.peer_venv or broker.tmp / "peer")
        ours = [sys.executable, "-m", "gpumesh"]
        cmd = Path(sys.executable).with_name("gpumesh")  # the console script, as a shell runs it
        if cmd.exists():
            ours = [str(cmd)]
        env = {**os.environ, "GPUMESH_URL": broker.url, "GPUMESH_CONFIG": str(broker.tmp / "none.toml")}
        script = broker.tmp / "t.py"
        script.write_text("import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n")
        job = subprocess.run([*ours, "submit", str(script), "--payloads", "-"], input='[{"i": 1}]', env=env,
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        json.loads(subprocess.run([*ours, "status", job, "--json"], env=env, capture_output=True, text=True,
                                  check=True).stdout)  # fmt: skip
        cases = {
            "gpumesh --help (ours)": [*ours, "--help"],
            "gpumesh --help (peer 3.2.0)": [str(peer), "--help"],
            "gpumesh status JOB --json (ours)": [*ours, "status", job, "--json"],
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.runs):  # alternating, so the machine's noise falls on all alike
            for name, argv in cases.items():
                times[name].append(timed(argv, env))
    finally:
        broker.stop()
    peer_help = med(times["gpumesh --help (peer 3.2.0)"])
    rows = [
        [name, f"{med(xs) * 1000:.0f}", f"{min(xs) * 1000:.0f}", f"{med(xs) / peer_help:.2f}x"]
        for name, xs in times.items()
    ]
    body = (
        table(["command", "median ms", "best ms", "vs the peer's --help"], rows)
        + "\n\nTargets: `--help` at most 1.5x the peer's `--help`, `status JOB --json` at most 2.5x it."
    )
    publish("cli-start", "How fast the CLI answers", body, f"python benchmarks/cli_start.py --runs {args.runs}")


if __name__ == "__main__":
    main()
