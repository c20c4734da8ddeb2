"""The Status RPC and the status page's JSON: a snapshot of the server's loaders and their
consumers (attached streams and the trainers' stall reports), with about a minute of history.

A loader's rates (busy workers, batches and bytes out, seconds per stage, host CPU) come from
its running totals (LoaderMetrics.totals), sampled at most once per REPORT_INTERVAL: at each
stall report, Status call and page poll. Nothing runs between them; the history has a sample
for each second someone reported or looked.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import threading
import time
from collections.abc import Callable, Mapping

import grpc

from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos.stall import COPY, HISTORY, IN_FLIGHT, REPORT_INTERVAL, WORKERS
from remote_loader.server.api.validation import Undecodable, decoded
from remote_loader.server.engine.autotune import host_idle_cores
from remote_loader.server.sharing.host import LoaderHost
from remote_loader.server.telemetry.metrics import LoaderMetrics, Totals
from remote_loader.server.telemetry.series import ConsumerRow
from remote_loader.server.telemetry.stall import Seen

# The current rates are over the last few samples (one second is noisy).
RATE_SPAN = 5.0


@dataclasses.dataclass(frozen=True)
class Rates:
    """A loader's figures between two samples."""

    busy: float = 0.0  # share of the time its workers spent making batches
    batches: float = 0.0  # per second
    nbytes: float = 0.0  # per second
    make: float = 0.0  # seconds per batch made
    stream_wait: float = 0.0  # seconds per batch a stream waited for
    send: float = 0.0  # seconds per batch sent


def rates(before: Totals, after: Totals, seconds: float, workers: int) -> Rates:
    """The rates from `before` to `after`, `seconds` apart, with `workers` workers."""
    if seconds <= 0:
        return Rates()

    def per(total: float, count: int) -> float:
        return total / count if count > 0 else 0.0

    return Rates(
        busy=min(1.0, (after.busy - before.busy) / (max(workers, 1) * seconds)),
        batches=(after.batches - before.batches) / seconds,
        nbytes=(after.nbytes - before.nbytes) / seconds,
        make=per(after.make - before.make, after.makes - before.makes),
        stream_wait=per(after.stream_wait - before.stream_wait, after.waits - before.waits),
        send=per(after.send - before.send, after.sends - before.sends),
    )


class Pulse:
    """One loader's totals sampled over the last minute (at most one sample per interval)."""

    def __init__(self, metrics: LoaderMetrics, clock: Callable[[], float] = time.monotonic):
        self._metrics = metrics
        self._clock = clock
        self._samples: collections.deque[tuple[float, Totals, int]] = collections.deque(
            maxlen=HISTORY + 1
        )

    def sample(self) -> None:
        now = self._clock()
        if self._samples and now - self._samples[-1][0] < REPORT_INTERVAL:
            return
        self._samples.append((now, self._metrics.totals(), self._metrics.workers))

    def current(self) -> Rates:
        """The rates over the last RATE_SPAN seconds of samples, up to now."""
        now, totals, workers = self._clock(), self._metrics.totals(), self._metrics.workers
        older = [s for s in self._samples if now - s[0] >= RATE_SPAN]
        start = older[-1] if older else (self._samples[0] if self._samples else None)
        if start is None:
            return Rates()
        return rates(start[1], totals, now - start[0], workers)

    def history(self) -> list[Rates]:
        """The rates between consecutive samples, oldest first."""
        samples = list(self._samples)
        return [rates(a[1], b[1], b[0] - a[0], b[2]) for a, b in itertools.pairwise(samples)]


