"""The plain-RQ contender of benchmarks/core.py: one RQ job per task, each running the task script
in a fresh `python -c` subprocess, as a user of plain RQ would."""

from __future__ import annotations

import json
import subprocess
import sys


def run(script: str, payload: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", script], input=json.dumps(payload).encode(), capture_output=True, check=True
    )
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def nothing(script: str, payload: dict) -> dict:
    """No subprocess at all: what RQ's own per-job bookkeeping costs, the ceiling for any RQ-based executor."""
    return payload


def sleep_cost(cost: float, unit: float) -> float:
    """The FIFO contender of benchmarks/makespan.py: sleep cost × unit ÷ this worker's emulated score."""
    import os
    import time

    seconds = cost * unit / float(os.environ["BENCH_SCORE"])
    time.sleep(seconds)
    return seconds
