"""The sharing policies on their own: who may join a Run, what each consumer takes, what happens
to what it held when it goes. The Run is never started (no engine, no thread): entries are put
in its lanes by hand, so each rule is checked in isolation. The same rules with production
running are in test_run.py, end to end in test_sharing.py."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import pytest

from remote_loader.server.batch.delivery import Delivery
from remote_loader.server.batch.lease import SlotLease
from remote_loader.server.config.sampling import EpochPlan, share
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.config.types import SHARING_MODES
from remote_loader.server.engine.seam import Engine
from remote_loader.server.errors import SharingRefused
from remote_loader.server.sharing.consumer import Consumer
from remote_loader.server.sharing.lanes import BroadcastLane, Lane, QueueLane
from remote_loader.server.sharing.membership import Membership
from remote_loader.server.sharing.policies import (
    POLICIES,
    Broadcast,
    Dynamic,
    Holder,
    Partition,
    Reader,
    admit,
    policy_for,
)
from remote_loader.server.sharing.run import Run, RunKey

EPOCH = [[i] for i in range(8)]


def make_run(sharing: str, world_size: int = 1, start: int = 0, **options: Any) -> Run:
    spec = LoaderSpec(name="policies", dataset="tests.datasets:Squares", **options)
    shares = policy_for(sharing).plan_world_size(Membership(sharing, "job", 0, world_size))
    plan = EpochPlan(0, 0, 0, shares, lambda r: iter(share(EPOCH, r, shares, drop_last=False)))
    key = RunKey(sharing, "job", 0, 0, world_size)
    return Run(key, spec, plan, _never_lent, iterable=False, on_close=_detach, start=start)


def _never_lent(give_up: Callable[[], bool]) -> contextlib.AbstractContextManager[Engine]:
    raise AssertionError("these Runs are never started")


def _detach(run: Run, consumer: Consumer, join: bool) -> None:
    run.detach(consumer)  # no registry: a consumer that closes leaves its Run


class Slots:
    """Deliveries whose release is counted, as a worker's shared-memory slots are."""

    def __init__(self) -> None:
        self.released: list[int] = []

    def make(self, lane: Lane, n: int) -> None:
        """Makes `lane`'s next `n` tasks, as the Run's thread would."""
        with contextlib.suppress(StopIteration):
            for _ in range(n):
                assert lane.tasks is not None
                [index] = next(lane.tasks)
                lane.issued += 1
                release = lambda i=index: self.released.append(i)  # noqa: E731
                lane.add(Delivery(blob=memoryview(b"x"), lease=SlotLease(release)))

    def finish(self, lane: Lane) -> None:
        """Makes the rest of `lane`'s tasks and marks it complete."""
        self.make(lane, 1 << 10)
        lane.tasks_done = True


def join(run: Run, rank: int = 0, start: int = 0) -> Consumer:
    consumer = run.try_attach(Membership(run.key.sharing, "job", rank, run.key.world_size), start)
    assert consumer is not None
    return consumer


def take(consumer: Consumer) -> int | None:
    with consumer.run.cond:
        entry = consumer.run.policy.take(consumer.seat)
    return None if entry is None else entry.position


def holder(consumer: Consumer) -> Holder:
    """A partition or dynamic consumer's state, which its policy keeps."""
    assert isinstance(consumer.seat, Holder)
    return consumer.seat


def reader(consumer: Consumer) -> Reader:
    """A broadcast consumer's state, which its policy keeps."""
    assert isinstance(consumer.seat, Reader)
    return consumer.seat


def test_every_sharing_mode_has_a_policy() -> None:
    assert set(POLICIES) == set(SHARING_MODES)


# --- partition --------------------------------------------------------------------------------


def test_partition_makes_a_lane_per_rank_when_the_rank_joins_and_refuses_it_twice() -> None:
    run = make_run("partition", world_size=4)
    assert run.policy.lanes == []  # nothing is built for ranks that have not come
    join(run, rank=2)
    assert [lane.rank for lane in run.policy.lanes] == [2]
    assert run.try_attach(Membership("partition", "job", 2, 4)) is None  # its share is taken
    join(run, rank=0)
    assert [lane.rank for lane in run.policy.lanes] == [2, 0]


