"""Signed jobs and attributable results, both Ed25519.

**Tasks.** Submitters sign every task; workers that trust keys (``--trust``) verify before running.
A task's signature covers its job id and index, the script's SHA-256, the SHA-256 of its payload
JSON, its limits (timeout, attempts), an expiry and, for a job that ships a project, brings back
files by glob or reuses a process per worker, the project's tree digest, the globs and that choice. The worker takes the job id and the index from
the task it actually leased (its key), never from fields stored next to it, and checks the job's
*spent set* (``keys.spent(job)``, made at submit with a placeholder member): a task whose index
is in it has ended for good (completed, failed for good or was cancelled: the transition functions add
it) and is not run again unless its submitter retries it (``retry`` takes the index out first; a worker
credential may only add to the set, so its call of retry fails before it changes anything). So a task written into Redis with a worker
credential, a tampered payload or script, a task copied into another job (even one whose hash keeps
the old ``id``), a finished task put back in the queue, and an expired job all fail without running.

**Results.** Each worker credential has a result key of its own, derived from the credential's password
(:func:`result_key`): whoever holds the credential can sign as it, no one else can. The admin registers
the public key under the ACL user's name in ``keys.RESULT_KEYS`` (``gpumesh serve`` for ``worker``,
``gpumesh access add NAME`` for ``worker-NAME``); a worker signs (task id, attempt, SHA-256 of the result,
worker id, user, and the SHA-256 of the task's artifact index, which lists each output file with its
SHA-256: `pull` checks the bytes against it) and stores the proof with the result in the same step. ``gpumesh results`` says
whether each result verifies and who signed it.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from gpumesh.errors import UsageError

CONTEXT = "gpumesh-task-v2"
RESULT_CONTEXT = "gpumesh-result-v2"
INLINE = "ed25519:"  # an inline public key: ed25519:<base64 of the 32 raw bytes>
SPENT_PLACEHOLDER = "*"  # the member a spent set is created with: a set without it was deleted or expired
SPENT_MARGIN = 86400.0  # s a job's spent set outlives the expiry of its signatures
PROOF_FIELD = "result_proof"  # task hash field: the JSON proof a worker stores with its result


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise UsageError(
            "signed jobs need the cryptography package, a dependency of gpumesh-pool: reinstall it"
        ) from None
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


def ensure_keypair(directory: Path, name: str) -> tuple[Path, Path]:
    """NAME.key and NAME.pub in ``directory``, made on first use and kept afterwards (serve's job-signing keys)."""
    priv, pub = directory / f"{name}.key", directory / f"{name}.pub"
    if priv.is_file() and pub.is_file():
        return priv, pub
    if priv.exists() or pub.exists():
        raise UsageError(f"{priv} or {pub} is missing its other half; restore it, or move both away for new keys")
    return generate(directory, name)


def _raw_public(public_key: Any) -> bytes:
    ser = _serialization()
    return bytes(public_key.public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw))


def key_id(public_key: Any) -> str:
    return hashlib.sha256(_raw_public(public_key)).hexdigest()[:16]


def inline(public_key: Any) -> str:
    """A public key as one copy-pasteable word, ``ed25519:<base64>``: what --trust and the registry take."""
    return INLINE + base64.b64encode(_raw_public(public_key)).decode()


def public_key(spec: str | Path) -> Any:
    """An Ed25519 public key from ``ed25519:<base64>`` or from a PEM file's path."""
    ed25519, ser = _crypto(), _serialization()
    text = str(spec).strip()
    if text.startswith(INLINE):
        try:
            raw = base64.b64decode(text[len(INLINE) :], validate=True)
            return ed25519.Ed25519PublicKey.from_public_bytes(raw)
        except (binascii.Error, ValueError):
            raise UsageError(f"{text[:60]!r} is not an Ed25519 public key (ed25519: and 32 bytes in base64)") from None
    try:
        key = ser.load_pem_public_key(Path(text).read_bytes())
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load the trusted key {text}: {exc}") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise UsageError(f"{text} is not an Ed25519 public key")
    return key


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
    """The keys a worker trusts: each a PEM file's path or an inline ``ed25519:<base64>`` key."""

    def __init__(self, specs: list[str] | list[Path] | list[str | Path]) -> None:
        self.keys: dict[str, Any] = {}
        for spec in specs:
            key = public_key(spec)
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
    job_id: str, index: int, script_sha: str, payload: str, timeout: float, max_attempts: int, expires: float,
    project: str = "", outputs: str = "", reuse: bool = False, env: str = "", preload: str = "",
) -> bytes:  # fmt: skip
    """The canonical bytes a task's signature covers (``payload``: the stored payload JSON, hashed here).
    A job with a project or output globs adds the project's tree digest and the globs (their JSON), and a job
    whose tasks share a process per worker (``reuse``) says so: a worker credential cannot point a job at
    another tree, make it bring back other files, nor make its tasks share a process. ``env`` and ``preload``: its
    environment's lock digest and the modules preloaded from it."""
    payload_sha = hashlib.sha256(payload.encode()).hexdigest()
    signed: list[object] = [
        CONTEXT, job_id, index, script_sha, payload_sha, float(timeout), int(max_attempts), float(expires)
    ]  # fmt: skip
    if project or outputs or reuse or env:
        signed += [project, outputs]
    if reuse:
        signed.append("reuse-process")
    if env:  # the environment's lock digest (gpumesh.envs): a worker credential cannot swap the lock
        signed.append(env)
    if preload:  # the modules its warm tasks find imported (comma-separated): nor make them import others
        signed.append(f"preload:{preload}")
    return json.dumps(signed, separators=(",", ":")).encode()


