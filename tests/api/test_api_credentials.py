"""The Python API's waits with a submitter credential, as `gpumesh serve` provisions it and as a broker set up by an
earlier serve does (its submitter may read the stream of task ends, but not block on it)."""

from __future__ import annotations

import importlib.util
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

import gpumesh as gm
from gpumesh.server.acl import ROLES
from gpumesh.server.broker_server import prepare

from ..conftest import RedisServer, Workers

SCRIPT = "import json, sys\nprint(json.dumps({'twice': 2 * json.load(sys.stdin)['x']}))\n"


def _submitter(r: redis.Redis, redis_server: RedisServer, rules: list[str]) -> str:
    user, password = f"submitter-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    r.execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}", *rules)
    prepare(r)  # gpumesh's functions and the epoch, which a submitter may not make
    return f"redis://{user}:{password}@127.0.0.1:{redis_server.port}/0"


FUNCTION = "def double(payload):\n    return 2 * payload['x']\n"


def _double(tmp_path: Path) -> Any:
    """A function defined in a file of its own (mesh.map ships its module's source)."""
    path = tmp_path / "doubling.py"
    path.write_text(FUNCTION)
    spec = importlib.util.spec_from_file_location("doubling", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["doubling"] = module
    spec.loader.exec_module(module)
    return module.double


@pytest.mark.processes
@pytest.mark.parametrize("rules", ["serve", "earlier serve"])
def test_wait_map_and_as_completed_with_a_submitter_credential(
    env: dict[str, str], r: redis.Redis, redis_server: RedisServer, workers: Workers, tmp_path: Path, rules: str
) -> None:
    granted = ROLES["submitter"] if rules == "serve" else [rule for rule in ROLES["submitter"] if rule != "+xread"]
    url = _submitter(r, redis_server, granted)
    script = tmp_path / "double.py"
    script.write_text(SCRIPT)
    workers.start()
    with gm.connect(url) as mesh:
        job = mesh.submit(script, [{"x": i} for i in range(3)])
        assert job.wait(timeout=60).status == "done"
        assert sorted(row.result["twice"] for row in job.results()) == [0, 2, 4]
        again = mesh.submit(script, [{"x": 5}, {"x": 6}])
        assert sorted(row.result["twice"] for row in again.as_completed(timeout=60)) == [10, 12]
        assert mesh.map(_double(tmp_path), [{"x": 7}, {"x": 8}], wait_timeout=60) == [14, 16]
