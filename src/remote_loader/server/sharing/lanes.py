"""Entries and lanes: the batches a Run has made, in order, and who may take them.

A lane is one sequence of tasks and the entries made from them: a QueueLane hands each entry to
one consumer (partition: one lane per rank; dynamic: one lane for all), a BroadcastLane lets
every consumer read every entry at its own cursor. Lanes are data; who reads which, and when
entries go, is the sharing policy's (server/sharing/policies.py).
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Iterator
from typing import Any

from remote_loader.server.batch.delivery import Delivery
from remote_loader.server.batch.outgoing import Outgoing
from remote_loader.server.errors import CapturedError
from remote_loader.server.sharing.reorder import Reorderer

log = logging.getLogger(__name__)

# A partition or dynamic lane keeps at most this many batches made and not yet sent, unless
# the pool keeps more in flight (prefetch_factor * num_workers), which then is the bound.
MIN_LANE_WINDOW = 2


class Entry:
    """A batch (or the error at its place) made by a Run, waiting to be sent.

    The sharing policy owns the batch's SlotLease (NOTE [ Slot lease ] in server/batch/lease.py) and
    ends its part with `release`; a zero-copy sender holds the lease through `outgoing` until
    its client has copied the batch out of the slot.
    """

    def __init__(self, position: int, delivery: Delivery) -> None:
        self.position = position
        self.delivery = delivery
        self.made_at = time.monotonic()
        # The encoded batch's size (0 for an error), kept: the blob goes once released.
        self.nbytes = len(delivery.blob) if delivery.blob is not None else 0
        # The batch as the send stage takes it (server/batch/outgoing.py); None for an error.
        self._outgoing = (
            None
            if delivery.blob is None
            else Outgoing(
                delivery.blob,
                delivery.header_nbytes,
                delivery.slot,
                delivery.lease,
                delivery.node_batch,
            )
        )

    @property
    def error(self) -> CapturedError | None:
        return self.delivery.error

    @property
    def outgoing(self) -> Outgoing:
        """The batch for a sender (server/transports/): its bytes, its slot, and its lease
        (for an entry without an error)."""
        assert self._outgoing is not None, "an entry without an error has a blob"
        return self._outgoing

    def release(self) -> None:
        """The policy is done with the entry; the slot goes back once no sender holds it.
        Idempotent."""
        self.delivery.lease.release()


class Lane:
    """One sequence of tasks and, in its order, the entries made from them.

    A lane starts at position `start` (a resumed consumer): for a map-style dataset the tasks
    before it are skipped without being run; an IterableDataset cannot skip, so its batches
    before `start` are made and dropped.
    """

    def __init__(self, in_order: bool, window: int) -> None:
        self.in_order = in_order
        self.tasks: Iterator[Any] | None = None  # None: not begun
        self.rank = 0  # partition: the rank whose share this lane makes
        self.window = window
        self.reorder: Reorderer[Delivery | None] = Reorderer(in_order=in_order)
        self.issued = 0  # lane-local task ids handed out
        self.outstanding = 0  # submitted, not yet back
        self.produced = 0  # positions made
        self.drop_before = 0  # positions made only to be dropped (IterableDataset resumed)
        self.tasks_done = True
        self.abandoned = False  # a partition rank left mid-epoch: make nothing more for it

    def begin(self, tasks: Iterator[Any], start: int, iterable: bool) -> None:
        if iterable:
            self.drop_before = start
        else:
            tasks = itertools.islice(tasks, start, None)
            self.issued = self.produced = start
            self.reorder = Reorderer(start, in_order=self.in_order)
        self.tasks = tasks
        self.tasks_done = False

    @property
    def complete(self) -> bool:
        """Nothing more will be made."""
        return self.tasks_done and self.outstanding == 0

    def backlog(self) -> int:
        raise NotImplementedError

    def wants_task(self) -> bool:
        return not self.tasks_done and not self.abandoned and self.backlog() < self.window

    def add(self, delivery: Delivery) -> None:
        raise NotImplementedError

    def drop_all(self) -> None:
        raise NotImplementedError


class QueueLane(Lane):
    """partition and dynamic: entries wait in order; each is taken by exactly one consumer."""

    def __init__(self, in_order: bool, window: int) -> None:
        super().__init__(in_order, window)
        self.pending: collections.deque[Entry] = collections.deque()
        self.taken = 0  # entries taken and not yet done with

    def backlog(self) -> int:
        return self.outstanding + len(self.pending) + self.taken

    def add(self, delivery: Delivery) -> None:
        entry = Entry(self.produced, delivery)
        self.produced += 1
        if self.abandoned or entry.position < self.drop_before:
            entry.release()
        else:
            self.pending.append(entry)

    def drop_all(self) -> None:
        while self.pending:
            self.pending.popleft().release()

    @property
    def drained(self) -> bool:
        return self.complete and not self.pending


class BroadcastLane(Lane):
    """broadcast: entries stay until every consumer has sent them (and the window needs room)."""

    def __init__(self, in_order: bool, window: int) -> None:
        super().__init__(in_order, window)
        self.entries: collections.deque[Entry] = collections.deque()
        self.base = 0  # position of entries[0]; > start once anything was retired

    def begin(self, tasks: Iterator[Any], start: int, iterable: bool) -> None:
        super().begin(tasks, start, iterable)
        self.base = start

    def backlog(self) -> int:
        # Batches back early wait in the reorder buffer: counted, so the lane never holds more
        # than its window.
        return self.outstanding + len(self.reorder) + len(self.entries)

    def add(self, delivery: Delivery) -> None:
        entry = Entry(self.produced, delivery)
        self.produced += 1
        if entry.position < self.drop_before:
            entry.release()
            self.base = self.produced
        else:
            self.entries.append(entry)

    def entry(self, position: int) -> Entry:
        return self.entries[position - self.base]

    def retire_before(self, position: int) -> None:
        while self.entries and self.base < position:
            self.entries.popleft().release()
            self.base += 1

    def drop_all(self) -> None:
        self.retire_before(self.produced)
