"""``gpumesh access``, ``keys``, ``metrics``, ``bench`` and ``config``: operating a mesh."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import click
import redis

from gpumesh.cli import render
from gpumesh.cli.helpers import connect, emit_json, err, json_option, url_option
from gpumesh.errors import GpumeshError, NotFound, UsageError
from gpumesh.settings import Settings, config_path
from gpumesh.store import tlspin
from gpumesh.store.connection import mask_url, translate


def _admin(data_dir: Path | None, url: str | None) -> redis.Redis:
    """The admin connection: ``url``, or the one serve's files in ``data_dir`` give (TLS pinned where it serves TLS)."""
    from gpumesh.server.broker_server import default_data_dir, local_admin_url
    from gpumesh.store.connection import client

    if url is None:
        d = data_dir or default_data_dir()
        try:
            url = local_admin_url(d)
        except FileNotFoundError:
            raise UsageError(f"no broker data in {d}; pass --data-dir (as given to serve) or --url ADMIN_URL") from None
    admin = client(url, decode=True, socket_timeout=3, retries=0, health_check=False)
    try:
        admin.ping()
    except redis.RedisError as exc:
        raise translate(exc, url) from None
    return admin


@click.group()
def keys() -> None:
    """Ed25519 keys for signed jobs: submitters sign, workers started with --trust verify."""


@keys.command("generate")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path), default=".", show_default=True,
              help="Directory to write the two key files in.")  # fmt: skip
@click.option("--name", default="gpumesh-signing", show_default=True, help="File name of the keys, without .key/.pub.")
def keys_generate(directory: Path, name: str) -> None:
    """Write NAME.key (private, mode 0600: keep it with the submitters) and NAME.pub (for the workers)."""
    from gpumesh.signing import generate

    priv, pub = generate(directory, name)
    click.echo(f"{priv}\n{pub}")
    err.print(f"submit with --sign-key {priv}; start workers with --trust {pub}")


@click.group()
def access() -> None:
    """Per-person worker credentials on a broker that `gpumesh serve` runs (run it on that machine)."""


access_options = [
    click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), help="serve's data dir [default]."),
    click.option("--url", metavar="ADMIN_URL", help="The admin URL instead of reading it from the data dir."),
]


def _access_opts(f: Any) -> Any:
    for option in reversed(access_options):
        f = option(f)
    return f


@access.command("add")
@click.argument("name")
@click.option(
    "--host",
    help="Address the person's workers reach the broker at (default: where serve's own worker line points: this "
    "machine's LAN address for a broker on 0.0.0.0; with --url, that URL's host).",
)
@_access_opts
def access_add(name: str, host: str | None, data_dir: Path | None, url: str | None) -> None:
    """Create (or rotate) the worker credential of NAME and print their join line.

    The credential's result key (derived from its password) is registered in the broker, so
    `gpumesh results` shows which results came from NAME's workers. The line pins serve's job-signing
    key (--trust ed25519:..., from signing.pub in the data dir) when there is one."""
    from gpumesh.server.broker_server import (
        add_worker,
        broker_url,
        default_data_dir,
        is_loopback,
        reachable_host,
        served_bind,
        worker_user,
    )
    from gpumesh.signing import inline, public_key, result_public
    from gpumesh.store.broker import register_result_key

    admin = _admin(data_dir, url)
    user = worker_user(name)
    result_public(user, "")  # without the cryptography package: a usage error before anything changes
    password = add_worker(admin, name)
    register_result_key(admin, user, result_public(user, password))
    kw = admin.connection_pool.connection_kwargs
    pub = (data_dir or default_data_dir()) / "signing.pub"
    trust = f" --trust {inline(public_key(pub))}" if pub.is_file() else ""
    if host is None:  # as serve's worker line: the LAN address of a broker listening on every interface
        host = kw["host"] if url is not None else reachable_host(served_bind(pub.parent))
    line = broker_url(password, host, kw["port"], user=user)
    fingerprint = kw.get(tlspin.PARAM)
    if fingerprint:  # serve --tls: the person's line pins the broker's CA as serve's own lines do
        line = line.replace("redis://", "rediss://", 1) + f"?{tlspin.PARAM}={fingerprint}"
    click.echo(f"gpumesh worker '{line}'{trust}")
    if not trust:
        err.print(f"no job-signing key in {pub.parent}: the line runs unsigned jobs (see `gpumesh serve --help`)")
    if is_loopback(host):
        err.print(
            f"the line names {host}: it reaches the broker from this machine only. For another machine, restart "
            "serve with --host 0.0.0.0 (or this machine's address), or pass --host ADDRESS-THEY-REACH"
        )
    err.print(f"revoke with: gpumesh access revoke {name}")


@access.command("revoke")
@click.argument("name")
@_access_opts
def access_revoke(name: str, data_dir: Path | None, url: str | None) -> None:
    """Delete NAME's worker credential; their connected workers are disconnected at once."""
    from gpumesh.server.broker_server import revoke_worker

    if not revoke_worker(_admin(data_dir, url), name):
        raise NotFound(f"no worker credential named {name!r}; `gpumesh access list` shows them")
    err.print(f"revoked {name}: their workers are disconnected and cannot reconnect")


