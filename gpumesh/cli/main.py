"""The ``gpumesh`` command: thin Click commands over the Python API (broker, worker, server, local).

Data goes to stdout, progress and errors to stderr. Exit codes: 0 ok · 1 job ended failed/cancelled ·
2 bad usage or input · 3 broker unreachable or refused the credentials · 4 not found.
"""

from __future__ import annotations

import click

from gpumesh import __version__
from gpumesh.cli import admin, jobs, mesh
from gpumesh.cli.helpers import Group


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="gpumesh")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Run data-parallel Python work on a mesh of uneven machines.

    A job is a script plus a JSON list of payloads; each payload is one task. Workers benchmark
    themselves and take tasks from the tier that matches their strength.

    \b
    One machine, one command:   gpumesh run examples/grid_search.py --payloads examples/payloads.json --local 2
    A broker others can join:   gpumesh serve            (prints the worker and submit lines to copy)
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


for command in (
    jobs.submit, jobs.status, jobs.jobs, jobs.results, jobs.workers, jobs.top, jobs.logs, jobs.cancel, jobs.retry,
    jobs.pull,
    mesh.worker, mesh.join, mesh.serve, mesh.run,
    admin.access, admin.keys, admin.metrics, admin.bench, admin.config,
):  # fmt: skip
    main.add_command(command)

if __name__ == "__main__":
    main()
