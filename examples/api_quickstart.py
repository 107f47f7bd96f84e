"""The Python API in one file: map a function, submit a script, stream results, catch a failure.

Start a mesh first (any of: `gpumesh serve` and `gpumesh worker URL` on each machine, or the
docker compose broker of docs/how-to/broker.md), point GPUMESH_URL at it (or `gpumesh config init`), then:

    python examples/api_quickstart.py

The functions below run on the workers: gpumesh ships this file's source (no pickle) and calls them
with each payload; the `if __name__ == "__main__":` block at the bottom runs only here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gpumesh

HERE = Path(__file__).resolve().parent


def circle(payload: dict[str, Any]) -> dict[str, float]:
    """Runs on a worker: a pure function of its payload, returning JSON."""
    r = float(payload["r"])
    return {"r": r, "area": round(math.pi * r * r, 3)}


def checked_sqrt(payload: dict[str, Any]) -> float:
    """Fails on a negative number, to show what a failed task looks like from here."""
    x = float(payload["x"])
    if x < 0:
        raise ValueError(f"cannot take the square root of {x}")
    return math.sqrt(x)


def main() -> None:
    with gpumesh.connect() as mesh:  # GPUMESH_URL, the config file, or redis://127.0.0.1:6379/0
        print(f"{len(mesh.workers())} worker(s) online")

        # 1. A function over payloads: results in payload order.
        areas = mesh.map(circle, [{"r": r} for r in (1, 2, 3)], progress=False)
        print("map:", [a["area"] for a in areas])

        # 2. A script (it reads its payload on stdin and prints its JSON result last), one task per payload.
        payloads = [{"lr": lr, "epochs": 200, "cost": 200} for lr in (0.3, 0.1, 0.03)]
        job = mesh.submit(HERE / "grid_search.py", payloads, name="quickstart")
        print("submitted", job.id)

        # 3. Results as the tasks end, in the order they end.
        for res in job.as_completed():
            print(f"  task {res.index} ({res.status} on {res.worker}): {res.result}")
        print("job", job.wait().status)

        # 4. A failure comes back typed: which task, the remote exception, its traceback.
        try:
            mesh.map(checked_sqrt, [{"x": 4}, {"x": -1}], max_attempts=1, progress=False)
        except gpumesh.TaskFailed as exc:
            print(f"task {exc.index} failed ({exc.kind}): {exc.exc_type}: {exc.message}")


if __name__ == "__main__":
    main()
