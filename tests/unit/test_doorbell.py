"""A ring's doorbell (NOTE [ Doorbell ] in protos/doorbell.py) between a writer and a reader in
this process: a server waiting for the client sleeps until the client releases, falls back to
polling when there is no bell, and leaves no name behind in /dev/shm.

The tests that start a server, a process or Ray: tests/integration/test_doorbell.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from remote_loader.protos import doorbell, shm
from tests.helpers import (
    LONG_TICK,
    left_in_dev_shm,
)

# No ring or bell is left in /dev/shm after a test.
pytestmark = pytest.mark.usefixtures("no_ring_left_behind")

RELEASE_AFTER = 0.3


def counted(ready: Callable[[], bool]) -> tuple[Callable[[], bool], list[int]]:
    calls = [0]

    def count() -> bool:
        calls[0] += 1
        return ready()

    return count, calls


def full_ring() -> tuple[shm.RingWriter, shm.RingReader, int]:
    """A one-batch ring holding a batch the client has not released yet; returns the cursor
    that releases it."""
    writer = shm.RingWriter(shm.ALIGN)
    reader = shm.RingReader(writer.name, writer.capacity)
    placed = writer.place(np.ones(8, np.uint8).data, lambda: False)
    assert placed is not None
    return writer, reader, placed[1]


def wait_for_a_late_release(
    writer: shm.RingWriter, reader: shm.RingReader, cursor: int
) -> tuple[int, float]:
    """The server waits for the client, which releases `cursor` RELEASE_AFTER s later: how
    many times the server looked at the cursor, and how long it waited."""
    ready, calls = counted(lambda: writer.consumed() >= cursor)

    def release() -> None:
        time.sleep(RELEASE_AFTER)
        reader.release(cursor)

    releasing = threading.Thread(target=release)
    releasing.start()
    start = time.monotonic()
    assert writer.wait(ready, lambda: False, 50e-6)
    waited = time.monotonic() - start
    releasing.join()
    return calls[0], waited


def test_a_waiting_server_sleeps_until_the_client_releases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(doorbell, "BELL_TICK", LONG_TICK)
    writer, reader, cursor = full_ring()
    try:
        looks, waited = wait_for_a_late_release(writer, reader, cursor)
        # Woken by the ring, not by a tick: one look before the sleep, one after the wake (a
        # few more if the release raced the first looks). Polling would look every 2 ms.
        assert waited < LONG_TICK / 2
        assert looks <= 6, f"the cursor was looked at {looks} times in {waited:.2f} s"
    finally:
        reader.close()
        writer.close()


def test_without_a_bell_the_server_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that cannot ring (an older one, or a socket it cannot reach) is still waited
    for: by polling."""

    def unreachable(self: doorbell.Ringer, path: str) -> None:
        raise OSError("cannot connect")

    monkeypatch.setattr(doorbell, "BELL_TICK", LONG_TICK)
    monkeypatch.setattr(doorbell.Ringer, "__init__", unreachable)
    writer, reader, cursor = full_ring()
    try:
        looks, waited = wait_for_a_late_release(writer, reader, cursor)
        assert waited < LONG_TICK / 2
        assert looks > 6  # it polled
    finally:
        reader.close()
        writer.close()


def test_a_client_gone_ends_the_wait_at_a_tick_without_spinning() -> None:
    """Nothing rings once the client is gone; `stopped()` still ends the wait, looked at once
    a tick (20 ms), not every 2 ms as polling would."""
    writer, reader, cursor = full_ring()
    try:
        reader.close()  # the cursor is never released
        deadline = time.monotonic() + 0.3
        ready, calls = counted(lambda: writer.consumed() >= cursor)
        assert not writer.wait(ready, lambda: time.monotonic() > deadline, 50e-6)
        assert calls[0] < 60, calls[0]  # ~2 looks per tick; polling: 150 in 0.3 s
    finally:
        writer.close()


def test_ringing_a_full_or_closed_bell_never_blocks_or_raises() -> None:
    writer = shm.RingWriter(shm.ALIGN)
    reader = shm.RingReader(writer.name, writer.capacity)
    try:
        for cursor in range(100):  # more than the socket queues, none drained
            reader.release(cursor)
        writer.close()  # the server's end goes: ECONNREFUSED from now on
        reader.release(100)
        reader.release(101)
    finally:
        reader.close()
        writer.close()


def test_the_bell_is_unlinked_when_the_client_opens_it() -> None:
    writer = shm.RingWriter(shm.ALIGN)
    bell = doorbell.BELL_PREFIX + writer.name[len(shm.RING_PREFIX) :]
    assert bell in left_in_dev_shm()
    reader = shm.RingReader(writer.name, writer.capacity)
    try:
        assert bell not in left_in_dev_shm()  # connected: the socket needs no name
        reader.release(1)
        assert writer.consumed() == 1
    finally:
        reader.close()
        writer.close()


def test_a_ring_nobody_opened_takes_its_bell_along() -> None:
    # no_ring_left_behind (this module's pytestmark) checks that neither name is left.
    writer = shm.RingWriter(shm.ALIGN)
    writer.close()
