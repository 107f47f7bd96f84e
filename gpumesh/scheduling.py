"""Scheduling logic that needs no Redis: pure functions, no I/O.

Placement itself happens in Redis (lua/dispatch.lua). Here: which running tasks a worker should back
up (the worker reads the facts, this decides), and the capability tiers: workers ranked by score over K
tiers (the weakest tier 0, the strongest K-1), as the dispatcher ranks the worker that asks; and the
forecast of where queued tasks go (`submit --json`, `gpumesh workers`): heaviest first, filling the tiers
from the top by share of the live score.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RunningTask:
    """A running task another worker holds, without a live backup copy."""

    task_id: str
    job_id: str
    worker: str
    started: float  # server time, s
    cost: float


@dataclass(frozen=True)
class JobProgress:
    """What a backup decision needs to know of a task's job."""

    speculate: bool
    queued: int
    pending_cost: float
    unit: float | None  # seconds per (cost / score) of its completed tasks; None before the first
    priority: float

    @classmethod
    def from_fields(cls, row: Sequence[str | None]) -> JobProgress:
        """From HMGET job speculate queued pending_cost unit_sum unit_n priority."""
        spec, queued, pending_cost, unit_sum, unit_n, prio = row
        unit = float(unit_sum or 0) / float(unit_n) if unit_n and float(unit_n) > 0 else None
        return cls(spec == "1", int(queued or 0), float(pending_cost or 0), unit, float(prio or 0))


def top_priority_jobs(ready: Sequence[tuple[str, float]]) -> tuple[float | None, set[str]]:
    """(the highest priority with queued work, the jobs queued at it), from (job, priority) entries."""
    top = max((prio for _job, prio in ready), default=None)
    return top, {job for job, prio in ready if prio == top}


def backup_candidates(
    mode: str, mine: float, scores: Mapping[str, float], tasks: Sequence[RunningTask],
    jobs: Mapping[str, JobProgress], top: tuple[float | None, set[str]], now: float, speedup: float, gain: float,
) -> list[str]:  # fmt: skip
    """Task ids a worker of score ``mine`` should back up, best first.

    mode 'idle' (nothing dispatchable to it): tasks of jobs with nothing queued, the weakest primary
    first, unless the job's timing says the copy would end after the primary. mode 'straggler' (the
    fleet changed): a primary whose expected end lies beyond the time its job's queued work needs, and
    that the copy would finish in under ``gain`` of its time left, for a job that is all the
    top-priority queued work (other jobs' queued tasks go first); the longest left first. Either way
    only primaries at most 1/``speedup`` as strong as this worker."""
    top_prio, top_jobs = top
    ranked: list[tuple[float, float, str]] = []
    for t in tasks:
        job = jobs[t.job_id]
        primary = scores.get(t.worker, 0.0)
        if not job.speculate or primary * speedup > mine:
            continue
        unit = job.unit if primary > 0 and t.started else None  # no estimate for a primary that left
        left = t.started + unit * t.cost / primary - now if unit is not None else None
        if mode == "idle":
            useful = left is None or (unit is not None and unit * t.cost / mine < left)
            if job.queued == 0 and useful:
                ranked.append((primary, t.started, t.task_id))
            continue
        if left is None or unit is None:
            continue  # no completed task yet: no estimate of how long a unit of cost takes
        if (top_jobs - {t.job_id}) or (top_prio is not None and job.priority < top_prio):
            continue  # other jobs' queued work goes first
        horizon = unit * job.pending_cost / max(sum(scores.values()), 1e-9)
        if left > horizon and unit * t.cost / mine < gain * left:
            ranked.append((-left, t.started, t.task_id))
    return [tid for _key, _started, tid in sorted(ranked)]


def worker_tiers(scores: Mapping[str, float], k: int) -> dict[str, int]:
    """Tier of each live worker: its rank by (score, id) spread over 0..k-1, rounded half up; a lone worker
    gets the top tier. lua/_lib.lua's tier_of computes the same for the worker that asks for work."""
    ranked = sorted(scores, key=lambda w: (scores[w], w))
    n = len(ranked)
    if n == 1:
        return {ranked[0]: k - 1}
    return {w: (2 * r * (k - 1) + (n - 1)) // (2 * (n - 1)) for r, w in enumerate(ranked)}


def tier_capacity(scores: Mapping[str, float], k: int) -> list[float]:
    """Sum of live score per tier."""
    cap = [0.0] * k
    for w, t in worker_tiers(scores, k).items():
        cap[t] += max(scores[w], 0.0)
    return cap


def assign_task_tiers(costs: Sequence[float], capacity: Sequence[float]) -> list[int]:
    """Tier per task (in input order).

    With live capacity, walk the tasks heaviest first; a task goes to the tier whose slice of the
    cumulative cost holds the task's midpoint, tier k's slice being its share of the live score.
    With no live capacity, equal-count quantiles (heaviest fifth to the top tier, and so on).
    """
    k = len(capacity)
    n = len(costs)
    order = sorted(range(n), key=lambda i: (-costs[i], i))
    tiers = [0] * n
    total_cap = sum(capacity)
    if total_cap <= 0:
        for pos, i in enumerate(order):
            tiers[i] = k - 1 - (pos * k) // n
        return tiers
    total_cost = float(sum(costs))
    bounds = []  # cumulative cost at which each tier's slice ends, top tier first
    acc = 0.0
    for t in range(k - 1, -1, -1):
        acc += total_cost * capacity[t] / total_cap
        bounds.append((acc, t))
    done = 0.0
    b = 0
    for i in order:
        mid = done + costs[i] / 2
        while b < len(bounds) - 1 and (mid > bounds[b][0] or capacity[bounds[b][1]] <= 0):
            b += 1
        tiers[i] = bounds[b][1]
        done += costs[i]
    return tiers


def queue_order(my_tier: int, served: set[int], k: int) -> list[int]:
    """Tiers a worker listens to, in priority order: its own, lighter ones, then unserved heavier ones."""
    lighter = list(range(my_tier, -1, -1))
    heavier = [t for t in range(my_tier + 1, k) if t not in served]
    return lighter + heavier
