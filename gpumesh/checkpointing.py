"""``gpumesh.checkpoint()``, for a task: save what it wrote to ``GPUMESH_CHECKPOINT_DIR`` now.

Import-light (a task's interpreter imports it): it creates the marker file the worker looks for and waits
until the worker has saved the directory and removed the marker. A task without gpumesh installed does the
same with two lines of its own: ``open(os.path.join(d, ".gpumesh-save"), "w").close()``, then wait until
the file is gone.
"""

from __future__ import annotations

import os
import time

SAVE_MARKER = ".gpumesh-save"


def checkpoint(timeout: float = 300.0) -> bool:
    """Ask the worker to save ``GPUMESH_CHECKPOINT_DIR`` now and wait until it has (write every file first; the
    save is what the directory holds when it is read). True once saved; False outside a gpumesh task, or when
    the worker did not answer within ``timeout`` seconds. The next attempt of this task, on whichever worker,
    starts with the newest saved checkpoint in its GPUMESH_CHECKPOINT_DIR.

    >>> import gpumesh
    >>> gpumesh.checkpoint()          # doctest: +SKIP
    True
    """
    where = os.environ.get("GPUMESH_CHECKPOINT_DIR")
    if not where:
        return False
    marker = os.path.join(where, SAVE_MARKER)
    open(marker, "w").close()  # noqa: SIM115 - created empty, closed at once
    deadline = time.monotonic() + timeout
    while os.path.exists(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
