"""A job's status read from the broker with redis-py alone (no pydantic model is built here): what
``Broker.job_status`` validates into ``JobStatus`` and ``gpumesh status JOB --json`` prints as it is.
The fields themselves are :mod:`gpumesh.jobstate`'s.
"""

from __future__ import annotations

import json
from typing import Any

from gpumesh import jobstate, requirements
from gpumesh.errors import NotFound
from gpumesh.store import keys


def live(r: Any, worker_ttl: float) -> tuple[int, dict[str, float]]:
    """(server time in ms, the score of every worker heard from within ``worker_ttl`` s), one round trip."""
    with r.pipeline(transaction=False) as p:
        p.time()
        p.zrange(keys.SCORES, 0, -1, withscores=True)
        p.zrange(keys.WORKERS, 0, -1, withscores=True)
        (sec, usec), scores, beats = p.execute()
    now = sec * 1000 + usec // 1000
    alive = {w for w, hb in beats if hb >= now - worker_ttl * 1000}
    return now, {w: s for w, s in scores if w in alive}


def live_resources(r: Any, worker_ttl: float) -> dict[str, dict[str, Any]]:
    """Resources of every live worker (what requirements are checked against); a registration that does
    not decode (garbage some credential wrote) offers nothing."""
    ids = sorted(live(r, worker_ttl)[1])
    with r.pipeline(transaction=False) as p:
        for w in ids:
            p.hget(keys.worker(w), "resources")
        raw = p.execute()
    out = {}
    for w, res in zip(ids, raw):
        try:
            decoded = json.loads(res) if res else None
        except (ValueError, RecursionError):
            continue
        if isinstance(decoded, dict):
            out[w] = decoded
    return out


def waiting_for(r: Any, job_id: str, h: dict[str, str], fleet: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Waiting's fields for each requirement class of the job whose queued tasks no live worker in
    ``fleet`` may run (or none that trusts the job's signer)."""
    classes = json.loads(h.get("classes") or "[[]]")
    with r.pipeline(transaction=False) as p:
        for k in range(len(classes)):
            p.zcard(keys.pending(job_id, k))
        counts = p.execute()
    signer = h.get("key_id") or ""
    out = []
    for reqs, n in zip(classes, counts):
        parsed = [requirements.Requirement(*req) for req in reqs]
        able = [res for res in fleet if requirements.meets_all(parsed, res)]
        if n and not able:
            out.append({"requires": [str(req) for req in parsed], "tasks": n, "signer": None})
        elif n and not any(requirements.accepts_signer(res, signer) for res in able):
            out.append({"requires": [str(req) for req in parsed], "tasks": n, "signer": signer or "unsigned"})
    return out


def preparing(r: Any, job_id: str, worker_ttl: float) -> list[str]:
    """The live workers that prepare the job's environment now (they lease none of its tasks meanwhile)."""
    ids = sorted(live(r, worker_ttl)[1])
    with r.pipeline(transaction=False) as p:
        for w in ids:
            p.hget(keys.worker(w), "preparing")
        said = p.execute()
    return [w for w, text in zip(ids, said) if isinstance(text, str) and text.endswith(f" for {job_id}")]


def read(r: Any, job_id: str, worker_ttl: float, waiting: bool = True) -> dict[str, Any]:
    """The job's status fields, ``waiting_for`` included when ``waiting`` and some task is queued. NotFound
    (exit 4) when the broker has no such job."""
    h = r.hgetall(keys.job(job_id))
    if not h:
        raise NotFound(f"no job {job_id!r} on this broker; `gpumesh jobs` lists the jobs")
    st = jobstate.fields(job_id, h)
    if waiting and st["tasks"]["queued"]:
        st["waiting_for"] = waiting_for(r, job_id, h, list(live_resources(r, worker_ttl).values()))
        if h.get("env"):
            st["preparing"] = preparing(r, job_id, worker_ttl)
    return st
