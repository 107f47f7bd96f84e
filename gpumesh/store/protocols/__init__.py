"""The protocols a broker serves: this release's and the one before it, side by side.

Each protocol is one Redis Functions library. This release's is assembled from ``store/lua`` by
``scripts.library()`` and named by its protocol (``gpumesh_p<N>``), so two releases that speak the same
protocol call the same functions whatever their bytes. The previous protocol's library is kept here as a
frozen file, ``<N>.lua``: the exact text that release loads (``python -m gpumesh.store.protocols.freeze REV``
makes it from git history), so that `gpumesh serve` and `gpumesh access load-functions` load it beside this
release's and a worker, submitter or dashboard one protocol behind keeps working on the same jobs.

Protocol 28 (gpumesh 0.2.0) predates protocol numbers: its library is named by a hash of its code.

What makes "one back" safe: a protocol's changes to the contract are additive (new KEYS and ARGV after the
old ones, new fields, new functions), so the previous library's functions work on the same data, and a
client of this release facing a broker that serves only the previous protocol calls that library instead
(``scripts.Scripts``). A change that cannot be additive sets PREVIOUS_CALLABLE false: such a client then
exits at start naming both protocols.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import redis

from gpumesh._version import OLDEST_PROTOCOL, PROTOCOL, __version__
from gpumesh.store import keys

# Whether this release's client may call the previous protocol's functions (its contract changes are additive).
PREVIOUS_CALLABLE = True

# The releases each frozen protocol comes from (git revision, package version), for messages and the record.
FROZEN_FROM = {28: ("4172a21", "0.2.0")}

_NAMED = re.compile(r"#!lua name=(gpumesh_[A-Za-z0-9_]+)")


@dataclass(frozen=True)
class Library:
    """One protocol's functions: ``name`` is what FUNCTION LOAD keeps it as (functions ``<name>_<script>``)."""

    protocol: int
    name: str
    code: str


@cache
def frozen(protocol: int) -> Library | None:
    """The previous protocol's library as its release loads it, None when this release keeps no copy of it."""
    path = resources.files(__package__) / f"{protocol}.lua"
    if not path.is_file():
        return None
    code = path.read_text()
    named = _NAMED.match(code)
    if named is None:
        raise ValueError(f"{path} does not start with '#!lua name=gpumesh_...'")
    return Library(protocol, named.group(1), code)


def served_before() -> list[Library]:
    """The older protocols this release serves beside its own (newest first): the frozen copies it keeps."""
    found = (frozen(p) for p in range(PROTOCOL - 1, OLDEST_PROTOCOL - 1, -1))
    return [lib for lib in found if lib is not None]


def fallback() -> Library | None:
    """The library a client of this release calls when the broker does not serve this protocol, if any."""
    if not PREVIOUS_CALLABLE:
        return None
    return frozen(PROTOCOL - 1)


def protocol_of(library: str) -> int | None:
    """The protocol a gpumesh library's name says (``gpumesh_p29``), or the frozen one it is; None if unknown."""
    if m := re.fullmatch(r"gpumesh_p(\d+)", library):
        return int(m.group(1))
    return next((lib.protocol for lib in served_before() if lib.name == library), None)


def record(client: Any, served: list[Library]) -> None:
    """Say what the broker serves (keys.PROTOCOLS), for clients that it does not serve and for ``doctor``."""
    with client.pipeline(transaction=True) as p:
        p.delete(keys.PROTOCOLS)
        p.hset(keys.PROTOCOLS, mapping={"version": __version__, **{str(lib.protocol): lib.name for lib in served}})
        p.execute()


def served_by(client: Any) -> tuple[list[int], str]:
    """(protocols the broker says it serves, the gpumesh version that loaded them): ([], '') for a broker
    prepared by a release that keeps no record (protocol 28 and before) or never prepared."""
    got = client.hgetall(keys.PROTOCOLS) or {}
    got = {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v) for k, v in got.items()
    }
    return sorted(int(k) for k in got if k.isdigit()), str(got.get("version", ""))


def present(client: Any) -> list[int]:
    """Which of the protocols this release knows (its own and the frozen ones) the broker has functions for,
    asked of the functions themselves (any credential may: FCALL_RO of each library's ``_version``)."""
    names = {PROTOCOL: f"gpumesh_p{PROTOCOL}", **{lib.protocol: lib.name for lib in served_before()}}
    found = []
    for protocol, name in sorted(names.items()):
        try:
            client.fcall_ro(f"{name}_version", 0)
        except redis.ResponseError:
            continue
        found.append(protocol)
    return found


def span(protocols: list[int]) -> str:
    return f"{protocols[0]}" if len(protocols) == 1 else f"{protocols[0]}-{protocols[-1]}"


def unserved_message(client: Any, lib: str) -> str:
    """One line for a client whose protocol the broker does not serve, that may not load it: both sides'
    versions, and which side to upgrade (or, when the broker should serve it, how to make it)."""
    ours = [PROTOCOL] + ([fb.protocol] if (fb := fallback()) else [])
    mine = f"this gpumesh {__version__} speaks protocol {PROTOCOL}" + (f" (and {ours[1]})" if len(ours) > 1 else "")
    served, version = served_by(client) if client is not None else ([], "")
    by = f" (gpumesh {version})" if version else ""
    if served and min(served) > PROTOCOL:
        return (
            f"the broker serves gpumesh protocol {span(served)}{by}; {mine}, too old for it: upgrade gpumesh on this "
            "machine (the way it was installed), then start again"
        )
    if served and max(served) < min(ours):
        return (
            f"the broker serves gpumesh protocol {span(served)}{by}; {mine}, too new for it: upgrade the broker's "
            "gpumesh and restart `gpumesh serve` (it serves one protocol back, so the older machines keep working)"
        )
    also = f", and protocol {fb.protocol}'s {fb.name}" if fb else ""
    why = (
        ""
        if served
        else f" (its functions were lost, or it runs gpumesh older than {FROZEN_FROM.get(min(ours), ('', __version__))[1]})"
    )
    return (
        f"the broker lacks gpumesh's Redis functions (library {lib}{also}) and this credential may not load "
        f"them{why}: restart `gpumesh serve` with this gpumesh or newer (it loads them at every start), or run "
        "`gpumesh access load-functions --url ADMIN_URL`"
    )


def of_registration(protocol: str | None, version: str | None) -> int | None:
    """The protocol a worker's registration says it speaks; for one that predates the field, its release's
    (FROZEN_FROM), else None."""
    if protocol and protocol.isdigit():
        return int(protocol)
    return next((p for p, (_, v) in FROZEN_FROM.items() if v == version), None)


def in_use(client: Any) -> dict[str, list[str]]:
    """The gpumesh libraries live workers registered that they call (library -> worker ids). A registration
    that names none calls its protocol's (``gpumesh_p<N>``), or, naming no protocol either, predates both
    fields: protocol 28's frozen library."""
    ids = [w.decode() if isinstance(w, bytes) else w for w in client.zrange(keys.WORKERS, 0, -1)]
    with client.pipeline(transaction=False) as p:
        for w in ids:
            p.hmget(keys.worker(w), "library", "protocol", "version")
        rows = p.execute()
    older = frozen(28)
    out: dict[str, list[str]] = {}
    for w, row in zip(ids, rows):
        library, protocol, version = (v.decode() if isinstance(v, bytes) else v for v in row)
        if version is None:  # expired: not live
            continue
        name = library or (f"gpumesh_p{protocol}" if protocol else older.name if older else "")
        if name:
            out.setdefault(name, []).append(w)
    return out
