"""``gpumesh serve --tls``: a private certificate authority and a server certificate, made at the first
TLS start and kept in the data directory's ``tls/`` folder (keys 0600).

Clients pin the CA by its SHA-256 fingerprint (``?ca_fingerprint=sha256:...`` in the printed lines, see
:mod:`gpumesh.store.tlspin`), not by the server's name: a tunnel gives the broker other names. The server
sends its certificate followed by the CA's, so a client with only the fingerprint can fetch the CA and
check it. The CA lives ten years; the server certificate is made again (signed by the same CA, so the
fingerprint stays) when it nears its end or does not name an address the broker is now reached at.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gpumesh.store.tlspin import fingerprint_of

CA_DAYS = 3650
SERVER_DAYS = 825
RENEW_DAYS = 30


@dataclass(frozen=True)
class TlsFiles:
    ca: Path  # the CA certificate (PEM): what clients pin
    chain: Path  # the server certificate then the CA's: redis-server's tls-cert-file
    key: Path  # the server's private key
    fingerprint: str  # "sha256:<hex>" of the CA certificate's DER bytes

    @property
    def directory(self) -> Path:
        return self.ca.parent


def tls_dir(data_dir: Path) -> Path:
    return data_dir / "tls"


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)  # whole or not at all: a broker killed mid-write keeps the old files


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _make_ca(directory: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"gpumesh broker CA {secrets.token_hex(4)}")])
    now = _now()
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    _write(directory / "ca.key", _key_pem(key), 0o600)
    _write(directory / "ca.pem", cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _names(hosts: list[str]) -> list[str]:
    wanted = ["127.0.0.1", "localhost", *hosts]
    return list(dict.fromkeys(h for h in wanted if h and h not in ("0.0.0.0", "::")))


def _server_cert_fits(chain: Path, key: Path, names: list[str]) -> bool:
    if not (chain.is_file() and key.is_file()):
        return False
    try:
        cert = x509.load_pem_x509_certificates(chain.read_bytes())[0]
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound, IndexError):
        return False
    if cert.not_valid_after_utc - _now() < datetime.timedelta(days=RENEW_DAYS):
        return False
    return all(_san(n) in san for n in names)


def _make_server_cert(directory: Path, names: list[str]) -> None:
    ca_key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca_pem = (directory / "ca.pem").read_bytes()
    ca = x509.load_pem_x509_certificate(ca_pem)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=SERVER_DAYS))
        .add_extension(x509.SubjectAlternativeName([_san(n) for n in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    _write(directory / "server.key", _key_pem(key), 0o600)
    _write(directory / "server.pem", cert.public_bytes(serialization.Encoding.PEM) + ca_pem, 0o644)


def ensure(data_dir: Path, hosts: list[str]) -> TlsFiles:
    """The data directory's CA (made once) and a server certificate naming ``hosts`` (and 127.0.0.1,
    localhost), made again when it is missing, near its end, or does not name one of them."""
    directory = tls_dir(data_dir)
    directory.mkdir(mode=0o700, exist_ok=True)
    if not ((directory / "ca.pem").is_file() and (directory / "ca.key").is_file()):
        _make_ca(directory)
        for stale in ("server.pem", "server.key"):  # signed by a CA that is gone
            (directory / stale).unlink(missing_ok=True)
    names = _names(hosts)
    files = TlsFiles(directory / "ca.pem", directory / "server.pem", directory / "server.key", "")
    if not _server_cert_fits(files.chain, files.key, names):
        _make_server_cert(directory, names)
    ca_der = x509.load_pem_x509_certificate(files.ca.read_bytes()).public_bytes(serialization.Encoding.DER)
    return TlsFiles(files.ca, files.chain, files.key, fingerprint_of(ca_der))
