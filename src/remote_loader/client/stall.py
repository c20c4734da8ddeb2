"""A trainer's stall over a sliding window: how much of its last seconds the training loop spent
blocked in `next()`, and on which stage (NOTE [ Stall stages ] in protos/stall.py).

The training loop records its waits (`blocked`, `waited`); the reporter thread reads `figures`.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable

from remote_loader.protos.stall import STAGES, WINDOW_SECONDS, split_wait

# Waits kept: at most a window's worth, and never more than this many (a loop that makes
# thousands of tiny waits a second must not grow the deque without bound).
MAX_WAITS = 4096
# Below this wait fraction the loop is said not to wait at all: no stage is named.
STAGE_MIN_FRACTION = 0.01


@dataclasses.dataclass(frozen=True)
class Figures:
    """A window's figures: `wait_fraction` of `window` seconds blocked in next(), its parts by
    stage (`stages`), the stage that held most of it ("" when the loop did not wait: under
    STAGE_MIN_FRACTION) and the batches received per second."""

    window: float
    wait_fraction: float
    stages: dict[str, float]
    stage: str
    batches_per_second: float


NO_FIGURES = Figures(0.0, 0.0, dict.fromkeys(STAGES, 0.0), "", 0.0)


@dataclasses.dataclass(frozen=True)
class _Wait:
    start: float
    end: float
    # Seconds by stage (sums to end - start), empty for a wait that ended without a batch.
    stages: dict[str, float]
    batch: bool  # a batch was received at `end`


class StallWindow:
    """The waits of the last `window` seconds, for any number of epochs of one RemoteLoader.

    Thread-safe: the training loop records, the reporter thread reads.
    """

    def __init__(
        self, window: float = WINDOW_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window = window
        self._clock = clock
        self._lock = threading.Lock()
        self._waits: collections.deque[_Wait] = collections.deque(maxlen=MAX_WAITS)
        self._since: float | None = None  # the first next(): the window starts no earlier
        self._blocked_at: float | None = None  # a wait going on now began then
        self._last_stage = ""  # the stage of the latest wait with one

    def blocked(self, at: float) -> None:
        """The training loop entered next() at `at` (time.monotonic())."""
        with self._lock:
            if self._since is None:
                self._since = at
            self._blocked_at = at

    def waited(
        self, start: float, end: float, workers: float | None = None, copy: float = 0.0
    ) -> None:
        """The wait that began at `start` ended at `end`: with a batch whose stream waited
        `workers` s for it and whose receiver spent `copy` s on it, or (`workers` None) with
        no batch (an error, the end of the epoch)."""
        waited = max(0.0, end - start)
        stages = {} if workers is None else split_wait(waited, workers, copy)
        with self._lock:
            self._blocked_at = None
            self._waits.append(_Wait(start, end, stages, workers is not None))
            if stages and waited > 0:
                self._last_stage = max(stages, key=stages.__getitem__)

    def active(self, now: float | None = None) -> bool:
        """Whether the loop is in next() now, or left it within the window."""
        now = self._clock() if now is None else now
        with self._lock:
            if self._blocked_at is not None:
                return True
            return bool(self._waits) and self._waits[-1].end >= now - self.window

    def figures(self, window: float | None = None, now: float | None = None) -> Figures:
        """The figures of the last `window` seconds (the whole window by default) up to `now`."""
        window = self.window if window is None else window
        now = self._clock() if now is None else now
        with self._lock:
            if self._since is None:
                return NO_FIGURES
            begin = max(now - window, self._since)
            span = now - begin
            while self._waits and self._waits[0].end < now - self.window:
                self._waits.popleft()
            stages = dict.fromkeys(STAGES, 0.0)
            total = 0.0
            batches = 0
            for wait in self._waits:
                if wait.end < begin:
                    continue
                batches += wait.batch
                length = wait.end - wait.start
                inside = wait.end - max(wait.start, begin)
                total += inside
                if length > 0:
                    for stage, seconds in wait.stages.items():
                        stages[stage] += seconds * inside / length
            if self._blocked_at is not None:
                total += now - max(self._blocked_at, begin)
            last_stage = self._last_stage
        if span <= 0:
            return dataclasses.replace(NO_FIGURES, stages=stages)
        fraction = min(1.0, total / span)
        named = sum(stages.values())
        if fraction < STAGE_MIN_FRACTION:
            stage = ""
        elif named > 0:
            stage = max(stages, key=stages.__getitem__)
        else:
            stage = last_stage  # only a wait still going on: the stage that held the last one
        return Figures(
            window=span,
            wait_fraction=fraction,
            stages={k: min(1.0, v / span) for k, v in stages.items()},
            stage=stage,
            batches_per_second=batches / span,
        )
