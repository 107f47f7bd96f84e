"""``%load_ext gpumesh``: a ``%%gpumesh`` cell magic for notebooks.

    %%gpumesh POINTS [--url URL] [--with SPEC ...]
    def distance(p):
        return (p["x"] ** 2 + p["y"] ** 2) ** 0.5

runs the cell (so ``distance`` is defined in the notebook too), then maps the cell's last function over
the notebook variable ``POINTS`` (a list of payload dicts) on the mesh, exactly as
``gpumesh.connect(URL).map(distance, POINTS)`` does, and shows the results (also in ``_``). Each
``--with SPEC`` is a package the function needs (``map``'s ``dependencies=``, docs/environments.md).
"""

from __future__ import annotations

import ast
import importlib
import shlex
from typing import Any

USAGE = (
    "usage: %%gpumesh PAYLOADS [--url URL] [--with SPEC ...], PAYLOADS naming a list of payload dicts defined in "
    "the notebook"
)


def load_ipython_extension(ipython: Any) -> None:
    """Register the ``%%gpumesh`` cell magic (what ``%load_ext gpumesh`` calls)."""

    def gpumesh_magic(line: str, cell: str) -> list[Any] | None:
        UsageError = importlib.import_module("IPython.core.error").UsageError  # IPython's: shown as one line

        words = shlex.split(line)
        url, deps = None, []
        rest = words[1:]
        while len(rest) >= 2 and rest[0] in ("--url", "--with"):
            if rest[0] == "--url":
                url = rest[1]
            else:
                deps.append(rest[1])
            rest = rest[2:]
        if not words or rest:
            raise UsageError(USAGE)
        name = words[0]
        if name not in ipython.user_ns:
            raise UsageError(f"{name} is not defined in this notebook; {USAGE}")
        tree = ast.parse(ipython.transform_cell(cell))
        functions = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)]
        if not functions:
            raise UsageError("the cell defines no function (def at its top level) to map over " + name)
        ran = ipython.run_cell(cell, store_history=False)
        if not ran.success:
            return None  # the cell's own error is already shown
        import gpumesh

        with gpumesh.connect(url) as mesh:
            results: list[Any] = mesh.map(ipython.user_ns[functions[-1]], ipython.user_ns[name], dependencies=deps)
        return results

    ipython.register_magic_function(gpumesh_magic, magic_kind="cell", magic_name="gpumesh")
