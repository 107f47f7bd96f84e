"""The package's shape: no import cycles (lazy imports inside functions count too), the layers
import only downwards, and ``gpumesh`` exports exactly its public API."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gpumesh

pytestmark = pytest.mark.core

PACKAGE = Path(gpumesh.__file__).parent
# Which layer may import which: a layer sees itself, the core modules and the layers listed here.
# core = the modules at the top of the package (errors, models, settings, ...), pure or near it.
LAYERS = {
    "core": set(),
    "envs": set(),  # a job's packages: declared, locked (uv) and built; pure of Redis and of the sandbox
    "store": {"envs"},  # a lock's digest travels with the job
    "sandbox": set(),
    "worker": {"store", "sandbox", "envs"},
    "server": {"store"},
    "api": {"store", "envs"},
    "dashboard": {"api", "store"},  # a web view over the Python API (and the artifact reader under it)
    "cli": {"api", "store", "worker", "server", "dashboard", "envs"},  # the commands that start them
}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The gpumesh modules ``name`` imports, wherever in the file (a function's lazy import counts)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("gpumesh")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if not base.startswith("gpumesh"):
                continue
            for a in node.names:  # `from gpumesh.cli import render` imports the module gpumesh.cli.render
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS and parts[1] != "api"):
        return parts[1]
    if module == "gpumesh.__main__":
        return "cli"
    return "api" if module in ("gpumesh", "gpumesh.api") else "core"


def test_no_import_cycles() -> None:
    g = graph()
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(g[m]):
            if n == m.rpartition(".")[0] or m.startswith(n + "."):
                continue  # a submodule's import runs its own package's __init__: not a cycle of code
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_layers_import_only_downwards() -> None:
    wrong = []
    for m, deps in graph().items():
        mine = layer(m)
        for d in deps:
            theirs = layer(d)
            if theirs in ("core", mine) or theirs in LAYERS[mine] or theirs == "api" and d == "gpumesh":
                continue
            wrong.append(f"{m} ({mine}) imports {d} ({theirs})")
    assert wrong == []


def test_the_launcher_imports_only_the_standard_library() -> None:
    # It is the only code that runs in the task's process, and it is copied alone for other interpreters.
    tree = ast.parse((PACKAGE / "sandbox" / "launcher.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {n.split(".")[0] for n in names} <= set(sys.stdlib_module_names) | {"__future__"}


def test_the_task_process_imports_nothing_of_gpumesh_but_the_launcher() -> None:
    code = "import sys, gpumesh.sandbox.launcher; print(sorted(m for m in sys.modules if m.startswith('gpumesh')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['gpumesh', 'gpumesh.sandbox', 'gpumesh.sandbox.launcher']"
    # typing too: the launcher imports from the task's directory, where a task's typing.py would shadow it
    heavy = "import sys, gpumesh.sandbox.launcher; print([m for m in ('redis', 'pydantic', 'rq', 'click', 'typing') if m in sys.modules])"
    assert (
        subprocess.run([sys.executable, "-c", heavy], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    )


def test_the_wheel_ships_every_module_the_lua_scripts_and_py_typed(tmp_path: Path) -> None:
    # The subpackages and the Lua files next to the code are package data a wrong pyproject leaves out.
    root = PACKAGE.parent
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(root)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("*.whl")
    import zipfile

    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("gpumesh/")}
    source = {
        str(p.relative_to(root))
        for p in PACKAGE.rglob("*")
        if p.suffix in (".py", ".lua") or p.name == "py.typed"
        if "__pycache__" not in p.parts
    }
    assert source - shipped == set()
    assert "gpumesh/store/lua/dispatch.lua" in shipped and "gpumesh/py.typed" in shipped


def test_only_store_keys_spells_a_redis_key() -> None:
    # The layout has one home: a key written out anywhere else (Python, Lua, a template) drifts from it
    # unnoticed. The Functions library gets the prefix from keys.py when scripts.py assembles it.
    spelled = re.compile(r"gpumesh:(?!\s)")  # "gpumesh: could not..." starts a message, not a key
    home = PACKAGE / "store" / "keys.py"
    frozen = PACKAGE / "store" / "protocols"  # earlier releases' libraries, kept byte for byte as they shipped
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*"))
        if path.is_file() and path != home and frozen not in path.parents
        if path.suffix in (".py", ".lua", ".html", ".js")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if spelled.search(line)
    ]
    assert found == []
    from gpumesh.store import keys, scripts

    assert f"local PREFIX = '{keys.PREFIX}'" in scripts.library()[1]


REDIS_DATA = (
    "get|set|mget|hget|hgetall|hset|hsetnx|hmget|hdel|hincrby|hexists|zadd|zrem|zrange|zrevrange|zrangebyscore|"
    "zscore|zcard|zcount|sadd|srem|smembers|sismember|scard|lpush|rpush|lpop|rpop|lrange|llen|lrem|lmove|xadd|"
    "xrange|xrevrange|xread|xlen|delete|unlink|expire|pexpire|exists|scan_iter|incr|incrby|fcall|fcall_ro"
)


def test_outside_store_no_code_reads_or_writes_redis_itself() -> None:
    # gpumesh's data is read and written by store methods only, so the layout changes in one layer: no
    # module elsewhere sends a data command on a Redis client or pipeline. The one exception is RQ's own
    # records (its queues, registries and worker key), which the RQ worker subclass keeps through RQ's
    # connection, as RQ's Worker does.
    command = re.compile(
        rf"(?:\.r|\.rq|\bclient|\bredis_client|\badmin|\.connection)\.(?:{REDIS_DATA})\("
        rf"|\bp\.(?!unlink|exists)(?:{REDIS_DATA})\("  # a pipeline (a Path's unlink and exists are not Redis)
    )
    rq_records = {PACKAGE / "worker" / "worker.py", PACKAGE / "worker" / "rqworker.py"}
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "store" and path not in rq_records
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if command.search(line)
    ]
    assert found == []
