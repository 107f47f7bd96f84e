"""rq-dashboard without pickle: ``python -m gpumesh.server.rq_dashboard -j [rq-dashboard's options]``.

rq-dashboard 0.9.0 reads its job pages with the JSON serializer its ``-j`` flag names, but its workers page
(``Worker.all()``, then each busy worker's current job) with RQ's default one, which is pickle. Any
credential that may write RQ's keys (gpumesh's worker and submitter credentials may: RQ's bookkeeping needs
it) can plant a job whose data is a pickle and an execution naming it, and the next person to open the
workers page runs that code in the dashboard's process, with the dashboard's broker password. Here RQ's
default serializer is JSON in this process before rq-dashboard starts: that page reads gpumesh's
deliveries (JSON) as the others do, and a planted pickle is a decoding error, never code that runs.

Standard library, RQ and rq-dashboard only: the compose file's rq-dashboard image runs this file alone.
"""

from __future__ import annotations

import sys


def json_only() -> None:
    """Make RQ's default (pickle) serializer JSON's, in this process, for every reader that falls back to it."""
    from rq import serializers

    serializers.DefaultSerializer.dumps = staticmethod(serializers.JSONSerializer.dumps)
    serializers.DefaultSerializer.loads = staticmethod(serializers.JSONSerializer.loads)
    if serializers.resolve_serializer(None).loads is not serializers.JSONSerializer.loads:  # another RQ's ways
        sys.exit("error: this RQ still falls back to pickle here: install rq>=3.0,<4 (what gpumesh is tested with)")


def main() -> None:
    json_only()
    try:
        from rq_dashboard.cli import main as run  # type: ignore[import-untyped]
    except ImportError:
        sys.exit("error: rq-dashboard is not installed here: pip install rq-dashboard==0.9.0 six")
    run()


if __name__ == "__main__":
    main()
