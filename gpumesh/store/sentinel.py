"""A broker that fails over: ``redis+sentinel://`` URLs (DESIGN §7), through redis-py's Sentinel client.

``redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]…]/SERVICE[/DB][?OPTIONS]``, and
``rediss+sentinel://`` for TLS. HOST:PORT are the Sentinels (port 26379 when left out), SERVICE the name
they monitor the primary under (``sentinel monitor SERVICE …``), DB the database (0). USER and PASSWORD
are the broker's: the primary's (and, after a failover, the promoted replica's) ACL user and password.

The Sentinels themselves are asked without credentials (their default), unless the URL ends with
``?sentinel_auth=broker``: then they get the broker's USER and PASSWORD too (Sentinels configured with
``requirepass`` set to the broker's password, as many charts do). With ``rediss+sentinel://`` both the
primary and the Sentinels are spoken to over TLS; ``ssl_*`` options (``ssl_ca_certs=FILE``,
``ssl_cert_reqs=none``, …) apply to both, as redis-py takes them.

The client is :meth:`redis.sentinel.Sentinel.master_for`'s: its connection pool asks the Sentinels for
the primary's address at every new connection, drops idle connections when the address changes, and turns
a ``READONLY`` answer (a demoted primary still reached) into a ConnectionError that closes the connection,
so it is retried, like a lost connection, against whichever server the Sentinels name then.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode

import redis
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.retry import Retry

from gpumesh.errors import UsageError

SCHEMES = ("redis+sentinel://", "rediss+sentinel://")
DEFAULT_PORT = 26379
AUTH_PARAM = "sentinel_auth"
SENTINEL_TIMEOUT = 3.0  # s a Sentinel may take to answer (it answers from memory, never blocks)
# A primary gone while its Sentinels still monitor the service: they call it down after their
# down-after-milliseconds, then agree and promote a replica, within seconds more (about 2 s past a 1 s
# down-after on one loopback VM). A command that finds no primary waits that long, never past the cap.
FAILOVER_MARGIN = 10.0
FAILOVER_WAIT_MAX = 60.0


def is_sentinel(url: str) -> bool:
    return url.startswith(SCHEMES)


@dataclass(frozen=True)
class SentinelURL:
    """A parsed ``redis+sentinel://`` URL."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    sentinel_auth: bool = False
    options: dict[str, Any] = field(default_factory=dict)  # ssl_* options, as redis-py's parse_url types them


