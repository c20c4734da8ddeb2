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

# NOTE [ Coalesced waits ]: a loop taking thousands of batches a second makes thousands of
# waits a second, so a wait that begins less than a granule (the window / GRANULES_PER_WINDOW:
# 10 ms of 10 s) after the start of the entry before it is summed into that entry: at most
# GRANULES_PER_WINDOW + 1 entries cover a window, whatever the rate. Keeping each wait but at
# most 4096 of them made a trainer above ~410 batches/s read low (batches/s capped there, its
# stall cut to the last 4096 waits); summing costs only where the window's edge cuts an entry,
# at most a granule of it, counted pro rata.
GRANULES_PER_WINDOW = 1000
# The deque's bound: entries begin a granule apart at least, so this many span two windows
# and the oldest one dropped at the bound has left the window already.
MAX_WAITS = 2 * GRANULES_PER_WINDOW
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


@dataclasses.dataclass
class _Waits:
    """Waits from `start` to `end` (one, or those that began within a granule: NOTE
    [ Coalesced waits ]): `waited` seconds blocked in all, by stage in `stages` (waits that
    ended without a batch have none), and the batches they received."""

    start: float
    end: float
    waited: float
    stages: dict[str, float]
    batches: int

    def share(self, begin: float) -> float:
        """The part of these waits after `begin` (pro rata over the entry's span)."""
        if self.start >= begin:
            return 1.0
        span = self.end - self.start
        return max(0.0, self.end - begin) / span if span > 0 else 0.0


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
        self._granule = window / GRANULES_PER_WINDOW
        self._waits: collections.deque[_Waits] = collections.deque(maxlen=MAX_WAITS)
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
            last = self._waits[-1] if self._waits else None
            if last is not None and start - last.start < self._granule:
                last.end = max(last.end, end)
                last.waited += waited
                for stage, seconds in stages.items():
                    last.stages[stage] = last.stages.get(stage, 0.0) + seconds
                last.batches += workers is not None
            else:
                self._waits.append(_Waits(start, end, waited, stages, int(workers is not None)))
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
            batches = 0.0
            for waits in self._waits:
                if waits.end < begin:
                    continue
                # A wait that ended at `begin` or after it: its batch counts whole.
                share = waits.share(begin)
                batches += waits.batches if waits.batches <= 1 else waits.batches * share
                total += waits.waited * share
                for stage, seconds in waits.stages.items():
                    stages[stage] += seconds * share
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
