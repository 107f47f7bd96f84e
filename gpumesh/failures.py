"""How a task failed, as a person and ``Mesh.map``'s TaskFailed read it: the kinds, and the one line that says
which kind and why, worked out from the error its worker recorded."""

from __future__ import annotations

import json

# The last stderr line of a function task that raised (gpumesh.functions), followed by JSON {type, message}.
EXCEPTION_MARKER = "gpumesh-exception "

# How a task failed, as Mesh.map's TaskFailed.kind says it, read from the error its worker recorded.
FAILURE_KINDS = {
    "exception": "the function raised (exc_type, message and traceback say what)",
    "script_error": "the script exited non-zero or was killed by a signal",
    "timeout": "the attempt ran past the job's timeout",
    "memory": "the attempt went over its memory cap, or CUDA ran out of memory",
    "bad_result": "the script ended cleanly but its last stdout line is not a usable JSON result",
    "lost": "its worker stopped heartbeating or stopped during the attempt",
    "refused": "the worker refused to run it (signature, tampered script)",
    "environment": "the job's environment could not be built on the worker's machine (the builder's message)",
    "cancelled": "the job was cancelled",
}


def failure_kind(status: str, error: str | None, recorded: str | None = None) -> str:
    """One of FAILURE_KINDS for a task that ended ``failed`` or ``cancelled``. ``recorded``: the kind its
    worker recorded (RECORDED_KINDS, the task's ``error_kind``); a 'script' failure is told apart further
    (exception, bad_result, script_error) by its error text, as is a task from before kinds were recorded."""
    text = error or ""
    first = text.partition("\n")[0]
    if status == "cancelled":
        return "cancelled"
    if recorded in ("timeout", "memory", "lost", "refused", "environment"):
        return recorded
    if "\n" + EXCEPTION_MARKER in text:
        return "exception"
    if first.startswith(("result line is over", "the script printed nothing", "the last stdout line", "the result")):
        return "bad_result"
    if recorded == "script":
        return "script_error"
    if first.startswith("timed out"):
        return "timeout"
    if "over its memory cap" in first or "CUDA out of memory" in text:
        return "memory"
    if first.startswith(("lease expired", "lease lost", "worker stopped")):
        return "lost"
    if first.startswith(("signature", "the script in the broker does not match")) or "refused" in first:
        return "refused"
    return "script_error"


def error_summary(status: str, error: str | None, recorded: str | None = None) -> str:
    """One line saying how a task failed: its kind, then the exception (``ZeroDivisionError: division by
    zero``) when the error holds a Python traceback, else the error's first line."""
    kind = failure_kind(status, error, recorded)
    text = (error or "").rstrip()
    if kind == "cancelled":
        return "cancelled"
    marker = text.rfind("\n" + EXCEPTION_MARKER)
    if marker >= 0:
        try:
            info = json.loads(text[marker + 1 + len(EXCEPTION_MARKER) :].splitlines()[0])
            return f"{kind}: {info['type']}: {info['message']}".splitlines()[0]
        except (ValueError, KeyError, IndexError, TypeError):
            pass
    lines = text.splitlines()
    first = lines[0] if lines else status
    if "Traceback (most recent call last):" in text:
        for line in reversed(lines):
            if line and not line.startswith((" ", "\t", "Traceback")):
                return f"{kind}: {line}" if line != first else f"{kind}: {first}"
    return f"{kind}: {first}"