def test_partition_is_complete_only_once_every_rank_has_joined_and_been_made() -> None:
    run = make_run("partition", world_size=2)
    slots = Slots()
    join(run, rank=0)
    slots.finish(run.policy.lanes[0])
    assert not run.policy.complete()  # rank 1's share is still to be made
    join(run, rank=1)
    slots.finish(run.policy.lanes[1])
    assert run.policy.complete()


def test_partition_batch_index_numbers_every_batch_of_the_epoch_once() -> None:
    run = make_run("partition", world_size=3)
    for rank in range(3):
        join(run, rank=rank)
    indices = []
    for k in range(4):
        for lane in run.policy.lanes:
            lane.issued = k
            indices.append(run.policy.batch_index(lane))
    assert sorted(indices) == list(range(12))


def test_a_partition_rank_that_leaves_mid_share_abandons_it_and_every_slot_goes_back() -> None:
    run = make_run("partition", world_size=2)
    slots = Slots()
    rank0, rank1 = join(run, rank=0), join(run, rank=1)
    lane0 = run.policy.lanes[0]
    assert isinstance(lane0, QueueLane)
    slots.make(lane0, 3)
    assert take(rank0) == 0  # held: taken, not yet sent
    run.detach(rank0)
    assert lane0.abandoned and not lane0.wants_task()
    assert sorted(slots.released) == [0, 2, 4]  # the held one and the two pending
    assert lane0.taken == 0
    assert rank1.seat.lane is not lane0


def test_partition_refuses_to_split_an_iterable_dataset_between_ranks() -> None:
    spec = LoaderSpec(name="it", dataset="tests.datasets:Squares")
    with pytest.raises(SharingRefused, match="cannot split"):
        admit(Membership("partition", "job", 0, 2), spec, iterable=True)
    admit(Membership("partition", "job", 0, 1), spec, iterable=True)
    admit(Membership("dynamic", "job", 0, 2), spec, iterable=True)


# --- dynamic ----------------------------------------------------------------------------------


def test_dynamic_hands_what_a_leaving_consumer_held_to_the_next_one_first() -> None:
    run = make_run("dynamic")
    slots = Slots()
    a, b = join(run), join(run, rank=1)
    assert a.seat.lane is b.seat.lane
    slots.make(run.policy.lanes[0], 4)
    assert [take(a), take(a), take(b)] == [0, 1, 2]
    run.detach(a)
    assert slots.released == []  # nothing is lost...
    assert [take(b), take(b), take(b)] == [0, 1, 3]  # ...and what a held comes first, in order


def test_dynamic_waits_for_a_peer_s_held_batches_at_most_handback_timeout() -> None:
    run = make_run("dynamic", handback_timeout=0.2)
    slots = Slots()
    held, waiter = join(run), join(run, rank=1)
    slots.finish(run.policy.lanes[0])
    positions = [take(held) for _ in EPOCH]
    assert positions == list(range(len(EPOCH)))
    policy = run.policy
    with run.cond:
        policy.asking(waiter.seat)
        assert not policy.finished(waiter.seat)  # the holder may still hand them back
        waiting_since = holder(waiter).waiting_since
        assert waiting_since is not None
        holder(waiter).waiting_since = waiting_since - 0.25  # as if 0.25 s had passed
        assert policy.finished(waiter.seat)  # held longer than handback_timeout: not waited for
        policy.asking(waiter.seat)  # a next() begins: its wait starts afresh
        assert not policy.finished(waiter.seat)
    for entry in list(holder(held).holding):
        held.done(entry)
    with run.cond:
        policy.asking(waiter.seat)
        assert policy.finished(waiter.seat)  # nothing held, nothing pending: at once


def test_dynamic_refuses_a_consumer_once_its_lane_is_drained() -> None:
    run = make_run("dynamic")
    slots = Slots()
    a = join(run)
    slots.finish(run.policy.lanes[0])
    while (entry := run.policy.take(a.seat)) is not None:
        a.done(entry)
    assert run.try_attach(Membership("dynamic", "job", 1, 1)) is None
    assert len(slots.released) == len(EPOCH)


# --- broadcast --------------------------------------------------------------------------------


