"""The worker's heartbeat thread on a beat that keeps failing: an error nothing expects is said once, in one line
with no traceback, and after a bound of them in a row the worker stops for good; a broker out of reach is
retried for as long as it takes."""

from __future__ import annotations

import logging
import threading

import pytest
import redis

from gpumesh.worker.heartbeat import UNEXPECTED_BOUND, Heartbeat

from ..conftest import wait_until

pytestmark = pytest.mark.faults


class Beats:
    """A beat that raises what ``errors`` holds, in turn, then succeeds; and what the heartbeat told the worker."""

    def __init__(self, *errors: Exception | None) -> None:
        self.errors = list(errors)
        self.calls = 0
        self.gave_up: list[str] = []
        self.given_up = threading.Event()

    def beat(self) -> None:
        self.calls += 1
        error = self.errors[min(self.calls, len(self.errors)) - 1] if self.errors else None
        if error is not None:
            raise error

    def give_up(self, why: str) -> None:
        self.gave_up.append(why)
        self.given_up.set()

    def refused(self, exc: Exception) -> None:
        raise AssertionError(f"refused: {exc}")


def test_a_beat_that_keeps_failing_unexpectedly_stops_the_worker_once_with_one_line(
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.DEBUG, logger="gpumesh.worker")
    beats = Beats(TypeError("'NoneType' object is not subscriptable"))
    hb = Heartbeat(0.01, 30.0, beats.beat, refused=beats.refused, give_up=beats.give_up)
    hb.start()
    assert beats.given_up.wait(10), "the heartbeat never gave up"
    hb.stop(timeout=5)
    assert beats.calls == UNEXPECTED_BOUND, "beats went on after the heartbeat gave up"
    (why,) = beats.gave_up
    assert f"failed {UNEXPECTED_BOUND} times in a row" in why and "TypeError: 'NoneType'" in why, why
    said = [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert [rec.getMessage().split(" (")[0] for rec in said] == ["heartbeat error"], said
    assert all(rec.exc_info is None for rec in said), "a traceback was logged above DEBUG"
    assert hb.halted


def test_a_beat_that_gets_through_resets_the_count_and_an_unreachable_broker_never_stops_it(
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.INFO, logger="gpumesh.worker")
    odd = ValueError("bad field")
    gone = redis.ConnectionError("Connection refused")
    errors = [*[odd] * (UNEXPECTED_BOUND - 1), None, *[odd] * (UNEXPECTED_BOUND - 1), *[gone] * 3 * UNEXPECTED_BOUND]
    beats = Beats(*errors, None)
    hb = Heartbeat(0.01, 30.0, beats.beat, refused=beats.refused, give_up=beats.give_up)
    hb.start()
    try:
        wait_until(lambda: beats.calls > len(errors) + 2, timeout=10, what="the beats to get through again")
    finally:
        hb.stop(timeout=5)
    assert beats.gave_up == []
    lines = [rec.getMessage() for rec in caplog.records]
    assert sum(line.startswith("heartbeat error") for line in lines) == 2, lines
    assert sum(line.startswith("heartbeat failed (Connection refused)") for line in lines) == 1, lines
    assert "broker reachable again" in lines, lines
