"""Redis clients for gpumesh, and redis-py's errors turned into gpumesh's one-line ``BrokerError``."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from gpumesh.errors import BrokerError, UsageError


def mask_url(url: str) -> str:
    """The URL with its password replaced by ***, for logs and messages."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def client(url: str, *, decode: bool, socket_timeout: float, retries: int) -> redis.Redis:
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise UsageError(f"broker URL {mask_url(url)!r} must start with redis://, rediss:// or unix://")
    try:
        return redis.Redis.from_url(
            url,
            decode_responses=decode,
            socket_connect_timeout=3,
            socket_timeout=socket_timeout,
            health_check_interval=15,
            retry=Retry(ExponentialBackoff(cap=2.0, base=0.1), retries),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        )
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
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return BrokerError(f"cannot reach the broker at {mask_url(url)} ({text}); is Redis running there?")
    return BrokerError(f"the broker at {mask_url(url)} answered an error: {text}")
