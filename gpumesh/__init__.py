"""gpumesh: a compute mesh for data-parallel Python work on machines of uneven strength.

    >>> import gpumesh
    >>> mesh = gpumesh.connect()                       # doctest: +SKIP
    >>> job = mesh.submit("train.py", [{"lr": 0.1}])   # doctest: +SKIP

The public names are in ``__all__``; everything else is internal. Kept import-light on purpose: the
names load on first use, because the sandbox launcher (``gpumesh.sandbox.launcher``) runs inside
every task and imports this package first.
"""

from __future__ import annotations

# Not `from typing import TYPE_CHECKING`: the task's interpreter imports this file before its script runs,
# from the task's directory, where a script named typing.py would shadow the module (type checkers
# read this constant as typing's).
TYPE_CHECKING = False


# public name -> the module that defines it
_EXPORTS = {
    "__version__": "gpumesh._version",  # with the protocol it speaks, in a module of its own
    "connect": "gpumesh.api",
    "checkpoint": "gpumesh.checkpointing",
    "Mesh": "gpumesh.api",
    "Job": "gpumesh.api",
    "GpumeshError": "gpumesh.errors",
    "UsageError": "gpumesh.errors",
    "BrokerError": "gpumesh.errors",
    "NotFound": "gpumesh.errors",
    "JobEnded": "gpumesh.errors",
    "TaskFailed": "gpumesh.errors",
    "JobOptions": "gpumesh.models",
    "JobStatus": "gpumesh.models",
    "SubmitResult": "gpumesh.models",
    "TaskResult": "gpumesh.models",
    "Attempt": "gpumesh.models",
    "WorkerInfo": "gpumesh.models",
    "TierLoad": "gpumesh.models",
}

__all__ = [
    "__version__",
    "connect",
    "checkpoint",
    "Mesh",
    "Job",
    "GpumeshError",
    "UsageError",
    "BrokerError",
    "NotFound",
    "JobEnded",
    "TaskFailed",
    "JobOptions",
    "JobStatus",
    "SubmitResult",
    "TaskResult",
    "Attempt",
    "WorkerInfo",
    "TierLoad",
]

if TYPE_CHECKING:
    from gpumesh._version import __version__
    from gpumesh.api import Job, Mesh, connect
    from gpumesh.checkpointing import checkpoint
    from gpumesh.errors import BrokerError, GpumeshError, JobEnded, NotFound, TaskFailed, UsageError
    from gpumesh.models import Attempt, JobOptions, JobStatus, SubmitResult, TaskResult, TierLoad, WorkerInfo


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext gpumesh`` in a notebook: adds the ``%%gpumesh`` cell magic (see gpumesh.magic)."""
    from gpumesh.magic import load_ipython_extension as load

    load(ipython)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gpumesh' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return list(__all__)  # the public names; submodules and helpers are not part of the API
