"""Task requirements (``submit --require``, a payload's ``"requires"``) and worker resources: pure logic.

A requirement is ``KEY=VALUE``, ``KEY!=VALUE``, ``KEY>=NUMBER``, ``KEY<=NUMBER`` or ``KEY~TEXT``
(case-insensitive substring). A worker's resources are what its probe found (``device``, ``gpu``,
``vram_gb``, ``vram_free_gb``, ``cpu_cores``, ``ram_gb``) overridden by ``worker --resource KEY=VALUE``.

The dispatcher evaluates the same rules inside Redis (``meets`` in ``lua/_lib.lua``); both are
tested against one table of cases, so a status that says "no live worker can run these" agrees
with what the dispatcher does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpumesh.errors import UsageError

KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}")
# Longest operators first, so "vram_gb>=40" is not read as "vram_gb>" "=40".
_EXPR = re.compile(r"^\s*(?P<key>[^=!<>~\s]+)\s*(?P<op>!=|>=|<=|=|~)\s*(?P<value>.*?)\s*$")
MAX_REQUIREMENTS = 32


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # '=', '!=', '>=', '<=', '~'
    value: str

    def __str__(self) -> str:
        return f"{self.key}{self.op}{self.value}"


NUMBER = re.compile(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*")
MAX_NUMBER = 40  # characters, as the Lua's MAX_DECIMAL: longer text is no number (its pattern backtracks)


def _number(text: str) -> float | None:
    """A decimal number, as the dispatcher's Lua reads one (no '1_0', 'inf', 'nan' or hex)."""
    if len(text) > MAX_NUMBER or not NUMBER.fullmatch(text):
        return None
    x = float(text)
    return x if math.isfinite(x) else None


def _text(value: object) -> str:
    """A resource value as the dispatcher's Lua prints it (cjson numbers: %.14g, so 62.0 is '62')."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return format(value, ".14g")
    return str(value)


_STRICT = re.compile(r"=?([<>])(?!=)")  # '>', '<', '=>' or '=<' where '>=' or '<=' was meant


def parse(expr: object, where: str = "--require") -> Requirement:
    """One EXPR, or a UsageError that says what is wrong with it and what is expected (and, for a
    comparison written ``>``, ``<``, ``=>`` or ``=<``, the one it likely meant)."""
    try:
        return _parse(expr, where)
    except UsageError as wrong:
        meant = _STRICT.sub(r"\1=", expr, count=1) if isinstance(expr, str) else expr
        if meant == expr:
            raise
        try:
            _parse(meant, where)
        except UsageError:
            raise wrong from None
        said = f"{where}: {expr!r} is not a requirement: numbers compare with >= and <= only; did you mean {meant!r}?"
        raise UsageError(said[:300]) from None


def _parse(expr: object, where: str) -> Requirement:
    if not isinstance(expr, str):
        raise UsageError(f'{where}: a requirement must be a string such as "vram_gb>=40", got {expr!r}'[:200])
    m = _EXPR.match(expr)
    hint = "expected KEY=VALUE, KEY!=VALUE, KEY>=NUMBER, KEY<=NUMBER or KEY~TEXT, e.g. vram_gb>=40 or gpu~a100"
    if not m:
        raise UsageError(f"{where}: {expr!r} is not a requirement; {hint}"[:300])
    key, op, value = m["key"], m["op"], m["value"]
    if not KEY.fullmatch(key):
        raise UsageError(f"{where}: {key!r} in {expr!r} is not a resource name (letters, digits, _ . -); {hint}"[:300])
    if value == "" or any(c in value for c in "=<>~!") and op in ("=", "!=", "~"):
        raise UsageError(f"{where}: {expr!r} has no single value after {op!r}; {hint}"[:300])
    if op in (">=", "<=") and _number(value) is None:
        raise UsageError(f"{where}: {expr!r} compares with {op} but {value!r} is not a number; {hint}"[:300])
    return Requirement(key, op, value)


def parse_all(exprs: Iterable[object], where: str = "--require") -> tuple[Requirement, ...]:
    out = tuple(parse(e, where) for e in exprs)
    if len(out) > MAX_REQUIREMENTS:
        raise UsageError(f"{where}: at most {MAX_REQUIREMENTS} requirements, got {len(out)}")
    return out


def parse_resource(text: str) -> tuple[str, str]:
    """``worker --resource KEY=VALUE``."""
    key, sep, value = text.partition("=")
    key, value = key.strip(), value.strip()
    if not sep or not KEY.fullmatch(key) or value == "":
        raise UsageError(
            f"--resource {text!r}: expected KEY=VALUE with a resource name of letters, digits, _ . - "
            "(e.g. --resource vram_gb=80 or --resource gpu=A100)"
        )
    if key == "trusts":  # worker/build.py's TRUSTS: what --trust publishes, and the dispatcher obeys
        raise UsageError(
            f"--resource {text!r}: 'trusts' is the resource --trust sets (this worker would run only tasks signed "
            "by those keys); to do that, use --trust KEY"
        )
    return key, value


def meets(req: Requirement, resources: Mapping[str, object]) -> bool:
    """Whether one requirement holds for a worker with these resources (same rules as lua/_lib.lua)."""
    have = resources.get(req.key)
    if have is None:
        return req.op == "!="  # a worker without the resource has any value but VALUE
    text = _text(have)
    if req.op in (">=", "<="):
        x, want = _number(text), _number(req.value)
        if x is None or want is None:
            return False
        return x >= want if req.op == ">=" else x <= want
    if req.op == "~":
        return req.value.lower() in text.lower()
    a, b = _number(text), _number(req.value)
    equal = a == b if a is not None and b is not None else text.lower() == req.value.lower()
    return equal if req.op == "=" else not equal


def meets_all(reqs: Iterable[Requirement], resources: Mapping[str, object]) -> bool:
    return all(meets(r, resources) for r in reqs)


def canonical(reqs: Iterable[Requirement]) -> tuple[str, ...]:
    """A requirement set as sorted unique strings: tasks with the same set share one pending queue."""
    return tuple(sorted({str(r) for r in reqs}))


def fmt_number(x: float) -> str:
    """A probed number as a resource value: integers without '.0', others rounded to 0.1."""
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


def accepts_signer(resources: dict[str, object], key_id: str) -> bool:
    """Whether a worker runs a job signed by ``key_id`` ("" for unsigned): a worker started with --trust
    publishes ``trusts`` (its keys' ids, comma-separated) and runs only those; any other runs every task.
    The twin of accepts_signer in gpumesh/store/lua/_lib.lua."""
    trusts = str(resources.get("trusts") or "")
    if not trusts:
        return True
    return bool(key_id) and key_id in trusts.split(",")
