"""num_workers = "auto": how many workers a pool should have, decided from what they did.

NOTE [ Worker autotuning ]

Every TUNE_INTERVAL the pool tells the tuner how long its workers spent making batches since
the last decision; busy = that time / (workers * interval).

- Busy above ADD_ABOVE: the workers cannot keep up, so the streams wait on production. A worker
  is added if the host has at least half a core idle (from /proc/stat over the same interval)
  and the pool is below max_workers: more workers on a saturated host only take CPU from each
  other and from the server.
- Busy below REMOVE_BELOW: the workers wait for room, so the consumers are the bottleneck (or
  nobody reads); one worker goes, down to one.
- At most one change per interval, and none in the interval after a change (its effect is not
  measured yet), so the count does not oscillate on a noisy machine.

Batches stay identical whatever the count because autotuning requires seeding = "per_batch"
(each batch seeded from its index, whoever makes it) and a map-style dataset (an
IterableDataset shards by worker count). A worker that joins sees get_worker_info() with the
count of the moment; workers already running keep the count they started with.

Applied by the local pool (server/pool_resize.py: worker processes) and the Ray pool
(server/ray_pool.py: actors, through the bridge's Resize); only the last worker is removed,
once it holds no task, so worker ids stay 0..n-1.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

TUNE_INTERVAL = 1.0
ADD_ABOVE = 0.85
REMOVE_BELOW = 0.5
# Idle CPU (in cores) the host must have for a worker to be added.
MIN_IDLE_CORES = 0.5


@dataclasses.dataclass(frozen=True)
class Decision:
    delta: int  # +1: add a worker, -1: remove one
    reason: str  # "production" or "consumers": what the streams wait on
    detail: str  # for the log line


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
        interval: float = TUNE_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
        idle_cores: Callable[[], float | None] | None = None,
    ) -> None:
        self.max_workers = max_workers
        self.max_pool_bytes = max_pool_bytes
        self.prefetch = prefetch
        self.largest_batch = 0  # bytes: what one more worker's tasks in flight may hold each
        self.interval = interval
        self._clock = clock
        self._idle_cores = idle_cores if idle_cores is not None else host_idle_cores()
        self._since = clock()
        self._busy = 0.0
        self._settling = False  # the interval after a change: measured, not acted on
        self._idle_cores()  # starts the host's measure

    def made(self, seconds: float, nbytes: int = 0) -> None:
        """A worker spent `seconds` making a batch of `nbytes` encoded bytes."""
        self._busy += max(0.0, seconds)
        self.largest_batch = max(self.largest_batch, nbytes)

    def decide(self, workers: int) -> Decision | None:
        """Called often; answers at most once per interval."""
        now = self._clock()
        elapsed = now - self._since
        if elapsed < self.interval:
            return None
        busy = self._busy / (workers * elapsed)
        idle = self._idle_cores()
        self._since, self._busy = now, 0.0
        if self._settling:
            self._settling = False
            return None
        decision = None
        if busy > ADD_ABOVE and workers < self.max_workers:
            in_flight = (workers + 1) * self.prefetch * self.largest_batch
            if self.max_pool_bytes is not None and in_flight > self.max_pool_bytes:
                pass  # one more worker's batches would not fit in max_pool_bytes
            elif idle is not None and idle >= MIN_IDLE_CORES:
                decision = Decision(
                    +1,
                    "production",
                    f"workers {busy:.0%} busy, {idle:.1f} cores idle on the host",
                )
        elif busy < REMOVE_BELOW and workers > 1:
            decision = Decision(-1, "consumers", f"workers only {busy:.0%} busy")
        self._settling = decision is not None
        return decision
