"""End to end against the peer : N no-op shards through ONE worker, timed from `submit --wait`
in a shell to its exit, gpumesh (warm, the default, and --fresh) beside K4 gpumesh 3.2.0 from PyPI (installed
into its own venv under the benchmark's temp dir, or the one --peer-venv names), alternating, medians.

    python benchmarks/peer.py [--tasks 200] [--rounds 3] [--peer-venv DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_start import PeerMesh, peer_venv  # noqa: E402
from common import PrivateRedis, med, publish, rounds, start_worker, stop, table  # noqa: E402

NOOP = "import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n"


def ours(broker: PrivateRedis, payloads: Path, script: Path, mode: str, tasks: int) -> float:
    """One round: a fresh database, one worker, `gpumesh submit --wait`; seconds from submit to its exit."""
    url = broker.db(1)
    env = {**os.environ, "GPUMESH_URL": url, "GPUMESH_CONFIG": str(broker.tmp / "none.toml")}
    import redis

    redis.Redis.from_url(url).flushdb()
    worker = start_worker(url, 10, mode, env={"GPUMESH_CONFIG": env["GPUMESH_CONFIG"]})
    try:
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 60
        while not client.zcard("gpumesh:workers"):
            assert time.monotonic() < deadline and worker.poll() is None, "our worker did not register"
            time.sleep(0.05)
        time.sleep(1.0)  # its spare interpreter (fresh) or zygote (warm) is up, as on a worker that waits
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "gpumesh", "submit", str(script), "--payloads", str(payloads),
                               "--wait"], env=env, capture_output=True, text=True)  # fmt: skip
        elapsed = time.perf_counter() - t0
        assert done.returncode == 0, done.stderr
        return elapsed
    finally:
        stop([worker])


def peer(exe: Path, tmp: Path, payloads: Path, script: Path, tasks: int) -> float:
    """One round of the peer: its coordinator (own database), one `join` worker, its `submit --wait`."""
    home = Path(tempfile.mkdtemp(dir=tmp))
    mesh = PeerMesh(exe, home)
    try:
        mesh.wait_up()
        mesh.join(1)
        time.sleep(3.0)  # it registers and starts polling
        t0 = time.perf_counter()
        mesh.submit_wait(script, payloads)
        return time.perf_counter() - t0
    finally:
        mesh.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--peer-venv", type=Path, help="a venv with the peer installed (default: make one)")
    args = ap.parse_args()
    broker = PrivateRedis()
    try:
        exe = peer_venv(args.peer_venv or broker.tmp / "peer")
        payloads = broker.tmp / "payloads.json"
        payloads.write_text(json.dumps([{"i": i} for i in range(args.tasks)]))
        script = broker.tmp / "noop.py"
        script.write_text(NOOP)
        cases = {
            "gpumesh (warm, the default)": lambda: ours(broker, payloads, script, "--warm", args.tasks),
            "gpumesh --fresh": lambda: ours(broker, payloads, script, "--fresh", args.tasks),
            "peer (K4 gpumesh 3.2.0)": lambda: peer(exe, broker.tmp, payloads, script, args.tasks),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):  # alternating
            for name, run in cases.items():
                times[name].append(run())
    finally:
        broker.stop()
    peer_rate = args.tasks / med(times["peer (K4 gpumesh 3.2.0)"])
    rows = []
    for name, xs in times.items():
        rate = args.tasks / med(xs)
        rows.append([name, f"{med(xs):.2f}", rounds(xs), f"{rate:.1f}", f"{rate / peer_rate:.2f}x"])
    body = (
        f"{args.tasks} no-op shards through one worker, from `submit --wait` to its exit:\n\n"
        + table(["", "median s", "rounds", "tasks/s", "vs the peer"], rows)
        + "\n\nTarget: at least 2.5x the peer per worker."
    )
    publish("peer", "End to end against the peer", body,
            f"python benchmarks/peer.py --tasks {args.tasks} --rounds {args.rounds}")  # fmt: skip


if __name__ == "__main__":
    main()
