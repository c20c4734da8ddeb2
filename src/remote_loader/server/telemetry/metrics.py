"""Prometheus metrics: what each loader served to whom, where its batches waited, restarts.

Every LoaderHost records into its own `LoaderMetrics`; a server shows its hosts' together, in the
Prometheus text format, on an HTTP port of its own (`MetricsServer` in
server/telemetry/exposition.py, setting `metrics_address`). Which consumers get series of their
own is server/telemetry/series.py's.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from remote_loader.server.telemetry.series import (
    CONSUMER_LABELS,
    DEFAULT_MAX_CONSUMERS,
    ConsumerLabels,
    ConsumerRow,
    ConsumerSeries,
)
from remote_loader.server.telemetry.stall import OTHER_REPORTERS, StallBoard

# Seconds, from a batch that was already waiting (1 ms) to a consumer stalled for minutes.
BUCKETS = (
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
    60.0,
    120.0,
)
# The queues a batch passes through on the server, in order (remote_loader_queue_wait_seconds).
QUEUES = ("index", "result", "reorder", "lane")


@dataclasses.dataclass
class Totals:
    """Running totals of a loader, for rates over a few seconds (the status snapshot): worker
    seconds making batches, batches and bytes sent, and the seconds and counts of the make,
    stream-wait and send stages."""

    busy: float = 0.0
    batches: int = 0
    nbytes: int = 0
    make: float = 0.0
    makes: int = 0
    stream_wait: float = 0.0
    waits: int = 0
    send: float = 0.0
    sends: int = 0


class LoaderMetrics:
    """One loader's metrics (all labelled loader=NAME); a prometheus_client collector.

    The pool, the Runs and the streams of the loader record into it; `consumers` is asked at
    each scrape for the consumers attached now and their lag.
    """

    def __init__(self, loader: str, max_consumers: int = DEFAULT_MAX_CONSUMERS) -> None:
        self.loader = loader
        # The consumer label sets with series of their own (at most max_consumers).
        self.series = ConsumerSeries(loader, max_consumers)
        self._consumers: Callable[[], Iterable[ConsumerRow]] = list
        self.workers = 0  # remote_loader_workers now
        self._totals = Totals()
        self._totals_lock = threading.Lock()
        # The trainers' own reports of their stall (the Report RPC), within the same cap.
        self.stalls = StallBoard(
            lambda job, sharing, rank: self.series.labels(job, sharing, rank, add=False),
            max_consumers + OTHER_REPORTERS,
        )
        # Not registered anywhere: a server's MetricsServer collects its hosts' through collect().
        self.batches_served = Counter(
            "remote_loader_batches_served",
            "Batches sent to a consumer (errors at a batch's position not included).",
            CONSUMER_LABELS,
            registry=None,
        )
        self.bytes_served = Counter(
            "remote_loader_bytes_served",
            "Encoded batch bytes (header and tensor data, as the client decodes them) sent to a "
            "consumer; RemoteLoader.stats().bytes counts the same bytes on the client.",
            CONSUMER_LABELS,
            registry=None,
        )
        self.batch_errors = Counter(
            "remote_loader_batch_errors",
            "Errors sent at a batch's position (DatasetError on the client): the dataset, "
            "collate_fn or encoding raised, a worker kept dying, timeout, max_batch_bytes.",
            CONSUMER_LABELS,
            registry=None,
        )
        self._remote_bytes = Counter(
            "remote_loader_remote_batch_bytes",
            "Encoded bytes of batches made on other hosts (Ray actors on COPY or KEEP lanes), by "
            'the path they took to trainers: "server" (through this server, which received '
            'them) or "node" (fetched by the trainer from the node that made them: NOTE [ Node '
            "data connection ] in protos/node.py). server / (server + node) is the share of "
            "batch bytes that crossed this host.",
            ("loader", "path"),
            registry=None,
        )
        self._restarts = Counter(
            "remote_loader_worker_restarts",
            "Worker processes replaced after they died or were stopped for the loader's timeout.",
            ("loader",),
            registry=None,
        )
        self._pool_nodes = Gauge(
            "remote_loader_pool_nodes",
            "Hosts the loader's workers ran on when its pool last started (1 for local "
            'processes; Ray nodes holding its actors for pool = "ray").',
            ("loader", "backend"),
            registry=None,
        )
        self._workers = Gauge(
            "remote_loader_workers",
            "Workers making the loader's batches: its num_workers from start-up and each time "
            'its pool starts (0: made in the server process), then as num_workers = "auto" '
            "sets them.",
            ("loader",),
            registry=None,
        )
        self._prefetch = Gauge(
            "remote_loader_prefetch_factor",
            "Tasks in flight per worker: the loader's prefetch_factor from start-up (absent with "
            'num_workers = 0), then as prefetch_factor = "auto" sets it.',
            ("loader",),
            registry=None,
        )
        self._worker_changes = Counter(
            "remote_loader_autotune_changes",
            'Changes made by num_workers or prefetch_factor = "auto", by setting and by what '
            'streams waited on: "production" (raised) or "consumers" (lowered).',
            ("loader", "setting", "reason"),
            registry=None,
        )
        self._busy = Counter(
            "remote_loader_worker_busy_seconds",
            "Seconds the loader's workers (or the server, with num_workers = 0) spent making "
            "batches: rate() / remote_loader_workers is the share of the time they were busy.",
            ("loader",),
            registry=None,
        )
        self._pool_workers = Gauge(
            "remote_loader_pool_workers",
            "Workers (processes or Ray actors) of the loader's pool when it last started.",
            ("loader", "backend"),
            registry=None,
        )
        self._queue_wait = Histogram(
            "remote_loader_queue_wait_seconds",
            "Seconds a batch waited in each server queue: index (task submitted -> a worker "
            "starts it), result (worker done -> the server reads it), reorder (read -> its turn "
            "in sampler order), lane (ready -> its stream takes it; per consumer for broadcast).",
            ("loader", "queue"),
            buckets=BUCKETS,
            registry=None,
        )
        self._latency = Histogram(
            "remote_loader_batch_latency_seconds",
            "Seconds from a batch's task being submitted to the batch being ready to send in the "
            "server (in order, in its lane): the index, make, result and reorder stages together.",
            ("loader",),
            buckets=BUCKETS,
            registry=None,
        )
        self._make = Histogram(
            "remote_loader_batch_make_seconds",
            "Seconds a worker (or the server, with num_workers = 0) spent making a batch: the "
            "dataset, collate_fn and encoding.",
            ("loader",),
            buckets=BUCKETS,
            registry=None,
        )
        self._stream_wait = Histogram(
            "remote_loader_stream_wait_seconds",
            "Seconds a stream waited for its next batch to be ready (per batch sent): high "
            "means production is the bottleneck.",
            ("loader",),
            buckets=BUCKETS,
            registry=None,
        )
        self._send = Histogram(
            "remote_loader_send_seconds",
            "Seconds a stream spent handing a batch to gRPC (per batch sent), mostly blocked by "
            "flow control: high means the client or the network is the bottleneck.",
            ("loader",),
            buckets=BUCKETS,
            registry=None,
        )
        # Bound once: recording is then one lock and an add, no label lookup.
        self.restarts = self._restarts.labels(loader)
        self.index_wait, self.result_wait, self.reorder_wait, self.lane_wait = (
            self._queue_wait.labels(loader, queue) for queue in QUEUES
        )
        self.latency = self._latency.labels(loader)
        self.busy = self._busy.labels(loader)
        self.make = self._make.labels(loader)
        self.stream_wait = self._stream_wait.labels(loader)
        self.send = self._send.labels(loader)
        self._families = (
            self.batches_served,
            self.bytes_served,
            self.batch_errors,
            self._remote_bytes,
            self._restarts,
            self._pool_nodes,
            self._pool_workers,
            self._workers,
            self._prefetch,
            self._worker_changes,
            self._busy,
            self._queue_wait,
            self._latency,
            self._make,
            self._stream_wait,
            self._send,
        )

    def remote_bytes(self, path: str, nbytes: int) -> None:
        """`nbytes` of a batch made on another host reached a trainer by `path` ("server",
        "node"): remote_loader_remote_batch_bytes."""
        self._remote_bytes.labels(self.loader, path).inc(nbytes)

    def configured(self, workers: int, prefetch: int | None) -> None:
        """The loader starts with `workers` workers (0: in the server process), each with
        `prefetch` tasks in flight (None: no workers): the gauges autotuning moves exist from
        the first scrape, whatever the loader's settings."""
        self._workers.labels(self.loader).set(workers)
        self.workers = workers
        if prefetch is not None and workers > 0:
            self._prefetch.labels(self.loader).set(prefetch)

    def autotuned(self, setting: str, value: int, reason: str) -> None:
        """Autotuning set `setting` ("num_workers" or "prefetch_factor") to `value` because
        streams waited on `reason` ("production" or "consumers")."""
        gauge = self._workers if setting == "num_workers" else self._prefetch
        gauge.labels(self.loader).set(value)
        if setting == "num_workers":
            self.workers = value
        self._worker_changes.labels(self.loader, setting, reason).inc()

    def pool_started(self, backend: str, nodes: int, workers: int) -> None:
        """A pool of `backend` started with `workers` workers on `nodes` hosts."""
        self._pool_nodes.labels(self.loader, backend).set(nodes)
        self._pool_workers.labels(self.loader, backend).set(workers)
        self._workers.labels(self.loader).set(workers)
        self.workers = workers

    def watch_consumers(self, consumers: Callable[[], Iterable[ConsumerRow]]) -> None:
        """Where scrapes read the attached consumers and their lag from (the loader's Runs)."""
        self._consumers = consumers

    def stream(self, job: str, sharing: str, rank: int) -> StreamMetrics:
        """The recorder of one consumer's stream."""
        return StreamMetrics(self, self.series.labels(job, sharing, rank, add=True))

    def worker_timing(
        self, submitted: float, started: float, finished: float, received: float
    ) -> None:
        """A worker's batch came back: its time.monotonic() stamps (see Result in worker.py)."""
        self.index_wait.observe(max(0.0, started - submitted))
        self.made(finished - started)
        self.result_wait.observe(max(0.0, received - finished))

    def made(self, seconds: float) -> None:
        """A worker (or the server) spent `seconds` making a batch."""
        seconds = max(0.0, seconds)
        self.make.observe(seconds)
        self.busy.inc(seconds)
        self.add(busy=seconds, make=seconds, makes=1)

    def add(self, **amounts: float) -> None:
        """Adds to the running totals (Totals' fields)."""
        with self._totals_lock:
            for name, amount in amounts.items():
                setattr(self._totals, name, getattr(self._totals, name) + amount)

    def totals(self) -> Totals:
        """A copy of the running totals."""
        with self._totals_lock:
            return dataclasses.replace(self._totals)

    def consumers(self) -> list[ConsumerRow]:
        """The consumers attached now (the loader's Runs)."""
        return list(self._consumers())

    def batch_ready(self, submitted: float, received: float, now: float) -> None:
        """A batch left the reorder buffer for its lane."""
        self.reorder_wait.observe(max(0.0, now - received))
        self.latency.observe(max(0.0, now - submitted))

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            yield from family.collect()
        yield from self.series.collect(self._consumers())
        yield from self.stalls.collect()


class StreamMetrics:
    """One consumer's recorder: its counters bound to its labels, shared histograms."""

    def __init__(self, loader: LoaderMetrics, labels: ConsumerLabels) -> None:
        self._loader = loader
        self._batches = loader.batches_served.labels(*labels)
        self._bytes = loader.bytes_served.labels(*labels)
        self._errors = loader.batch_errors.labels(*labels)

    def took(self, waited: float, queued: float) -> None:
        """The stream took a batch after waiting `waited` s; it had been ready `queued` s."""
        self._loader.stream_wait.observe(waited)
        self._loader.lane_wait.observe(max(0.0, queued))
        self._loader.add(stream_wait=waited, waits=1)

    def sending(self, seconds: float) -> None:
        """The stream was done with a batch `seconds` after it took it."""
        self._loader.send.observe(seconds)
        self._loader.add(send=seconds, sends=1)

    def sent(self, nbytes: int, error: bool) -> None:
        """A batch of `nbytes` encoded bytes (or an error at its position) was sent."""
        if error:
            self._errors.inc()
        else:
            self._batches.inc()
            self._bytes.inc(nbytes)
            self._loader.add(batches=1, nbytes=nbytes)
