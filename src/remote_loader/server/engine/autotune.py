"""num_workers = "auto": how many workers a pool should have, decided from what they did.

NOTE [ Worker autotuning ]

Every TUNE_INTERVAL the pool tells the tuner how long its workers spent making batches since
the last decision; busy = that time / (workers * interval).

- The trainers wait on the workers: a worker is added if the host has at least half a core
  idle (from /proc/stat over the same interval) and the pool is below max_workers: more
  workers on a saturated host only take CPU from each other and from the server. Where the
  trainers report their stall (NOTE [ Stall stages ] in protos/stall.py; the pool reads the
  loader's StallBoard, server/telemetry/stall.py), that means one of them spent more than
  STALL_ADD_ABOVE of its last second blocked in next() on the stage "workers"; while they
  report and none does, no worker is added however busy the workers are (they keep up: one
  more would only make batches sooner than anyone reads them). Where none reports (older
  clients), the workers' busy time stands in for it: busy above ADD_ABOVE.
- Busy below REMOVE_BELOW, the pool below its cap of tasks in flight: the workers wait for
  room, so the consumers are the bottleneck (or nobody reads); one worker goes, down to one
  (with prefetch_factor = "auto", the queue per worker is made shallower first).
- Not all busy although the pool sat at its cap (prefetch_factor * num_workers tasks out) more
  than half the time: tasks wait behind a slow one while other workers have none; with
  prefetch_factor = "auto" the queue per worker deepens, up to MAX_PREFETCH.
- At most one change per interval, and none in the interval after a change (its effect is not
  measured yet), so the count does not oscillate on a noisy machine.

Batches stay identical whatever the count because autotuning requires seeding = "per_batch"
(each batch seeded from its index, whoever makes it) and a map-style dataset (an
IterableDataset shards by worker count). A worker that joins sees get_worker_info() with the
count of the moment; workers already running keep the count they started with.

Applied by a Resizer, part of the pool core (server/engine/pool.py) whatever runs the workers
(processes, or Ray actors); only the last worker is removed, once it holds no task, so worker
ids stay 0..n-1.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Protocol

from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.engine.seam import in_flight_bound
from remote_loader.server.telemetry.metrics import LoaderMetrics

log = logging.getLogger(__name__)

TUNE_INTERVAL = 1.0
ADD_ABOVE = 0.85
# A trainer blocked on the workers more than this share of its last second wants a worker.
STALL_ADD_ABOVE = 0.05
REMOVE_BELOW = 0.5
# Idle CPU (in cores) the host must have for a worker to be added.
MIN_IDLE_CORES = 0.5
# prefetch_factor = "auto": between torch's default and this.
MIN_PREFETCH, MAX_PREFETCH = 2, 8
# Fraction of polls at the pool's cap (prefetch_factor * num_workers tasks out) above which
# idle workers mean the cap, not the work, held production back.
CAPPED_ABOVE = 0.5


@dataclasses.dataclass(frozen=True)
class Decision:
    delta: int  # +1 or -1
    reason: str  # "production" or "consumers": what the streams wait on
    detail: str  # for the log line
    setting: str = "num_workers"  # or "prefetch_factor"


def new_tuner(spec: LoaderSpec, prefetch: int) -> WorkerTuner | None:
    """The tuner of a pool whose spec says num_workers or prefetch_factor = "auto"."""
    pool = spec.parts.pool
    if not (pool.autotune or pool.autotune_prefetch):
        return None
    return WorkerTuner(
        pool.max_workers,
        max_pool_bytes=pool.max_pool_bytes,
        prefetch=prefetch,
        workers=pool.autotune,
        prefetch_factor=pool.autotune_prefetch,
    )


def log_decision(loader: str, metrics: LoaderMetrics, decision: Decision, value: int) -> None:
    """Logs a decision the pool has applied (`value`: the setting now) and counts it."""
    log.info(
        "loader %r: %s %s to %d (streams wait on %s: %s)",
        loader,
        "raising" if decision.delta > 0 else "lowering",
        decision.setting,
        value,
        decision.reason,
        decision.detail,
    )
    metrics.autotuned(decision.setting, value, decision.reason)


class Tunable(Protocol):
    """What a Resizer reads and changes in a pool: its size, its queue per worker and bound
    (engine.in_flight_bound), which workers take tasks, and how it grows or loses its last."""

    num_workers: int
    prefetch: int
    max_outstanding: int

    @property
    def outstanding(self) -> int: ...

    @property
    def active(self) -> list[bool]:
        """Per worker: whether it is given tasks (False: drained, or its data ran dry)."""
        ...

    def holds(self, worker_id: int) -> bool:
        """Whether `worker_id` still has tasks out."""
        ...

    def add_worker(self) -> None: ...
    def remove_last(self) -> None: ...


class Resizer:
    """Applies a WorkerTuner's decisions to a pool (NOTE [ Worker autotuning ]); the pool calls
    `made` for every batch back and `tune` from its poll (the Run's thread)."""

    def __init__(self, tuner: WorkerTuner, loader: str, metrics: LoaderMetrics) -> None:
        self.tuner = tuner
        self._loader = loader
        self._metrics = metrics
        if tuner.stall is None:
            tuner.stall = metrics.stalls.workers_stall  # what the trainers report

    def made(self, seconds: float, nbytes: int) -> None:
        self.tuner.made(seconds, nbytes)

    def tune(self, pool: Tunable) -> None:
        """Applies the tuner's decision: a worker added at once, or the last one drained (no
        new tasks) and removed once it holds none, or the queue per worker changed."""
        tuner = self.tuner
        if not pool.active:
            return  # between epochs
        tuner.polled(pool.outstanding >= pool.max_outstanding)
        last = pool.num_workers - 1
        if last > 0 and not pool.active[last] and not pool.holds(last):
            pool.remove_last()
            last = pool.num_workers - 1
        decision = tuner.decide(pool.num_workers)
        if decision is None or not all(pool.active):
            return
        if decision.setting == "prefetch_factor":
            pool.prefetch = tuner.prefetch = pool.prefetch + decision.delta
            pool.max_outstanding = in_flight_bound(pool.prefetch, pool.num_workers)
            target = pool.prefetch
        elif decision.delta > 0:
            pool.add_worker()
            target = pool.num_workers
        else:
            pool.active[last] = False  # drained first: removed by a later tune
            pool.max_outstanding = in_flight_bound(pool.prefetch, last)
            target = last
        log_decision(self._loader, self._metrics, decision, target)


def host_idle_cores() -> Callable[[], float | None]:
    """A probe: each call returns the cores idle on this host since the previous call (None on
    the first, or where /proc/stat cannot be read)."""
    last: list[tuple[float, float]] = []

    def probe() -> float | None:
        try:
            with open("/proc/stat") as f:
                fields = [float(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle, total = fields[3] + (fields[4] if len(fields) > 4 else 0.0), sum(fields)
        previous = last[0] if last else None
        last[:] = [(idle, total)]
        if previous is None or total <= previous[1]:
            return None
        return (idle - previous[0]) / (total - previous[1]) * (os.cpu_count() or 1)

    return probe


class WorkerTuner:
    """Decides whether the pool grows or shrinks (NOTE [ Worker autotuning ])."""

    def __init__(
        self,
        max_workers: int,
        *,
        max_pool_bytes: int | None = None,
        prefetch: int = 2,
        workers: bool = True,
        prefetch_factor: bool = False,
        interval: float = TUNE_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
        idle_cores: Callable[[], float | None] | None = None,
        stall: Callable[[], float | None] | None = None,
    ) -> None:
        self.max_workers = max_workers
        self.max_pool_bytes = max_pool_bytes
        self.prefetch = prefetch  # the pool keeps it current
        self.tunes_workers = workers  # num_workers = "auto"
        self.tunes_prefetch = prefetch_factor  # prefetch_factor = "auto"
        self._polls = self._capped = 0
        self.largest_batch = 0  # bytes: what one more worker's tasks in flight may hold each
        self.interval = interval
        self._clock = clock
        self._idle_cores = idle_cores if idle_cores is not None else host_idle_cores()
        # The trainers' wait on the workers (StallBoard.workers_stall); None: none reports.
        self.stall = stall
        self._since = clock()
        self._busy = 0.0
        self._settling = False  # the interval after a change: measured, not acted on
        self._idle_cores()  # starts the host's measure

    def made(self, seconds: float, nbytes: int = 0) -> None:
        """A worker spent `seconds` making a batch of `nbytes` encoded bytes."""
        self._busy += max(0.0, seconds)
        self.largest_batch = max(self.largest_batch, nbytes)

    def polled(self, capped: bool) -> None:
        """The pool was polled, with (capped) or without its cap of tasks out."""
        self._polls += 1
        self._capped += capped

    def decide(self, workers: int) -> Decision | None:
        """Called often; answers at most once per interval."""
        now = self._clock()
        elapsed = now - self._since
        if elapsed < self.interval:
            return None
        busy = self._busy / (workers * elapsed)
        capped = self._capped / self._polls if self._polls else 0.0
        idle = self._idle_cores()
        stall = self.stall() if self.stall is not None else None
        self._since, self._busy, self._polls, self._capped = now, 0.0, 0, 0
        if self._settling:
            self._settling = False
            return None
        decision = self._choose(workers, busy, capped, idle, stall)
        self._settling = decision is not None
        return decision

    def _fits(self, workers: int, prefetch: int) -> bool:
        """`workers` * `prefetch` batches in flight fit in max_pool_bytes."""
        in_flight = workers * prefetch * self.largest_batch
        return self.max_pool_bytes is None or in_flight <= self.max_pool_bytes

    def _choose(
        self, workers: int, busy: float, capped: float, idle: float | None, stall: float | None
    ) -> Decision | None:
        short = busy > ADD_ABOVE if stall is None else stall > STALL_ADD_ABOVE
        if short or busy > ADD_ABOVE:
            if (
                short
                and self.tunes_workers
                and workers < self.max_workers
                and self._fits(workers + 1, self.prefetch)
                and idle is not None
                and idle >= MIN_IDLE_CORES
            ):
                why = f"workers {busy:.0%} busy"
                if stall is not None:
                    why = f"trainers {stall:.0%} stalled on the workers, {why}"
                return Decision(+1, "production", f"{why}, {idle:.1f} cores idle on the host")
            return None
        if capped > CAPPED_ABOVE:
            # Workers idle while the pool sat at its cap: tasks queued behind a slow one while
            # the others had none (not the consumers: they would leave the pool below its cap).
            # A deeper queue per worker evens that out.
            if (
                self.tunes_prefetch
                and self.prefetch < MAX_PREFETCH
                and self._fits(workers, self.prefetch + 1)
            ):
                detail = f"workers {busy:.0%} busy while at the cap {capped:.0%} of the time"
                return Decision(+1, "production", detail, "prefetch_factor")
            return None
        if busy < REMOVE_BELOW:
            detail = f"workers only {busy:.0%} busy"
            if self.tunes_prefetch and self.prefetch > MIN_PREFETCH:
                return Decision(-1, "consumers", detail, "prefetch_factor")
            if self.tunes_workers and workers > 1:
                return Decision(-1, "consumers", detail)
        return None
