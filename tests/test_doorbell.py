"""A ring's doorbell (NOTE [ Doorbell ] in protos/doorbell.py): a server waiting for the client
sleeps until the client releases, falls back to polling when there is no bell, and leaves no
name behind in /dev/shm."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from remote_loader.client import RemoteLoader
from remote_loader.protos import doorbell, shm
from tests.conftest import ServeLoaders, assert_same

# The autouse fixture: no ring or bell is left in /dev/shm after a test.
from tests.test_shm import (  # noqa: F401
    _no_ring_left_behind,
    expected,
    left_in_dev_shm,
    sizes_spec,
)

# A tick so long that a wait which ends sooner was ended by the client's ring; a wait that polls
# instead (no bell) looks at the cursor many times meanwhile.
LONG_TICK = 30.0
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


def release_later(reader: shm.RingReader, cursor: int) -> threading.Thread:
    def release() -> None:
        time.sleep(RELEASE_AFTER)
        reader.release(cursor)

    thread = threading.Thread(target=release)
    thread.start()
    return thread


def test_a_waiting_server_sleeps_until_the_client_releases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(doorbell, "BELL_TICK", LONG_TICK)
    writer, reader, cursor = full_ring()
    try:
        ready, calls = counted(lambda: writer.consumed() >= cursor)
        releasing = release_later(reader, cursor)
        start = time.monotonic()
        assert writer.wait(ready, lambda: False, 50e-6)
        waited = time.monotonic() - start
        releasing.join()
        # Woken by the ring, not by a tick: one look before the sleep, one after the wake (a
        # few more if the release raced the first looks). Polling would look every 2 ms.
        assert waited < LONG_TICK / 2
        assert calls[0] <= 6, f"the cursor was looked at {calls[0]} times in {waited:.2f} s"
    finally:
        reader.close()
        writer.close()


def test_without_a_bell_the_server_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that cannot ring (an older one, or no FIFOs) is still waited for: by polling."""

    def no_fifo(self: doorbell.Ringer, path: str) -> None:
        raise OSError("no FIFOs here")

    monkeypatch.setattr(doorbell, "BELL_TICK", LONG_TICK)
    monkeypatch.setattr(doorbell.Ringer, "__init__", no_fifo)
    writer, reader, cursor = full_ring()
    try:
        ready, calls = counted(lambda: writer.consumed() >= cursor)
        releasing = release_later(reader, cursor)
        start = time.monotonic()
        assert writer.wait(ready, lambda: False, 50e-6)
        releasing.join()
        assert time.monotonic() - start < LONG_TICK / 2
        assert calls[0] > 6  # it polled
    finally:
        reader.close()
        writer.close()


def test_a_client_that_closes_its_end_is_polled_then_and_stops_the_wait() -> None:
    """End-of-file on the bell (the client's end closed) neither spins nor hangs the server:
    it polls, and `stopped()` still ends the wait."""
    writer, reader, cursor = full_ring()
    try:
        reader.close()  # closes the ringer; the cursor is never released
        deadline = time.monotonic() + 0.3
        ready, calls = counted(lambda: writer.consumed() >= cursor)
        assert not writer.wait(ready, lambda: time.monotonic() > deadline, 50e-6)
        assert calls[0] < 1000  # polled with back-off (0.3 s / 2 ms), did not spin on EOF
    finally:
        writer.close()


def test_ringing_a_full_or_closed_bell_never_blocks_or_raises() -> None:
    writer = shm.RingWriter(shm.ALIGN)
    reader = shm.RingReader(writer.name, writer.capacity)
    try:
        for cursor in range(70_000):  # more than the FIFO's 64 KiB, none drained
            reader.release(cursor)
        writer.close()  # the server's end goes: EPIPE from now on
        reader.release(70_000)
        reader.release(70_001)
    finally:
        reader.close()
        writer.close()


def test_the_bell_is_unlinked_when_the_client_opens_it() -> None:
    writer = shm.RingWriter(shm.ALIGN)
    bell = doorbell.BELL_PREFIX + writer.name[len(shm.RING_PREFIX) :]
    assert bell in left_in_dev_shm()
    reader = shm.RingReader(writer.name, writer.capacity)
    try:
        assert bell not in left_in_dev_shm()  # the two descriptors keep the FIFO
        reader.release(1)
        assert writer.consumed() == 1
    finally:
        reader.close()
        writer.close()


def test_a_ring_nobody_opened_takes_its_bell_along() -> None:
    # The autouse fixture (_no_ring_left_behind) checks that neither name is left.
    writer = shm.RingWriter(shm.ALIGN)
    writer.close()


@pytest.mark.parametrize("zero_copy", [True, False])
@pytest.mark.timeout(120)
def test_a_slow_trainers_server_sleeps_on_the_bell(
    serve_loaders: ServeLoaders, monkeypatch: pytest.MonkeyPatch, zero_copy: bool
) -> None:
    """A client slower than its loader: the server waits for every release (a slot lease, or
    room in the ring), each time asleep on the bell until the client's ring ends the wait, and
    the epoch arrives whole."""
    monkeypatch.setattr(doorbell, "BELL_TICK", LONG_TICK)
    waits: list[tuple[bool | None, float]] = []  # what each wait returned, and its seconds
    real = doorbell.Doorbell.wait

    def timed(self: doorbell.Doorbell, *args: Callable[[], bool]) -> bool | None:
        start = time.monotonic()
        done = real(self, *args)
        waits.append((done, time.monotonic() - start))
        return done

    monkeypatch.setattr(doorbell.Doorbell, "wait", timed)
    sizes = [200_000] * 16
    settings = {} if zero_copy else {"zero_copy": False}
    served = serve_loaders(sizes_spec(sizes, num_workers=1), **settings)
    got = []
    with RemoteLoader(served.address, device="cpu", prefetch=1) as loader:
        for batch in loader:
            time.sleep(0.05)  # the train step
            got.append(batch)
        assert loader.last_transport == "shm"
    assert_same(got, expected(sizes))
    assert len(waits) >= 4, waits  # the server waited on the client, on the bell
    assert all(done is True for done, _ in waits), waits
    # Each wait was ended by the client's ring, not by a tick.
    assert max(seconds for _, seconds in waits) < LONG_TICK / 2, waits
