"""``gpumesh worker``: the RQ worker (``worker``), the one function RQ runs (``executor``), the
reaper, the output shipper, the per-GPU supervisor, and ``build``, which assembles a worker from
settings for the CLI and for ``gpumesh run --local``."""
