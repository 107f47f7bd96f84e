"""The store layer: everything that talks to Redis.

``keys`` names every key, ``lua/`` holds the atomic transitions of the task state machine and
``scripts`` is their Python face, ``connection`` makes clients and turns redis-py's errors into
gpumesh's, and ``broker`` (with ``submit``) is the one API the rest of gpumesh calls; ``jobstatus``
reads a job's status with redis-py alone, for ``broker`` and for ``status --json``'s fast path.
"""
