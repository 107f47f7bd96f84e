"""The ``gpumesh`` command: thin Click commands over the Python API (broker, worker, server, local).

Data goes to stdout, progress and errors to stderr. Exit codes: 0 ok · 1 job ended failed/cancelled ·
2 bad usage or input · 3 broker unreachable or refused the credentials · 4 not found.
"""

from __future__ import annotations

import inspect

import click

from gpumesh import __version__
from gpumesh.cli import admin, doctor, jobs, mesh
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


# One or two lines of each command's --help: what a newcomer types first.
EXAMPLES = {
    "submit": ["gpumesh submit train.py --payloads sweep.json --wait",
               "gpumesh submit train.py --payloads - --require vram_gb>=40 --priority 5 < sweep.json"],
    "status": ["gpumesh status 8f3c2a1b9d0e --watch"],
    "jobs": ["gpumesh jobs --limit 10 --json"],
    "results": ["gpumesh results 8f3c2a1b9d0e --format csv -o results.csv"],
    "workers": ["gpumesh workers --json"],
    "top": ["gpumesh top --interval 2"],
    "logs": ["gpumesh logs 8f3c2a1b9d0e-3 -f"],
    "cancel": ["gpumesh cancel 8f3c2a1b9d0e --keep-files"],
    "retry": ["gpumesh retry 8f3c2a1b9d0e --wait", "gpumesh retry 8f3c2a1b9d0e --cancelled"],
    "pull": ["gpumesh pull 8f3c2a1b9d0e --to runs/", "gpumesh pull 8f3c2a1b9d0e 3 --to runs/ --glob '*.pt'"],
    "worker": ["gpumesh worker redis://worker:PASSWORD@10.0.0.5:6390/0 --gpus all",
               "gpumesh worker --score 10 --resource has_torch=yes"],
    "join": ["gpumesh join 10.0.0.5:6390 --token PASSWORD"],
    "serve": ["gpumesh serve --host 0.0.0.0"],
    "run": ["gpumesh run examples/grid_search.py --payloads examples/payloads.json --local 2"],
    "access": ["gpumesh access add alice"],
    "access add": ["gpumesh access add alice"],
    "access revoke": ["gpumesh access revoke alice"],
    "access list": ["gpumesh access list"],
    "keys": ["gpumesh keys generate --dir ~/.config/gpumesh"],
    "keys generate": ["gpumesh keys generate --dir ~/.config/gpumesh --name lab"],
    "metrics": ["gpumesh metrics --port 9464"],
    "bench": ["gpumesh bench --save"],
    "config": ["gpumesh config init --url redis://:PASSWORD@10.0.0.5:6390/0"],
    "config init": ["gpumesh config init --url redis://:PASSWORD@10.0.0.5:6390/0"],
    "config show": ["gpumesh config show"],
    "doctor": ["gpumesh doctor", "gpumesh doctor --json"],
}  # fmt: skip


def _with_examples(command: click.Command, path: str = "") -> None:
    """Append the command's examples to its help (and its subcommands', for a group)."""
    name = f"{path} {command.name}".strip()
    lines = EXAMPLES.get(name)
    if lines and "Example" not in (command.help or ""):
        command.help = inspect.cleandoc(command.help or "") + "\n\n\b\nExamples:\n" + "\n".join(f"  {x}" for x in lines)
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _with_examples(sub, name)


for command in (
    jobs.submit, jobs.status, jobs.jobs, jobs.results, jobs.workers, jobs.top, jobs.logs, jobs.cancel, jobs.retry,
    jobs.pull,
    mesh.worker, mesh.join, mesh.serve, mesh.run,
    admin.access, admin.keys, admin.metrics, admin.bench, admin.config, doctor.doctor,
):  # fmt: skip
    _with_examples(command)
    main.add_command(command)

if __name__ == "__main__":
    main()
