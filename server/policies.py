"""Sharing policies: how the consumers of one Run divide its batches (NOTE [ Sharing ] in
server/sharing.py).

A policy owns a Run's lanes and decides, under the Run's `cond`, who may join, what a consumer
takes next, when its epoch is over and what happens to what it held when it goes. The Run
(server/run.py) drives production and knows no policy by name: a fourth mode would be a class
here and an entry in POLICIES, as tf.data service adds a sharding policy with a task runner.
"""

from __future__ import annotations

import abc
import logging
import time
from typing import TYPE_CHECKING, Any, ClassVar

from remote_loader.server.errors import clip
from remote_loader.server.lanes import BroadcastLane, Entry, Lane, QueueLane
from remote_loader.server.sampling import EpochPlan
from remote_loader.server.spec import LoaderSpec

if TYPE_CHECKING:  # membership.py asks the policies what they refuse; run.py holds a policy
    from remote_loader.server.membership import Membership
    from remote_loader.server.run import Consumer, RunKey

log = logging.getLogger(__name__)


class Policy(abc.ABC):
    """One Run's sharing policy. Every method but the class-level ones runs under the Run's
    `cond`; `lanes` is what the Run's thread submits tasks for, taking turns."""

    name: ClassVar[str]
    # Several consumers send the same entry (as the same batch number): transports keep the
    # forms they build of it (server/transports/base.py) rather than build one per consumer.
    shares_entries: ClassVar[bool] = False
    # Each consumer's share of an epoch has a length known in advance (len(loader) works).
    fixed_length: ClassVar[bool] = True

    def __init__(
        self,
        key: RunKey,
        spec: LoaderSpec,
        plan: EpochPlan,
        *,
        iterable: bool,
        start: int,
        window: int,
    ) -> None:
        self.key = key
        self.spec = spec
        self._lane_tasks = plan.lane  # rank -> that rank's tasks
        self._indices = plan.indices  # rank -> its tasks' indices in the epoch, when not k*w+r
        self._iterable = iterable
        self._window = window
        self.lanes: list[Lane] = []

    # --- which Run, which plan (no Run yet) ---------------------------------------------------

    @staticmethod
    def run_world_size(membership: Membership) -> int:
        """The world size in the key of the Runs `membership` may join."""
        return membership.world_size

    @staticmethod
    def plan_world_size(membership: Membership) -> int:
        """Into how many shares the epoch's plan is split (a lane per share)."""
        return 1

    @classmethod
    def refusal(cls, membership: Membership, spec: LoaderSpec, iterable: bool) -> str | None:
        """Why this policy cannot serve `membership` on such a loader; None if it can."""
        return None

    # --- consumers ----------------------------------------------------------------------------

    @abc.abstractmethod
    def join(self, membership: Membership, start: int, consumers: list[Consumer]) -> Lane | None:
        """The lane a consumer starting at `start` reads, or None if it cannot join this Run
        (it then gets a Run of its own)."""

    @abc.abstractmethod
    def take(self, consumer: Consumer) -> Entry | None:
        """The consumer's next entry if one is ready; None to wait or end (see `finished`)."""

    @abc.abstractmethod
    def finished(self, consumer: Consumer) -> bool:
        """Nothing ready and nothing more will be for this consumer: its epoch is over."""

    @abc.abstractmethod
    def done(self, consumer: Consumer, entry: Entry) -> None:
        """The consumer has sent `entry` (or given up sending it)."""

    @abc.abstractmethod
    def let_go(self, consumer: Consumer) -> None:
        """The consumer left: settle what it held (its Run has already dropped it)."""

    @abc.abstractmethod
    def lag(self, consumer: Consumer, consumers: list[Consumer]) -> int:
        """How many batches the consumer is behind, for metrics."""

    # --- production (the Run's thread) --------------------------------------------------------

    def set_window(self, window: int) -> None:
        """The engine is known: a queue lane's window is what the engine keeps in flight."""
        self._window = window
        for lane in self.lanes:
            lane.window = window

    def complete(self) -> bool:
        """Everything this Run will make has been made."""
        return all(lane.complete for lane in self.lanes)

    def make_room(self, lane: Lane, consumers: list[Consumer]) -> None:
        """Called before `lane` is asked whether it wants a task: a policy whose entries wait
        for several consumers frees what they have all sent (queue lanes free as they go)."""
        return None

    def batch_index(self, lane: Lane) -> int:
        """The index in the epoch of `lane`'s next task (seeding = "per_batch")."""
        return lane.issued

    def _queue_lane(self, rank: int, start: int) -> QueueLane:
        lane = QueueLane(self.spec.in_order, self._window)
        lane.rank = rank
        lane.begin(self._lane_tasks(rank), start, self._iterable)
        return lane


