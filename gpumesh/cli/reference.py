"""The CLI and settings reference, generated from the code: every command's ``--help`` and every setting.

    python -m gpumesh.cli.reference > docs/reference/cli.md

``tests/test_docs.py`` fails when the committed page and this output disagree, so the page is never stale.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import click
from click.testing import CliRunner

HEADER = """# CLI and settings reference

Generated from the code by `python -m gpumesh.cli.reference > docs/reference/cli.md`; a test fails when
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


if __name__ == "__main__":
    sys.stdout.write(render())
