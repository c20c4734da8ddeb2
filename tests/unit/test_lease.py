"""SlotLease (server/batch/lease.py): a slot goes back once, after its owner and every reader
are done.

The whole path, worker to client and back, runs in tests/integration/test_zero_copy.py; here the
lease's own rules, with a give-back that counts.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable

import pytest

from remote_loader.server.batch.delivery import Delivery
from remote_loader.server.batch.lease import SlotLease
from remote_loader.server.sharing.lanes import Entry


class Counted:
    def __init__(self) -> None:
        self.given = 0

    def __call__(self) -> None:
        self.given += 1


def test_the_slot_goes_back_when_the_owner_releases_an_unheld_lease() -> None:
    back = Counted()
    lease = SlotLease(back)
    assert back.given == 0 and not lease.given_back
    lease.release()
    lease.release()  # idempotent
    assert back.given == 1 and lease.given_back


def test_readers_keep_the_slot_past_the_owners_release_until_the_last_ends() -> None:
    back = Counted()
    lease = SlotLease(back)
    first, second = lease.hold(), lease.hold()
    lease.release()
    first()
    first()  # an end called twice counts once
    assert back.given == 0, "the second reader still reads the slot"
    second()
    assert back.given == 1


def test_readers_that_end_before_the_owner_leave_the_give_back_to_the_owner() -> None:
    back = Counted()
    lease = SlotLease(back)
    lease.hold()()
    assert back.given == 0
    lease.release()
    assert back.given == 1


class Mapping:
    """Stands for the batch's memoryview into its slot."""


def test_the_lease_keeps_the_slot_mapped_until_the_give_back() -> None:
    # A zero-copy client opens the slot by the descriptor its mapping keeps open: the pool's own
    # view may be gone (its Run ended) while a sender still holds the batch for the client.
    mapping = Mapping()
    alive = weakref.ref(mapping)
    lease = SlotLease(mapping=mapping)
    end = lease.hold()
    lease.release()
    del mapping
    gc.collect()
    assert alive() is not None, "a reader still holds the batch"
    end()
    gc.collect()
    assert alive() is None, "given back: the mapping is let go"


def test_a_hold_after_the_give_back_is_refused() -> None:
    lease = SlotLease()
    lease.release()
    with pytest.raises(AssertionError, match="already given back"):
        lease.hold()


def test_many_threads_ending_holds_give_the_slot_back_exactly_once() -> None:
    for _ in range(50):
        back = Counted()
        lease = SlotLease(back)
        ends = [lease.hold() for _ in range(8)]
        barrier = threading.Barrier(len(ends) + 1)
        threads = [threading.Thread(target=_together, args=(barrier, end)) for end in ends]
        for t in threads:
            t.start()
        barrier.wait()
        lease.release()
        for t in threads:
            t.join()
        assert back.given == 1


def _together(barrier: threading.Barrier, end: Callable[[], None]) -> None:
    barrier.wait()
    end()


def test_an_entry_hands_its_senders_the_batchs_own_lease() -> None:
    back = Counted()
    entry = Entry(0, Delivery(blob=memoryview(b"batch"), lease=SlotLease(back)))
    end = entry.outgoing.lease.hold()  # a zero-copy sender
    entry.release()  # the policy is done
    assert back.given == 0
    end()
    assert back.given == 1