class _QueuePolicy(Policy):
    """partition and dynamic: each entry is taken by exactly one consumer, who holds it until
    it is sent (Consumer.holding)."""

    def take(self, consumer: Consumer) -> Entry | None:
        lane = self._lane_of(consumer)
        if not lane.pending:
            return None
        entry = lane.pending.popleft()
        lane.taken += 1
        consumer.holding.append(entry)
        return entry

    def done(self, consumer: Consumer, entry: Entry) -> None:
        if entry in consumer.holding:
            consumer.holding.remove(entry)
            self._lane_of(consumer).taken -= 1
            entry.release()

    def lag(self, consumer: Consumer, consumers: list[Consumer]) -> int:
        lane = self._lane_of(consumer)
        return len(lane.pending) + lane.taken

    @abc.abstractmethod
    def _lane_of(self, consumer: Consumer) -> QueueLane: ...


class Partition(_QueuePolicy):
    """Rank r of w reads its own lane, the tasks of its share (server/sampling.py). Lanes take
    turns at the engine, so a fast rank cannot starve a slow one, and each buffers at most a
    window, so a slow rank cannot stall a fast one."""

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

    def join(self, membership: Membership, start: int, consumers: list[Consumer]) -> Lane | None:
        if membership.rank in self._by_rank:
            return None  # that rank's share is already taken: a new Run makes it again
        lane = self._queue_lane(membership.rank, start)
        self._by_rank[membership.rank] = lane
        self.lanes.append(lane)
        return lane

    def _lane_of(self, consumer: Consumer) -> QueueLane:
        return self._by_rank[consumer.membership.rank]

    def finished(self, consumer: Consumer) -> bool:
        return self._lane_of(consumer).complete

    def let_go(self, consumer: Consumer) -> None:
        lane = self._lane_of(consumer)
        held, consumer.holding = consumer.holding, []
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
        # index whatever the split (an elastic resume keeps each batch's, server/elastic.py).
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

    def join(self, membership: Membership, start: int, consumers: list[Consumer]) -> Lane | None:
        return None if self._lane.drained else self._lane

    def _lane_of(self, consumer: Consumer) -> QueueLane:
        return self._lane

    def finished(self, consumer: Consumer) -> bool:
        # Not while another consumer still holds batches: they come back here if it goes away
        # before sending them. A peer that holds one longer than handback_timeout does not keep
        # this stream open.
        lane = self._lane
        if not lane.complete:
            return False
        now = time.monotonic()
        if consumer.waiting_since is None:
            consumer.waiting_since = now
        return lane.taken == 0 or now - consumer.waiting_since >= _seconds(
            self.spec.handback_timeout
        )

    def let_go(self, consumer: Consumer) -> None:
        # Batches it took but did not finish sending go to the next consumer that asks, first,
        # so none is lost and the order stays as close as it can.
        held, consumer.holding = consumer.holding, []
        for entry in reversed(held):
            self._lane.pending.appendleft(entry)
        self._lane.taken -= len(held)