def test_broadcast_refuses_a_consumer_whose_next_batch_is_retired_and_a_rank_twice() -> None:
    run = make_run("broadcast", world_size=2, broadcast_window=2)
    slots = Slots()
    a, b = join(run, rank=0), join(run, rank=1)
    assert run.try_attach(Membership("broadcast", "job", 0, 2)) is None  # rank 0 is here
    lane = run.policy.lanes[0]
    slots.make(lane, 2)
    for consumer in (a, b):
        for _ in range(2):
            entry = run.policy.take(consumer.seat)
            assert entry is not None
            consumer.done(entry)
    with run.cond:
        run.policy.make_room(lane)
    assert slots.released == [0, 1]  # both sent both: retired
    run.detach(a)
    assert run.try_attach(Membership("broadcast", "job", 0, 2), start=1) is None  # 1 is gone
    assert reader(join(run, rank=0, start=2)).cursor == 2
    fresh = make_run("broadcast", world_size=1)
    join(fresh), join(fresh)  # world_size 1: any number of consumers, ranks not counted


def test_broadcast_retires_nothing_until_its_group_has_joined() -> None:
    run = make_run("broadcast", world_size=2, broadcast_window=1, group_timeout=60.0)
    slots = Slots()
    a = join(run, rank=0)
    lane = run.policy.lanes[0]
    slots.make(lane, 1)
    entry = run.policy.take(a.seat)
    assert entry is not None
    a.done(entry)
    with run.cond:
        run.policy.make_room(lane)
    assert slots.released == []  # rank 1 has not come: batch 0 waits for it
    b = join(run, rank=1)
    assert take(b) == 0
    entry = run.policy.take(b.seat)
    assert entry is not None
    b.done(entry)
    with run.cond:
        run.policy.make_room(lane)
    assert slots.released == [0]


def test_broadcast_detaches_the_consumer_holding_the_others_for_detach_timeout() -> None:
    run = make_run("broadcast", broadcast_window=2, detach_timeout=0.1)
    slots = Slots()
    fast, slow = join(run), join(run)
    lane = run.policy.lanes[0]
    assert isinstance(lane, BroadcastLane)
    slots.make(lane, 2)
    for _ in range(2):
        entry = run.policy.take(fast.seat)
        assert entry is not None
        fast.done(entry)
    with run.cond:
        run.policy.make_room(lane)
        assert slow.detached is None  # not held for detach_timeout yet
        assert run.policy.lag(slow.seat) == 2
    # A second later, with batch 0 there to send all along:
    reader(slow).moved_at = reader(fast).moved_at = time.monotonic() - 1.0
    for entry in lane.entries:
        entry.made_at -= 1.0
    with run.cond:
        run.policy.make_room(lane)
    assert slow.detached is not None and "detach_timeout" in slow.detached
    assert run.consumers == [fast]
    assert slots.released == [0, 1]  # the window is free again


def test_a_broadcast_lane_never_holds_more_than_its_window() -> None:
    # A batch back before the one due first waits in the reorder buffer, and counts: else the
    # lane would take a task more than its window allows.
    lane = BroadcastLane(in_order=True, window=2)
    lane.begin(iter([[0], [1], [2]]), 0, iterable=False)
    lane.issued, lane.outstanding = 2, 2  # two tasks submitted
    lane.outstanding -= 1
    lane.reorder.put(1, Delivery(blob=memoryview(b"x")))  # task 1 is back before task 0
    assert list(lane.reorder.ready()) == []
    assert not lane.wants_task()


def test_only_broadcast_shares_entries_and_only_dynamic_has_no_fixed_length() -> None:
    assert [p.shares_entries for p in (Partition, Broadcast, Dynamic)] == [False, True, False]
    assert [p.fixed_length for p in (Partition, Broadcast, Dynamic)] == [True, True, False]
    m = Membership("partition", "job", 1, 4)
    assert Partition.plan_world_size(m) == 4 and Partition.run_world_size(m) == 4
    assert Broadcast.plan_world_size(m) == 1 and Broadcast.run_world_size(m) == 4
    assert Dynamic.plan_world_size(m) == 1 and Dynamic.run_world_size(m) == 1