@access.command("list")
@_access_opts
def access_list(data_dir: Path | None, url: str | None) -> None:
    """List the per-person worker credentials."""
    from gpumesh.server.broker_server import list_workers

    for name in list_workers(_admin(data_dir, url)):
        click.echo(name)


@access.command("load-functions")
@_access_opts
def access_load_functions(data_dir: Path | None, url: str | None) -> None:
    """Load this gpumesh version's Redis functions (its protocol's and the one before) and make the broker's
    epoch key, as the admin.

    `gpumesh serve` does it at every start; run this for a broker that serve does not run (a managed
    Redis with your own ACLs), where workers and submitters may not load functions themselves. Other
    gpumesh libraries are deleted unless a live worker still calls them."""
    from gpumesh.server.broker_server import prepare

    admin = _admin(data_dir, url)
    try:
        served = prepare(admin)
    except redis.RedisError as exc:
        raise translate(exc, url or "the admin URL") from None
    err.print(f"the broker has gpumesh's functions, {served}, and an epoch")


@click.command()
@click.option("--port", default=9464, show_default=True, type=click.IntRange(1, 65535),
              help="Port the Prometheus exporter listens on.")  # fmt: skip
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@url_option
@click.pass_context
def metrics(ctx: click.Context, port: int, host: str, url: str | None) -> None:
    """Export Prometheus metrics for the mesh: queue depth per priority, live workers per tier (score band) and device,
    task outcomes, lease expiries, task durations, broker round trip. Runs until Ctrl-C."""
    from gpumesh.server.metrics import serve_metrics

    broker = connect(ctx, url)
    serve_metrics(broker, port, host)
    err.print(f"metrics on http://{host}:{port}/metrics for {broker.url_masked}")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


@click.command()
@json_option
@click.option("--save", is_flag=True, help="Also cache the result as the score workers on this machine use.")
def bench(as_json: bool, save: bool) -> None:
    """Probe and benchmark this machine (in a child process) and show the result.

    The score is the best of 30 matmul trials over about 2.5 s; a warning says when the trials disagreed
    (something else used the CPU meanwhile, here or on a VM's host) and the score may not repeat.
    Nothing changes for workers unless --save: it writes the cached score a worker reads when it starts
    (a running worker keeps the score it started with), so a noisy measurement never slips in unseen."""
    from gpumesh import capability

    settings = Settings.load()
    if not as_json:
        err.print("benchmarking (matmul, about 3 seconds)…")
    cap, rates = capability.measure()
    if as_json:
        emit_json(cap.model_dump())
    else:
        render.out().print(render.capability_table(cap))
    for warning in (capability.warning(cap), capability.unsteady(rates)):
        if warning is not None:
            click.echo(warning, err=True)  # one line, never wrapped to a console's width: grep-able in logs
    if save:
        try:
            path = capability.save(settings.cache_dir, cap)
        except OSError as e:
            raise GpumeshError(f"cannot write the capability cache in {settings.cache_dir}: {e}") from e
        click.echo(f"saved to {path}: workers started from now on use it", err=True)
    elif not as_json:
        click.echo("not saved: gpumesh bench --save makes this the score workers use", err=True)


@click.group()
def config() -> None:
    """Write or show the config file that every command reads (mode 0600)."""


@config.command("init")
@click.option("--url", help="The broker URL to store (asked for on a terminal when omitted).")
@click.option(
    "--sign-key",
    type=click.Path(dir_okay=False, exists=True, resolve_path=True, path_type=Path),
    help="Also store this Ed25519 private key (serve's signing.key), so that every submit signs its jobs.",
)
@click.option("--force", is_flag=True, help="Overwrite an existing config file.")
def config_init(url: str | None, sign_key: Path | None, force: bool) -> None:
    """Store the broker URL (and the job-signing key) so commands need no --url, GPUMESH_URL or --sign-key.

    `gpumesh serve` prints this command with its submitter URL and signing key filled in."""
    path = config_path()
    if path.exists() and not force:
        raise UsageError(f"{path} already exists; pass --force to overwrite it")
    if url is None:
        if not sys.stdin.isatty():
            raise UsageError("config init needs --url when not run on a terminal")
        url = click.prompt("Broker URL (redis://submitter:PASSWORD@HOST:PORT/0)", hide_input=True)
    Settings.load(url=url)  # validates it
    lines = [f"url = {json.dumps(url)}"]
    if sign_key is not None:
        from gpumesh.signing import Signer

        Signer(sign_key)  # a file that is no private key: a usage error before anything is written
        lines.append(f"signing_key = {json.dumps(str(sign_key))}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("# gpumesh settings; keys as in `gpumesh config show`\n" + "\n".join(lines) + "\n")
    os.chmod(path, 0o600)
    signs = f", jobs signed with {sign_key}" if sign_key else ""
    err.print(f"wrote {path} (mode 0600) for {mask_url(url)}{signs}")


@config.command("show")
@json_option
def config_show(as_json: bool) -> None:
    """Print the settings in effect (flags aside), with the password masked."""
    s = Settings.load()
    data = {**s.model_dump(mode="json"), "url": mask_url(s.url), "config_file": str(config_path())}
    if as_json:
        emit_json(data)
    else:
        for k, v in data.items():
            click.echo(f"{k} = {v}")