class Broadcast(Policy):
    """One lane; every consumer reads every entry at its own cursor. An entry is retired once
    every consumer has sent it, and the lane holds at most `broadcast_window` entries, so the
    fastest consumer is at most that far ahead of the slowest."""

    name = "broadcast"
    shares_entries = True

    def __init__(self, *args: Any, start: int, **kwargs: Any) -> None:
        super().__init__(*args, start=start, **kwargs)
        self._lane = BroadcastLane(self.spec.in_order, self.spec.broadcast_window)
        self._lane.begin(self._lane_tasks(0), start, self._iterable)
        self.lanes.append(self._lane)
        self._ranks: set[int] = set()
        # With a known group nothing is retired until all of it has joined (or group_timeout
        # has passed), so consumers that start a little apart still share.
        self._holding_for_group = self.key.world_size > 1
        self._started_at = time.monotonic()

    def join(self, membership: Membership, start: int, consumers: list[Consumer]) -> Lane | None:
        if start < self._lane.base:
            return None  # its next batch is gone; this consumer gets a Run of its own
        if self.key.world_size > 1 and any(c.membership.rank == membership.rank for c in consumers):
            return None  # that rank is here already
        self._ranks.add(membership.rank)
        return self._lane

    def take(self, consumer: Consumer) -> Entry | None:
        if consumer.cursor < self._lane.produced:
            return self._lane.entry(consumer.cursor)
        return None

    def finished(self, consumer: Consumer) -> bool:
        return self._lane.complete

    def done(self, consumer: Consumer, entry: Entry) -> None:
        if entry.position == consumer.cursor:
            consumer.cursor += 1

    def let_go(self, consumer: Consumer) -> None:
        pass  # its cursor no longer holds the window back: the next make_room retires

    def lag(self, consumer: Consumer, consumers: list[Consumer]) -> int:
        return max((c.cursor for c in consumers), default=0) - consumer.cursor

    def set_window(self, window: int) -> None:
        pass  # the broadcast window is the spec's, whatever the engine keeps in flight

    def make_room(self, lane: Lane, consumers: list[Consumer]) -> None:
        if self._holding_for_group and (
            len(self._ranks) >= self.key.world_size
            or time.monotonic() - self._started_at >= _seconds(self.spec.group_timeout)
        ):
            self._holding_for_group = False
        if self._lane.backlog() >= self._lane.window:
            self._retire(consumers)

    def _retire(self, consumers: list[Consumer]) -> None:
        """Retires the entries every consumer has sent, and detaches (removes from
        `consumers`) a consumer that has held the others back for detach_timeout."""
        lane = self._lane
        if self._holding_for_group or not consumers:
            return
        slowest = min(c.cursor for c in consumers)
        lane.retire_before(slowest)
        if lane.backlog() < lane.window:
            return
        fastest = max(c.cursor for c in consumers)
        if fastest == slowest or not lane.entries:
            return  # nobody is being held back
        now = time.monotonic()
        # A consumer is stalled from when the batch it needs was there to send (or from its
        # last batch, if later): time spent waiting for production is not its fault.
        available_at = lane.entries[0].made_at
        for c in list(consumers):
            stalled = now - max(c.moved_at, available_at)
            if c.cursor == slowest and stalled >= self.spec.detach_timeout:
                log.warning(
                    "loader %r job %r epoch %d: detaching broadcast consumer rank %d: it sent "
                    "nothing for %.1f s while others waited (detach_timeout)",
                    self.spec.name,
                    clip(self.key.job),
                    self.key.epoch,
                    c.membership.rank,
                    stalled,
                )
                c.detached = (
                    f"detached from the broadcast of loader {self.spec.name!r}: it sent no "
                    f"batch for {self.spec.detach_timeout:g} s (detach_timeout) while the "
                    f"other consumers waited; it was {fastest - slowest} batches behind"
                )
                consumers.remove(c)
        if consumers:
            lane.retire_before(min(c.cursor for c in consumers))


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Partition, Broadcast, Dynamic)}


def policy_for(sharing: str) -> type[Policy]:
    """The policy of a sharing mode (Membership.check has refused unknown ones)."""
    return POLICIES[sharing]


def _seconds(timeout: float | None) -> float:
    """A sharing wait of the spec: set by LoaderSpec (None only before __post_init__)."""
    assert timeout is not None
    return timeout
