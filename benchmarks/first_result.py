"""First result fast : the grid-search example from one command to its results, on this
machine with 2 workers. gpumesh: `gpumesh run examples/grid_search.py --payloads examples/payloads.json
--local 2` (a private broker and 2 workers, started and stopped by the command). The peer (K4 gpumesh
3.2.0, installed as benchmarks/cli_start.py does): its `serve`, 2 `join` workers and `submit --wait`,
timed from the first command to the submit's exit. Alternating, medians.

    python benchmarks/first_result.py [--rounds 3] [--peer-venv DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_start import PeerMesh, peer_venv  # noqa: E402
from common import ROOT, med, publish, rounds, table  # noqa: E402

EXAMPLE = ROOT / "examples" / "grid_search.py"
PAYLOADS = ROOT / "examples" / "payloads.json"


def ours(tmp: Path) -> float:
    env = {**os.environ, "GPUMESH_CONFIG": str(tmp / "none.toml"), "XDG_CACHE_HOME": str(tmp / "cache")}
    env.pop("GPUMESH_URL", None)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gpumesh", "run", str(EXAMPLE), "--payloads", str(PAYLOADS),
                           "--local", "2", "--format", "json"], env=env, capture_output=True, text=True)  # fmt: skip
    elapsed = time.perf_counter() - t0
    assert done.returncode == 0, done.stderr
    return elapsed


def peer(exe: Path, tmp: Path) -> float:
    """The peer's way: its coordinator, 2 `join` workers once it answers, `submit --wait`; from the first command."""
    home = Path(tempfile.mkdtemp(dir=tmp))
    t0 = time.perf_counter()
    mesh = PeerMesh(exe, home)
    try:
        mesh.wait_up()
        mesh.join(2)
        mesh.submit_wait(EXAMPLE, PAYLOADS)
        return time.perf_counter() - t0
    finally:
        mesh.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--peer-venv", type=Path, help="a venv with the peer installed (default: make one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpumesh-first-") as scratch:
        tmp = Path(scratch)
        exe = peer_venv(args.peer_venv or tmp / "peer")
        cases = {
            "gpumesh run --local 2": lambda: ours(tmp),
            "peer: serve + 2 join + submit --wait": lambda: peer(exe, tmp),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, run in cases.items():
                times[name].append(run())
    rows = [[name, f"{med(xs):.2f}", rounds(xs)] for name, xs in times.items()]
    body = "The grid-search example (6 shards) on this machine, from the first command to the results:\n\n" + table(
        ["", "median s", "rounds"], rows
    )
    publish("first-result", "First result: one command to results", body,
            f"python benchmarks/first_result.py --rounds {args.rounds}")  # fmt: skip


if __name__ == "__main__":
    main()
