"""The direct lane of a same-host Ray actor (NOTE [ Ray direct lane ] in server/ray_lane.py):
only a peer that knows the pool's secret and whose memory this process maps gets one; anyone
else is refused at once, without unpickling a byte of theirs, and the listener goes on.

With real sockets and shared memory, no Ray: the actors' side is `attach`, as a RayWorker
calls it (tests/test_pool_contract.py runs the lanes of real actors).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
from collections.abc import Iterator

import pytest
import torch

from remote_loader.server.ray_lane import (
    HELLO_TIMEOUT,
    Lanes,
    Probe,
    SlotRef,
    attach,
    open_slot,
    share,
)

pytestmark = pytest.mark.unit


@pytest.fixture
def lanes() -> Iterator[Lanes]:
    lanes = Lanes()
    try:
        yield lanes
    finally:
        lanes.close()


def test_an_actor_whose_memory_maps_here_gets_its_lane(lanes: Lanes) -> None:
    probe = Probe()
    theirs = attach(lanes.address, 7, probe)
    assert theirs is not None
    ours = lanes.take(7)
    assert ours is not None
    ours.send(("task", 1))
    assert theirs.recv() == ("task", 1)
    theirs.send(("result", 1))
    assert ours.recv() == ("result", 1)
    ours.close()
    with pytest.raises(EOFError):  # the actor's lane thread ends when the server closes it
        theirs.recv()


def test_a_peer_without_the_secret_is_refused_and_the_listener_goes_on(lanes: Lanes) -> None:
    wrong = dataclasses.replace(lanes.address, secret=os.urandom(32))
    theirs = attach(wrong, 3, Probe())
    assert theirs is not None  # connected: the hello is what is refused
    with pytest.raises(EOFError):
        theirs.recv()
    started = time.monotonic()
    assert lanes.take(3, timeout=0.5) is None
    # Bytes that are no hello at all, then a good actor: it still gets its lane.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(lanes.address.path)
        raw.sendall(os.urandom(4096))
        raw.settimeout(HELLO_TIMEOUT + 1)
        with contextlib.suppress(ConnectionResetError):  # closed with our bytes unread
            assert raw.recv(1) == b""  # closed by the server
    probe = Probe()  # kept while the server opens it, as an actor keeps its own
    good = attach(lanes.address, 4, probe)
    assert good is not None and lanes.take(4) is not None
    assert time.monotonic() - started < HELLO_TIMEOUT


def test_an_actor_whose_probe_does_not_hold_its_token_is_answered_at_once(lanes: Lanes) -> None:
    # As from a process of the same pid on another host: the file opens, its content differs.
    probe = Probe()
    probe.token = bytes(16)
    theirs = attach(lanes.address, 5, probe)
    assert theirs is not None
    started = time.monotonic()
    assert lanes.take(5) is None  # no wait for a hello that will never check out
    assert time.monotonic() - started < 1.0
    with pytest.raises(EOFError):
        theirs.recv()


def test_no_lane_where_the_socket_cannot_be_reached() -> None:
    lanes = Lanes()
    address = lanes.address
    lanes.close()
    assert attach(address, 1, Probe()) is None  # batches come through Ray instead


def test_a_slot_is_mapped_once_and_a_reused_descriptor_refused() -> None:
    buffer = torch.zeros(1 << 16, dtype=torch.uint8).share_memory_()
    ref = share(buffer)
    mapped = open_slot(ref)
    buffer[100] = 42
    assert int(mapped[100]) == 42 and mapped.numel() == 1 << 16
    with pytest.raises(OSError, match="not the actor's slot"):
        open_slot(SlotRef(ref.pid, ref.fd, ref.inode + 1, ref.size))
    with pytest.raises(OSError):
        open_slot(SlotRef(ref.pid, 10_000, ref.inode, ref.size))
