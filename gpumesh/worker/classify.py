"""How an attempt failed, in words a person reads and the kind the broker records: pure functions over what
the sandbox returned (sandbox.runner.Attempt) and the broker answered, with no Redis and no process of their own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from gpumesh.failures import EXCEPTION_MARKER
from gpumesh.payloads import loads_strict
from gpumesh.sandbox.runner import Attempt, Limits
from gpumesh.store.scripts import Outcome
from gpumesh.worker.lending import VRAM_OVER

ERROR_LINE_CHARS = 300  # of a failed attempt's error line, in the summary rq-dashboard shows
# What a script's stderr says when it ran out of device memory (PyTorch, cuBLAS, the CUDA runtime and
# driver, JAX/XLA, Apple's MPS): the attempt failed for memory, not for a bug.
DEVICE_OOM = (
    "CUDA out of memory",
    "torch.OutOfMemoryError",
    "torch.cuda.OutOfMemoryError",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "cudaErrorMemoryAllocation",
    "CUDA_ERROR_OUT_OF_MEMORY",
    "RESOURCE_EXHAUSTED: Out of memory",
    "MPS backend out of memory",
)


def failure_of(out: Attempt, resources: dict[str, Any]) -> tuple[str, tuple[str, float] | None, str]:
    """How an attempt that exited non-zero or was killed failed: its kind (models.RETRY_KINDS), for a
    memory failure the resource it ran out of with this worker's value of it (None: unknown), and the
    error's first line. Memory: over the RSS cap, device memory exhausted (DEVICE_OOM in its stderr), a
    Python MemoryError, or SIGKILL while the kernel's out-of-memory killer ran."""
    said = out.describe_exit()
    ram = _resource(resources, "task_memory_gb")
    if out.killed == "timeout":
        return "timeout", None, said
    if out.killed == "memory":
        return "memory", ram, said
    if out.killed and out.killed.startswith(VRAM_OVER):
        return "memory", _resource(resources, "vram_gb"), said
    if out.killed:  # stopped for the worker's reason (it stops, the backup copy yielded): not the script's doing
        return "lost", None, said
    # What the script died of: its exception's line when it ended with a traceback (a script that logged
    # "CUDA out of memory", recovered and then died of a bug failed for the bug), else all it wrote last
    # (a CUDA driver or XLA abort prints no traceback).
    tail = list(out.stderr_tail)
    raw = next((line.strip() for line in reversed(tail) if line.strip()), "")
    last = exception_line(raw)
    raised = raw != last or any(line.startswith("Traceback (most recent call last)") for line in tail)
    died_of = last if raised else "\n".join(tail)
    if any(marker in died_of for marker in DEVICE_OOM):
        vram = None if "MPS backend out of memory" in died_of else _resource(resources, "vram_gb")
        return "memory", vram or ram, said
    if last.partition(":")[0].endswith("MemoryError"):  # MemoryError, numpy's _ArrayMemoryError: RAM
        return "memory", ram, said
    if out.returncode == -9 and out.kernel_oom:
        return "memory", ram, said + " (the kernel's out-of-memory killer ran during the attempt)"
    return "script", None, said


_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")


def module_hint(stderr_tail: Iterable[str], siblings: frozenset[str], script: str) -> str:
    """For a lone script that died of a ModuleNotFoundError naming a module that lay beside it where it was
    submitted: the line that says to ship the folder (its last line, which status and results show)."""
    if not siblings:
        return ""
    for line in reversed(list(stderr_tail)):
        found = _NO_MODULE.search(line)
        if found:
            name = found.group(1)
            if name.split(".")[0] in siblings:
                return (
                    f"ModuleNotFoundError: No module named '{name}': it is beside {script} where the job was "
                    "submitted, but only the script was sent; submit with --project DIR to ship the folder"
                )
            return ""
    return ""


def exception_line(line: str) -> str:
    """``Type: message`` of a function task's exception (its marker line, gpumesh.functions), else the line."""
    if not line.startswith(EXCEPTION_MARKER):
        return line
    try:
        info = json.loads(line[len(EXCEPTION_MARKER) :])
        return f"{info['type']}: {info['message']}"
    except (ValueError, KeyError, TypeError):
        return line


def _resource(resources: dict[str, Any], key: str) -> tuple[str, float] | None:
    """(key, this worker's value of it) for a resource it registered as a positive number; else None."""
    try:
        value = float(resources.get(key) or 0)
    except (TypeError, ValueError):
        return None
    return (key, value) if value > 0 else None


def next_step(res: Outcome, kind: str, need: tuple[str, float] | None) -> str:
    """What happens to a task after a failed attempt, when it is not the plain "queued again": a line
    for its log (empty for a plain retry)."""
    if res.status == "failed" and kind == "environment":
        return "not retried: this machine cannot build the job's environment (the message above is the builder's)"
    if res.status == "failed" and res.not_retried:
        return (
            f"not retried: the job does not retry {kind} failures (submit --retry-on {kind} would); attempts were left"
        )
    if res.status == "queued" and kind == "memory":
        if res.bigger:
            what = need[0] if need else "memory"
            return f"retrying on worker {res.bigger[0]}, which has more memory ({what} {res.bigger[1]:g})"
        return "retrying: no live worker has more memory than this one"
    return ""


def outcome(status: str, error: str = "") -> dict[str, Any]:
    """How a delivery ended, for a person reading rq-dashboard: ``outcome`` done, failed (``error``: the
    error in one line, see error_line; ``next``: what happens to the task), cancelled or lost (killed or
    not ours to report: the task runs again elsewhere). ``status`` is what the attempt's report answered."""
    if status in ("done", "cancelled", "lost"):
        return {"outcome": status}
    if status.startswith("rejected:"):  # the report came after the lease moved on
        why = status.partition(":")[2]
        return {"outcome": "cancelled" if why == "cancelled" else "lost", "why": f"the report was refused ({why})"}
    out: dict[str, Any] = {"outcome": "failed", "error": error_line(error)}
    out["next"] = {
        "queued": "queued for another attempt",
        "failed": "failed for good",
        "running": "another copy of the task runs on",
    }.get(status, status)
    return out


def error_line(error: str) -> str:
    """An attempt's error in one line: its first (how the script ended), with the last line of what it
    wrote to stderr when there is one (a traceback's exception): ``exit code 1: ValueError: bad lr``."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    if not lines:
        return ""
    said = lines[0] if len(lines) == 1 else f"{lines[0]}: {lines[-1]}"
    return said[:ERROR_LINE_CHARS]


def bad_result(out: Attempt, limits: Limits) -> str | None:
    """Why a clean exit still has no result to report, or None: the result is the last stdout line, as JSON."""
    if out.result_too_large:
        return f"result line is over the {limits.result_bytes}-byte cap"
    if out.last_line is None:
        return "the script printed nothing; the result must be the last stdout line, as JSON"
    try:
        loads_strict(out.last_line)
    except json.JSONDecodeError:
        return f"the last stdout line is not JSON: {out.last_line[:200]!r}"
    except ValueError as exc:  # NaN or Infinity, nested too deep, an integer of thousands of digits
        return f"the result (the last stdout line) cannot be used: {exc}"
    return None
