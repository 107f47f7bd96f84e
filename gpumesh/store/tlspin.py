"""TLS to a broker whose CA is pinned by fingerprint: ``rediss://...?ca_fingerprint=sha256:<hex>``.

The lines ``gpumesh serve --tls`` prints carry the SHA-256 fingerprint of the broker's private CA
instead of a CA file. At the first connection a client fetches the CA: a TLS handshake that checks
nothing and sends nothing (no command, no password), keeping from the certificates the server sent
the one whose fingerprint is the pinned one. That CA is cached (``~/.cache/gpumesh/ca/<hex>.pem``,
checked against the fingerprint at every read) and is from then on the *only* trust anchor of every
connection: the handshake must verify against it before redis-py sends AUTH. A broker that sends no
such CA is refused with :class:`FingerprintMismatch`, before anything is sent to it.

Standard library only (``ssl``): a client needs no ``cryptography``.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import ssl
import string
import threading
from pathlib import Path
from typing import Any

from redis.connection import SSLConnection

from gpumesh.errors import BrokerError, UsageError

PARAM = "ca_fingerprint"
_PEM = re.compile(r"-----BEGIN CERTIFICATE-----\s.+?-----END CERTIFICATE-----", re.S)
_known: dict[str, str] = {}  # fingerprint -> CA PEM, for this process
_lock = threading.Lock()


class FingerprintMismatch(BrokerError):
    """The broker did not present the pinned CA: a wrong fingerprint, another broker, or someone between."""


def fingerprint_of(der: bytes) -> str:
    """``sha256:<hex>`` of a certificate's DER bytes: what ``ca_fingerprint`` holds."""
    return "sha256:" + hashlib.sha256(der).hexdigest()


def parse_fingerprint(value: str) -> str:
    """``sha256:<64 hex digits>`` (colons between the digits and upper case allowed), normalised."""
    algorithm, sep, digits = value.strip().lower().partition(":")
    digits = digits.replace(":", "")
    if algorithm != "sha256" or not sep or len(digits) != 64 or not set(digits) <= set(string.hexdigits):
        raise UsageError(
            f"{PARAM} must be sha256: and 64 hex digits (as `gpumesh serve --tls` prints it), got {value!r}"
        )
    return f"sha256:{digits}"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpumesh" / "ca"


def _ders(pem_text: str) -> list[bytes]:
    out = []
    for block in _PEM.findall(pem_text):
        try:
            out.append(ssl.PEM_cert_to_DER_cert(block))
        except ValueError:
            continue
    return out


def _pick(ders: list[bytes], fingerprint: str) -> str | None:
    for der in ders:
        if fingerprint_of(der) == fingerprint:
            return ssl.DER_cert_to_PEM_cert(der)
    return None


def _unverified_chain(sock: ssl.SSLSocket) -> list[bytes]:
    """The certificates the server sent, leaf first. Public from Python 3.13; the same call is on the
    private ``_sslobj`` in 3.10-3.12."""
    get = getattr(sock, "get_unverified_chain", None) or sock._sslobj.get_unverified_chain  # type: ignore[attr-defined]
    certs: list[Any] = get() or []
    return [c if isinstance(c, bytes) else c.public_bytes(ssl._ssl.ENCODING_DER) for c in certs]  # type: ignore[attr-defined]


def fetch_ca(host: str, port: int, fingerprint: str, timeout: float | None) -> str:
    """The pinned CA (PEM) from the certificates the broker sends in a handshake; nothing else is sent."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # only to read the certificates; this connection carries no data
    with (
        socket.create_connection((host, port), timeout=timeout) as raw,
        ctx.wrap_socket(raw, server_hostname=host) as tls,
    ):
        chain = _unverified_chain(tls)
    pem = _pick(chain, fingerprint)
    if pem is None:
        raise FingerprintMismatch(
            f"the broker at {host}:{port} does not present the CA the URL pins ({PARAM}={fingerprint}); nothing was "
            "sent to it. Check the URL against the lines `gpumesh serve --tls` printed: a wrong fingerprint, another "
            "broker, or someone in between"
        )
    return pem


def pinned_ca(host: str, port: int, fingerprint: str, timeout: float | None, ca_file: str | None = None) -> str:
    """The pinned CA's PEM: from ``ca_file`` if given (it must hold it), else this process's memory, the
    cache, or the broker (then cached)."""
    if ca_file:
        try:
            pem = _pick(_ders(Path(ca_file).read_text()), fingerprint)
        except OSError as exc:
            raise UsageError(f"cannot read ssl_ca_certs {ca_file}: {exc.strerror}") from None
        if pem is None:
            raise FingerprintMismatch(f"{ca_file} does not hold the CA the URL pins ({PARAM}={fingerprint})")
        return pem
    with _lock:
        if fingerprint in _known:
            return _known[fingerprint]
    path = cache_dir() / f"{fingerprint.partition(':')[2]}.pem"
    try:
        pem = _pick(_ders(path.read_text()), fingerprint)  # a cache file that does not match is ignored
    except OSError:
        pem = None
    if pem is None:
        pem = fetch_ca(host, port, fingerprint, timeout)
        try:  # best effort: without a writable cache the CA is fetched once per process
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(pem)
            os.replace(tmp, path)
        except OSError:
            pass
    with _lock:
        _known[fingerprint] = pem
    return pem


class PinnedSSLConnection(SSLConnection):
    """redis-py's TLS connection, verified against the pinned CA only (see the module's docstring).

    Hostnames are not checked: the CA is private to one broker and pinned by its fingerprint, and it is
    the only trust anchor (no system CAs), so a certificate it signed is that broker's, whatever name a
    client dials it by (a LAN address, a tunnel's host)."""

    def __init__(self, ca_fingerprint: str, **kwargs: Any) -> None:
        self.ca_fingerprint = parse_fingerprint(ca_fingerprint)
        super().__init__(**kwargs)

    def _wrap_socket_with_ssl(self, sock: socket.socket) -> ssl.SSLSocket:
        pem = pinned_ca(self.host, self.port, self.ca_fingerprint, self.socket_connect_timeout, self.ca_certs)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = False  # see the class's docstring
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=pem)
        return ctx.wrap_socket(sock, server_hostname=self.host)
