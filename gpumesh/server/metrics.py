"""Prometheus metrics, read from Redis at scrape time (``gpumesh metrics`` or ``gpumesh serve --metrics-port``).

Counters and the duration histogram are kept by the Lua transitions themselves (``keys.STATS``, ``keys.STATS_DURATION``),
so every exporter, on any machine, reports the same numbers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

from gpumesh.errors import UsageError
from gpumesh.models import RECORDED_KINDS
from gpumesh.store.broker import Broker

DURATION_BUCKETS = ("0.1", "0.5", "1", "5", "10", "30", "60", "300", "1800", "3600")  # as in lua/_lib.lua


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        from gpumesh.extras import install_hint

        raise UsageError(f"metrics need prometheus-client (the metrics extra): {install_hint('metrics')}") from None
    return prometheus_client


class MeshCollector:
    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        b = self.broker
        rtt = b.round_trip_s()
        counters = b.counters()
        queued, stats, hist = counters.queued, counters.stats, counters.duration
        g = GaugeMetricFamily(
            "gpumesh_queue_depth", "Queued tasks waiting for a worker, by priority", labels=["priority"]
        )
        for level, depth in sorted(queued.items()):
            g.add_metric([level], depth)
        yield g

        live = Counter((str(w.tier), w.device) for w in b.workers())
        g = GaugeMetricFamily("gpumesh_workers", "Live workers by tier and device", labels=["tier", "device"])
        for (tier, device), n in sorted(live.items()):
            g.add_metric([tier, device], n)
        yield g

        c = CounterMetricFamily("gpumesh_tasks", "Task attempts by outcome", labels=["outcome"])
        for outcome in ("done", "failed", "retried", "lease_expired"):
            c.add_metric([outcome], int(stats.get(outcome, 0)))
        yield c

        c = CounterMetricFamily(
            "gpumesh_failed_attempts", "Failed attempts by failure kind (script, timeout, memory, lost, refused)",
            labels=["kind"],
        )  # fmt: skip
        for kind in RECORDED_KINDS:
            c.add_metric([kind], int(stats.get("attempts_failed:" + kind, 0)))
        yield c

        c = CounterMetricFamily(
            "gpumesh_backup_copies", "Backup copies of stragglers (speculation)", labels=["outcome"]
        )
        c.add_metric(["started"], int(stats.get("speculated", 0)))
        c.add_metric(["won"], int(stats.get("speculative_wins", 0)))
        yield c

        buckets, cumulative = [], 0
        for le in (*DURATION_BUCKETS, "+Inf"):
            cumulative += int(hist.get(le, 0))
            buckets.append((le, cumulative))
        h = HistogramMetricFamily("gpumesh_task_duration_seconds", "Duration of successful task attempts")
        h.add_metric([], buckets, sum_value=float(hist.get("sum", 0)))
        yield h

        g = GaugeMetricFamily("gpumesh_broker_rtt_seconds", "Round trip of a PING to the broker, at scrape time")
        g.add_metric([], rtt)
        yield g


def serve_metrics(broker: Broker, port: int, host: str = "127.0.0.1") -> Any:
    """Start the exporter's HTTP server in a thread; returns the server."""
    prom = _prometheus()
    registry = prom.CollectorRegistry()
    registry.register(MeshCollector(broker))
    server, _thread = prom.start_http_server(port, addr=host, registry=registry)
    return server
