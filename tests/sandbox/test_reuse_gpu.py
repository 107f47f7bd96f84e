"""Load once, run many on a GPU: CUDA initialised by a reused process's first task is there for the next ones, and
what reuse saves per task, on the same card (a torch model built in the test, no download).

Runs where torch sees a CUDA device (the device check: `pytest tests/sandbox/test_reuse_gpu.py -s`); elsewhere it is
reported skipped. It prints the figures docs/reuse.md quotes."""

from __future__ import annotations

import importlib.util
import statistics

import pytest

import gpumesh as gm

from ..conftest import ROOT, Workers


def _cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


pytestmark = [pytest.mark.processes, pytest.mark.skipif(not _cuda(), reason="no CUDA device (or torch) here")]


def test_cuda_stays_initialised_between_tasks_and_reuse_saves_the_load_per_task(env, workers: Workers):
    workers.start("--warm")
    script = str(ROOT / "examples" / "reuse_infer.py")
    payloads = [{"seed": i, "batch": 256} for i in range(12)]
    with gm.connect() as mesh:
        reused = mesh.submit(script, payloads, reuse_process=True)
        assert reused.wait(timeout=600).status == "done"
        fresh = mesh.submit(script, payloads[:4])
        assert fresh.wait(timeout=600).status == "done"
        rows, plain = reused.results(), fresh.results()
    results = sorted((r.result for r in rows), key=lambda res: res["model_was_loaded"])
    assert {res["device"] for res in results} == {"cuda"}
    assert len({res["pid"] for res in results}) == 1  # one worker, one process for the job
    assert sum(not res["model_was_loaded"] for res in results) == 1  # loaded by the first task only
    assert all(res["cuda_initialised"] for res in results)
    first = max(r.duration_s or 0 for r in rows)
    per_task = statistics.median(sorted(r.duration_s or 0 for r in rows)[:-1])
    without = statistics.median(r.duration_s or 0 for r in plain)
    print(f"\nreuse on the same card: first task {first:.3f} s, then {per_task * 1000:.1f} ms a task; "
          f"without reuse {without:.3f} s a task ({without / per_task:.0f} ×)")  # fmt: skip
    assert per_task < without
