"""Signed jobs: submitters sign every task with Ed25519; workers that trust keys verify before running.

What a signature covers: the job id and the task's index, the script's SHA-256, the payload, the
limits (timeout, attempts) and an expiry. A task written into Redis by anyone else (a leaked worker
credential, say), a tampered payload or script, a task copied into another job, and an expired job
all fail verification and never run.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from gpumesh.errors import UsageError

CONTEXT = "gpumesh-task-v1"


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise UsageError("signed jobs need the cryptography package: pip install 'gpumesh-pool[signing]'") from None
    return ed25519


def _serialization() -> Any:
    from cryptography.hazmat.primitives import serialization

    return serialization


def generate(directory: Path, name: str = "gpumesh-signing") -> tuple[Path, Path]:
    """Write NAME.key (private, 0600) and NAME.pub; refuse to overwrite a key."""
    ed25519, ser = _crypto(), _serialization()
    key = ed25519.Ed25519PrivateKey.generate()
    priv, pub = directory / f"{name}.key", directory / f"{name}.pub"
    if priv.exists() or pub.exists():
        raise UsageError(f"{priv} or {pub} already exists; move it away or choose another --name")
    directory.mkdir(parents=True, exist_ok=True)
    pem = key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption())
    fd = os.open(priv, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub.write_bytes(key.public_key().public_bytes(ser.Encoding.PEM, ser.PublicFormat.SubjectPublicKeyInfo))
    return priv, pub


def _raw_public(public_key: Any) -> bytes:
    ser = _serialization()
    return bytes(public_key.public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw))


def key_id(public_key: Any) -> str:
    return hashlib.sha256(_raw_public(public_key)).hexdigest()[:16]


class Signer:
    def __init__(self, path: Path) -> None:
        ed25519, ser = _crypto(), _serialization()
        try:
            key = ser.load_pem_private_key(Path(path).read_bytes(), password=None)
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot load the signing key {path}: {exc}") from None
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise UsageError(f"{path} is not an Ed25519 private key (make one with `gpumesh keys generate`)")
        self.key = key
        self.key_id = key_id(key.public_key())

    def sign(self, message: bytes) -> str:
        return base64.b64encode(self.key.sign(message)).decode()


class Verifier:
    def __init__(self, paths: list[Path]) -> None:
        ed25519, ser = _crypto(), _serialization()
        self.keys: dict[str, Any] = {}
        for path in paths:
            try:
                key = ser.load_pem_public_key(Path(path).read_bytes())
            except (OSError, ValueError) as exc:
                raise UsageError(f"cannot load the trusted key {path}: {exc}") from None
            if not isinstance(key, ed25519.Ed25519PublicKey):
                raise UsageError(f"{path} is not an Ed25519 public key")
            self.keys[key_id(key)] = key

    def verify(self, key_id: str, signature: str, message: bytes) -> str | None:
        """None when the signature is good, else why not (for the task's error)."""
        from cryptography.exceptions import InvalidSignature

        if not signature:
            return "signature: the task is not signed, and this worker runs only signed tasks"
        key = self.keys.get(key_id)
        if key is None:
            return f"signature: signed by key {key_id or '?'}, which this worker does not trust"
        try:
            key.verify(base64.b64decode(signature), message)
        except (InvalidSignature, ValueError):
            return "signature: does not match the task (tampered, or copied from another job)"
        return None


def message(
    job_id: str, index: int, script_sha: str, payload: str, timeout: float, max_attempts: int, expires: float
) -> bytes:
    """The canonical bytes a task's signature covers."""
    return json.dumps(
        [CONTEXT, job_id, index, script_sha, payload, float(timeout), int(max_attempts), float(expires)],
        separators=(",", ":"),
    ).encode()
