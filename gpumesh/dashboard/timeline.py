"""The timeline of a job's attempts as SVG: one lane per worker (strongest on top), one bar per attempt.

A pure function of its inputs (no Redis, no clock), so that it is tested without a broker and the same
text serves the timeline page (inline) and ``timeline.svg``. Every string in it comes from workers and
tasks, so every one is escaped; colours are presentation attributes, not styles, which the dashboard's
Content-Security-Policy would block in the standalone SVG.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from html import escape as _html_escape
from typing import Protocol

# Each outcome a hue of its own (retried, lost and handed back were three oranges): no two closer than 25 in
# CIELAB ΔE76; and the outcomes that call for a look carry a pattern too, for readers who cannot tell
# the hues apart (red failed from green done, the commonest confusion).
OUTCOME_COLOURS = {
    "running": "#2f6fdd",
    "done": "#2e9e4f",
    "failed": "#d23b3b",
    "retried": "#e69f00",
    "lost": "#a0529a",
    "handed back": "#17becf",
    "cancelled": "#8a8a8a",
    "superseded": "#cfcfcf",
}
OUTCOME_MARKS = {"failed": "cross", "retried": "diagonal", "lost": "dots", "handed back": "horizontal"}  # else plain
_MARKS = {  # white marks drawn over the outcome's colour, in a 6 px tile
    "diagonal": ('patternTransform="rotate(45)"', '<line x1="0" y1="0" x2="0" y2="6" stroke-width="2"/>'),
    "cross": ('patternTransform="rotate(45)"',
              '<line x1="0" y1="0" x2="0" y2="6" stroke-width="1.5"/><line x1="0" y1="0" x2="6" y2="0" stroke-width="1.5"/>'),
    "horizontal": ("", '<line x1="0" y1="3" x2="6" y2="3" stroke-width="2"/>'),
    "dots": ("", '<circle cx="3" cy="3" r="1.4" stroke="none" fill="#ffffff"/>'),
}  # fmt: skip
UNKNOWN_COLOUR = "#555555"
WIDTH = 1000  # px of the whole drawing
LABEL_W = 190  # px of the lane labels on the left
LANE_H = 26
BAR_H = 18
AXIS_H = 28  # px above the first lane: the time axis
LEGEND_H = 30
MIN_BAR = 2  # px: an attempt of a few milliseconds is still visible
MAX_LANES = 200  # the lanes drawn (the workers with most attempts); the rest are counted below the drawing
MAX_BARS = 20_000  # the attempts drawn (the newest): the SVG of 50,000 is 15 MB
XML_ILLEGAL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")  # not even escaped: no XML may hold them
STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 28800, 86400)


def escape(text: str) -> str:
    """Escaped for XML text and attributes, and without the control characters XML cannot hold at all (a
    worker named with one would make the standalone SVG unreadable)."""
    return _html_escape(XML_ILLEGAL.sub("\ufffd", text))


class AttemptLike(Protocol):
    """What is drawn of one attempt: gpumesh.models.Attempt, as ``Job.attempts()`` returns it."""

    @property
    def index(self) -> int: ...
    @property
    def task_id(self) -> str: ...
    @property
    def attempt(self) -> int: ...
    @property
    def worker(self) -> str: ...
    @property
    def copy(self) -> str: ...
    @property
    def started_at(self) -> float | None: ...
    @property
    def ended_at(self) -> float | None: ...
    @property
    def outcome(self) -> str: ...
    @property
    def kind(self) -> str | None: ...


@dataclass(frozen=True)
class Lane:
    """A worker as its lane shows it: id, the name people know it by, its benchmark score (None: it has
    left the mesh, and its lane goes to the bottom)."""

    worker: str
    name: str
    score: float | None = None


def outcome_class(outcome: str) -> str:
    """``outcome-done``; an outcome with a space ("handed back") is one class: ``outcome-handed-back``."""
    return "outcome-" + re.sub(r"[^a-z0-9]+", "-", outcome.lower()).strip("-")


def _lanes(attempts: Sequence[AttemptLike], known: Iterable[Lane]) -> list[Lane]:
    """The workers that ran an attempt, strongest first; those no longer registered after them, by id."""
    by_id = {lane.worker: lane for lane in known}
    lanes = [by_id.get(w, Lane(w, w)) for w in dict.fromkeys(a.worker for a in attempts)]
    return sorted(lanes, key=lambda lane: (lane.score is None, -(lane.score or 0.0), lane.name, lane.worker))


def _step(span: float) -> int:
    """Seconds between ticks: at most about 8 over ``span``."""
    return next((s for s in STEPS if span / s <= 8), STEPS[-1] * math.ceil(span / (8 * STEPS[-1])))


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}:{s % 60:02d}"
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def outcome_fill(outcome: str) -> str:
    """The fill of an outcome's bars and legend key: its pattern (``url(#fill-…)``) or its plain colour."""
    if outcome in OUTCOME_MARKS:
        return f"url(#fill-{outcome_class(outcome).removeprefix('outcome-')})"
    return OUTCOME_COLOURS.get(outcome, UNKNOWN_COLOUR)


