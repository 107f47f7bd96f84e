"""Environments: the packages a job declares, locked once at submit and built once per machine.

``declare``: what a job asks for (a script's PEP 723 block, ``--with``, ``--requirements``, a job file's
``[env]``, the API's ``dependencies=``/``requirements=``). ``lock``: resolved on the submitting machine by uv into
a pinned, hash-checked lock for every platform (``uv pip compile --universal --generate-hashes``). ``cache``: the
worker's side, built with uv into a cache that the workers of one machine share (one build per lock digest).
The sandbox only receives the result: an interpreter and a site-packages folder to add once the task is confined.
"""

from __future__ import annotations

from gpumesh.envs.declare import Declared, declare, pep723
from gpumesh.envs.lock import Lock, lock, uv_binary

__all__ = ["Declared", "Lock", "declare", "lock", "pep723", "uv_binary"]
