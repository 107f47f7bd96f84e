"""The torch example end to end on whatever device the worker finds (CPU here, CUDA on a GPU host).

Runs where torch is installed (`pip install -e '.[gpu]'`); CI installs no torch and reports it skipped.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from ..conftest import ROOT, Workers, gpumesh

pytestmark = [
    pytest.mark.processes,
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None, reason="torch is not installed (pip install -e '.[gpu]')"
    ),
]


def test_torch_example_trains_on_the_worker_device(env, workers: Workers):
    workers.start()
    p = gpumesh(
        "submit", str(ROOT / "examples/torch_regression.py"), "--payloads", str(ROOT / "examples/torch_payloads.json"),
        "--wait", "--json", env=env, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    job = json.loads(p.stdout)["job_id"]
    rows = json.loads(gpumesh("results", job, "--format", "json", env=env).stdout)
    device = json.loads(gpumesh("workers", "--json", env=env).stdout)[0]["device"]
    assert len(rows) == 6 and all(r["status"] == "done" for r in rows)
    assert {r["result"]["device"].split(":")[0] for r in rows} == {device}
    best = min(rows, key=lambda r: r["result"]["test_loss"])
    assert best["result"]["test_loss"] < 0.1  # the wide nets fit sin(3x)·x well
