"""The Python API's examples run as a user runs them: examples/api_quickstart.py as a program, and
examples/notebook.ipynb headless in a real Jupyter kernel (nbclient + ipykernel), against a live mesh."""

from __future__ import annotations

import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from ..conftest import ROOT

pytestmark = pytest.mark.processes


def test_the_quickstart_program_runs_against_a_mesh(env, mesh_worker) -> None:
    mesh_worker.start()
    ran = subprocess.run(
        [sys.executable, "examples/api_quickstart.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0] == "1 worker(s) online"
    assert lines[1] == "map: [3.142, 12.566, 28.274]"  # the functions ran there, main() only here
    assert lines[2].startswith("submitted ")
    streamed = sorted(line.strip() for line in lines[3:6])
    assert [line.split(" (")[0] for line in streamed] == ["task 0", "task 1", "task 2"]
    assert all("done on " in line and "'loss': " in line for line in streamed)
    assert lines[6] == "job done"
    assert lines[7] == "task 1 failed (exception): ValueError: cannot take the square root of -1.0"


def outputs(cell: dict) -> str:
    """What a cell printed and returned (its widgets aside)."""
    text = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            text.append(out["text"])
        elif out["output_type"] == "execute_result":
            text.append(out["data"]["text/plain"])
    return "".join(text)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # jupyter_core's notice about its paths
def test_the_notebook_maps_functions_defined_in_cells(env, mesh_worker, tmp_path) -> None:
    mesh_worker.start()
    nb = nbformat.read(ROOT / "examples" / "notebook.ipynb", as_version=4)
    client = NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError if any cell fails
    code = {c.source.splitlines()[0]: c for c in nb.cells if c.cell_type == "code"}

    assert outputs(code["import gpumesh"]).strip() == "1 worker(s) online"
    mapped = code["mesh.map(hypotenuse, sides, progress=True)"]
    assert outputs(mapped).strip().endswith("[41.231, 44.721, 50.0, 56.569, 64.031]")
    widgets = [o for o in mapped.outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(widgets) == 1  # progress as a notebook widget, not a terminal bar in the cell's text
    assert "\r" not in outputs(mapped) and "\x1b" not in outputs(mapped)

    streamed = outputs(code["job = mesh.submit(hypotenuse, sides)"]).split()
    assert sorted(zip(streamed[::2], streamed[1::2])) == [
        ("0", "41.231"), ("1", "44.721"), ("2", "50.0"), ("3", "56.569"), ("4", "64.031"),
    ]  # fmt: skip
    assert outputs(code["def parse(payload):"]).strip() == "1 ValueError invalid literal for int() with base 10: 'two'"
    magic = outputs(code["%%gpumesh sides"])  # the cell magic; math comes from another cell's import
    assert magic.strip().startswith("[9.12310562") and "15.4031242" in magic


def test_the_first_example_of_the_python_how_to_runs_as_written(env, mesh_worker, tmp_path) -> None:
    """docs/how-to/python.md opens with a program a reader copies into a file and runs: without its
    `if __name__ == "__main__":` guard, each worker ran the driving code too and every task failed."""
    text = (ROOT / "docs/how-to/python.md").read_text()
    source = text.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "first.py").write_text(source)
    mesh_worker.start()
    ran = subprocess.run([sys.executable, str(tmp_path / "first.py")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0] == "[0, 1, 4, 9, 16]" and lines[1].startswith("0 done "), ran.stdout
