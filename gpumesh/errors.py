"""The exception tree. Each class carries the CLI exit code it maps to.

    GpumeshError                 1  (never raised bare)
    ├── UsageError               2  bad input: payloads, script, options
    ├── BrokerError              3  cannot reach or authenticate to Redis
    │   └── BrokerUnreachable    3  no answer: down, cut off, or too slow (commands that follow a job wait)
    ├── NotFound                 4  unknown job, task or worker
    └── JobEnded                 1  a waited-for job ended failed or cancelled

The CLI catches GpumeshError in one place and prints ``error: <message>``.
"""

from __future__ import annotations


class GpumeshError(Exception):
    """Root of every error gpumesh raises on purpose."""

    exit_code = 1


class UsageError(GpumeshError):
    """The input is wrong; the message names what and how to fix it."""

    exit_code = 2


class BrokerError(GpumeshError):
    """Redis cannot be reached, refused the credentials, or answered nonsense."""

    exit_code = 3


class BrokerUnreachable(BrokerError):
    """Redis did not answer (connection refused or reset, or a timeout): an outage, perhaps a short one."""


class NotFound(GpumeshError):
    """The job, task or worker does not exist (or has expired)."""

    exit_code = 4


class JobEnded(GpumeshError):
    """A job ended in ``failed`` or ``cancelled``."""

    exit_code = 1
