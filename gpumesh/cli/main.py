"""The ``gpumesh`` command: thin Click commands over the Python API (broker, worker, server, local).

Data goes to stdout, progress and errors to stderr. Exit codes: 0 ok · 1 job ended failed/cancelled ·
2 bad usage or input · 3 broker unreachable or refused the credentials · 4 not found.
"""

from __future__ import annotations

import importlib
import inspect

import click

from gpumesh._version import PROTOCOL, __version__
from gpumesh.cli.group import Group

# Every command: the module that defines it, and the line `gpumesh --help` shows for it. A command's module
# is imported only when that command runs or shows its own help, so `gpumesh --help` loads no redis, rich
# or pydantic (tests/cli/test_cli_start.py checks both: the modules, and that these lines are the commands' own).
COMMANDS: dict[str, tuple[str, str]] = {
    "submit": ("gpumesh.cli.jobs", "Submit SCRIPT with one task per payload; print the job id."),
    "status": ("gpumesh.cli.status", "Show a job's status and task counts, and which queued tasks no live worker may run."),
    "jobs": ("gpumesh.cli.jobs", "List recent jobs, newest first."),
    "results": ("gpumesh.cli.jobs", "Print a job's per-task results in payload order (--json is --format json)."),
    "workers": ("gpumesh.cli.jobs", "List live workers with their device, score and tier (score band: 0 the weakest), then each tier: its RQ queue, its workers, the tasks waiting in that queue (the next 20 at most) and all the queued tasks it gets."),
    "top": ("gpumesh.cli.jobs", "A live view of the workers (tier, score, current task), the tiers' queues and the recent jobs. Ctrl-C quits."),
    "logs": ("gpumesh.cli.jobs", "Print the output of a task, or of every task of a job: its stdout to stdout, stderr to stderr."),
    "cancel": ("gpumesh.cli.jobs", "Cancel a job: queued tasks never run, running ones are killed within a heartbeat. The output files its done tasks stored are deleted too (pull them first, or pass --keep-files)."),
    "retry": ("gpumesh.cli.jobs", "Re-queue the failed tasks of a job (with --cancelled, its cancelled ones too), each with a fresh set of attempts."),
    "pull": ("gpumesh.cli.jobs", "Fetch the files a job's tasks wrote to GPUMESH_OUTPUT_DIR (or one TASK's: its index or id)."),
    "worker": ("gpumesh.cli.mesh", "Benchmark this machine, join the mesh at URL and run tasks until stopped."),
    "join": ("gpumesh.cli.mesh", "Join the mesh at HOST:PORT with a token: `gpumesh worker` in the original tool's form."),
    "serve": ("gpumesh.cli.mesh", "Start a broker for the mesh: Redis with a generated password, kept across restarts."),
    "run": ("gpumesh.cli.mesh", "Run SCRIPT on a private local mesh: a broker and N workers on this machine, one command."),
    "access": ("gpumesh.cli.admin", "Per-person worker credentials on a broker that `gpumesh serve` runs (run it on that machine)."),
    "keys": ("gpumesh.cli.admin", "Ed25519 keys for signed jobs: submitters sign, workers started with --trust verify."),
    "metrics": ("gpumesh.cli.admin", "Export Prometheus metrics for the mesh: queue depth per priority, live workers per tier (score band) and device, task outcomes, lease expiries, task durations, broker round trip. Runs until Ctrl-C."),
    "bench": ("gpumesh.cli.admin", "Probe and benchmark this machine (in a child process) and show the result."),
    "config": ("gpumesh.cli.admin", "Write or show the config file that every command reads (mode 0600)."),
    "dashboard": ("gpumesh.cli.dashboard", "Serve a web dashboard of the mesh: workers, jobs, tasks, failures, a timeline of attempts, live logs. Cancel and retry only with a credential that may write. Runs until Ctrl-C."),
    "lent": ("gpumesh.cli.lent", "List every attempt this machine's workers ran for the mesh: job, name, submitter, script digest, start, duration, outcome and output bytes sent. Kept on this machine ($XDG_STATE_HOME/gpumesh/lent.jsonl, or GPUMESH_LENT_FILE; readable by its user alone; the newest few thousand), written even when the broker is unreachable."),
    "doctor": ("gpumesh.cli.doctor", "Check this machine and the broker, and say how to fix what is wrong."),
    "envs": ("gpumesh.cli.envs", "Show the environments this machine's workers built, and prune them."),
    "init": ("gpumesh.cli.jobs", "Write a commented gpumesh.toml (a job file) from what this folder holds."),
}  # fmt: skip