def _host_port(item: str, bad: Any) -> tuple[str, int]:
    """(host, port) of ``HOST[:PORT]`` or ``[IPV6][:PORT]``."""
    if item.startswith("["):
        host, closed, rest = item[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise bad(f"Sentinel address {item!r} is not HOST:PORT")
        sep, port_text = rest[:1], rest[1:]
    else:
        host, sep, port_text = item.partition(":")
    if not host:
        raise bad(f"Sentinel address {item!r} has no host")
    if not sep:
        return unquote(host), DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise bad(f"Sentinel address {item!r}: the port must be a number from 1 to 65535")
    return unquote(host), int(port_text)


def parse(url: str, shown: str) -> SentinelURL:
    """The URL's parts; a UsageError (one line, naming the URL as ``shown``: its password masked) when
    it is not of the form above."""

    def bad(why: str) -> UsageError:
        return UsageError(
            f"invalid Sentinel URL {shown!r}: {why} "
            "(the form is redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB])"
        )

    tls = url.startswith("rediss+")
    after = url.split("://", 1)[1]
    if "@" in after and "@" not in after.partition("/")[0].partition("?")[0].partition("#")[0]:
        # a '/', '?' or '#' before the '@': part of the password would be read as a host; say so without it
        raise bad("the password has a '/', '?' or '#': percent-encode them (%2F, %3F, %23)")
    rest, _, fragment = after.partition("#")
    if fragment:
        raise bad("a URL fragment (#...) means nothing here")
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username, password = unquote(user) or None, (unquote(pw) or None) if colon else None
    if not hosts:
        raise bad("no Sentinel address")
    sentinels = tuple(_host_port(item, bad) for item in hosts.split(","))
    service, db = _service_db(path if slash else "", bad)
    auth, options = _options(query, tls, bad)
    return SentinelURL(sentinels, service, db, username, password, tls, auth, options)


def _service_db(path: str, bad: Any) -> tuple[str, int]:
    parts = path.split("/")
    if parts[-1] == "" and len(parts) > 1:
        parts.pop()  # a trailing slash
    if not parts[0]:
        raise bad("no service name (the name the Sentinels monitor the primary under)")
    if len(parts) > 2:
        raise bad(f"too many path parts {path!r}")
    if len(parts) == 2 and not parts[1].isdigit():
        raise bad(f"the database must be a number, got {parts[1]!r}")
    return unquote(parts[0]), int(parts[1]) if len(parts) == 2 else 0


def _options(query: str, tls: bool, bad: Any) -> tuple[bool, dict[str, Any]]:
    """(sentinel_auth, the ssl_* options typed as redis-py's parse_url types them)."""
    auth = False
    options: dict[str, Any] = {}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise bad(f"unreadable options {query!r}") from None
    for name, value in pairs:
        if name == AUTH_PARAM:
            if value not in ("broker", "none"):
                raise bad(f"{AUTH_PARAM} is broker (send the broker's credentials to the Sentinels) or none")
            auth = value == "broker"
        elif name == "ca_fingerprint":
            raise bad("ca_fingerprint pins a `gpumesh serve --tls` broker; with Sentinels give ssl_ca_certs=FILE")
        elif name.startswith("ssl_") and tls:
            try:
                options.update(parse_url(f"redis://x/?{urlencode({name: value})}"))  # type: ignore[no-untyped-call]
            except ValueError as exc:
                raise bad(str(exc)) from None
            options.pop("host", None)
        elif name.startswith("ssl_"):
            raise bad(f"{name} is a TLS option: use rediss+sentinel://")
        else:
            raise bad(f"unknown option {name!r} (known: {AUTH_PARAM}, and ssl_* with rediss+sentinel://)")
    return auth, options


def client(parsed: SentinelURL, **connection: Any) -> redis.Redis:
    """The primary's client, through the Sentinels. ``connection``: the keyword arguments of every
    connection to the primary (timeouts, retry, decode_responses), as ``redis.Redis`` takes them."""
    from redis.sentinel import Sentinel  # here: every other command imports this module, not redis.sentinel

    tls: dict[str, Any] = {"ssl": True, **parsed.options} if parsed.tls else {}
    sentinel_kwargs: dict[str, Any] = {
        "socket_connect_timeout": min(float(connection.get("socket_connect_timeout", SENTINEL_TIMEOUT)), 3.0),
        "socket_timeout": SENTINEL_TIMEOUT,
        "retry": Retry(NoBackoff(), 0),  # one Sentinel down: ask the next at once, not the same one again
        **tls,
    }
    if parsed.sentinel_auth:
        sentinel_kwargs.update(username=parsed.username, password=parsed.password)
    # redis-py before 8 leaves Sentinel untyped; 8 types it: the ignore holds for both
    manager = Sentinel(list(parsed.sentinels), sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call,unused-ignore]
    primary: redis.Redis = manager.master_for(  # type: ignore[no-untyped-call,unused-ignore]
        parsed.service,
        db=parsed.db,
        username=parsed.username,
        password=parsed.password,
        **tls,
        **connection,
    )
    return primary


def describe_no_primary(text: str, parsed: SentinelURL) -> str:
    """Why no primary was found, for :func:`gpumesh.store.connection.translate`. redis-py's message lists
    each Sentinel's client (a long repr) and its error by name: only the names are kept."""
    where = ", ".join(f"{h}:{p}" for h, p in parsed.sentinels)
    errors = sorted(set(re.findall(r" - (\w+):(\w+)", text)))
    said = ", ".join(f"{kind}: {name}" for kind, name in errors) or text[:200]
    if any(m in text for m in ("Authentication required", "NOAUTH", "WRONGPASS", "AuthenticationError")):
        hint = (
            "the Sentinels refused to answer without a password: if theirs is the broker's, add "
            f"?{AUTH_PARAM}=broker to the URL"
            if not parsed.sentinel_auth
            else "the Sentinels refused the broker's credentials"
        )
        return f"{hint} (Sentinels {where}: {said})"
    return (
        f"no Sentinel of {where} names a healthy primary for service {parsed.service!r} ({said}); "
        "are the Sentinels running, is the service name right, is a failover under way?"
    )


def failover_wait(primary: redis.Redis) -> float:
    """Seconds to wait for a failover when ``primary`` (a :func:`client`) cannot be reached: the Sentinels'
    down-after time for its service plus FAILOVER_MARGIN, at most FAILOVER_WAIT_MAX; 0 when no Sentinel
    answers or none monitors the service (nothing will promote a replica: say so at once)."""
    pool = primary.connection_pool
    manager, service = getattr(pool, "sentinel_manager", None), getattr(pool, "service_name", None)
    if manager is None or service is None:
        return 0.0
    for guard in manager.sentinels:
        try:
            state = guard.sentinel_masters().get(service)
        except redis.RedisError:
            continue
        if state:
            down_after = float(state.get("down-after-milliseconds", 30_000)) / 1000
            return min(down_after + FAILOVER_MARGIN, FAILOVER_WAIT_MAX)
    return 0.0
