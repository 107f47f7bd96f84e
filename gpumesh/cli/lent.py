"""``gpumesh lent``: what ran on this machine, from the record its workers keep here (no broker needed)."""

from __future__ import annotations

import datetime
import re
import time

import click

from gpumesh.cli.options import emit_json, json_option
from gpumesh.errors import UsageError

_AGO = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def since_of(text: str | None) -> float:
    """--since as Unix time: an age (30m, 12h, 7d) or a local date or time (YYYY-MM-DD[THH:MM])."""
    if not text:
        return 0.0
    m = _AGO.fullmatch(text.strip())
    if m:
        return time.time() - float(m.group(1)) * _UNIT[m.group(2)]
    try:
        return datetime.datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise UsageError(
            f"--since {text!r}: expected an age (30m, 12h, 7d) or a local date YYYY-MM-DD[THH:MM]"
        ) from None


@click.command()
@click.option(
    "--since",
    metavar="AGE|DATE",
    help="Only attempts that started since: 30m, 12h, 7d, or a local date YYYY-MM-DD[THH:MM].",
)
@json_option
def lent(since: str | None, as_json: bool) -> None:
    """List every attempt this machine's workers ran for the mesh: job, name, submitter, script digest, start,
    duration, outcome and output bytes sent. Kept on this machine ($XDG_STATE_HOME/gpumesh/lent.jsonl, or
    GPUMESH_LENT_FILE; readable by its user alone; the newest few thousand), written even when the broker is
    unreachable."""
    from gpumesh.settings import Settings
    from gpumesh.worker import lent as record

    path = record.path_of(Settings.load().lent_file)
    rows = record.read(path, since_of(since))
    if as_json:
        emit_json(rows)
        return
    from gpumesh.cli import render

    table = render._table(
        "start", "job", "name", "submitter", "script", "took", "outcome", "sent", title=f"lent ({path})"
    )
    for row in rows:
        start = datetime.datetime.fromtimestamp(float(row.get("start") or 0)).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(
            *map(render.cell, (start, f"{row.get('job', '')} #{row.get('attempt', '')}", row.get("name", ""),
                               row.get("submitter") or "?", str(row.get("script", ""))[:12],
                               render._duration(float(row.get("duration") or 0)), row.get("outcome", ""),
                               f"{int(row.get('sent_bytes') or 0)} B"))
        )  # fmt: skip
    render.out().print(table)