def _patterns() -> list[str]:
    """The tiles of the patterned outcomes: the outcome's colour, white marks over it."""
    out = []
    for outcome, mark in OUTCOME_MARKS.items():
        transform, shapes = _MARKS[mark]
        out.append(
            f'<pattern id="{outcome_fill(outcome)[5:-1]}" data-mark="{mark}" width="6" height="6" '
            f'patternUnits="userSpaceOnUse" {transform}><rect width="6" height="6" fill="{OUTCOME_COLOURS[outcome]}"/>'
            f'<g stroke="#ffffff" stroke-opacity="0.75">{shapes}</g></pattern>'
        )
    return out


def _attempt_rect(a: AttemptLike, x: float, y: float, w: float, seconds: float, lane: Lane) -> str:
    colour = OUTCOME_COLOURS.get(a.outcome, UNKNOWN_COLOUR)
    backup = a.copy == "backup"
    look = (
        f'fill="url(#hatch)" stroke="{colour}" stroke-width="2" stroke-dasharray="4 2"'
        if backup
        else f'fill="{outcome_fill(a.outcome)}" stroke="#ffffff" stroke-width="0.5"'
    )
    kind = f", {a.kind}" if a.kind else ""
    tip = (
        f"task {a.index} ({a.task_id}), attempt {a.attempt}{' (backup copy)' if backup else ''}\n"
        f"worker {lane.name} ({a.worker})\n{a.outcome}{kind}, {seconds:.1f} s"
    )
    return (
        f'<rect class="attempt {escape(outcome_class(a.outcome))}{" backup" if backup else ""}" '
        f'data-task="{a.index}" data-attempt="{a.attempt}" data-copy="{escape(a.copy)}" '
        f'data-outcome="{escape(a.outcome)}" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{BAR_H}" rx="2" '
        f"{look}><title>{escape(tip)}</title></rect>"
    )


