"""A ring's doorbell (NOTE [ Doorbell ] in protos/doorbell.py): a server waiting for the client
sleeps until the client releases, falls back to polling when there is no bell, and leaves no
name behind in /dev/shm."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from remote_loader.client import RemoteLoader
from remote_loader.protos import doorbell, shm
from tests.helpers import (
    LONG_TICK,
    ServeLoaders,
    assert_same,
    expected,
    left_in_dev_shm,
    sizes_spec,
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


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
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


def test_a_trainer_with_the_default_sigpipe_survives_the_server_closing_the_bell() -> None:
    """A trainer may restore SIGPIPE's default action (killing the process): ringing a bell whose
    server end has closed must not raise it, as a write to a FIFO without a reader would."""
    script = textwrap.dedent(
        """
        import signal
        from remote_loader.protos import shm
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        writer = shm.RingWriter(shm.ALIGN)
        reader = shm.RingReader(writer.name, writer.capacity)
        writer.close()
        reader.release(1)
        reader.release(2)
        reader.close()
        print("alive")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "alive", (done.returncode, done.stderr)


@pytest.mark.unit
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


@pytest.mark.unit
def test_a_ring_nobody_opened_takes_its_bell_along() -> None:
    # no_ring_left_behind (this module's pytestmark) checks that neither name is left.
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
