"""The references generated from the code: every command's ``--help`` and every setting, and the Python API
from its docstrings.

    python -m gpumesh.cli.reference cli > docs/reference/cli.md
    python -m gpumesh.cli.reference python > docs/reference/python-api.md

``tests/test_docs.py`` fails when a committed page and this output disagree, so the pages are never stale.
"""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Iterator
from typing import Any

import click
from click.testing import CliRunner

HEADER = """# CLI and settings reference

Generated from the code by `python -m gpumesh.cli.reference cli > docs/reference/cli.md`; a test fails when
this page and the commands disagree, so what is below is what `gpumesh COMMAND --help` prints.

Every command that talks to the broker takes `--url`; reading commands take `--json` (one JSON document
on stdout, nothing else). Progress and errors go to stderr. `gpumesh --debug COMMAND` shows tracebacks.
Exit codes and JSON shapes: [exit codes and JSON](exit-codes-and-json.md).
"""

WIDTH = 100  # the width the group's help is laid out in (its max_content_width)


def commands(cmd: click.Command, path: str = "gpumesh") -> Iterator[tuple[str, click.Command]]:
    """Every command under ``cmd``, depth first, loading each the way click finds it."""
    yield path, cmd
    if isinstance(cmd, click.Group):
        ctx = click.Context(cmd)
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield from commands(sub, f"{path} {name}")


def help_text(path: str) -> str:
    """What ``path --help`` prints, at a fixed width."""
    from gpumesh.cli.main import main

    runner = CliRunner()
    res = runner.invoke(main, [*path.split()[1:], "--help"], prog_name="gpumesh", env={"COLUMNS": str(WIDTH)})
    if res.exit_code != 0:
        raise RuntimeError(f"{path} --help exited {res.exit_code}: {res.output}")
    return res.stdout.rstrip() + "\n"


def settings_table() -> str:
    """One row per setting: its config-file key, its environment variable, its default and what it does."""
    from pydantic_core import PydanticUndefined

    from gpumesh.settings import ENV_PREFIX, Settings

    rows = [
        "| config file key | environment | default | what it is |",
        "| --- | --- | --- | --- |",
    ]
    for name, field in Settings.model_fields.items():
        default = field.default
        shown = "see the description" if default is PydanticUndefined else f"`{json.dumps(default)}`"
        if default == "":
            shown = "empty"
        rows.append(f"| `{name}` | `{ENV_PREFIX}{name.upper()}` | {shown} | {field.description or ''} |")
    return "\n".join(rows) + "\n"


def render() -> str:
    from gpumesh.cli.main import main

    parts = [HEADER, "## Commands\n"]
    found = list(commands(main))
    parts.append("\n".join(f"- [`{path}`](#{path.replace(' ', '-')})" for path, _ in found) + "\n")
    for path, _ in found:
        parts.append(f"## {path}\n\n```text\n{help_text(path)}```\n")
    parts.append(
        "## Settings\n\nOne settings object, in layers: a command's flag, then the environment, then the config "
        "file (`~/.config/gpumesh/config.toml`, or `$GPUMESH_CONFIG`; `gpumesh config init` writes it, "
        "`gpumesh config show` prints what is in effect), then the default. In the config file the keys are "
        'the names below (`url = "redis://…"`, `lease_ttl = 60`).\n\n' + settings_table()
    )
    return "\n".join(parts)


PYTHON_HEADER = """# Python API

Generated from the docstrings by `python -m gpumesh.cli.reference python > docs/reference/python-api.md`;
a test fails when this page and the code disagree. These are the names `gpumesh.__all__` exports; how to
use them: [Python and notebooks](../how-to/python.md).
"""


def _doc(obj: object) -> str:
    """``obj``'s docstring as Markdown: its doctest examples fenced as code, so none of them reads as a link."""
    out: list[str] = []
    fenced = False
    for line in inspect.cleandoc(obj.__doc__ or "").strip().splitlines():
        example = line.startswith((">>> ", "... ")) or line in (">>>", "...")
        if example != fenced:
            out.append("```pycon" if example else "```")
            fenced = example
        out.append(line)
    return "\n".join(out + (["```"] if fenced else []))


def _signature(name: str, obj: Any) -> str:
    try:
        return f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return name


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return (
        str(annotation).replace("typing.", "").replace("datetime.datetime", "datetime").replace("gpumesh.models.", "")
    )


def _members(cls: type) -> Iterator[tuple[str, Any]]:
    """The public methods and properties ``cls`` itself defines, in source order."""
    for name, member in vars(cls).items():
        if name.startswith("_") and name not in ("__enter__", "__exit__"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if callable(member) or isinstance(member, property):
            yield name, member


def _class(name: str, cls: type) -> list[str]:
    from pydantic import BaseModel

    out = [f"### `{name}`", "", _doc(cls), ""]
    if issubclass(cls, BaseModel):
        out += ["| field | type | default |", "| --- | --- | --- |"]
        for field, info in cls.model_fields.items():
            default = "required" if info.is_required() else f"`{info.get_default(call_default_factory=True)!r}`"
            shown = _type_name(info.annotation).replace("|", "\\|")  # a table cell: | would end it
            out.append(f"| `{field}` | `{shown}` | {default} |")
        out.append("")
        return out
    if issubclass(cls, BaseException):
        code = getattr(cls, "exit_code", None)
        base = cls.__mro__[1].__name__
        out[2:2] = [f"A subclass of `{base}`" + (f"; exit code {code}." if code is not None else "."), ""]
        return out
    for member_name, member in _members(cls):
        target = member.fget if isinstance(member, property) else member
        shown = member_name if isinstance(member, property) else _signature(member_name, member)
        out += [f"- `{name}.{shown}`" + (" (property)" if isinstance(member, property) else ""), ""]
        doc = _doc(target)
        if doc:
            out += ["  " + line if line else "" for line in doc.splitlines()] + [""]
    return out


def render_python_api() -> str:
    import gpumesh

    parts = [PYTHON_HEADER]
    for name in gpumesh.__all__:
        obj = getattr(gpumesh, name)
        if name == "__version__":
            continue
        if inspect.isclass(obj):
            parts.append("\n".join(_class(name, obj)))
        else:
            parts.append("\n".join([f"### `{_signature(name, obj)}`", "", _doc(obj), ""]))
    return "\n".join(parts).rstrip() + "\n"


PAGES = {"cli": render, "python": render_python_api}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in PAGES:
        sys.exit(f"usage: python -m gpumesh.cli.reference {'|'.join(PAGES)}")
    sys.stdout.write(PAGES[sys.argv[1]]())
