"""The exception tree. Each class carries the CLI exit code it maps to.

    GpumeshError                 1  (never raised bare)
    ├── UsageError               2  bad input: payloads, script, options
    ├── BrokerError              3  cannot reach or authenticate to Redis
    │   └── BrokerUnreachable    3  no answer: down, cut off, or too slow (commands that follow a job wait)
    ├── NotFound                 4  unknown job, task or worker
    └── JobEnded                 1  a waited-for job ended failed or cancelled
        └── TaskFailed           1  a task of Mesh.map failed: which one, how, and the remote exception

The CLI catches GpumeshError in one place and prints ``error: <message>``.
"""

from __future__ import annotations


class GpumeshError(Exception):
    """Root of every error gpumesh raises on purpose; ``exit_code`` is what the CLI exits with.

    >>> try:                                                    # doctest: +SKIP
    ...     gpumesh.connect("redis://nowhere:6379/0")
    ... except gpumesh.GpumeshError as exc:
    ...     print(exc.exit_code, exc)
    3 cannot reach the broker at redis://nowhere:6379/0 (...); is Redis running there?
    """

    exit_code = 1


class UsageError(GpumeshError):
    """The input is wrong; the message names what and how to fix it. Nothing was written.

    >>> mesh.submit("train.py", [{"cost": -1}])                 # doctest: +SKIP
    gpumesh.errors.UsageError: payloads[0].cost must be a positive number, got -1
    """

    exit_code = 2


class BrokerError(GpumeshError):
    """Redis cannot be reached, refused the credentials, or answered nonsense.

    >>> gpumesh.connect("redis://submitter:wrong@10.0.0.5:6390/0")      # doctest: +SKIP
    gpumesh.errors.BrokerError: the broker at redis://submitter:***@10.0.0.5:6390/0 refused the credentials (...)
    """

    exit_code = 3


class BrokerUnreachable(BrokerError):
    """Redis did not answer (connection refused or reset, or a timeout): an outage, perhaps a short one."""


class NotFound(GpumeshError):
    """The job, task or worker does not exist (or has expired).

    >>> mesh.job("nosuchjob")                                  # doctest: +SKIP
    gpumesh.errors.NotFound: no job 'nosuchjob' on this broker; `gpumesh jobs` lists the jobs
    """

    exit_code = 4


class JobEnded(GpumeshError):
    """A job ended in ``failed`` or ``cancelled`` (``gpumesh submit --wait`` exits 1).

    >>> try:                                                    # doctest: +SKIP
    ...     mesh.map(fn, payloads)
    ... except gpumesh.JobEnded as exc:                         # TaskFailed is one
    ...     print(exc)
    task 3 of job j8f3c2a1b9d0 raised KeyError: 'text'; the job was cancelled. Its log: gpumesh logs j8f3c2a1b9d0-3
    """

    exit_code = 1


class TaskFailed(JobEnded):
    """A task of ``Mesh.map`` failed for good (or was cancelled), so the map has no complete answer.

    ``index`` and ``task_id`` name the task; ``kind`` says how it failed (:data:`gpumesh.models.FAILURE_KINDS`);
    for a function that raised, ``exc_type`` (e.g. ``"ValueError"``, ``"numpy.linalg.LinAlgError"``),
    ``message`` and ``traceback`` are the remote exception's, as text: nothing is unpickled. ``error`` is
    everything the worker recorded: the exit, then the tail of the task's stderr (``stderr``).

    >>> try:                                                    # doctest: +SKIP
    ...     mesh.map(parse, payloads)
    ... except gpumesh.TaskFailed as exc:
    ...     print(exc.index, exc.exc_type, exc.message)
    ...     print(exc.traceback)
    3 KeyError 'text'
    """

    def __init__(
        self,
        summary: str,
        *,
        job_id: str,
        index: int,
        task_id: str,
        kind: str,
        error: str,
        exc_type: str | None = None,
        message: str | None = None,
        traceback: str | None = None,
    ) -> None:
        super().__init__(summary)
        self.job_id, self.index, self.task_id, self.kind, self.error = job_id, index, task_id, kind, error
        self.exc_type, self.message, self.traceback = exc_type, message, traceback
        self.stderr = error.partition("\n")[2]  # the tail of the task's stderr, as the worker recorded it
