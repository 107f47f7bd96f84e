"""Capability tiers: pure functions, no I/O.

Workers are ranked by score and spread over K tiers so the weakest is tier 0 and the strongest K-1.
A job's tasks, heaviest first, fill the tiers from the top, each tier taking a share of the job's total
cost equal to its share of the live score. Workers take their own tier, then lighter ones, then heavier
tiers that no live worker serves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def worker_tiers(scores: Mapping[str, float], k: int) -> dict[str, int]:
    """Tier of each live worker: rank by score spread over 0..k-1; a lone worker gets the top tier."""
    ranked = sorted(scores, key=lambda w: (scores[w], w))
    n = len(ranked)
    if n == 1:
        return {ranked[0]: k - 1}
    return {w: round(r * (k - 1) / (n - 1)) for r, w in enumerate(ranked)}


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