def leased_identity(task_id: str) -> tuple[str, int] | None:
    """(job id, index) of a task, read from its id (its key), the only place a copy cannot keep; None when
    the id is not one submit makes (``<job>-<index>``, the index in canonical decimal)."""
    job_id, _, tail = task_id.rpartition("-")
    if not job_id or not tail.isdigit() or str(int(tail)) != tail:
        return None
    return job_id, int(tail)


# -- attributable results --------------------------------------------------------------------------


def result_key(user: str, password: str) -> Any:
    """The Ed25519 result key of a worker credential: derived (HKDF-SHA256) from its password, per user.

    Redis keeps only a hash of the password (SHA-256, for AUTH), which does not give this key away."""
    ed25519 = _crypto()
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    seed = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"gpumesh-result-key-v1", info=user.encode()).derive(
        password.encode()
    )
    return ed25519.Ed25519PrivateKey.from_private_bytes(seed)


def result_public(user: str, password: str) -> str:
    """What the admin registers for ``user`` in ``keys.RESULT_KEYS``."""
    return inline(result_key(user, password).public_key())


def credential_of(url: str) -> tuple[str, str] | None:
    """(ACL user, password) of a redis:// or rediss:// URL; None when it carries no password."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if parts.scheme not in ("redis", "rediss", "redis+sentinel", "rediss+sentinel") or not parts.password:
        return None
    return unquote(parts.username or "") or "default", unquote(parts.password)


def files_digest(index: str) -> str:
    """What a result proof holds of a task's output files: the SHA-256 of its artifact index as stored
    (the task hash's ``artifacts`` field, which lists each file's SHA-256), '' for a task without any."""
    return hashlib.sha256(index.encode()).hexdigest() if index else ""


def result_message(task_id: str, attempt: int, result: str, worker_id: str, user: str, files: str) -> bytes:
    """The bytes a result proof signs; ``files``: :func:`files_digest` of the task's artifact index."""
    return json.dumps(
        [RESULT_CONTEXT, task_id, int(attempt), hashlib.sha256(result.encode()).hexdigest(), files, worker_id, user],
        separators=(",", ":"),
    ).encode()


class ResultSigner:
    """A worker's signer of its results, from the credential in its broker URL."""

    def __init__(self, user: str, password: str) -> None:
        self.user = user
        self.key = result_key(user, password)

    @classmethod
    def of_url(cls, url: str) -> ResultSigner | None:
        """None when the URL has no password, or without the cryptography package (results go unsigned)."""
        cred = credential_of(url)
        if cred is None:
            return None
        try:
            return cls(*cred)
        except UsageError:
            return None

    def proof(self, task_id: str, attempt: int, result: str, worker_id: str, artifacts: str = "") -> str:
        """The proof stored with the result (task hash field ``result_proof``); ``artifacts``: the artifact
        index (JSON) stored with it, '' for none."""
        files = files_digest(artifacts)
        sig = self.key.sign(result_message(task_id, attempt, result, worker_id, self.user, files))
        proof = {"user": self.user, "worker": worker_id, "attempt": int(attempt), "files": files,
                 "sig": base64.b64encode(sig).decode()}  # fmt: skip
        return json.dumps(proof, separators=(",", ":"))


@functools.lru_cache(maxsize=256)
def _registered_key(spec: str) -> Any:
    """A registered result key, parsed once (a job's rows are checked against a few keys many times)."""
    if not spec.startswith(INLINE):
        raise UsageError("a registered result key is inline (ed25519:BASE64)")
    return public_key(spec)


def verify_result(task_id: str, h: dict[str, str], registry: dict[str, str]) -> tuple[bool | None, str | None]:
    """(verified, signed by) of a stored task: verified is None when the task has no result (not done) or
    the broker registers no result keys at all, True when its proof verifies with the registered key of
    the user it names, else False (no proof, an unregistered user, a result, its artifact index or the
    proof changed since). A task whose output files complete had to drop (their staging expired first:
    ``artifacts_lost``) has no index, so it does not verify: its result lacks the files its worker signed for."""
    if h.get("status") != "done":
        return None, None
    try:
        proof = json.loads(h.get(PROOF_FIELD) or "null")
        user, worker, attempt, sig = proof["user"], proof["worker"], int(proof["attempt"]), proof["sig"]
        files = proof["files"]
        if not all(isinstance(v, str) for v in (user, worker, sig, files)):
            raise TypeError("not text")
    except (ValueError, TypeError, KeyError):
        return (None if not registry else False), None
    if not registry:
        return None, user
    registered = registry.get(user)
    if not registered:
        return False, user
    stored = h.get("artifacts") or ""
    if files_digest(stored) != files:
        # Output files other than those the worker signed for, or none where it signed for some: also when
        # complete had to drop them (artifacts_lost, a field any worker credential can write): not what it made.
        return False, user
    try:
        from cryptography.exceptions import InvalidSignature
    except ImportError:  # cannot tell here
        return None, user

    try:
        _registered_key(registered).verify(
            base64.b64decode(sig, validate=True),
            result_message(task_id, attempt, h.get("result") or "", worker, user, files),
        )
    except (InvalidSignature, ValueError, binascii.Error, UsageError):
        return False, user
    return True, user
