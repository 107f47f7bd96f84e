"""Tier assignment is pure logic: tested without Redis."""

from __future__ import annotations

from gpumesh.scheduling import assign_task_tiers, queue_order, tier_capacity, worker_tiers


def test_lone_worker_takes_the_top_tier_and_serves_every_tier():
    tiers = worker_tiers({"a": 5.0}, 3)
    assert tiers == {"a": 2}
    assert queue_order(2, set(tiers.values()), 3) == [2, 1, 0]


def test_workers_spread_from_weakest_to_strongest():
    tiers = worker_tiers({"w1": 1, "w2": 2, "w4": 4, "w8": 8}, 3)
    assert tiers["w1"] == 0 and tiers["w8"] == 2
    assert tiers["w2"] <= tiers["w4"]


def test_two_workers_leave_the_middle_tier_empty_and_the_weak_one_covers_it():
    tiers = worker_tiers({"weak": 1, "strong": 8}, 3)
    assert tiers == {"weak": 0, "strong": 2}
    assert queue_order(0, {0, 2}, 3) == [0, 1]  # unserved heavier tier 1, never the served tier 2
    assert queue_order(2, {0, 2}, 3) == [2, 1, 0]


def test_task_cost_share_follows_score_share():
    capacity = tier_capacity({"weak": 1, "strong": 3}, 2)  # tier 0: 1, tier 1: 3
    assert capacity == [1.0, 3.0]
    costs = [1.0] * 100
    tiers = assign_task_tiers(costs, capacity)
    assert tiers.count(1) == 75 and tiers.count(0) == 25


def test_heaviest_tasks_go_to_the_top_tier():
    costs = [1, 9, 2, 8, 3]
    tiers = assign_task_tiers(costs, [1.0, 1.0])
    assert tiers[1] == 1  # cost 9
    assert tiers[0] == 0  # cost 1
    assert all(tiers[i] >= tiers[j] for i in range(5) for j in range(5) if costs[i] > costs[j])


def test_tier_without_capacity_gets_no_tasks():
    tiers = assign_task_tiers([5, 4, 3, 2, 1, 1, 1], [2.0, 0.0, 6.0])
    assert 1 not in tiers
    assert set(tiers) == {0, 2}


def test_no_live_worker_means_equal_count_quantiles():
    tiers = assign_task_tiers([float(c) for c in range(1, 10)], [0.0, 0.0, 0.0])
    assert sorted(tiers) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert tiers[8] == 2 and tiers[0] == 0  # heaviest (cost 9) top, lightest bottom
