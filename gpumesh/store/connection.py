"""Redis clients for gpumesh, and redis-py's errors turned into gpumesh's one-line ``BrokerError``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Literal, Protocol, cast, overload
from urllib.parse import parse_qs, urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from gpumesh.errors import BrokerError, BrokerUnreachable, UsageError
from gpumesh.store import sentinel, tlspin

SOCKET_TIMEOUT = 5.0  # s a reply may take before the broker counts as unreachable (exit 3 for the CLI)

# What a call retries (after closing its connection) before it gives up: a lost connection, a reply too
# slow, and READONLY, which a primary demoted to a replica answers to writes (a failover, or a managed
# Redis whose address moved to the new primary): nothing was written, and a new connection may reach the
# primary. Through Sentinel, redis-py turns READONLY into a ConnectionError and asks the Sentinels again.
RETRIED: list[type[Exception]] = [redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError]


def mask_url(url: str) -> str:
    """The URL with its password replaced by ***, for logs and messages. The hosts stay as written (a
    Sentinel URL lists several). Everything between ``://`` and the last ``@`` is taken as user and
    password, so a password holding '/', '?' or '#' (which URL parsing would cut short) is masked whole."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, hosts = rest.rpartition("@")
    if not sep or not at:
        return url
    user, colon, _password = userinfo.partition(":")
    if not colon:
        return url  # a user name alone
    return f"{scheme}://{user}:***@{hosts}"


def client(url: str, *, decode: bool, socket_timeout: float, retries: int, health_check: bool = True) -> redis.Redis:
    """A client that gives up after ``retries`` more tries of ``socket_timeout`` each. ``health_check``
    PINGs a connection idle for 15 s before using it (long-lived workers); it doubles the tries.

    A ``redis+sentinel://`` (``rediss+sentinel://``) URL gives the primary's client through the Sentinels
    it lists, which finds the new primary by itself after a failover (see :mod:`gpumesh.store.sentinel`)."""
    retry = Retry(ExponentialBackoff(cap=2.0, base=0.1), retries)
    common: dict[str, Any] = {
        "decode_responses": decode,
        "socket_connect_timeout": 3,
        "socket_timeout": socket_timeout,
        "health_check_interval": 15 if health_check else 0,
        "retry": retry,
        "retry_on_error": list(RETRIED),  # redis-py may add to the list it is given
    }
    if sentinel.is_sentinel(url):
        return sentinel.client(sentinel.parse(url, mask_url(url)), **common)
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise UsageError(
            f"broker URL {mask_url(url)!r} must start with redis://, rediss://, unix://, redis+sentinel:// "
            "or rediss+sentinel://"
        )
    pinned: dict[str, Any] = {}
    try:
        values = parse_qs(urlsplit(url).query).get(tlspin.PARAM)
    except ValueError as exc:
        raise UsageError(f"invalid broker URL {mask_url(url)!r}: {exc}") from None
    if values:  # `serve --tls`'s lines: the broker's CA pinned by its fingerprint
        if not url.startswith("rediss://"):
            raise UsageError(f"broker URL {mask_url(url)!r}: {tlspin.PARAM} needs rediss:// (TLS)")
        if len(values) != 1:
            raise UsageError(f"broker URL {mask_url(url)!r}: give {tlspin.PARAM} once")
        tlspin.parse_fingerprint(values[0])  # a bad one is a usage error now, not at the first command
        pinned["connection_class"] = tlspin.PinnedSSLConnection  # redis-py hands it the ca_fingerprint
    try:
        return redis.Redis.from_url(url, **pinned, **common)
    except ValueError as exc:
        raise UsageError(f"invalid broker URL {mask_url(url)!r}: {exc}") from None


