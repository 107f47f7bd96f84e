"""``gpumesh serve`` put together: the broker started from its data dir, the signing set-up, metrics, the public
tunnel, and the lines a person copies onto other machines; everything it started stopped on the way out.

The command parses its flags into :class:`ServeOptions`, enters :func:`serving`, prints what it says, and keeps the
mesh's reaper running until it is told to stop.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gpumesh.errors import UsageError
from gpumesh.server.broker_server import BrokerServer, default_data_dir, has_tls, is_loopback, reachable_host
from gpumesh.settings import Settings
from gpumesh.store.broker import Broker

log = logging.getLogger("gpumesh.serve")


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """``gpumesh serve``'s flags."""

    host: str = "127.0.0.1"
    port: int
    data_dir: Path | None = None
    tls: bool | None = None  # None: as the data dir was last served
    public: bool = False
    insecure_public: bool = False
    metrics_port: int | None = None
    no_sign: bool = False
    fsync: str = "always"


@dataclass
class Served:
    """A running broker: what to keep serving with, and what to say about it."""

    server: BrokerServer
    broker: Broker
    settings: Settings
    warnings: list[str] = field(default_factory=list)  # for the person who started it (stderr, in red)
    lines: list[str] = field(default_factory=list)  # to copy onto other machines (stdout)


@contextlib.contextmanager
def serving(opts: ServeOptions, stop: threading.Event) -> Iterator[Served]:
    """Start the broker as ``opts`` say and yield it; SIGINT and SIGTERM set ``stop`` once it runs. On the way out
    the tunnel is closed and Redis stopped cleanly (the append-only file flushed)."""
    data_dir = opts.data_dir or default_data_dir()
    tls = has_tls(data_dir) if opts.tls is None else opts.tls  # a restart keeps the mode: handed-out lines work
    if opts.public and not tls and not opts.insecure_public:
        raise UsageError(
            "--public without TLS sends the password through the tunnel in clear: add --tls, "
            "or --insecure-public to accept that"
        )
    ngrok = _ngrok() if opts.public else None
    server = BrokerServer(data_dir, host=opts.host, port=opts.port, tls=tls, fsync=opts.fsync).start()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    tunnel_url = None
    try:
        settings = Settings.load(url=server.url)
        broker = Broker(settings).ping()
        broker.epoch()
        served = Served(server, broker, settings)
        trust, sign_key = _signing(server, broker, opts.no_sign)
        if opts.metrics_port:
            from gpumesh.server.metrics import serve_metrics

            serve_metrics(broker, opts.metrics_port)
            log.info("metrics on http://127.0.0.1:%d/metrics", opts.metrics_port)
        join_host = reachable_host(opts.host)
        if not is_loopback(opts.host):
            served.warnings.append(
                f"WARNING: the broker listens on {opts.host}: anyone who can reach port {opts.port} and has the "
                "password can run code on every worker. Keep the password secret"
                + ("; traffic is TLS." if tls else "; prefer a VPN or --tls.")
            )
        join = server.url_for("worker", join_host)
        submit_url = server.url_for("submitter", join_host)
        if ngrok is not None:
            tunnel = ngrok.connect(opts.port, "tcp")
            public_host, public_port = urlsplit(tunnel.public_url).netloc.rsplit(":", 1)
            tunnel_url = server.url_for("worker", public_host, int(public_port))
            submit_url = server.url_for("submitter", public_host, int(public_port))
            served.warnings.append(_public_warning(f"{public_host}:{public_port}", tls))
        served.lines = _lines(opts, server, tls, join, tunnel_url, submit_url, trust, sign_key)
        yield served
        broker.close()
    finally:
        if tunnel_url and ngrok is not None:
            ngrok.kill()
        server.stop()


def _ngrok() -> Any:
    try:
        from pyngrok import ngrok
    except ImportError:
        from gpumesh.extras import install_hint

        raise UsageError(f"--public needs pyngrok (the tunnel extra): {install_hint('tunnel')}") from None
    return ngrok


def _public_warning(where: str, tls: bool) -> str:
    return (
        f"WARNING: the broker is now reachable from the whole internet at {where}. Whoever has the join line can "
        "run code on your workers. "
        + (
            "Traffic through the tunnel is TLS, checked against the pinned CA."
            if tls
            else "Redis traffic through the tunnel is NOT encrypted (--insecure-public): "
            "anyone on the path can read the password; use --tls."
        )
    )


def _lines(
    opts: ServeOptions,
    server: BrokerServer,
    tls: bool,
    join: str,
    tunnel_url: str | None,
    submit_url: str,
    trust: str,
    sign_key: str,
) -> list[str]:
    """What serve prints: where it listens, and the lines to copy on other machines."""
    lines = [f"gpumesh broker listening on {opts.host}:{opts.port}, data in {server.data_dir}"]
    if tls:
        lines.append(f"TLS only; CA fingerprint {server.fingerprint} (CA in {server.data_dir / 'tls' / 'ca.pem'})")
    lines += [
        "",
        "Join a worker on another machine:"
        if tunnel_url or not is_loopback(opts.host)
        else f"Join a worker on this machine (the broker listens on {opts.host} only: serve --host 0.0.0.0 for others):",
        f"  gpumesh worker '{tunnel_url or join}'{trust}",
        "Submit a job:",
        f"  gpumesh submit examples/grid_search.py --payloads examples/payloads.json{sign_key} --url '{submit_url}' "
        "--wait",
        "Or store that URL and key once, then submit with no --url or --sign-key:",
        f"  gpumesh config init --url '{submit_url}'{sign_key}",
        "",
        "A credential per person (revocable): gpumesh access add NAME",
        f"Admin URL: in {server.data_dir / 'credentials.json'} (mode 0600)",
    ]
    if tunnel_url:
        lines += ["On this machine or its LAN:", f"  gpumesh worker '{join}'{trust}"]
    return lines


def _signing(server: BrokerServer, broker: Broker, no_sign: bool) -> tuple[str, str]:
    """serve's signing set-up: the job-signing key pair in the data dir (made at first start) and the
    result key of the `worker` credential, registered in keys.RESULT_KEYS (with the admin credential).
    Returns what the worker line and the submit line add (' --trust ed25519:...', ' --sign-key PATH')."""
    from gpumesh import signing

    try:
        broker.register_result_key("worker", signing.result_public("worker", server.passwords["worker"]))
    except UsageError:  # no cryptography package: results go unsigned
        if not no_sign:
            from gpumesh.extras import pip_command

            raise UsageError(
                "serve signs jobs by default and needs the cryptography package, a dependency of gpumesh: "
                f"{pip_command(['cryptography>=42'])} (or pass --no-sign for unsigned jobs)"
            ) from None
    if no_sign:
        return "", ""
    priv, pub = signing.ensure_keypair(server.data_dir, "signing")
    return f" --trust {signing.inline(signing.public_key(pub))}", f" --sign-key {shlex.quote(str(priv))}"
