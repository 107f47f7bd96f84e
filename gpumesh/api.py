"""The Python API: what a program or a notebook uses, and what the CLI is a thin layer over.

    >>> import gpumesh
    >>> with gpumesh.connect("redis://127.0.0.1:6379/0") as mesh:      # doctest: +SKIP
    ...     job = mesh.submit("examples/grid_search.py", [{"lr": 0.1}, {"lr": 0.01}])
    ...     job.wait()
    ...     [r.result for r in job.results()]

Every input is checked before anything is written (the same checks as the CLI) and every error is a
:class:`gpumesh.GpumeshError` subclass. Functions as tasks (``Mesh.map``), ``Job.as_completed`` and
``Job.pull`` are described in DESIGN §8 and §9 and land with the API and artifact work.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from pydantic import ValidationError

from gpumesh.errors import UsageError
from gpumesh.models import JobOptions, JobStatus, SubmitResult, TaskResult, WorkerInfo, check_payloads
from gpumesh.settings import Settings
from gpumesh.store.broker import Broker


def connect(url: str | None = None) -> Mesh:
    """Connect to a mesh's broker, with the CLI's settings layering: ``url``, then ``$GPUMESH_URL``,
    then the config file, then ``redis://127.0.0.1:6379/0``. Raises BrokerError when it cannot be reached.

    >>> mesh = gpumesh.connect("redis://:secret@10.0.0.5:6379/0")   # doctest: +SKIP
    """
    return Mesh(Broker(Settings.load(url=url), retries=1, health_check=False).ping())


class Mesh:
    """A connection to one mesh. Close it (or use it as a context manager) to release its connections.

    >>> with gpumesh.connect() as mesh:                                # doctest: +SKIP
    ...     print([w.name for w in mesh.workers()])
    """

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def __enter__(self) -> Mesh:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections to the broker."""
        self.broker.close()

    def submit(
        self,
        script: str | Path,
        payloads: Iterable[dict[str, Any]],
        *,
        name: str | None = None,
        timeout: float | None = None,
        max_attempts: int = 3,
        priority: int = 0,
        requires: Iterable[str] = (),
        speculate: bool | None = None,
        idempotency_key: str | None = None,
    ) -> Job:
        """Submit ``script`` (a path to a file, or Python source text) with one task per payload.

        >>> job = mesh.submit("train.py", [{"lr": 0.1, "cost": 4}], requires=["vram_gb>=40"])  # doctest: +SKIP
        """
        source, script_name = _script(script)
        checked = check_payloads(list(payloads) if not isinstance(payloads, list) else payloads)
        try:
            options = JobOptions(
                name=name or "",
                timeout=3600 if timeout is None else timeout,
                max_attempts=max_attempts,
                priority=priority,
                requires=tuple(requires),
                speculate=True if speculate is None else speculate,
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            raise UsageError(f"{first['loc'][0]}: {first['msg'].removeprefix('Value error, ')}") from None
        res = self.broker.submit(source, script_name, checked, options, idempotency_key=idempotency_key)
        return Job(self, res.job_id, res)

    def job(self, job_id: str) -> Job:
        """A job submitted earlier (by anyone), by id. Raises NotFound when the broker has no such job."""
        self.broker.job_status(job_id)
        return Job(self, job_id)

    def workers(self) -> list[WorkerInfo]:
        """The live workers, with device, score, tier and what each runs now."""
        return self.broker.workers()

    def jobs(self, limit: int = 50) -> list[JobStatus]:
        """Recent jobs, newest first."""
        return self.broker.jobs(limit)


class Job:
    """One submitted job. ``job.id`` names it for the CLI too (``gpumesh status ID``)."""

    def __init__(self, mesh: Mesh, job_id: str, submitted: SubmitResult | None = None) -> None:
        self.mesh = mesh
        self.id = job_id
        self.submitted = submitted  # what submit answered (tasks, tiers), when this object made the job

    def __repr__(self) -> str:
        return f"<gpumesh.Job {self.id}>"

    def status(self) -> JobStatus:
        """Counts per state, and which queued tasks no live worker may run (``waiting_for``)."""
        return self.mesh.broker.job_status(self.id, waiting=True)

    def wait(self, timeout: float | None = None, interval: float = 0.25) -> JobStatus:
        """Block until the job ends (done, failed or cancelled) and return its status; TimeoutError after
        ``timeout`` seconds. Does not raise when the job failed: look at ``status``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        st = self.mesh.broker.job_status(self.id)
        while not st.finished:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.id} is still {st.status} after {timeout} s")
            time.sleep(interval)
            st = self.mesh.broker.job_status(self.id)
        return st

    def results(self) -> list[TaskResult]:
        """Every task's result in payload order (``result`` is the JSON the script printed last)."""
        return self.mesh.broker.results(self.id)

    def logs(self) -> Iterator[tuple[str, str, str]]:
        """The output so far of every task: (task id, stream, line), stream being stdout, stderr or gpumesh."""
        return self.mesh.broker.logs(self.id)

    def cancel(self) -> JobStatus:
        """Cancel: queued tasks never run, running ones are killed within a heartbeat."""
        return self.mesh.broker.cancel(self.id)

    def retry(self) -> int:
        """Re-queue the failed tasks, each with a fresh set of attempts; how many were re-queued."""
        n, _st = self.mesh.broker.retry(self.id)
        return n


def _script(script: str | Path) -> tuple[str, str]:
    """(source, name) of a script given as a path or as source text."""
    if not isinstance(script, (str, Path)):
        raise UsageError(f"script must be a path or Python source text, got {type(script).__name__}")
    if isinstance(script, Path) or ("\n" not in script and script.endswith(".py")):
        path = Path(script)
        if not path.is_file():
            raise UsageError(f"script {path} does not exist or is not a file")
        try:
            return path.read_text(), path.name
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read script {path}: {exc}") from None
    return script, "script.py"
