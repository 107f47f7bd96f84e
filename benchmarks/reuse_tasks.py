"""The tasks benchmarks/reuse.py runs on gpumesh (shipped as this file's source) and on Ray (imported by its
workers): standard library only."""

import os
import time

LOAD_S = 2.0  # what "loading the model" costs, once per process
ANSWER_S = 0.010  # what each inference costs once it is loaded

_MODELS = {}


def noop(payload):
    return payload["i"]


def infer(payload):
    """Loads its "model" on first use in this process (per ``payload["model"]``, so that a new round loads anew,
    as a new job's process does), then answers in ANSWER_S."""
    key = payload.get("model", "m")
    if key not in _MODELS:
        time.sleep(LOAD_S)
        _MODELS[key] = os.getpid()
    time.sleep(ANSWER_S)
    return {"i": payload["i"], "pid": _MODELS[key]}
