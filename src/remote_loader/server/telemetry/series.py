"""A loader's consumer series: which consumers' label sets get metric series of their own (a
bounded number, whatever the clients send), and the gauges of the consumers attached now.

`LoaderMetrics` (server/telemetry/metrics.py) keeps one `ConsumerSeries`; the stall board takes
its labels from it too (NOTE [ Stall board ] in server/telemetry/stall.py).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

# A consumer's series: one per (loader, job, sharing, rank) seen, kept for the server's life as
# counters must be. Job names and ranks are the clients' to choose, so a loader gives series of
# their own to its first `max_consumers` label sets only; a consumer past them is counted under
# job="other", rank="other" (its sharing mode kept). The bound on a scrape: about
# 9 * (max_consumers + 3) consumer series per loader, whatever the clients send (served, bytes,
# errors, lag and ready; the stall and its 3 stages while a trainer reports, NOTE [ Stall
# board ] in server/telemetry/stall.py).
CONSUMER_LABELS = ("loader", "job", "sharing", "rank")
DEFAULT_MAX_CONSUMERS = 256
OTHER = "other"
# A job label longer than this is cut, and ends in a hash of the whole name so that two long
# names sharing their start stay two series: a label line stays a few hundred bytes.
MAX_LABEL_CHARS = 64

ConsumerLabels = tuple[str, str, str, str]  # loader, job, sharing, rank


class ConsumerRow(NamedTuple):
    """An attached consumer (a stream), as scrapes and the status snapshot see it."""

    job: str
    sharing: str
    rank: int
    lag: int  # batches behind (remote_loader_consumer_lag_batches)
    ready: int = 0  # its batches made and not yet sent to it
    epoch: int = 0
    world_size: int = 1


def label_value(text: str) -> str:
    """`text` as a label value: itself, or cut to MAX_LABEL_CHARS ending in a hash of all of it."""
    if len(text) <= MAX_LABEL_CHARS:
        return text
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()
    return f"{text[: MAX_LABEL_CHARS - len(digest) - 1]}~{digest}"


class ConsumerSeries:
    """One loader's consumer label sets with series of their own (at most `max_consumers`).
    Thread-safe: streams take their labels as they start, scrapes and reports read them."""

    def __init__(self, loader: str, max_consumers: int = DEFAULT_MAX_CONSUMERS) -> None:
        if max_consumers < 0:
            raise ValueError(f"max_consumers must be >= 0, got {max_consumers}")
        self.loader = loader
        self.max_consumers = max_consumers
        self._series: set[tuple[str, str, str]] = set()
        self._lock = threading.Lock()

    def labels(self, job: str, sharing: str, rank: int, add: bool) -> ConsumerLabels:
        """A consumer's labels: its own while the loader has room for its series (`add`: take
        room), else job="other", rank="other"."""
        key = (label_value(job), sharing, str(rank))
        with self._lock:
            if key not in self._series:
                if not add or len(self._series) >= self.max_consumers:
                    return (self.loader, OTHER, sharing, OTHER)
                self._series.add(key)
        return (self.loader, *key)

    def collect(self, rows: Iterable[ConsumerRow]) -> Iterator[Metric]:
        """The gauges of the consumers attached now (`rows`): how many, and each one's lag and
        batches ready."""
        rows = list(rows)
        consumers = GaugeMetricFamily(
            "remote_loader_consumers",
            "Consumers (streams) attached to the loader now.",
            labels=("loader",),
        )
        consumers.add_metric((self.loader,), len(rows))
        yield consumers
        lag = GaugeMetricFamily(
            "remote_loader_consumer_lag_batches",
            "How far behind a consumer is, in batches. broadcast: behind the job's fastest "
            "consumer; partition: its batches made and not yet sent; dynamic: the job's "
            "batches made and not yet sent (shared by its consumers).",
            labels=CONSUMER_LABELS,
        )
        ready = GaugeMetricFamily(
            "remote_loader_consumer_ready_batches",
            "Batches made and waiting to be sent to a consumer, ahead of it: 0 while it waits "
            "on the workers. broadcast: the job's batches it has not read yet.",
            labels=CONSUMER_LABELS,
        )
        # Consumers with the same labels (two epochs of a job overlapping, broadcast
        # consumers all rank 0) are one series: the one furthest behind (and the one with
        # the fewest batches ready). Consumers past max_consumers share job="other",
        # rank="other" alike.
        worst: dict[ConsumerLabels, tuple[int, int]] = {}
        for row in rows:
            key = self.labels(row.job, row.sharing, row.rank, add=False)
            behind, ahead = worst.get(key, (0, row.ready))
            worst[key] = (max(behind, row.lag), min(ahead, row.ready))
        for labels, (behind, ahead) in sorted(worst.items()):
            lag.add_metric(labels, behind)
            ready.add_metric(labels, ahead)
        yield lag
        yield ready
