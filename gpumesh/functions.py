"""Functions as tasks, without pickle: a plain function is shipped as source text, never as bytes.

    >>> def square(payload):                                   # at the top of a module, or in a notebook cell
    ...     return payload["x"] ** 2
    >>> mesh.map(square, [{"x": 1}, {"x": 2}])                 # doctest: +SKIP
    [1, 4]

:func:`package` turns a function into an ordinary gpumesh script (content-addressed like any other): the
source of the function's module file, or of its notebook cell (that cell's imports, functions, classes
and constants), embedded in a small entry point. The entry point runs that source as a module under the
module's own name (so an ``if __name__ == "__main__":`` block does not run on the worker), calls
``fn(payload)`` with the task's payload, and prints the JSON of the return value as the result line.

If the function raises, the entry point prints the traceback to stderr and, as its last stderr line,
:data:`EXCEPTION_MARKER` followed by JSON ``{"type", "message"}``, which :class:`gpumesh.TaskFailed`
reads back. If the module itself fails as it loads on the worker (driving code outside the main guard
reading ``sys.argv``, say), the message names the module-level line that failed and says where such code
belongs. Arguments and results are JSON, so nothing that comes back can run code on the submitter.

What the function imports must be installed on the workers (pin a worker that has a package with
``requires=["KEY=VALUE"]`` and ``gpumesh worker --resource KEY=VALUE``); modules next to its file travel
only with ``project=`` (the folder its module file lies in, docs/projects.md).
"""

from __future__ import annotations

import ast
import builtins
import dis
import inspect
import json
import linecache
import os
import sys
import types
from collections.abc import Callable
from typing import Any

from gpumesh.errors import UsageError
from gpumesh.models import EXCEPTION_MARKER

MAX_MESSAGE = 2000  # characters of the exception's message carried in the marker line

# The script a function task runs: stdlib only, no gpumesh import, nothing read from the payload but data.
_ENTRY = """\
# gpumesh function task: runs {filename} as module {module!r} and prints the JSON of {name}(payload).
# Made by gpumesh.functions.package; the source below is {filename}, shipped as text (no pickle).
import json as _json
import linecache as _linecache
import sys as _sys
import traceback as _traceback
import types as _types

_SOURCE = {source!r}


def _report(exc, loading=False):
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # this entry point's own frame is noise: start at the function's module
    _traceback.print_exception(type(exc), exc, tb)
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ in ("builtins", "__main__") else kind.__module__ + "." + kind.__qualname__
    message = str(exc)[:{max_message}] + (_while_loading(exc, tb) if loading else "")
    print({marker!r} + _json.dumps({{"type": name, "message": message}}), file=_sys.stderr, flush=True)
    _sys.exit(1)


def _while_loading(exc, tb):
    # The module's own top-level statement that failed (the call it made may have failed deeper down).
    while tb is not None and not (tb.tb_frame.f_code.co_filename == {filename!r} and tb.tb_frame.f_code.co_name == "<module>"):
        tb = tb.tb_next
    where, lines = "", _SOURCE.splitlines()
    if tb is not None:
        text = lines[tb.tb_lineno - 1].strip()[:120] if 0 < tb.tb_lineno <= len(lines) else ""
        where = " line " + str(tb.tb_lineno) + (" (" + text + ")" if text else "")
    said = " [raised by " + {filename!r} + where + " at module level, as the worker loaded the file to call {name}()"
    if {whole_file!r}:
        said += ': the whole file runs on every worker, so the code that drives the job belongs under if __name__ == "__main__":'
    if isinstance(exc, ImportError):
        said += "; what it imports at the top must be installed on the workers"
    return said + "]"


class _Tail:
    # sys.stdout, remembering whether the function left a line unfinished (print(..., end=""))

    def __init__(self, stream):
        self._stream, self.ended = stream, True

    def write(self, text):
        if text:
            self.ended = text.endswith("\\n")
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


_payload = _json.load(_sys.stdin)
_sys.stdout = _out = _Tail(_sys.stdout)
_module = _types.ModuleType({module!r})
_module.__file__ = {filename!r}
_sys.modules[{module!r}] = _module
_linecache.cache[{filename!r}] = (len(_SOURCE), None, _SOURCE.splitlines(True), {filename!r})
try:
    exec(compile(_SOURCE, {filename!r}, "exec"), _module.__dict__)
except (Exception, SystemExit) as _exc:  # SystemExit too: an unguarded main() or argparse exits
    _report(_exc, loading=True)
try:
    _result = getattr(_module, {name!r})(_payload)
except Exception as _exc:
    _report(_exc)
try:
    _line = _json.dumps(_result, allow_nan=False)
except (TypeError, ValueError, RecursionError) as _exc:
    _report(TypeError(f"{name}() returned a value that is not JSON ({{_exc}}); return dicts, lists, str, numbers, bools or None"))
_sys.stdout = _out._stream
print(("" if _out.ended else "\\n") + _line, flush=True)  # the result is a line of its own
"""


