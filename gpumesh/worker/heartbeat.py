"""The worker's heartbeat thread: one beat every interval, and what the worker learns from how beats go.

The beat itself (renew the registration and the current lease, hear of a cancel, take a turn as reaper) is the
worker's; this part owns the thread, its stop, and the record of failures: a broker out of reach is said once
and retried every beat; an error nothing expects (a bug, data no beat can read) is said once in one line and
retried, and after ``UNEXPECTED_BOUND`` of them in a row the worker stops for good, since a worker whose
heartbeat cannot run loses every lease it takes. ``stalled`` tells the worker to take no new task meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from gpumesh.worker.rqworker import REFUSED

log = logging.getLogger("gpumesh.worker")

UNEXPECTED_BOUND = 5  # unexpected errors in a row after which the worker stops for good


class Heartbeat:
    """Calls ``beat`` every ``interval`` seconds on a thread of its own, from :meth:`start` to :meth:`stop`.
    ``beat`` calls :meth:`succeeded` once the broker took it. ``refused(exc)``: the broker refused the worker's
    credentials; ``give_up(why)``: unexpected errors reached the bound (both stop the worker for good)."""

    def __init__(
        self,
        interval: float,
        lease_ttl: float,
        beat: Callable[[], None],
        *,
        refused: Callable[[Exception], None],
        give_up: Callable[[str], None],
        bound: int = UNEXPECTED_BOUND,
    ) -> None:
        self.interval = interval
        self.lease_ttl = lease_ttl
        self._beat = beat
        self._refused = refused
        self._give_up = give_up
        self.bound = bound
        self.ok_at = time.monotonic()  # when a beat last reached the broker (renewed registration and lease)
        self.unexpected = 0  # unexpected errors since the last beat that went through
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False  # the broker is out of reach (said once)
        self._stalled_said = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="gpumesh-heartbeat", daemon=True)
        self._thread.start()

    def halt(self) -> None:
        """No beat after the one running now (callable from the heartbeat thread itself)."""
        self._stop.set()

    def stop(self, timeout: float = 5.0) -> None:
        """Halt, and wait up to ``timeout`` seconds for the beat running now."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds; True once the heartbeat was halted (other loops of the worker end
        with it)."""
        return self._stop.wait(timeout)

    @property
    def halted(self) -> bool:
        return self._stop.is_set()

    def succeeded(self, at: float) -> None:
        """A beat sent at ``at`` (monotonic) reached the broker."""
        self.ok_at = at

    def out_of_touch(self) -> bool:
        """Whether no beat has reached the broker for a lease TTL."""
        return time.monotonic() - self.ok_at > self.lease_ttl

    def stalled(self) -> bool:
        """:meth:`out_of_touch`, said once each way: a worker whose heartbeat is stuck cannot renew a lease, so
        each task it took would be leased again elsewhere (and this attempt killed) at the TTL, every attempt
        spent here while healthy workers idle. It takes no new task until a beat gets through."""
        stalled = self.out_of_touch()
        if stalled and not self._stalled_said:
            log.warning(
                "no heartbeat has succeeded for %.0f s, longer than the lease TTL (%g s): taking no new task "
                "until one does",
                time.monotonic() - self.ok_at,
                self.lease_ttl,
            )
        elif not stalled and self._stalled_said:
            log.info("heartbeats succeed again: taking work")
        self._stalled_said = stalled
        return stalled

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.once()

    def once(self) -> None:
        """One beat, and what its outcome means (the thread's turn; callable on its own)."""
        try:
            self._beat()
        except REFUSED as exc:
            self._refused(exc)
        except redis.RedisError as exc:
            if not self._failing:
                log.warning("heartbeat failed (%s); retrying every %.1fs", exc, self.interval)
            self._failing = True
        except Exception as exc:  # noqa: BLE001 - counted, said once, and bounded: see the module's docstring
            self._unexpected(exc)
        else:
            if self._failing:
                log.info("broker reachable again")
            if self.unexpected:
                log.info("heartbeat works again after %d unexpected errors", self.unexpected)
            self._failing = False
            self.unexpected = 0

    def _unexpected(self, exc: Exception) -> None:
        self.unexpected += 1
        what = f"{type(exc).__name__}: {str(exc)[:200]}"
        log.debug("heartbeat error", exc_info=exc)
        if self.unexpected >= self.bound:
            self.halt()
            self._give_up(f"the heartbeat failed {self.unexpected} times in a row ({what})")
        elif self.unexpected == 1:
            log.warning(
                "heartbeat error (%s); retrying every %.1fs, stopping the worker after %d in a row",
                what,
                self.interval,
                self.bound,
            )
