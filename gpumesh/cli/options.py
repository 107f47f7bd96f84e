"""The options every command shares, and how JSON is printed: import-light (click and json only), so
that a command meant to answer fast (``status JOB --json``) can take them without the heavy helpers."""

from __future__ import annotations

import json
from typing import Any

import click

url_option = click.option(
    "--url",
    metavar="URL",
    help="Broker URL: redis://[USER:PASSWORD@]HOST:PORT/DB (USER worker or submitter for a `gpumesh serve` broker, "
    "as its lines print; empty for a Redis with only a requirepass password, such as the compose file's), "
    "rediss:// for TLS, "
    "redis+sentinel://[:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB] for a broker that fails over "
    "(default: $GPUMESH_URL, then the config file, then redis://127.0.0.1:6379/0).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout, nothing else.")


def dump(data: Any) -> str:
    return json.dumps(data, indent=2, default=str)


def emit_json(data: Any) -> None:
    click.echo(dump(data))
