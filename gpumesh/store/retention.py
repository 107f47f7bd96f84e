"""Deleting a job with everything it left (its tasks, logs, output files, streams and sets), in steps that
each hold Redis about a millisecond however big the job is.

A job of 1,000,000 tasks is 1,000,000 task hashes: deleted in one MULTI/EXEC they held Redis for seconds,
and every worker's call with them. Here the job leaves the index it is listed in first (no one lists it from
then on) and enters ``keys.PRUNING``; then each step deletes the keys of STEP tasks from the end of its
task list and shortens the list, in one transaction (WATCHed, so two reapers never trim each other's
tasks away); last, its own keys go with UNLINK, which frees a big stream or set outside Redis's main thread.
A deletion cut short (a reaper pass's budget, a crash) is resumed from ``keys.PRUNING``.
"""

from __future__ import annotations

import json
import time
from typing import Any, cast

import redis

from gpumesh.store import artifacts, keys, projects, scripts
from gpumesh.store.connection import TextClient

STEP = 1000  # tasks whose keys one step deletes (each has up to four: hash, output files, checkpoint, an old log)


def begin(r: TextClient, job_id: str, index: str) -> None:
    """Take the job out of ``index`` (the jobs index, or the staging claims) and mark it as being deleted."""
    sec, usec = r.time()
    with r.pipeline(transaction=True) as p:
        p.zadd(keys.PRUNING, {job_id: sec * 1000 + usec // 1000}, nx=True)
        p.zrem(index, job_id)
        p.execute()


def step(r: TextClient, job_id: str) -> int:
    """Delete the keys of up to STEP of the job's tasks (the last in its task list) and drop them from the
    list; how many (0: none was left)."""
    listed = keys.job_tasks(job_id)
    with r.pipeline(transaction=True) as p:
        while True:
            try:
                cast(Any, p).watch(listed)  # redis-py leaves Pipeline.watch untyped
                tids: list[str] = cast(Any, p).lrange(listed, -STEP, -1)  # answered at once while watching
                if not tids:
                    p.reset()
                    return 0
                p.multi()
                p.delete(*[keys.task(t) for t in tids], *[keys.task_files(t) for t in tids],
                         *[keys.task_checkpoint(t) for t in tids], *[keys.task_log(t) for t in tids])  # fmt: skip
                p.ltrim(listed, 0, -len(tids) - 1)
                p.execute()
                return len(tids)
            except redis.WatchError:
                continue  # another reaper took a step on this job meanwhile: look again


def finish(r: TextClient, job_id: str, own_store: str = "", files: projects.Files | None = None) -> None:
    """The job's own keys (hash, lists, streams, sets; its files in an object store), once its tasks are gone,
    and its project, if no other job refers to it (``files``: where project files are kept)."""
    classes, store, project = r.hmget(keys.job(job_id), "classes", "artifact_store", "project")
    try:
        pending = [keys.pending(job_id, k) for k in range(len(json.loads(classes)))] if classes else []
    except (ValueError, TypeError):
        pending = []
    if classes is None:  # staged, never made visible: its classes were not recorded
        pending = list(r.scan_iter(match=keys.pending(job_id, 0)[:-1] + "*", count=1000))
    if store:
        artifacts.delete_from_object_store(store, job_id, own_store)
    with r.pipeline(transaction=True) as p:
        if pending:
            p.unlink(*pending)
        p.unlink(keys.job(job_id), keys.job_tasks(job_id), keys.job_ended(job_id), keys.job_failed(job_id),
                 keys.job_attempts(job_id), keys.job_log(job_id), keys.spent(job_id))  # fmt: skip
        p.zrem(keys.PRUNING, job_id)
        p.execute()
    if project and files is not None:
        projects.detach(files, scripts.Scripts(cast(redis.Redis, r)), r, job_id, project, own_store)


def delete_job(
    r: TextClient, job_id: str, index: str, own_store: str = "", deadline: float | None = None,
    files: projects.Files | None = None,
) -> bool:  # fmt: skip
    """Delete a job with its tasks, logs, output files, checkpoints and pending sets, and drop it from ``index``;
    its project goes too, if no other job refers to it (``files``). Files in an object store are deleted only
    from ``own_store`` (this machine's GPUMESH_ARTIFACTS), in the background.
    With ``deadline`` (time.monotonic()), stops between steps once it has passed and answers False: the job
    stays in ``keys.PRUNING`` for the next call (resuming()) to finish. True once the job is gone."""
    begin(r, job_id, index)
    while step(r, job_id) == STEP:  # fewer: the list is empty now
        if deadline is not None and time.monotonic() >= deadline:
            return False
    finish(r, job_id, own_store, files)
    return True


def resuming(r: TextClient, limit: int = 50) -> list[str]:
    """Jobs whose deletion began and has not finished, oldest first."""
    return r.zrange(keys.PRUNING, 0, limit - 1)
