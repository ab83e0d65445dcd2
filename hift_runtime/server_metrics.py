"""The server's own state as Prometheus metrics, on a port beside Triton's (``hift-serve --state-metrics-port``).

Triton's endpoint counts requests, batches and queue time per model; what it cannot see is ours: open streams,
requests refused by reason, streams expired, the step batches the scheduler formed, how busy each device was, and
the full garbage collections (each stalls every stream of the process while it runs; see :mod:`.process_tuning`).
Everything is read from the live objects at scrape time (no hooks in the request path).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from . import wire
from .process_tuning import CollectionPauses
from .serving import StreamTable


def _schedulers(vocoder: Any) -> list[tuple[str, Any]]:
    """(device name, scheduler) of a vocoder, or of each device of a multi-device one."""
    vocoders = getattr(vocoder, "vocoders", None)
    if vocoders is None:
        return [("0", vocoder.scheduler)]
    return list(zip(vocoder.names, (v.scheduler for v in vocoders)))


class ServerStateCollector:
    """Collects the metrics of one :class:`~hift_runtime.serving.StreamTable` and its vocoder."""

    def __init__(self, table: StreamTable, requests_in_flight: Callable[[], int] | None = None) -> None:
        self.table = table
        self.requests_in_flight = requests_in_flight
        self.started = time.monotonic()
        self.pauses = CollectionPauses()

    def collect(self) -> Iterator[Any]:
        table = self.table
        yield GaugeMetricFamily("hift_open_streams", "streams open now", value=table.open_streams)
        if self.requests_in_flight is not None:
            yield GaugeMetricFamily(wire.REQUESTS_IN_FLIGHT_METRIC,
                                    "requests received and not yet sent their final reply",
                                    value=self.requests_in_flight())
        refused = CounterMetricFamily("hift_requests_refused", "requests refused, by reason", labels=["reason"])
        for reason, count in sorted(table.refused.items()):
            refused.add_metric([reason], count)
        yield refused
        yield CounterMetricFamily("hift_streams_expired", "streams released after idle_timeout_s",
                                  value=table.streams_expired)
        yield CounterMetricFamily("hift_resends_replayed", "resent chunks (same offset) answered with the audio "
                                  "already computed, nothing applied twice", value=table.resends_replayed)
        calls = CounterMetricFamily("hift_step_calls", "stream steps run, by device and kind (generator, final, f0)",
                                    labels=["device", "kind"])
        batches = CounterMetricFamily("hift_step_batches", "batched device calls, by device and kind; calls / "
                                      "batches is the mean batch size", labels=["device", "kind"])
        largest = GaugeMetricFamily("hift_step_batch_max", "the largest batch formed, by device", labels=["device"])
        queued = CounterMetricFamily("hift_step_batches_queued", "batched calls started behind another one still on "
                                     "the device, by device (under load: no idle gap between the two)",
                                     labels=["device"])
        busy = CounterMetricFamily("hift_device_busy_seconds", "seconds inside device calls, by device",
                                   labels=["device"])
        busy_by_kind = CounterMetricFamily("hift_step_busy_seconds", "seconds inside device calls, by device and "
                                           "kind (generator, final, f0)", labels=["device", "kind"])
        share = GaugeMetricFamily("hift_device_busy_share", "seconds inside device calls / seconds since the server "
                                  "started, by device (F0 calls that run beside the generator's, where the engine has "
                                  "an F0 lane, not counted: they overlap)", labels=["device"])
        uptime = max(time.monotonic() - self.started, 1e-9)
        for device, scheduler in _schedulers(table.vocoder):
            if scheduler is None:
                continue
            stats = scheduler.stats
            for kind, (n_calls, n_batches, busy_s) in sorted(stats.by_kind.items()):
                calls.add_metric([device, kind], n_calls)
                batches.add_metric([device, kind], n_batches)
                busy_by_kind.add_metric([device, kind], busy_s)
            largest.add_metric([device], stats.max_batch)
            queued.add_metric([device], stats.queued)
            busy.add_metric([device], stats.busy_s)
            share.add_metric([device], min(1.0, stats.main_lane_busy_s / uptime))
        yield from (calls, batches, busy_by_kind, largest, queued, busy, share)
        yield CounterMetricFamily("hift_gc_full_collections", "full garbage collections since the metrics started",
                                  value=self.pauses.count)
        yield CounterMetricFamily("hift_gc_full_collection_seconds", "seconds inside full garbage collections (every "
                                  "stream of the process waits through them)", value=self.pauses.total_s)
        yield GaugeMetricFamily("hift_gc_full_collection_max_seconds", "the longest full garbage collection",
                                value=self.pauses.max_s)
        yield GaugeMetricFamily("hift_gc_frozen_objects", "objects frozen once warm, never walked by a collection "
                                "(0: HIFT_GC_TUNING=0)", value=gc.get_freeze_count())


def serve_state_metrics(table: StreamTable, port: int, address: str = "127.0.0.1",
                        requests_in_flight: Callable[[], int] | None = None) -> Any:
    """Serve the collector's metrics at ``http://address:port/metrics`` from a daemon thread; the server object."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerStateCollector(table, requests_in_flight))  # type: ignore[arg-type]
    server, _thread = start_http_server(port, addr=address, registry=registry)
    return server
