"""Dispatch: which worker the pool core (server/engine/pool.py) sends the next task to, chosen as
torch's _MultiProcessingDataLoaderIter._try_put_index chooses it.

NOTE [ Dispatch ]

Both policies walk one cycle over the worker ids that lives as long as the pool's size (torch's
_worker_queue_idx_cycle), skipping workers that take no tasks (their IterableDataset ran dry,
autotuning drains them, or their replacement cannot start: NOTE [ Capacity lost ]).

  in_order = true   RoundRobin: the next worker in turn, whatever it holds. The Run keeps
                    at most max_outstanding tasks out in all, and the order is the sampler's
                    however long any one task takes.
  in_order = false  ByCapacity: the next worker in turn that holds fewer than its share,
                    max_outstanding // (workers taking tasks), as torch does. When no worker
                    has room, nothing is sent (`has_room` is False: the Run waits for a
                    result, which frees its worker's room, before it draws the next task), so a
                    straggler's worker is passed over instead of queueing every other task
                    behind it. torch draws the index first and drops it when no worker has room;
                    here the Run does not draw it until one has.

When no worker takes tasks at all, `has_room` is True and `pick` None: the pool's submit then
says the workers ran dry. Moving a short worker's tasks (the pool's `_reassign`) goes in turn
whatever the others hold (`in_turn`): those tasks are already out and must go somewhere.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

# Per worker id: whether it takes tasks, and how many it holds (sent and not yet back).
Takes = Callable[[int], bool]
Held = Callable[[int], int]


class RoundRobin:
    """in_order = true: each task to the next worker in turn (NOTE [ Dispatch ])."""

    def __init__(self, num_workers: int) -> None:
        self._num_workers = num_workers
        self._cycle = itertools.cycle(range(num_workers))

    def resize(self, num_workers: int) -> None:
        """The pool grew or shrank (num_workers = "auto"): the turn starts again at worker 0."""
        self._num_workers = num_workers
        self._cycle = itertools.cycle(range(num_workers))

    def in_turn(self, takes: Takes) -> int | None:
        """The next worker in turn that takes tasks; None when none does."""
        for _ in range(self._num_workers):
            worker_id = next(self._cycle)
            if takes(worker_id):
                return worker_id
        return None

    def has_room(self, takes: Takes, held: Held, bound: int) -> bool:
        """Whether a task submitted now would be sent at once."""
        return True

    def pick(self, takes: Takes, held: Held, bound: int) -> int | None:
        """The worker to send the next task to; None when no worker takes tasks."""
        return self.in_turn(takes)


class ByCapacity(RoundRobin):
    """in_order = false: each task to the next worker in turn that holds fewer than its share
    of `bound` (NOTE [ Dispatch ])."""

    def has_room(self, takes: Takes, held: Held, bound: int) -> bool:
        takers = [w for w in range(self._num_workers) if takes(w)]
        if not takers:
            return True  # pick says none takes tasks: the pool reports them all run dry
        share = _share(bound, len(takers))
        return any(held(w) < share for w in takers)

    def pick(self, takes: Takes, held: Held, bound: int) -> int | None:
        takers = sum(1 for w in range(self._num_workers) if takes(w))
        if not takers:
            return None
        share = _share(bound, takers)
        for _ in range(self._num_workers):
            worker_id = next(self._cycle)
            if takes(worker_id) and held(worker_id) < share:
                return worker_id
        return None


def _share(bound: int, takers: int) -> int:
    """What one worker may hold: torch's max_tasks // active workers (at least one, so an epoch
    always moves)."""
    return max(1, bound // takers)


def dispatch_for(in_order: bool, num_workers: int) -> RoundRobin:
    """The policy of a loader's spec (`in_order`)."""
    return RoundRobin(num_workers) if in_order else ByCapacity(num_workers)