class LazyGroup(Group):
    """The top-level group: commands load on first use (see COMMANDS)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(self.commands) | set(COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            command = getattr(importlib.import_module(COMMANDS[cmd_name][0]), cmd_name)
            _with_examples(command)
            self.add_command(command)
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """As click's, with each line from COMMANDS: listing the commands imports none of them."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = []
        for name in names:
            loaded = self.commands.get(name)
            if loaded is not None and loaded.hidden:
                continue
            if name in COMMANDS:
                rows.append((name, click.Command(name, help=COMMANDS[name][1]).get_short_help_str(limit)))
            elif loaded is not None:  # added with add_command, not in the table
                rows.append((name, loaded.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="gpumesh", message=f"%(prog)s %(version)s (broker protocol {PROTOCOL})")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Run data-parallel Python work on a mesh of uneven machines.

    A job is a script plus a JSON list of payloads; each payload is one task. Workers benchmark
    themselves; when one asks for work it gets what fits it, the strongest the heaviest tasks.

    \b
    One machine, one command:   gpumesh run examples/grid_search.py --payloads examples/payloads.json --local 2
    A broker others can join:   gpumesh serve            (prints the worker and submit lines to copy)
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


# One or two lines of each command's --help: what a newcomer types first.
EXAMPLES = {
    "submit": ["gpumesh submit train.py --payloads sweep.json --wait",
               "gpumesh submit train.py --payloads - --require vram_gb>=40 --priority 5 < sweep.json",
               "gpumesh submit examples/reuse_infer.py --payloads examples/reuse_payloads.json --reuse-process --wait",
               "gpumesh submit train.py --project . --payloads sweep.json --output 'outputs/*.json'",
               "gpumesh submit                  (reads ./gpumesh.toml; gpumesh init writes one)"],
    "status": ["gpumesh status 8f3c2a1b9d0e --watch"],
    "jobs": ["gpumesh jobs --limit 10 --json"],
    "results": ["gpumesh results 8f3c2a1b9d0e --format csv -o results.csv"],
    "workers": ["gpumesh workers --json"],
    "top": ["gpumesh top --interval 2"],
    "logs": ["gpumesh logs 8f3c2a1b9d0e-3 -f"],
    "cancel": ["gpumesh cancel 8f3c2a1b9d0e --keep-files"],
    "retry": ["gpumesh retry 8f3c2a1b9d0e --wait", "gpumesh retry 8f3c2a1b9d0e --cancelled"],
    "pull": ["gpumesh pull 8f3c2a1b9d0e --to runs/", "gpumesh pull 8f3c2a1b9d0e 3 --to runs/ --glob '*.pt'"],
    "worker": ["gpumesh worker 'redis://worker:PASSWORD@10.0.0.5:6390/0' --trust ed25519:KEY --gpus all   # serve's line",
               "gpumesh worker --score 10 --resource has_torch=yes"],
    "join": ["gpumesh join 10.0.0.5:6390 --token PASSWORD --trust ed25519:KEY   # serve's worker password and key"],
    "serve": ["gpumesh serve --host 0.0.0.0"],
    "run": ["gpumesh run examples/grid_search.py --payloads examples/payloads.json --local 2",
            "gpumesh run train.py --project . --payloads payloads.json --local 2"],
    "init": ["gpumesh init && gpumesh submit"],
    "lent": ["gpumesh lent --since 24h", "gpumesh lent --json"],
    "access": ["gpumesh access add alice"],
    "access add": ["gpumesh access add alice"],
    "access revoke": ["gpumesh access revoke alice"],
    "access list": ["gpumesh access list"],
    "keys": ["gpumesh keys generate --dir ~/.config/gpumesh"],
    "keys generate": ["gpumesh keys generate --dir ~/.config/gpumesh --name lab"],
    "metrics": ["gpumesh metrics --port 9464"],
    "bench": ["gpumesh bench --save"],
    "config": ["gpumesh config init --url 'redis://submitter:PASSWORD@10.0.0.5:6390/0' --sign-key signing.key   # serve prints it"],
    "config init": ["gpumesh config init --url 'redis://submitter:PASSWORD@10.0.0.5:6390/0' --sign-key signing.key   # serve prints it",
                    "gpumesh config init --url 'redis://:PASSWORD@10.0.0.5:6390/0'   # the compose broker (one password)"],
    "config show": ["gpumesh config show"],
    "dashboard": ["gpumesh dashboard --port 9181", "gpumesh dashboard --url 'redis://submitter:PASSWORD@10.0.0.5:6390/0'"],
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


if __name__ == "__main__":
    main()