def package(fn: Callable[..., Any]) -> tuple[str, str]:
    """(script source, script name) that runs ``fn`` on each payload; UsageError saying why and what to do
    instead when ``fn`` cannot be shipped as source (a lambda, a closure, a method, a built-in, ...)."""
    name = _check_shape(fn)
    module = sys.modules.get(fn.__module__)
    filename = fn.__code__.co_filename
    if module is None or getattr(module, name, None) is not fn:
        raise UsageError(
            f"function {name}() is not a top-level name of its module {fn.__module__!r}, so the worker could not "
            "find it by name: define it with def at the top level of a module file or a notebook cell"
        )
    if fn.__module__ == "__main__" and not _is_main_file(filename):  # typed in: a notebook or IPython cell
        lines = linecache.getlines(filename)
        if not lines:
            raise UsageError(
                f"function {name}() was defined in {filename}, whose source gpumesh cannot read: define it in a "
                ".py file or a notebook cell"
            )
        cell = _cell_definitions("".join(lines))
        source, module_name, shown = _with_imports(cell, fn.__globals__, name), "__gpumesh_cell__", "cell.py"
    else:
        source, module_name = _read(filename), fn.__module__
        _no_relative_imports(source, filename)
        if module_name == "__main__":
            module_name = "__gpumesh_main__"  # its `if __name__ == "__main__":` block must not run on the worker
        shown = os.path.basename(filename)
    script = _ENTRY.format(
        filename=shown, module=module_name, name=name, source=source, marker=EXCEPTION_MARKER, max_message=MAX_MESSAGE,
        whole_file=module_name != "__gpumesh_cell__",  # a notebook cell ships its definitions alone
    )  # fmt: skip
    return script, f"{shown.removesuffix('.py')}.{name}.py"


def _is_main_file(filename: str) -> bool:
    """Whether ``filename`` is the file ``python FILE`` runs as ``__main__`` (a notebook's main has none)."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return isinstance(main_file, str) and os.path.abspath(main_file) == os.path.abspath(filename)


def _check_shape(fn: Callable[..., Any]) -> str:
    """The function's name, once it is a plain, named, top-level function."""
    what = getattr(fn, "__qualname__", None) or type(fn).__name__
    if inspect.ismethod(fn):
        raise UsageError(
            f"{what} is a method: a task cannot carry the object it is bound to; define a top-level function "
            "that takes the payload (and builds what it needs from it)"
        )
    if not inspect.isfunction(fn):
        raise UsageError(
            f"{what} is a {type(fn).__name__}, not a function defined with def: wrap it in a top-level function "
            "of your own that calls it"
        )
    if fn.__name__ == "<lambda>":
        raise UsageError(
            "a lambda cannot be shipped: it has no name the worker could call it by; define it with def at the "
            "top level of a module file or a notebook cell"
        )
    if fn.__closure__ or "<locals>" in fn.__qualname__:
        outer = fn.__qualname__.split(".<locals>")[0]
        raise UsageError(
            f"function {fn.__name__}() is defined inside {outer}(): the local state it closes over cannot travel "
            "without pickle; move it to the top level and put what it needs in the payload"
        )
    if fn.__qualname__ != fn.__name__:
        raise UsageError(
            f"{fn.__qualname__} is defined in a class: define a top-level function that takes the payload instead"
        )
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        raise UsageError(
            f"function {fn.__name__}() is a coroutine or generator function; its return value is not JSON. Use a "
            "plain def that returns the result (asyncio.run(...) inside it for async code)"
        )
    return fn.__name__


