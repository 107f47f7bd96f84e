"""What a submitter sends besides its options: the payloads (a JSON list of objects, each with an optional
``cost`` and ``requires``) and the script, checked at the edge with one clear UsageError per mistake.
Results are read back with the same strict JSON (:func:`loads_strict`)."""

from __future__ import annotations

import json
import math
import sys
from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict, Field, TypeAdapter, ValidationError

from gpumesh.errors import UsageError
from gpumesh.requirements import parse_all


def payload_cost(payload: dict[str, Any]) -> float:
    return float(payload.get("cost", 1))


def _check_cost(payload: dict[str, Any]) -> dict[str, Any]:
    if "cost" in payload:
        cost = payload["cost"]
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not math.isfinite(cost) or cost <= 0:
            raise ValueError(f"cost must be a positive number, got {json.dumps(cost)}")
    if "requires" in payload:
        reqs = payload["requires"]
        if not isinstance(reqs, list):
            raise ValueError(
                f'requires must be a list of requirements such as ["vram_gb>=40"], got {json.dumps(reqs)[:60]}'
            )
        try:
            parse_all(reqs, "requires")
        except UsageError as exc:
            raise ValueError(str(exc)) from None
    return payload


def payload_requires(payload: dict[str, Any]) -> list[str]:
    reqs = payload.get("requires")
    return reqs if isinstance(reqs, list) else []


Payload = Annotated[dict[str, Any], AfterValidator(_check_cost)]
PAYLOADS = TypeAdapter(Annotated[list[Payload], Field(min_length=1)], config=ConfigDict(defer_build=True))


MAX_DEPTH = 100  # how deep a payload or a result may nest (lists and objects); deeper is refused


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (JSON has no NaN or Infinity; send null or a string)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: a literal past a double's range, read as Infinity
        raise ValueError(f"the number {text[:40]} is too large for a 64-bit float; send it as a string")
    return value


def loads_strict(text: str) -> Any:
    """json.loads without NaN/Infinity (written, or a number too large that would read as one), with every
    failure (too deep, a number too long) as a ValueError."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError(f"it nests deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError:
        raise
    except ValueError as exc:
        if "integer string conversion" in str(exc):  # Python's guard against quadratic int parsing
            raise ValueError(
                f"a number in it has more than {sys.get_int_max_str_digits()} digits; send it as a string"
            ) from None
        raise
    if too_deep(value):
        raise ValueError(f"it nests deeper than {MAX_DEPTH} levels")
    return value


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``value`` nests lists and dicts more than ``limit`` levels deep (no recursion: any depth is safe)."""
    level: list[Any] = [value] if isinstance(value, (dict, list)) else []
    for _ in range(limit):
        inner: list[Any] = []
        for v in level:
            inner.extend(v.values() if isinstance(v, dict) else v)
        level = [v for v in inner if isinstance(v, (dict, list))]
        if not level:
            return False
    return bool(level)


class Payloads(list[dict[str, Any]]):
    """A payload list that passed :func:`check_payloads`, so submit does not check it a second time."""


def parse_payloads(text: str, source: str = "payloads") -> Payloads:
    """Validate a JSON list of objects with an optional positive ``cost``; one clear UsageError otherwise."""
    try:
        data = loads_strict(text)
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"{source} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
            'expected a list of objects such as [{"lr": 0.1}, {"lr": 0.01}]'
        ) from None
    except ValueError as exc:  # NaN, too deep, an integer of thousands of digits
        raise UsageError(f"{source} cannot be used: {exc}") from None
    return Payloads(_validate(data, source))


def check_payloads(data: Any, source: str = "payloads") -> Payloads:
    """The checks of :func:`parse_payloads` on data already decoded (what a Python caller passes)."""
    if isinstance(data, Payloads):
        return data
    checked = _validate(data, source)
    try:  # what came from Python, not from JSON text: it must be JSON, and finite
        json.dumps(checked, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        why = f"it nests deeper than {MAX_DEPTH} levels" if isinstance(exc, RecursionError) else str(exc)
        raise UsageError(f"{source} cannot be sent as JSON: {why}") from None
    if too_deep(checked):
        raise UsageError(f"{source} cannot be used: a payload nests deeper than {MAX_DEPTH} levels")
    return Payloads(checked)


def _validate(data: Any, source: str) -> list[dict[str, Any]]:
    try:
        return PAYLOADS.validate_python(data, strict=True)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = err["loc"]
        if not loc:
            if isinstance(data, list):
                raise UsageError(f"{source} is an empty list; a job needs at least one payload") from None
            raise UsageError(f"{source} must be a JSON list of objects, got a JSON {type(data).__name__}") from None
        where = f"{source}[{loc[0]}]"
        if err["type"] == "value_error":
            raise UsageError(f"{where}.{err['msg'].removeprefix('Value error, ')}") from None
        raise UsageError(f"{where} must be a JSON object, got {_show(data[loc[0]])}") from None


def _show(value: Any) -> str:
    try:
        return json.dumps(value)[:60]
    except (TypeError, ValueError):
        return type(value).__name__


def check_script(source: str, name: str) -> str:
    """A script's source, once it compiles; one UsageError naming the line otherwise."""
    if not isinstance(source, str):
        raise UsageError(f"script {name} must be Python source text, got {type(source).__name__}")
    try:
        compile(source, name, "exec")
    except SyntaxError as exc:
        raise UsageError(f"script {name} has a syntax error at line {exc.lineno}: {exc.msg}") from None
    except ValueError as exc:  # e.g. a NUL byte in the source
        raise UsageError(f"script {name} cannot be compiled: {exc}") from None
    return source


REUSE_ENTRY = "main"  # what a script submitted with --reuse-process defines, and each task calls


def check_reusable(source: str, name: str) -> None:
    """A script submitted with --reuse-process (its tasks share a process per worker) must define its entry point,
    ``def main(payload)`` at its top level, which each task calls; one UsageError saying so otherwise."""
    import ast

    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == REUSE_ENTRY:
            return
    raise UsageError(
        f"script {name} has no top-level def {REUSE_ENTRY}(payload): with --reuse-process each task calls "
        f"{REUSE_ENTRY}(payload) in a process that stays loaded, and returns its result; define it (see docs/reuse.md) "
        "or submit without --reuse-process"
    )