class Snapshots:
    """Snapshots of `hosts` (ServerStatus), and the pulses behind them."""

    def __init__(self, hosts: Mapping[str, LoaderHost]) -> None:
        self._hosts = dict(hosts)
        self._pulses = {name: Pulse(host.metrics) for name, host in self._hosts.items()}
        self._lock = threading.Lock()
        self._idle_cores = host_idle_cores()
        self._idle_cores()  # starts its measure
        self._cpu_used = 0.0
        self._cpu_at = time.monotonic()

    def tick(self) -> None:
        """Samples every loader's totals, and the host's CPU, if a sample is due."""
        with self._lock:
            for pulse in self._pulses.values():
                pulse.sample()
            now = time.monotonic()
            if now - self._cpu_at >= REPORT_INTERVAL:
                idle = self._idle_cores()
                if idle is not None:
                    self._cpu_used = max(0.0, (os.cpu_count() or 1) - idle)
                self._cpu_at = now

    def status(self) -> pb.ServerStatus:
        self.tick()
        status = pb.ServerStatus(history_interval=REPORT_INTERVAL)
        with self._lock:
            for name in sorted(self._hosts):
                status.loaders.append(self._loader(self._hosts[name], self._pulses[name]))
        return status

    def Status(
        self, request: pb.StatusRequest | Undecodable, context: grpc.ServicerContext
    ) -> pb.ServerStatus:
        decoded("Status", request, context)
        return self.status()

    def _loader(self, host: LoaderHost, pulse: Pulse) -> pb.LoaderStatus:
        pool = host.spec.parts.pool
        metrics = host.metrics
        now = pulse.current()
        history = pulse.history()
        loader = pb.LoaderStatus(
            name=host.spec.name,
            backend=pool.backend if pool.num_workers > 0 or pool.autotune else "inline",
            workers=metrics.workers,
            busy=now.busy,
            batches_per_second=now.batches,
            bytes_per_second=now.nbytes,
            cpu_cores_used=self._cpu_used,
            cores=os.cpu_count() or 1,
            make_seconds=now.make,
            stream_wait_seconds=now.stream_wait,
            send_seconds=now.send,
            busy_history=[r.busy for r in history],
            rate_history=[r.batches for r in history],
        )
        loader.consumers.extend(consumers(metrics.consumers(), metrics.stalls.seen()))
        return loader


def consumers(rows: list[ConsumerRow], seen: list[tuple[Seen, float]]) -> list[pb.ConsumerStatus]:
    """One entry per reporting trainer, joined with the attached stream of its labels, then
    one per attached stream no trainer reports for (an older client)."""
    attached: dict[tuple[str, str, int], list[ConsumerRow]] = {}
    for row in rows:
        attached.setdefault((row.job, row.sharing, row.rank), []).append(row)
    out: list[pb.ConsumerStatus] = []
    joined: set[tuple[str, str, int]] = set()
    for s, age in sorted(seen, key=lambda x: (x[0].report.job, x[0].report.rank, x[0].reporter)):
        r = s.report
        key = (r.job, r.sharing, r.rank)
        entry = pb.ConsumerStatus(
            consumer=pb.Consumer(
                sharing=r.sharing, job=r.job, rank=r.rank, world_size=r.world_size
            ),
            epoch=r.epoch,
            reported=True,
            wait_fraction=r.wait_fraction,
            workers=r.stages.get(WORKERS, 0.0),
            in_flight=r.stages.get(IN_FLIGHT, 0.0),
            copy=r.stages.get(COPY, 0.0),
            stage=r.stage,
            batches_per_second=r.batches_per_second,
            report_age=age,
            wait_history=[w for w, _ in s.history],
            rate_history=[b for _, b in s.history],
            reporter=s.reporter,
        )
        streams = attached.get(key)
        if streams:
            joined.add(key)
            entry.attached = True
            entry.lag = max(row.lag for row in streams)
            entry.ready = min(row.ready for row in streams)
        out.append(entry)
    for key, streams in sorted(attached.items()):
        if key in joined:
            continue
        for row in streams:
            out.append(
                pb.ConsumerStatus(
                    consumer=pb.Consumer(
                        sharing=row.sharing, job=row.job, rank=row.rank, world_size=row.world_size
                    ),
                    epoch=row.epoch,
                    attached=True,
                    lag=row.lag,
                    ready=row.ready,
                )
            )
    return out
