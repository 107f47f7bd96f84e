"""What the dashboard's pages show, read from one mesh through the Python API (and the artifact reader
under it): blocking calls, which the web app (gpumesh.dashboard.app) runs in its thread pool. Also the
formatting the pages share, and the checks a stored file passes before its bytes are sent."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import secrets
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any
from urllib.parse import quote

from gpumesh import api
from gpumesh.dashboard import timeline
from gpumesh.errors import NotFound, UsageError
from gpumesh.models import TERMINAL, JobStatus, TaskResult, Waiting, WorkerInfo, error_summary
from gpumesh.store import artifacts, keys

TASKS_SHOWN = 500  # rows of the job page's task table
JOBS_SHOWN = 100  # rows of the jobs page
RESULT_CHARS = 200  # of a result's JSON in the task table
STREAMS = ("stdout", "stderr", "gpumesh")
TASK_ID = re.compile(r".{1,200}-\d{1,9}")  # keys.task_id: a job id, a dash, the task's index


class Damaged(Exception):
    """A stored file that does not match its index (size, checksum) or is gone: never sent as if whole."""


# -- formatting -----------------------------------------------------------------------------------


def ago(seconds: float | None) -> str:
    """``3 s ago``, ``4 min ago``, ``2 h ago``, ``3 d ago``; an unknown time is "—"."""
    if seconds is None:
        return "—"
    s = max(0, int(seconds))
    if s < 90:
        return f"{s} s ago"
    if s < 5400:
        return f"{round(s / 60)} min ago"
    if s < 129600:
        return f"{round(s / 3600)} h ago"
    return f"{round(s / 86400)} d ago"


def duration(seconds: float | None) -> str:
    """``0.4 s``, ``12 s``, ``3 min 5 s``, ``2 h 10 min``; none is "—"."""
    if seconds is None:
        return "—"
    if seconds < 10:
        return f"{seconds:.1f} s"
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def first_line(text: str | None) -> str:
    return (text or "").strip().partition("\n")[0]


def error_line(status: str, error: str | None, kind: str | None) -> str:
    """A failure in one line: the error's first line, and what the exception said when that is elsewhere
    (a script's error starts "exit code 1" and the traceback's last line says why)."""
    first = first_line(error)
    summary = error_summary(status, error, kind).partition(": ")[2]
    if not first:
        return summary
    return first if not summary or summary in first else f"{first} · {summary}"


def waiting_text(w: Waiting) -> str:
    """Why some queued tasks wait: no live worker meets what they require, or none trusts their signer."""
    n = f"{w.tasks} task{'s' if w.tasks != 1 else ''}"
    if w.signer:
        return f"{n}: no live worker that may run them trusts their signer ({w.signer})"
    if w.requires:
        return f"{n}: no live worker meets {', '.join(w.requires)}"
    return f"{n}: no live worker"


def result_json(res: TaskResult) -> str:
    if res.result is None:
        return ""
    text = json.dumps(res.result, ensure_ascii=False)
    return text if len(text) <= RESULT_CHARS else text[: RESULT_CHARS - 1] + "…"


def safe_filename(path: str) -> str:
    """The download's name: the path's last part, in characters every browser and file system takes."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", path.rsplit("/", 1)[-1]).strip("._") or "artifact"
    return name[:120]


def project_facts(fields: list[str | None]) -> dict[str, Any]:
    """What the job page shows of a job's project (its files, their bytes, its tree digest) and output globs."""
    digest, files, nbytes, outputs = fields
    out: dict[str, Any] = {"project": None, "outputs": ""}
    if digest:
        size = int(nbytes or 0)
        shown = (
            f"{size} B" if size < 10_240 else f"{size / 1024:.1f} KiB" if size < 10 << 20 else f"{size / 2**20:.1f} MiB"
        )
        out["project"] = {"digest": digest, "short": digest[:12], "files": int(files or 0), "bytes": shown}
    if outputs:
        try:
            out["outputs"] = ", ".join(str(g) for g in json.loads(outputs))
        except (ValueError, TypeError):
            out["outputs"] = outputs
    return out


def _age(now_s: float, when: datetime | None) -> float | None:
    return None if when is None else now_s - when.timestamp()


# -- the data behind each page (blocking: run in the thread pool) -------------------------------------


