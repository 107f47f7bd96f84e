"""A function the reuse tests map over the mesh with reuse_process=True. gpumesh ships this whole file to the
workers as the function's source, so it imports only the standard library."""

import os

_CACHE = {}


def cached_square(payload):
    """Loads its "model" once per process (a module-level cache), and says how often it was called there."""
    if "model" not in _CACHE:
        with open(payload["loads"], "a") as f:
            f.write(f"{os.getpid()}\n")
        _CACHE["model"] = lambda x: x * x
        _CACHE["calls"] = 0
    _CACHE["calls"] += 1
    return {"y": _CACHE["model"](payload["x"]), "pid": os.getpid(), "calls": _CACHE["calls"]}
