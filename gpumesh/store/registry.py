"""A worker's own records in the broker: its registration, its wake list, the reaper lock, and the
reads the straggler scan needs. The worker decides; this module only reads and writes.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpumesh._version import PROTOCOL, __version__
from gpumesh.models import Capability
from gpumesh.store import keys
from gpumesh.store.connection import TextClient


def fleet_changed(p: Any) -> None:
    """A worker joined or left: the dispatcher recounts the fleet, and workers look for stragglers again."""
    p.hset(keys.FLEET, "dirty", 1)
    p.hincrby(keys.FLEET, "v", 1)


@dataclass(frozen=True)
class RunningRow:
    """A running task as the straggler scan sees it."""

    task_id: str
    worker: str
    started_at: float
    cost: float


class Registry:
    """The registration of one worker (``worker_id``) through the broker's text client ``r``."""

    def __init__(self, r: TextClient, worker_id: str) -> None:
        self.r = r
        self.worker_id = worker_id

    def register(
        self, name: str, cap: Capability, resources: Mapping[str, object], ttl_ms: int, paused: str = "",
        library: tuple[str, int] = ("", PROTOCOL),
    ) -> None:  # fmt: skip
        """Announce the worker (hash with a TTL, its score) and tell the dispatcher the fleet changed.
        ``library``: the functions library it calls and that library's protocol (``serve`` keeps a library
        that a live worker calls; ``workers`` shows both beside the package's version)."""
        with self.r.pipeline(transaction=True) as p:
            p.hset(
                keys.worker(self.worker_id),
                mapping={
                    "resources": json.dumps(resources),
                    "name": name,
                    "hostname": socket.gethostname(),
                    "pid": os.getpid(),
                    "device": cap.device,
                    "device_name": cap.device_name,
                    "memory": cap.memory_bytes,
                    "score": cap.score_gflops,
                    "version": __version__,
                    "protocol": library[1],
                    "library": library[0],
                    "current_task": "",
                    "paused": paused,
                },
            )
            p.pexpire(keys.worker(self.worker_id), ttl_ms)
            p.zadd(keys.SCORES, {self.worker_id: cap.score_gflops})
            fleet_changed(p)
            p.execute()

    def set_paused(self, reason: str, ttl_ms: int) -> None:
        """Why the worker takes no work now (the lender's probes), or '' when it does: ``workers`` shows it. Written
        only into a live registration (one that expired is written whole again by the next heartbeat)."""
        key = keys.worker(self.worker_id)
        if self.r.exists(key):
            with self.r.pipeline(transaction=True) as p:
                p.hset(key, "paused", reason)
                p.pexpire(key, ttl_ms)
                p.execute()

    def unregister(self) -> None:
        """Remove every trace of the worker: registration, wake list; the fleet changed. (The tier queues it
        served are every tier worker's: they stay.)"""
        with self.r.pipeline(transaction=True) as p:
            p.delete(keys.worker(self.worker_id), keys.wake(self.worker_id))
            p.zrem(keys.WORKERS, self.worker_id)
            p.zrem(keys.SCORES, self.worker_id)
            p.srem(keys.IDLE, self.worker_id)
            fleet_changed(p)
            p.execute()

    def publish_tier(self, tier: int) -> None:
        """The tier the worker's last heartbeat computed (the dispatcher computes its own as the worker asks)."""
        self.r.hset(keys.worker(self.worker_id), "tier", tier)

    def wake(self, why: str) -> None:
        """Put a token on this worker's own wake list: out of its wait for work at once."""
        self.r.lpush(keys.wake(self.worker_id), why)

    def sleep_until_woken(self, timeout: int) -> None:
        """Block on the worker's wake list (a requeue or a submit pushes to it) for at most ``timeout`` s."""
        self.r.blpop([keys.wake(self.worker_id)], timeout=timeout)

    def woken_with_work(self) -> bool:
        """New work arrived since our last dispatch found none (its wake emptied the idle set), and it waits."""
        with self.r.pipeline(transaction=False) as p:
            p.sismember(keys.IDLE, self.worker_id)
            p.zcard(keys.READY)
            idle, ready = p.execute()
        return not idle and ready > 0

    def reaper_turn(self, ttl_ms: int) -> bool:
        """One reaper at a time across the mesh (an optimisation: reaping twice is harmless)."""
        if self.r.set(keys.REAPER_LOCK, self.worker_id, nx=True, px=ttl_ms):
            return True
        if self.r.get(keys.REAPER_LOCK) == self.worker_id:
            self.r.pexpire(keys.REAPER_LOCK, ttl_ms)
            return True
        return False

    def others_running(self, limit: int = 200) -> tuple[float, list[RunningRow]]:
        """(server time in s, the running tasks of other workers that have no live backup copy yet).
        A backup whose worker died lapses at its ``backup_until``."""
        tids = self.r.zrange(keys.LEASES, 0, limit - 1)
        if not tids:
            return 0.0, []
        with self.r.pipeline(transaction=False) as p:
            for tid in tids:
                p.hmget(keys.task(tid), "status", "worker", "backup_until", "started_at", "cost")
            p.time()
            *rows, (sec, usec) = p.execute()
        now = sec + usec / 1e6
        return now, [
            RunningRow(tid, worker, float(started or 0), float(cost or 1))
            for tid, (status, worker, backup_until, started, cost) in zip(tids, rows)
            if status == "running" and worker != self.worker_id and float(backup_until or 0) <= now * 1000
        ]

    def job_progress(self, job_ids: list[str], with_ready: bool) -> tuple[list[list[str | None]], list[Any]]:
        """Each job's progress fields (for scheduling.JobProgress), and the ready index when asked."""
        with self.r.pipeline(transaction=False) as p:
            for job in job_ids:
                p.hmget(keys.job(job), "speculate", "queued", "pending_cost", "unit_sum", "unit_n", "priority")
            if with_ready:
                p.zrevrange(keys.READY, 0, -1, withscores=True)
            (*info,) = p.execute()
        ready = info.pop() if with_ready else []
        return info, ready