class View:
    """What the pages show, read from one mesh; each method is one page's or fragment's data."""

    def __init__(self, mesh: api.Mesh, may_write: bool) -> None:
        self.mesh = mesh
        self.may_write = may_write
        self.csrf = secrets.token_urlsafe(32)
        self.silent_after_s = 2 * mesh.broker.settings.heartbeat_interval + 1
        self.stopping: Callable[[], bool] = lambda: False  # serve: the server is shutting down, streams end

    def now(self) -> float:
        return self.mesh.broker.server_ms() / 1000

    def common(self) -> dict[str, Any]:
        return {"broker": self.mesh.broker.url_masked, "may_write": self.may_write, "csrf": self.csrf}

    def workers(self) -> dict[str, Any]:
        now = self.now()
        online: list[dict[str, Any]] = []
        silent: list[dict[str, Any]] = []
        live = self.mesh.workers()
        for w in sorted(live, key=lambda w: (-w.score_gflops, w.name, w.id)):
            row = self._worker_row(w, now)
            (online if row["age"] is not None and row["age"] <= self.silent_after_s else silent).append(row)
        # each tier's RQ queue (what rq-dashboard lists), who serves it, its window and its whole backlog
        tiers = self.mesh.broker.tiers(live=live) if live else []
        return {"workers": online, "silent": silent, "tiers": tiers}

    @staticmethod
    def _worker_row(w: WorkerInfo, now: float) -> dict[str, Any]:
        vram = w.resources.get("vram_gb")
        return {
            "id": w.id, "name": w.name, "hostname": w.hostname, "device": w.device,
            "gpu": w.resources.get("gpu") or "—",  # probed on a GPU, or declared; a processor is no GPU
            "vram": f"{vram:g} GiB" if isinstance(vram, int | float) else "—", "score": f"{w.score_gflops:g}",
            "tier": w.tier, "release": w.release, "resources": [f"{k}={v}" for k, v in sorted(w.resources.items())],
            "envs": [f"{d[:12]} ready" for d in w.envs] + [f"{d[:12]} failed" for d in w.env_failed],
            "task": f"preparing {w.preparing}" if w.preparing
            else w.current_task or (f"paused: {w.paused}" if w.paused else "idle"),
            "busy": w.current_task is not None, "age": _age(now, w.last_heartbeat),
        }  # fmt: skip

    def jobs(self) -> dict[str, Any]:
        now = self.now()
        broker = self.mesh.broker
        listed = self.mesh.jobs(JOBS_SHOWN)
        # re-read every second while the page is open: a few pipelined reads for the whole page
        failures = broker.first_failures([st.job_id for st in listed if st.tasks.failed])
        waiting = broker.waiting_for([st.job_id for st in listed if st.tasks.queued])
        rows = []
        for st in listed:
            st.waiting_for = waiting.get(st.job_id, [])
            first = failures.get(st.job_id)
            if first is None and st.tasks.failed:  # failed before its list was kept, or past its first 100
                found, _n = api.Job(self.mesh, st.job_id).failures(limit=1)
                first = found[0] if found else None
            failure = error_line(first.status, first.error, first.error_kind) if first else ""
            rows.append(self._job_row(st, now) | {"failure": failure})
        return {"jobs": rows}

    @staticmethod
    def _job_row(st: JobStatus, now: float) -> dict[str, Any]:
        return {
            "id": st.job_id, "name": st.name, "status": st.status, "priority": st.priority, "tasks": st.tasks,
            "waiting": [waiting_text(w) for w in st.waiting_for], "created": ago(_age(now, st.created_at)),
            "ended": st.tasks.done + st.tasks.failed + st.tasks.cancelled,
        }  # fmt: skip

    def job(self, job_id: str) -> dict[str, Any]:
        job = self.mesh.job(job_id)  # NotFound
        st = job.status()
        now = self.now()
        broker = self.mesh.broker
        total = broker.task_count(job_id)  # a job of 1,000,000 tasks: read the first rows only
        rows = broker.task_results(broker.first_task_ids(job_id, TASKS_SHOWN))
        failures, failed_n = job.failures(limit=5) if st.tasks.failed else ([], 0)
        tasks = [
            {
                "index": r.index, "task_id": r.task_id, "status": r.status, "attempts": r.attempts,
                "worker": r.worker or "—", "duration": duration(r.duration_s), "error_kind": r.error_kind or "",
                "error": error_line(r.status, r.error, r.error_kind) if r.error else "", "result": result_json(r),
                "artifacts": [(a.path, quote(a.path), a.bytes) for a in r.artifacts],
            }
            for r in rows
        ]  # fmt: skip
        return {
            "job": self._job_row(st, now) | {
                "retry_on": ", ".join(st.retry_on) or "none", "failed_by_kind": st.failed_by_kind,
                "finished": ago(_age(now, st.finished_at)) if st.finished_at else "",
            } | project_facts(broker.job_fields(job_id, "project", "project_files", "project_bytes", "outputs")),
            "tasks": tasks, "shown": len(tasks), "total": total,
            "failures": [(r.index, r.task_id, error_line(r.status, r.error, r.error_kind)) for r in failures],
            "failed_n": failed_n,
            "can_cancel": self.may_write and st.status in ("queued", "running"),
            "can_retry": self.may_write and (st.tasks.failed + st.tasks.cancelled) > 0,
        }  # fmt: skip

    def timeline(self, job_id: str) -> str:
        job = self.mesh.job(job_id)
        attempts = job.attempts()
        lanes = [timeline.Lane(w.id, w.name, w.score_gflops) for w in self.mesh.workers()]
        return timeline.render(attempts, lanes, self.now())

    def log(self, task_id: str, cursors: dict[str, str]) -> tuple[bool, list[tuple[str, str]]]:
        """(whether the task had ended before these lines were read, its new (stream, line)s)."""
        broker = self.mesh.broker
        status = broker.task_fields(task_id, "status")[0] if TASK_ID.fullmatch(task_id) else None
        if status is None:  # a job id is no task (its log would be every task's, re-read twice a second)
            raise NotFound(f"no task {task_id!r} on this broker")
        # the status is read before the lines, so that no line is missed: two round trips a poll
        lines = [(s if s in STREAMS else "stdout", line) for _t, s, line in broker.task_logs([task_id], cursors)]
        return status in TERMINAL, lines

    def cancel(self, job_id: str) -> None:
        self.mesh.job(job_id).cancel(keep_files=True)  # a click should not delete what the done tasks stored

    def retry(self, job_id: str) -> None:
        self.mesh.job(job_id).retry(cancelled=True)

    def artifact(self, job_id: str, index: int, path: str) -> tuple[int, Iterator[bytes]]:
        """(size, its bytes) of one file a done task stored, as its index lists it; NotFound otherwise."""
        self.mesh.job(job_id)
        broker = self.mesh.broker
        status, raw = broker.task_fields(keys.task_id(job_id, index), "status", "artifacts")
        if status != "done" or not raw:
            raise NotFound(f"task {index} of job {job_id} has no stored files")
        try:
            stored = json.loads(raw)
            n = next(n for n, f in enumerate(stored["files"]) if f.get("path") == path)
            entry = stored["files"][n]
            size, sha = int(entry["bytes"]), str(entry["sha256"])
            artifacts.safe_path(path)
            store = artifacts.reader(stored, broker.rq, broker.settings.artifacts)
        except StopIteration:
            raise NotFound(f"task {index} of job {job_id} stored no file {path!r}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise NotFound(f"task {index}'s file index is malformed ({type(exc).__name__})") from None
        except UsageError as exc:  # an index naming a store this dashboard does not read from (untrusted)
            raise NotFound(f"task {index}'s files are not readable here: {exc}") from None
        return size, first_checked(checked(store.read(stored, n), size, sha, path))


def checked(chunks: Iterator[bytes], size: int, sha256: str, path: str) -> Iterator[bytes]:
    """The chunks, checked against the index's size and checksum. The last chunk is held back until the
    whole file has checked out: a damaged copy ends the download short of its Content-Length, so the
    browser reports it failed instead of saving a bad file."""
    digest = hashlib.sha256()
    got = 0
    held: bytes | None = None
    try:
        for data in chunks:
            got += len(data)
            if got > size:
                raise Damaged(f"{path}: the stored copy is longer than its index says")
            digest.update(data)
            if held is not None:
                yield held
            held = data
    except LookupError as exc:  # a chunk is gone (the job expired or was cancelled meanwhile)
        raise Damaged(f"{path}: {exc}") from None
    if got != size or digest.hexdigest() != sha256:
        raise Damaged(f"{path}: the stored copy does not match its checksum")
    if held is not None:
        yield held


def first_checked(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """``chunks`` with the first one read now: a file of one chunk (most) is then checked whole before
    any header goes out, and a damaged one is a clear error instead of a cut-off download."""
    first = next(chunks, None)
    return itertools.chain([] if first is None else [first], chunks)


def probe_may_write(mesh: api.Mesh) -> bool:
    """Whether the credential may write the job index: ``ZADD XX`` of a member that is not there adds
    nothing, and a read-only credential is refused it."""
    return mesh.broker.may_write_jobs()
