"""Sharing policies: partition, broadcast and dynamic, how the consumers of one Run divide its
batches (NOTE [ Sharing ] in server/sharing/runs.py), and which policy a sharing mode names.

Each fills the seam in server/sharing/policy.py, which says what a Run asks of its policy.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.errors import SharingRefused, clip
from remote_loader.server.sharing.lanes import BroadcastLane, Entry, Lane, QueueLane
from remote_loader.server.sharing.membership import Membership
from remote_loader.server.sharing.policy import Policy, Seat

log = logging.getLogger(__name__)


class Holder(Seat):
    """A partition or dynamic consumer: the entries it took and has not sent yet."""

    lane: QueueLane

    def __init__(self, membership: Membership, lane: QueueLane) -> None:
        super().__init__(membership, lane)
        self.holding: list[Entry] = []
        # dynamic: since when this next() has waited with only peers' batches left.
        self.waiting_since: float | None = None


class _QueuePolicy(Policy[Holder]):
    """partition and dynamic: each entry is taken by exactly one consumer, who holds it until
    it is sent (Holder.holding)."""

    def take(self, seat: Holder) -> Entry | None:
        lane = seat.lane
        if not lane.pending:
            return None
        entry = lane.pending.popleft()
        lane.taken += 1
        seat.holding.append(entry)
        return entry

    def done(self, seat: Holder, entry: Entry) -> None:
        if entry in seat.holding:
            seat.holding.remove(entry)
            seat.lane.taken -= 1
            entry.release()

    def lag(self, seat: Holder) -> int:
        return len(seat.lane.pending) + seat.lane.taken

    def ready(self, seat: Holder) -> int:
        return len(seat.lane.pending)


class Partition(_QueuePolicy):
    """Rank r of w reads its own lane, the tasks of its share (server/config/sampling.py).
    Lanes take turns at the engine, so a fast rank cannot starve a slow one, and each buffers at
    most a window, so a slow rank cannot stall a fast one."""

    name = "partition"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A rank's lane is made when the rank joins: a job of 2**20 ranks costs what its
        # joined ranks cost.
        self._by_rank: dict[int, QueueLane] = {}

    @staticmethod
    def plan_world_size(membership: Membership) -> int:
        return membership.world_size

    @classmethod
    def refusal(cls, membership: Membership, spec: LoaderSpec, iterable: bool) -> str | None:
        if membership.world_size > 1 and iterable:
            return (
                f"loader {spec.name!r} serves an IterableDataset, which the server cannot split "
                "between ranks; use sharing='dynamic' (or 'broadcast'), or world_size=1 with a "
                "dataset that shards itself"
            )
        return None

    def join(self, membership: Membership, start: int) -> Holder | None:
        if membership.rank in self._by_rank:
            return None  # that rank's share is already taken: a new Run makes it again
        lane = self._queue_lane(membership.rank, start)
        self._by_rank[membership.rank] = lane
        self.lanes.append(lane)
        return Holder(membership, lane)

    def finished(self, seat: Holder) -> bool:
        return seat.lane.complete

    def let_go(self, seat: Holder) -> None:
        lane = seat.lane
        held, seat.holding = seat.holding, []
        if not lane.complete or lane.pending or held:
            # A rank left before the end of its share: make nothing more for it and hand every
            # slot back, including one its stream may still be copying from when this runs on
            # the loader's reaper: that client is gone, nobody reads it.
            lane.abandoned = True
            lane.drop_all()
            for entry in held:
                entry.release()
            lane.taken -= len(held)

    def complete(self) -> bool:
        # Ranks that have not joined yet will: their shares are still to be made.
        return len(self.lanes) == self.key.world_size and super().complete()

    def batch_index(self, lane: Lane) -> int:
        # Rank r of w's k-th batch is batch k * w + r: every batch of an epoch has its own
        # index whatever the split (an elastic resume keeps each batch's,
        # server/sharing/elastic.py).
        if self._indices is not None:
            return self._indices(lane.rank)[lane.issued]
        return lane.issued * self.key.world_size + lane.rank


class Dynamic(_QueuePolicy):
    """One lane for every consumer: each batch goes to whichever asks first."""

    name = "dynamic"
    fixed_length = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Dynamic consumers never skip: their positions are their own, so the lane begins at 0.
        self._lane = self._queue_lane(0, 0)
        self.lanes.append(self._lane)

    @staticmethod
    def run_world_size(membership: Membership) -> int:
        return 1

    def join(self, membership: Membership, start: int) -> Holder | None:
        return None if self._lane.drained else Holder(membership, self._lane)

    def asking(self, seat: Holder) -> None:
        seat.waiting_since = None

    def finished(self, seat: Holder) -> bool:
        # Not while another consumer still holds batches: they come back here if it goes away
        # before sending them. A peer that holds one longer than handback_timeout does not keep
        # this stream open.
        lane = self._lane
        if not lane.complete:
            return False
        now = time.monotonic()
        if seat.waiting_since is None:
            seat.waiting_since = now
        return lane.taken == 0 or now - seat.waiting_since >= self.spec.parts.timeouts.handback

    def let_go(self, seat: Holder) -> None:
        # Batches it took but did not finish sending go to the next consumer that asks, first,
        # so none is lost and the order stays as close as it can.
        held, seat.holding = seat.holding, []
        for entry in reversed(held):
            self._lane.pending.appendleft(entry)
        self._lane.taken -= len(held)


class Reader(Seat):
    """A broadcast consumer: the lane position it reads next, and when it last sent one."""

    def __init__(self, membership: Membership, lane: Lane, start: int) -> None:
        super().__init__(membership, lane)
        self.cursor = start
        self.moved_at = time.monotonic()


class Broadcast(Policy[Reader]):
    """One lane; every consumer reads every entry at its own cursor. An entry is retired once
    every consumer has sent it, and the lane holds at most `broadcast_window` entries, so the
    fastest consumer is at most that far ahead of the slowest."""

    name = "broadcast"
    shares_entries = True

    def __init__(self, *args: Any, start: int, **kwargs: Any) -> None:
        super().__init__(*args, start=start, **kwargs)
        self._lane = BroadcastLane(
            self.spec.parts.batching.in_order, self.spec.parts.sharing.broadcast_window
        )
        self._lane.begin(self._lane_tasks(0), start, self._iterable)
        self.lanes.append(self._lane)
        # The consumers served, in the order they joined: those that left or were detached are
        # not (they no longer hold the window back).
        self._readers: list[Reader] = []
        self._ranks: set[int] = set()
        # With a known group nothing is retired until all of it has joined (or group_timeout
        # has passed), so consumers that start a little apart still share.
        self._holding_for_group = self.key.world_size > 1
        self._started_at = time.monotonic()

    def join(self, membership: Membership, start: int) -> Reader | None:
        if start < self._lane.base:
            return None  # its next batch is gone; this consumer gets a Run of its own
        if self.key.world_size > 1 and any(
            r.membership.rank == membership.rank for r in self._readers
        ):
            return None  # that rank is here already
        self._ranks.add(membership.rank)
        reader = Reader(membership, self._lane, start)
        self._readers.append(reader)
        return reader

    def take(self, seat: Reader) -> Entry | None:
        if seat.cursor < self._lane.produced:
            return self._lane.entry(seat.cursor)
        return None

    def finished(self, seat: Reader) -> bool:
        return self._lane.complete

    def done(self, seat: Reader, entry: Entry) -> None:
        seat.moved_at = time.monotonic()
        if entry.position == seat.cursor:
            seat.cursor += 1

    def let_go(self, seat: Reader) -> None:
        # Its cursor no longer holds the window back: the next make_room retires.
        if seat in self._readers:
            self._readers.remove(seat)

    def lag(self, seat: Reader) -> int:
        return max((r.cursor for r in self._readers), default=0) - seat.cursor

    def ready(self, seat: Reader) -> int:
        return max(0, self._lane.produced - seat.cursor)

    def set_window(self, window: int) -> None:
        pass  # the broadcast window is the spec's, whatever the engine keeps in flight

    def make_room(self, lane: Lane) -> None:
        if self._holding_for_group and (
            len(self._ranks) >= self.key.world_size
            or time.monotonic() - self._started_at >= self.spec.parts.timeouts.group
        ):
            self._holding_for_group = False
        if self._lane.backlog() >= self._lane.window:
            self._retire()

    def _retire(self) -> None:
        """Retires the entries every consumer has sent, and detaches a consumer that has held
        the others back for detach_timeout."""
        lane = self._lane
        readers = self._readers
        if self._holding_for_group or not readers:
            return
        slowest = min(r.cursor for r in readers)
        lane.retire_before(slowest)
        if lane.backlog() < lane.window:
            return
        fastest = max(r.cursor for r in readers)
        if fastest == slowest or not lane.entries:
            return  # nobody is being held back
        now = time.monotonic()
        # A consumer is stalled from when the batch it needs was there to send (or from its
        # last batch, if later): time spent waiting for production is not its fault.
        available_at = lane.entries[0].made_at
        for r in list(readers):
            stalled = now - max(r.moved_at, available_at)
            if r.cursor == slowest and stalled >= self.spec.parts.timeouts.detach:
                log.warning(
                    "loader %r job %r epoch %d: detaching broadcast consumer rank %d: it sent "
                    "nothing for %.1f s while others waited (detach_timeout)",
                    self.spec.name,
                    clip(self.key.job),
                    self.key.epoch,
                    r.membership.rank,
                    stalled,
                )
                readers.remove(r)
                self._detach(
                    r,
                    f"detached from the broadcast of loader {self.spec.name!r}: it sent no "
                    f"batch for {self.spec.parts.timeouts.detach:g} s (detach_timeout) while the "
                    f"other consumers waited; it was {fastest - slowest} batches behind",
                )
        if readers:
            lane.retire_before(min(r.cursor for r in readers))


POLICIES: dict[str, type[Policy[Any]]] = {p.name: p for p in (Partition, Broadcast, Dynamic)}


def policy_for(sharing: str) -> type[Policy[Any]]:
    """The policy of a sharing mode (Membership.check has refused unknown ones)."""
    return POLICIES[sharing]


def admit(membership: Membership, spec: LoaderSpec, iterable: bool) -> None:
    """Raises SharingRefused, saying what is allowed, for a membership the loader refuses: what
    every mode refuses (Membership.check), then what its policy does."""
    membership.check(spec, iterable)
    refusal = policy_for(membership.sharing).refusal(membership, spec, iterable)
    if refusal is not None:
        raise SharingRefused(refusal)
