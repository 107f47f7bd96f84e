"""``gpumesh pull`` end to end: real `gpumesh worker` processes, the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..conftest import cli
from ..store.test_artifacts import WRITER, content, four_tasks

pytestmark = pytest.mark.processes


def test_pull_end_to_end_with_real_workers(env, r, workers, tmp_path: Path):
    writer = tmp_path / "writer.py"
    writer.write_text(WRITER)
    workers.start()
    workers.start()
    ran = cli("submit", str(writer), "--payloads", "-", "--wait", input=json.dumps(four_tasks()))
    assert ran.returncode == 0, ran.stderr
    job = ran.stdout.split()[0]
    dest = tmp_path / "out"
    first = cli("pull", job, "--to", str(dest), "--json")
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert len(report["fetched"]) == 12 and report["bytes"] == sum(
        sum(p["files"].values()) for p in four_tasks()
    )  # fmt: skip
    for i, payload in enumerate(four_tasks()):
        for rel, size in payload["files"].items():
            assert (dest / str(i) / rel).read_bytes() == content(rel, i, size)
    second = cli("pull", job, "--to", str(dest))
    assert (
        second.returncode == 0 and "pulled 0 file(s), 0.0 MiB" in second.stderr and "12 already there" in second.stderr
    )
    one = cli("pull", job, "2", "--to", str(tmp_path / "one"), "--glob", "plots/*")
    assert one.returncode == 0 and [p.name for p in (tmp_path / "one").rglob("*") if p.is_file()] == ["loss.txt"]
    assert cli("pull", job, "9", "--to", str(tmp_path / "x")).returncode == 4
    results = json.loads(cli("results", job, "--format", "json").stdout)
    assert [a["path"] for a in results[0]["artifacts"]] == ["top.json", "ckpt/epoch0/model.bin", "plots/loss.txt"]
    assert set(results[0]["artifacts"][0]) == {"path", "bytes", "sha256"}
