"""``gpumesh dashboard``: the web dashboard (gpumesh.dashboard) for a mesh, served until Ctrl-C.

Its own module so that starlette, uvicorn and jinja2 (the ``dashboard`` extra) are imported only when the
command runs, and a missing extra is one line, not a traceback."""

from __future__ import annotations

import click

from gpumesh.cli.helpers import url_option
from gpumesh.server.broker_server import is_loopback, lan_address

EXTRA = ("starlette", "uvicorn", "jinja2", "markupsafe", "anyio")
MISSING = "gpumesh dashboard needs its extra: {}"
LOOPBACK_NAMES = ["127.0.0.1", "localhost", "::1", "[::1]"]


def own_names(host: str) -> list[str]:
    """The Host names a dashboard listening on ``host`` answers by default: on loopback the loopback names;
    elsewhere also that address, this machine's name and its LAN address. Any other name needs --allow-host:
    a name the dashboard did not choose may be another site's, rebound to this address (DNS rebinding)."""
    if is_loopback(host):
        return LOOPBACK_NAMES
    import socket

    names = [*LOOPBACK_NAMES]
    for lookup in (socket.gethostname, socket.getfqdn, lan_address):
        try:  # an offline machine whose name does not resolve still serves its other names
            names.append(lookup())
        except OSError:
            pass
    if host not in ("0.0.0.0", "::"):
        names.append(f"[{host}]" if ":" in host else host)  # how Starlette reads an IPv6 Host header
    return sorted({n.lower() for n in names if n})


@click.command()
@url_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=9181, show_default=True, help="Port to listen on.")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="NAME",
              help="Another Host name the dashboard answers (repeatable; e.g. the name a proxy forwards, or a "
                   "VPN address). It always answers 127.0.0.1, localhost and ::1, and off loopback also the "
                   "--host address and this machine's name and LAN address; other names get 400, so that "
                   "another site's page cannot read or write it through DNS rebinding.")  # fmt: skip
@click.option(
    "--read-only",
    is_flag=True,
    help="Never cancel or retry, whatever the credential may do (no buttons; the endpoints refuse). Use it on "
    "a machine that runs a worker: a dashboard that may write takes writes only with the access token it prints.",
)
@click.pass_context
def dashboard(
    ctx: click.Context, url: str | None, host: str, port: int, allow_hosts: tuple[str, ...], read_only: bool
) -> None:
    """Serve a web dashboard of the mesh: workers, jobs, tasks, failures, a timeline of attempts, live logs.
    Cancel and retry only with a credential that may write. Runs until Ctrl-C."""
    try:
        from gpumesh.dashboard.app import serve
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] not in EXTRA:
            raise
        from gpumesh.extras import install_hint

        click.echo(MISSING.format(install_hint("dashboard")), err=True)
        ctx.exit(2)
    if not is_loopback(host):
        click.secho(
            f"WARNING: the dashboard listens on {host}: anyone who can reach port {port} sees every job, its "
            "payloads, results and logs, without a password"
            + ("" if read_only else " (and may cancel and retry jobs if the credential may: --read-only stops that)")
            + ". Keep it on 127.0.0.1, or put it behind a VPN or an authenticating proxy.",
            err=True, fg="red", bold=True,
        )  # fmt: skip
    ctx.obj["url"] = url or ""
    serve(url, host, port, [*own_names(host), *allow_hosts], read_only=read_only)