def translate(exc: redis.RedisError, url: str) -> BrokerError:
    """One line for a Redis error, without the password."""
    text = str(exc).replace(urlsplit(url).password or "\0", "***")
    if isinstance(exc, redis.AuthenticationError) or "WRONGPASS" in text or "NOAUTH" in text:
        return BrokerError(f"the broker at {mask_url(url)} refused the credentials ({text}); check the URL's password")
    if "OOM" in text or isinstance(exc, redis.exceptions.OutOfMemoryError):
        return BrokerError(
            f"the broker at {mask_url(url)} is out of memory (maxmemory reached, noeviction) and refused the write; "
            "nothing was written. Free memory (finished jobs) or raise maxmemory"
        )
    if sentinel.is_sentinel(url) and type(exc).__name__ == "MasterNotFoundError":  # redis.sentinel's, loaded lazily
        try:
            parsed = sentinel.parse(url, mask_url(url))
        except UsageError:
            pass
        else:
            return BrokerUnreachable(
                f"cannot reach the broker at {mask_url(url)}: {sentinel.describe_no_primary(text, parsed)}"
            )
    if isinstance(exc, redis.exceptions.ReadOnlyError):
        return BrokerError(
            f"the broker at {mask_url(url)} is a read-only replica ({text}): point the URL at the primary, "
            "or at the Sentinels that know it (redis+sentinel://)"
        )
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        if url.startswith("redis://") and "reset by peer" in text:  # what a TLS-only port does to plain Redis
            return BrokerUnreachable(
                f"the broker at {mask_url(url)} closed the connection ({text}); if it serves TLS "
                "(`gpumesh serve --tls`), use the rediss:// line it printed"
            )
        return BrokerUnreachable(f"cannot reach the broker at {mask_url(url)} ({text}); is Redis running there?")
    return BrokerError(f"the broker at {mask_url(url)} answered an error: {text}")


def command(client: redis.Redis, *args: str) -> Any:
    """A raw command (ACL, CONFIG) for what redis-py types loosely; its answer as redis-py gives it."""
    return client.execute_command(*args)  # type: ignore[no-untyped-call]  # redis-py leaves it untyped


class TextClient(Protocol):
    """The part of redis-py's client that gpumesh calls, typed as a ``decode_responses=True`` client
    answers: ``str``, never ``bytes | str``. The one typed boundary over redis-py: the store layer calls
    Redis through this (see :func:`text`); pipelines answer ``list[Any]`` and are read where they run."""

    def pipeline(self, transaction: bool = True) -> redis.client.Pipeline: ...
    def ping(self) -> bool: ...
    def close(self) -> None: ...
    def time(self) -> tuple[int, int]: ...
    def config_get(self, pattern: str) -> dict[str, str]: ...
    def get(self, name: str) -> str | None: ...
    def set(self, name: str, value: str | int | float, *, nx: bool = False, px: int | None = None) -> bool | None: ...
    def exists(self, *names: str) -> int: ...
    def pexpire(self, name: str, time: int) -> bool: ...
    def hget(self, name: str, key: str) -> str | None: ...
    def hset(self, name: str, key: str, value: str | int | float) -> int: ...
    def hgetall(self, name: str) -> dict[str, str]: ...
    def hmget(self, name: str, *keys: str) -> list[str | None]: ...
    def lrange(self, name: str, start: int, end: int) -> list[str]: ...
    def llen(self, name: str) -> int: ...
    def lpush(self, name: str, *values: str) -> int: ...
    def blpop(self, keys: list[str], timeout: float = 0) -> tuple[str, str] | None: ...
    def zadd(self, name: str, mapping: Mapping[str, float], *, nx: bool = False) -> int: ...
    def zrem(self, name: str, *values: str) -> int: ...
    def zscore(self, name: str, value: str) -> float | None: ...
    @overload
    def zrange(self, name: str, start: int, end: int) -> list[str]: ...
    @overload
    def zrange(self, name: str, start: int, end: int, *, withscores: Literal[True]) -> list[tuple[str, float]]: ...
    def zrevrange(self, name: str, start: int, end: int) -> list[str]: ...
    def zrangebyscore(
        self, name: str, min: float | str, max: float | str, start: int | None = None, num: int | None = None
    ) -> list[str]: ...
    def xread(
        self, streams: Mapping[str, str], count: int | None = None, block: int | None = None
    ) -> list[tuple[str, list[tuple[str, dict[str, str]]]]]: ...
    def xrevrange(
        self, name: str, max: str = "+", min: str = "-", count: int | None = None
    ) -> list[tuple[str, dict[str, str]]]: ...
    def xrange(
        self, name: str, min: str = "-", max: str = "+", count: int | None = None
    ) -> list[tuple[str, dict[str, str]]]: ...
    def scan_iter(self, match: str | None = None, count: int | None = None) -> Iterator[str]: ...


def text(client: redis.Redis) -> TextClient:
    """A ``decode_responses=True`` client seen through :class:`TextClient`."""
    if not client.get_connection_kwargs().get("decode_responses"):
        raise TypeError("text() needs a client made with decode_responses=True")
    return cast(TextClient, client)