def _read(filename: str) -> str:
    try:
        with open(filename, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {filename}, the source of the function: {exc}") from None


# The statements of a notebook cell that travel with its function: the rest (calls, prints, assignments
# from computations, magics) is the notebook's own work and must not run again on every worker.
_KEPT = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _cell_definitions(cell: str) -> list[str]:
    """The cell's imports, functions, classes and assignments of constants (``N = 10``), in order."""
    try:
        tree = ast.parse(cell)
    except SyntaxError as exc:  # IPython compiled it, so only its own syntax (magics) can get here
        raise UsageError(f"cannot read the cell that defines the function: {exc}") from None
    kept = [node for node in tree.body if isinstance(node, _KEPT) or _constant_assignment(node)]
    lines = cell.splitlines()
    segments = []
    for node in kept:
        decorators = getattr(node, "decorator_list", None)
        if decorators:  # the segment starts at the def or class line: take its decorators along
            first = min(d.lineno for d in decorators) - 1
            segments.append("\n".join(lines[first : node.end_lineno]))
        else:
            segments.append(ast.get_source_segment(cell, node, padded=False) or "")
    return segments


def _with_imports(segments: list[str], namespace: dict[str, Any], name: str) -> str:
    """The cell's definitions, with imports of the modules (and importable functions and classes) that its
    code uses from the notebook's other cells; UsageError when it uses anything else from them, which
    would be missing on the worker."""
    cell = "\n\n".join(segments) + "\n"
    code = compile(cell, "cell.py", "exec")
    defined = _names_bound(code)
    lines, missing = [], []
    for used in sorted(_globals_read(code) - defined):
        if used not in namespace or hasattr(builtins, used):
            continue  # a builtin, or a name nothing defines (the function's own NameError, on the worker)
        line = _import_line(used, namespace[used])
        if line is None:
            missing.append(used)
        else:
            lines.append(f"{line}  # used from another cell")
    if missing:
        listed = ", ".join(missing)
        raise UsageError(
            f"function {name}() uses {listed} from another notebook cell; only its own cell (and the modules it "
            f"imports) is shipped to the workers: define {listed} in the same cell, or pass it in the payload"
        )
    future = [seg for seg in segments if seg.startswith("from __future__")]  # must stay first
    rest = [seg for seg in segments if not seg.startswith("from __future__")]
    return "\n\n".join([*future, *lines, *rest]) + "\n"


def _no_relative_imports(source: str, filename: str) -> None:
    """A module that imports relative to its package (``from . import x``) cannot run alone on a worker."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return  # check_script names the line
    for node in tree.body:  # what runs as the module loads (a function's own import fails only when called)
        if isinstance(node, ast.ImportFrom) and node.level:
            raise UsageError(
                f"{filename} imports relative to its package at line {node.lineno} (from {'.' * node.level}"
                f"{node.module or ''} import ...); only this file travels to the workers, so move the function "
                "to a module that imports its package absolutely (and install that package on the workers)"
            )


def _names_bound(code: types.CodeType) -> set[str]:
    """The names a module's top level binds (what its definitions, imports and assignments store)."""
    return {i.argval for i in dis.get_instructions(code) if i.opname in ("STORE_NAME", "STORE_GLOBAL")}


def _globals_read(code: types.CodeType) -> set[str]:
    """Every global name this code, and any function or class inside it, reads."""
    names = {str(i.argval) for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _globals_read(const)
    return names


def _import_line(alias: str, value: Any) -> str | None:
    """``import x as alias`` / ``from m import f as alias`` recreating ``value`` on a worker, if it can."""
    if isinstance(value, types.ModuleType):
        module = value.__name__
        if module == "__main__" or module.startswith("__gpumesh"):
            return None
        return f"import {module}" if module == alias else f"import {module} as {alias}"
    home, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if (
        isinstance(home, str) and isinstance(qualname, str) and home != "__main__" and "." not in qualname
        and home in sys.modules and getattr(sys.modules[home], qualname, None) is value
    ):  # fmt: skip
        return f"from {home} import {qualname}" + ("" if qualname == alias else f" as {alias}")
    return None


def _constant_assignment(node: ast.stmt) -> bool:
    value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
    if value is None:
        return False
    try:
        ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def remote_exception(error: str | None) -> tuple[str, str, str] | None:
    """(type, message, traceback) of the exception a function task raised, from the error its worker
    recorded (the stderr tail), or None when the task did not fail that way."""
    if not error:
        return None
    head, sep, tail = error.rpartition("\n" + EXCEPTION_MARKER)
    if not sep:
        return None
    try:
        info = json.loads(tail.splitlines()[0])
        kind, message = str(info["type"]), str(info["message"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    start = head.find("Traceback (most recent call last):")
    return kind, message, head[start:] if start >= 0 else head.partition("\n")[2]