def _axis(t0: float, span: float, scale: float, height: float) -> list[str]:
    step = _step(span)
    out = [
        f'<g class="axis"><line x1="{LABEL_W}" y1="{AXIS_H - 6}" x2="{WIDTH - 10}" y2="{AXIS_H - 6}" stroke="#999"/>'
    ]
    for i in range(int(span // step) + 1):
        x = LABEL_W + i * step * scale
        out.append(f'<line x1="{x:.1f}" y1="{AXIS_H - 10}" x2="{x:.1f}" y2="{height}" stroke="#e4e4e4"/>')
        out.append(f'<text x="{x:.1f}" y="{AXIS_H - 13}" font-size="11" text-anchor="middle" fill="#444">'
                   f"{escape(_clock(i * step))}</text>")  # fmt: skip
    out.append("</g>")
    return out


def _legend(y: float) -> list[str]:
    out = [f'<g class="legend" transform="translate({LABEL_W},{y:.0f})">']
    x = 0
    names = [*OUTCOME_COLOURS, "backup copy"]
    for name in names:
        fill = 'fill="url(#hatch)" stroke="#444" stroke-dasharray="4 2"' if name == "backup copy" else (
            f'fill="{outcome_fill(name)}"')  # fmt: skip
        out.append(f'<g class="key" data-outcome="{escape(name)}"><rect x="{x}" y="2" width="18" height="14" {fill}/>')
        out.append(f'<text x="{x + 22}" y="14" font-size="11" fill="#333">{escape(name)}</text></g>')
        x += 30 + 7 * len(name)
    out.append("</g>")
    return out


def render(attempts: Sequence[AttemptLike], workers: Iterable[Lane], now: float) -> str:
    """The SVG text (``<svg id="timeline">``) for these attempts; a running one ends at ``now`` (epoch s,
    the broker's clock). ``workers`` names and ranks the lanes; a worker not among them gets a lane too.
    An attempt whose start was not recorded cannot be placed and is left out."""
    attempts = [a for a in attempts if a.started_at is not None]
    attempts.sort(key=lambda a: a.started_at or 0.0)
    left_out = max(0, len(attempts) - MAX_BARS)
    attempts = attempts[left_out:]
    by_worker: dict[str, list[AttemptLike]] = {}
    for a in attempts:
        by_worker.setdefault(a.worker, []).append(a)
    lanes = _lanes(attempts, workers)
    if len(lanes) > MAX_LANES:
        busiest = set(sorted(by_worker, key=lambda w: -len(by_worker[w]))[:MAX_LANES])
        lanes = [lane for lane in lanes if lane.worker in busiest]
        kept = [a for a in attempts if a.worker in busiest]
        left_out += len(attempts) - len(kept)
        attempts = kept
    height = AXIS_H + max(1, len(lanes)) * LANE_H + LEGEND_H
    head = [
        f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" role="img" aria-label="attempts by worker">',
        '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
        '<rect width="6" height="6" fill="#ffffff"/><line x1="0" y1="0" x2="0" y2="6" stroke="#888" stroke-width="3"/>'
        "</pattern>",
        *_patterns(),
        "</defs>",
    ]
    if not attempts:
        text = '<text x="10" y="40" font-size="13" fill="#555">no attempt has started yet</text>'
        return "\n".join([*head, text, "</svg>"])
    starts = {id(a): a.started_at or 0.0 for a in attempts}
    t0 = min(starts.values())
    t1 = max(max(a.ended_at if a.ended_at is not None else now, starts[id(a)]) for a in attempts)
    span = max(t1 - t0, 1.0)
    scale = (WIDTH - LABEL_W - 10) / span
    body = _axis(t0, span, scale, AXIS_H + len(lanes) * LANE_H)
    for row, lane in enumerate(lanes):
        y = AXIS_H + row * LANE_H
        label = lane.name if lane.score is None else f"{lane.name} ({lane.score:g})"
        body.append(f'<g class="lane" data-worker="{escape(lane.worker)}">')
        body.append(f'<text class="lane-label" x="6" y="{y + BAR_H - 4}" font-size="12" fill="#222">'
                    f"{escape(label[:30])}<title>{escape(lane.worker)}</title></text>")  # fmt: skip
        for a in by_worker.get(lane.worker, []):
            end = a.ended_at if a.ended_at is not None else now
            seconds = max(0.0, end - starts[id(a)])
            x = LABEL_W + (starts[id(a)] - t0) * scale
            body.append(_attempt_rect(a, x, y + (LANE_H - BAR_H) / 2, max(MIN_BAR, seconds * scale), seconds, lane))
        body.append("</g>")
    body += _legend(AXIS_H + len(lanes) * LANE_H + 4)
    if left_out:
        body.append(f'<text class="left-out" x="{LABEL_W}" y="{height - 2}" font-size="11" fill="#a33">'
                    f"{left_out} older attempts (or of less busy workers) are not drawn</text>")  # fmt: skip
    return "\n".join([*head, *body, "</svg>"])
