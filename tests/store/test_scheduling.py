"""Tier assignment is pure logic: tested without Redis."""

from __future__ import annotations

import pytest

from gpumesh.scheduling import assign_task_tiers, queue_order, tier_capacity, worker_tiers

pytestmark = pytest.mark.core


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


def test_backup_candidates_idle_and_straggler():
    from gpumesh.scheduling import JobProgress, RunningTask, backup_candidates

    scores = {"weak": 1.0, "mid": 4.0, "strong": 10.0}
    tasks = [RunningTask("j-0", "j", "weak", 100.0, 30.0), RunningTask("j-1", "j", "mid", 100.0, 30.0)]
    done = {"j": JobProgress(True, 0, 0.0, 1.0, 0)}  # nothing queued; a unit of cost takes 1 s at score 1
    # idle: only primaries at most half as strong (not mid: 4 × 2 > 7); the copy (4.3 s) ends before it (130 s)
    assert backup_candidates("idle", 7.0, scores, tasks, done, (None, set()), 101.0, 2.0, 0.5) == ["j-0"]
    off = {"j": JobProgress(False, 0, 0.0, 1.0, 0)}
    assert backup_candidates("idle", 7.0, scores, tasks, off, (None, set()), 101.0, 2.0, 0.5) == []
    queued = {"j": JobProgress(True, 5, 5.0, 1.0, 0)}
    assert backup_candidates("idle", 7.0, scores, tasks, queued, (None, set()), 101.0, 2.0, 0.5) == []
    # straggler: its job still has 5 units queued (0.33 s of fleet time) and is the only top job
    assert backup_candidates("straggler", 7.0, scores, tasks, queued, (0.0, {"j"}), 101.0, 2.0, 0.5) == ["j-0"]
    # another job at the top priority goes first
    assert backup_candidates("straggler", 7.0, scores, tasks, queued, (0.0, {"j", "k"}), 101.0, 2.0, 0.5) == []
    # no completed task of the job yet: no estimate, no straggler backup
    blind = {"j": JobProgress(True, 5, 5.0, None, 0)}
    assert backup_candidates("straggler", 7.0, scores, tasks, blind, (0.0, {"j"}), 101.0, 2.0, 0.5) == []
