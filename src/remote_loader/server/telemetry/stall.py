"""The trainers' stall as they report it (the Report RPC, NOTE [ Stall stages ] in
protos/stall.py): one loader's reporters with about a minute of history each, the gauges they
add to its metrics, and the signal autotuning reads.

NOTE [ Stall board ]

A reporter is one RemoteLoader (its random `reporter` id). The board keeps, for each, its latest
report, when it came and HISTORY samples (wait fraction, batches/s), one per report.

Bounds, whatever the clients send:
- at most `max_reporters` at once: the loader's consumer-series cap (metrics_max_consumers) plus
  OTHER_REPORTERS for those past it; a new reporter past that is refused until one goes quiet;
- a reporter is forgotten REPORT_TTL after its latest report (its trainer stopped or left);
- a report closer than MIN_REPORT_GAP to its reporter's previous one is refused.
Memory is then O(max_reporters * HISTORY) and each report O(1).

Series: a reporter's gauges take its consumer's labels as the loader's metrics give them
(`labels`): its own while the consumer has a series of its own, else job="other",
rank="other" (NOTE on CONSUMER_LABELS in server/telemetry/series.py). Reporters with the same
labels (broadcast consumers all rank 0) show as one series: the one that waits most, as the lag
gauge shows the one furthest behind. A reporter forgotten drops its series: they are gauges.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from remote_loader.protos.stall import (
    HISTORY,
    MIN_REPORT_GAP,
    REPORT_INTERVAL,
    REPORT_TTL,
    STAGES,
    WORKERS,
)

# Reporters allowed beyond the consumer-series cap (they share job="other", rank="other").
OTHER_REPORTERS = 16
# How recent a report must be for autotuning to read it: two report intervals and some slack.
FRESH_FOR_TUNING = 3 * REPORT_INTERVAL

StallLabels = tuple[str, str, str, str]  # loader, job, sharing, rank


@dataclasses.dataclass(frozen=True)
class Report:
    """One StallReport as the board keeps it (fractions clamped to [0, 1])."""

    job: str
    sharing: str
    rank: int
    world_size: int
    epoch: int
    window: float
    wait_fraction: float
    stages: dict[str, float]  # by stage: its part of wait_fraction
    stage: str  # "" or one of STAGES
    batches_per_second: float
    recent_wait_fraction: float
    recent_stage: str


@dataclasses.dataclass
class Seen:
    """A reporter as the board holds it: its latest report, when it came, its history."""

    reporter: int
    labels: StallLabels
    report: Report
    at: float
    history: collections.deque[tuple[float, float]]  # (wait fraction, batches/s), oldest first


class StallBoard:
    """One loader's reporters (NOTE [ Stall board ]). Thread-safe: Report handlers record,
    scrapes, Status and the pool's tuner read."""

    def __init__(
        self,
        labels: Callable[[str, str, int], StallLabels],
        max_reporters: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._labels = labels
        self.max_reporters = max_reporters
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[int, Seen] = {}

    def record(self, reporter: int, report: Report) -> str | None:
        """Keeps `reporter`'s new report; why not (for RESOURCE_EXHAUSTED), or None if kept."""
        now = self._clock()
        labels = self._labels(report.job, report.sharing, report.rank)
        with self._lock:
            self._expire(now)
            seen = self._seen.get(reporter)
            if seen is None:
                if len(self._seen) >= self.max_reporters:
                    return (
                        f"this loader already has {self.max_reporters} trainers reporting; "
                        f"one is forgotten {REPORT_TTL:g} s after its last report"
                    )
                seen = self._seen[reporter] = Seen(
                    reporter, labels, report, now, collections.deque(maxlen=HISTORY)
                )
            elif now - seen.at < MIN_REPORT_GAP:
                return (
                    f"reports come at most one per {MIN_REPORT_GAP:g} s from one trainer; "
                    f"this one came {now - seen.at:.2f} s after its previous"
                )
            seen.labels, seen.report, seen.at = labels, report, now
            seen.history.append((report.wait_fraction, report.batches_per_second))
        return None

    def _expire(self, now: float) -> None:
        for reporter in [r for r, s in self._seen.items() if now - s.at > REPORT_TTL]:
            del self._seen[reporter]

    def seen(self) -> list[tuple[Seen, float]]:
        """The reporters not forgotten, each with its report's age in seconds (copies)."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            return [
                (dataclasses.replace(s, history=collections.deque(s.history)), now - s.at)
                for s in self._seen.values()
            ]

    def workers_stall(self) -> float | None:
        """For autotuning (NOTE [ Worker autotuning ]): the highest share of its last second a
        trainer spent waiting on the workers, among reports at most FRESH_FOR_TUNING old; 0.0
        when those trainers waited on something else or not at all; None when none reports (an
        older client: the tuner goes by the workers' busy time alone)."""
        now = self._clock()
        with self._lock:
            fresh = [s.report for s in self._seen.values() if now - s.at <= FRESH_FOR_TUNING]
        if not fresh:
            return None
        waiting = [r.recent_wait_fraction for r in fresh if r.recent_stage == WORKERS]
        return max(waiting, default=0.0)

    def collect(self) -> Iterator[Metric]:
        names = ("loader", "job", "sharing", "rank")
        stall = GaugeMetricFamily(
            "remote_loader_consumer_stall",
            "Share of its last seconds (about 10) a trainer spent blocked in next(), as it "
            "reports it (RemoteLoader.stats().window_wait_fraction); while it reports.",
            labels=names,
        )
        by_stage = GaugeMetricFamily(
            "remote_loader_consumer_stall_by_stage",
            "Parts of remote_loader_consumer_stall by the stage that held the batch: workers "
            "(not made yet when its stream asked), in flight (made, not yet at the trainer: "
            "queues, flow control, network), copy (receiving, decoding, copying to the device).",
            labels=(*names, "stage"),
        )
        worst: dict[StallLabels, Report] = {}
        for seen, _ in self.seen():
            held = worst.get(seen.labels)
            if held is None or seen.report.wait_fraction > held.wait_fraction:
                worst[seen.labels] = seen.report
        for labels, report in sorted(worst.items()):
            stall.add_metric(labels, report.wait_fraction)
            for stage in STAGES:
                by_stage.add_metric((*labels, stage), report.stages.get(stage, 0.0))
        yield stall
        yield by_stage
