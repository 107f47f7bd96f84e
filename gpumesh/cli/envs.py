"""``gpumesh envs``: the environments this machine's workers built (gpumesh.envs), and trimming them."""

from __future__ import annotations

import time
from typing import Any

import click

from gpumesh.cli.options import emit_json, json_option


@click.command()
@click.option(
    "--prune", is_flag=True, help="Remove every env no worker of this machine uses, and failed builds' marks."
)
@click.option(
    "--env-cache",
    "env_cache",
    metavar="DIR",
    help="The cache to show (default: the workers' default, or GPUMESH_ENV_CACHE).",
)
@json_option
def envs(prune: bool, env_cache: str | None, as_json: bool) -> None:
    """Show the environments this machine's workers built, and prune them.

    A job's packages (a script's PEP 723 block, submit --with, --requirements) are locked at submit
    and built once per machine into this cache, which the machine's workers share, before they take
    the job's tasks; the least recently used envs no worker holds go first past the size setting
    (GPUMESH_ENV_CACHE_MB). A failed build is kept as a mark: this machine does not try that lock
    again until --prune removes it.

    \b
      gpumesh envs                  # digest, size, last use, in use, packages
      gpumesh envs --prune          # remove what no worker uses now, and failed builds' marks
      gpumesh envs --env-cache /srv/gpumesh-envs --json
    """
    from gpumesh.envs.cache import EnvCache, default_root
    from gpumesh.settings import Settings

    settings = Settings.load()
    cache = EnvCache(env_cache or settings.env_cache or default_root(), settings.env_cache_mb)
    removed = cache.prune() if prune else []
    entries = cache.entries()
    if as_json:
        emit_json({"root": str(cache.root), "envs": entries, "removed": removed})
        return
    if prune:
        click.echo(f"removed {len(removed)} from {cache.root}")
    if not entries:
        click.echo(f"no environments in {cache.root}")
        return
    for e in entries:
        click.echo(_line(e))


def _line(e: dict[str, Any]) -> str:
    age = time.time() - float(e["last_used"])
    used = "in use" if e["in_use"] else f"last used {age / 60:.0f} min ago"
    if e["state"] == "failed":
        last = (str(e.get("error", "")).strip().splitlines() or [""])[-1]
        return f"{str(e['digest'])[:12]}  failed: {last}"
    pkgs = ", ".join(e.get("packages", [])[:6])
    return f"{str(e['digest'])[:12]}  {int(e['bytes']) / 2**20:7.1f} MiB  {used}  {pkgs}"
