"""The public API boundary: what ``import gpumesh`` exports, and that submitting from Python runs the
same checks as the CLI before anything is written."""

from __future__ import annotations

import subprocess
import sys

import pytest

import gpumesh
from gpumesh import api, errors, models

from ..conftest import ROOT

pytestmark = pytest.mark.core

EXAMPLE = ROOT / "examples" / "grid_search.py"
DEEP: list = []
_level = DEEP
for _ in range(150):
    _level.append([])
    _level = _level[0]


def test_exported_members_are_the_public_api() -> None:
    # As httpx's tests/test_exported_members.py: __all__ is what the package exports, all of it resolves,
    # each name is documented, and comes from the module DESIGN §8 names.
    exported = {name for name in dir(gpumesh) if not name.startswith("_")}
    assert exported == set(gpumesh.__all__) - {"__version__"}
    for name in gpumesh.__all__:
        value = getattr(gpumesh, name)
        if name != "__version__":
            assert value.__doc__, f"gpumesh.{name} has no docstring"
            # gpumesh.checkpoint() runs in a task's interpreter: a module of its own that imports nothing of gpumesh
            assert value.__module__ in ("gpumesh.api", "gpumesh.errors", "gpumesh.models", "gpumesh.checkpointing"), (
                name
            )
    assert gpumesh.connect is api.connect and gpumesh.TaskResult is models.TaskResult
    assert issubclass(gpumesh.UsageError, gpumesh.GpumeshError) and gpumesh.NotFound is errors.NotFound
    with pytest.raises(AttributeError, match="no attribute 'Broker'"):
        gpumesh.Broker  # noqa: B018 - internal names stay internal


def test_every_public_name_and_method_shows_an_example() -> None:
    # DESIGN §8: a docstring with an example on every public name, the methods of Mesh and Job too.
    missing = []
    for name in gpumesh.__all__:
        value = getattr(gpumesh, name)
        if name == "__version__":
            continue
        if ">>>" not in (value.__doc__ or ""):
            missing.append(name)
        if name in ("Mesh", "Job"):
            for attr, member in vars(value).items():
                if callable(member) and not attr.startswith("_") and ">>>" not in (member.__doc__ or ""):
                    missing.append(f"{name}.{attr}")
    assert missing == []


def test_import_gpumesh_is_light() -> None:
    # The launcher imports the package once per task: the public names load on first use only.
    code = "import sys, gpumesh; print(sorted(m for m in ('redis', 'rq', 'pydantic', 'click') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(
    ("payloads", "message"),
    [
        ([{"cost": -1}], r"payloads\[0\]\.cost must be a positive number, got -1"),
        ([1, 2], r"payloads\[0\] must be a JSON object, got 1"),
        ([], "a job needs at least one payload"),
        ([{"requires": "vram_gb>=40"}], r"payloads\[0\]\.requires must be a list"),
        ([{"lr": float("nan")}], "cannot be sent as JSON: Out of range float values are not JSON compliant"),
        ([{"ids": {1, 2}}], "cannot be sent as JSON: Object of type set is not JSON serializable"),
        ([{"a": DEEP}], "nests deeper than 100 levels"),
    ],
)
def test_submit_from_python_checks_payloads_before_writing(env, r, payloads, message) -> None:
    with gpumesh.connect() as mesh:
        with pytest.raises(gpumesh.UsageError, match=message):
            mesh.submit(EXAMPLE, payloads)
    assert r.dbsize() == 0


def test_submit_from_python_checks_script_and_options_before_writing(env, r) -> None:
    with gpumesh.connect() as mesh:
        with pytest.raises(gpumesh.UsageError, match="syntax error at line 1"):
            mesh.submit("def broken(:\n", [{}])
        with pytest.raises(gpumesh.UsageError, match="does not exist"):
            mesh.submit("no/such/script.py", [{}])
        with pytest.raises(gpumesh.UsageError, match="max_attempts"):
            mesh.submit(EXAMPLE, [{}], max_attempts=0)
        with pytest.raises(gpumesh.UsageError, match="vram_gb"):
            mesh.submit(EXAMPLE, [{}], requires=["vram_gb>=lots"])
        with pytest.raises(gpumesh.UsageError, match="expires: must be a finite number of seconds from 1 to a year"):
            mesh.submit(EXAMPLE, [{}], expires=float("inf"))
    assert r.dbsize() == 0


def test_a_broker_store_submit_checks_too(broker, r) -> None:
    # The store layer itself refuses bad input, so no caller can skip the checks.
    with pytest.raises(gpumesh.UsageError, match=r"payloads\[1\] must be a JSON object"):
        broker.submit(EXAMPLE.read_text(), "grid_search.py", [{}, [1]], models.JobOptions())  # type: ignore[list-item]
    assert r.dbsize() == 0


def test_a_job_submitted_from_python_runs_and_reads_back(env, r, mesh_worker) -> None:
    with gpumesh.connect() as mesh:
        job = mesh.submit(EXAMPLE, [{"lr": 0.1, "epochs": 1}, {"lr": 0.01, "epochs": 1}], name="from python")
        assert job.status().tasks.total == 2
        assert mesh.job(job.id).id == job.id
        assert [j.job_id for j in mesh.jobs()] == [job.id]
        mesh_worker.burst()
        st = job.wait(timeout=60)
        assert st.status == "done" and st.name == "from python"
        results = job.results()
        assert [res.index for res in results] == [0, 1] and all(res.status == "done" for res in results)
        with pytest.raises(gpumesh.NotFound):
            mesh.job("nosuchjob")
