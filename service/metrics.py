"""Prometheus metrics of one app instance (its own registry, so several apps in one
process, as in the tests, do not collide)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# seconds; from a sub-millisecond vector search to a slow upload
_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

CONTENT_TYPE = CONTENT_TYPE_LATEST
STAGES = ("decode", "embed", "search")


class ServiceMetrics:
    """Requests, errors, latency per route and per stage, batch sizes and index size."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "vitrieval_requests", "HTTP requests", ["method", "route", "status"], registry=r
        )
        self.errors = Counter(
            "vitrieval_request_errors",
            "HTTP responses with status >= 400",
            ["route", "status"],
            registry=r,
        )
        self.disconnects = Counter(
            "vitrieval_client_disconnects",
            "requests whose client hung up before the answer (not server errors)",
            ["route"],
            registry=r,
        )
        self.latency = Histogram(
            "vitrieval_request_duration_seconds",
            "HTTP request latency",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.stage = Histogram(
            "vitrieval_stage_duration_seconds",
            "time per query stage (decode, embed, search)",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "vitrieval_embed_batch_size",
            "images per model call (dynamic batching)",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.index_items = Gauge("vitrieval_index_items", "live items in the index", registry=r)
        self.journal_pending = Gauge(
            "vitrieval_journal_pending", "mutations journalled but not yet saved", registry=r
        )
        self.ready = Gauge("vitrieval_ready", "1 once the model and index are loaded", registry=r)
        self.damaged_segments = Gauge(
            "vitrieval_index_damaged_segments",
            "sealed segments that failed verification and are out of service",
            registry=r,
        )
        self.merges = Counter(
            "vitrieval_index_merges", "background merges of index segments", registry=r
        )
        self.last_checkpoint = Gauge(
            "vitrieval_last_checkpoint_timestamp_seconds",
            "Unix time of the last successful checkpoint (0: none since start)",
            registry=r,
        )
        self.checkpoint_failures = Counter(
            "vitrieval_checkpoint_failures",
            "checkpoints that failed (the journal kept their mutations; retried later)",
            registry=r,
        )

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(route).observe(seconds)
        if status >= 400:
            self.errors.labels(route, str(status)).inc()

    def observe_disconnect(self, route: str) -> None:
        self.disconnects.labels(route).inc()

    def observe_stage(self, stage: str, seconds: float) -> None:
        self.stage.labels(stage).observe(seconds)

    def track_index(
        self,
        items: Callable[[], float],
        pending: Callable[[], float],
        damaged: Callable[[], float] = lambda: 0,
    ) -> None:
        """Read the index size, journal length and damaged segments at scrape time."""
        self.index_items.set_function(items)
        self.journal_pending.set_function(pending)
        self.damaged_segments.set_function(damaged)

    def track_collections(
        self, items: Callable[[], dict[str, int]], damaged: Callable[[], dict[str, int]]
    ) -> None:
        """A data folder server's series labelled by collection, read at scrape time:
        `items` of the open collections, `damaged` segments of the damaged ones (-1: the
        collection cannot be opened)."""
        self.registry.register(_CollectionSeries(items, damaged))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _CollectionSeries(Collector):
    """vitrieval_collection_items and vitrieval_collection_damaged_segments, labelled
    by collection (see `ServiceMetrics.track_collections`)."""

    def __init__(
        self, items: Callable[[], dict[str, int]], damaged: Callable[[], dict[str, int]]
    ) -> None:
        self.items, self.damaged = items, damaged

    def describe(self) -> list[GaugeMetricFamily]:
        return [_collection_gauge(name, text) for name, text in _COLLECTION_SERIES]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for (name, text), values in zip(
            _COLLECTION_SERIES, (self.items(), self.damaged()), strict=True
        ):
            gauge = _collection_gauge(name, text)
            for collection, value in sorted(values.items()):
                gauge.add_metric([collection], value)
            yield gauge


_COLLECTION_SERIES = (
    ("vitrieval_collection_items", "live items of each open collection"),
    (
        "vitrieval_collection_damaged_segments",
        "damaged segments of each damaged collection (-1: it cannot be opened)",
    ),
)


def _collection_gauge(name: str, text: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, labels=["collection"])
