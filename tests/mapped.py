"""Functions the tests map over the mesh. gpumesh ships this whole file to the workers as the functions'
source, so it imports only the standard library (no pytest, no relative imports)."""

import math
import os
import time

OFFSET = 100


def square(payload):
    return payload["x"] ** 2


def shifted(payload):
    """Uses a module-level constant and a module import, both shipped with the file."""
    return {"x": payload["x"], "y": math.floor(payload["x"] + OFFSET), "task": os.environ.get("GPUMESH_TASK_INDEX")}


def parse(payload):
    return int(payload["text"])


def not_json(payload):
    return {1, 2, 3}


def slow(payload):
    time.sleep(payload.get("sleep", 0))
    return payload["x"]


def chatty(payload):
    print("a line the function printed", flush=True)
    return "ok"


class Holder:
    def method(self, payload):
        return payload


def generator(payload):
    yield payload


async def coroutine(payload):
    return payload


def make_closure():
    seen = []

    def remember(payload):
        seen.append(payload)
        return len(seen)

    return remember


if __name__ == "__main__":
    raise SystemExit("the module's main block must never run on a worker")


def add_tiny(payload):
    """Imports a package only the job's environment has (tests/envs/test_envs.py: dependencies=["gmtiny"])."""
    import gmtiny

    return gmtiny.VALUE + payload["x"]
