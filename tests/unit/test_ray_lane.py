"""A Ray actor's direct lane (NOTE [ Ray direct lane ] in server/engine/ray/lane.py): only a
peer that knows the pool's secret gets one, a SLOTS lane when this process maps its memory, else a
COPY lane; anyone else is refused at once, without unpickling a byte of theirs, and the listener
goes on. Over the Unix listener, and over TCP for a peer that cannot reach it.

With real sockets and shared memory, no Ray: the actors' side is `attach`, as a RayWorker
calls it (tests/integration/test_pool_contract.py runs the lanes of real actors).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from remote_loader.server.engine.ray.lane import (
    HELLO_TIMEOUT,
    ActorProbe,
    Lanes,
    ProcFd,
    attach,
    open_slot,
    proc_fd,
    recv_bytes_into,
    recv_message,
)


@pytest.fixture
def lanes() -> Iterator[Lanes]:
    lanes = Lanes()
    try:
        yield lanes
    finally:
        lanes.close()


def test_an_actor_whose_memory_maps_here_gets_a_slots_lane(lanes: Lanes) -> None:
    probe = ActorProbe()
    lane = attach(lanes.address, 7, probe)
    assert lane is not None and not lane.copy
    taken = lanes.take(7)
    assert taken is not None and not taken.copy
    theirs, ours = lane.conn, taken.conn
    ours.send(("task", 1))
    assert theirs.recv() == ("task", 1)
    theirs.send(("result", 1))
    assert ours.recv() == ("result", 1)
    ours.close()
    with pytest.raises(EOFError):  # the actor's lane thread ends when the server closes it
        theirs.recv()


def test_a_peer_without_the_secret_is_refused_and_the_listener_goes_on(lanes: Lanes) -> None:
    wrong = dataclasses.replace(lanes.address, secret=os.urandom(32))
    started = time.monotonic()
    assert attach(wrong, 3, ActorProbe()) is None  # closed without an answer
    assert lanes.take(3, timeout=0.5) is None
    # Bytes that are no hello at all, then a good actor: it still gets its lane.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(lanes.address.path)
        raw.sendall(os.urandom(4096))
        raw.settimeout(HELLO_TIMEOUT + 1)
        with contextlib.suppress(ConnectionResetError):  # closed with our bytes unread
            assert raw.recv(1) == b""  # closed by the server
    probe = ActorProbe()  # kept while the server opens it, as an actor keeps its own
    assert attach(lanes.address, 4, probe) is not None and lanes.take(4) is not None
    assert time.monotonic() - started < HELLO_TIMEOUT


def test_an_actor_whose_memory_does_not_map_here_gets_a_copy_lane(lanes: Lanes) -> None:
    # As from a process of the same pid on another host: the file opens, its content differs.
    probe = ActorProbe()
    probe.token = bytes(16)
    lane = attach(lanes.address, 5, probe)
    assert lane is not None and lane.copy
    taken = lanes.take(5)
    assert taken is not None and taken.copy
    blob = os.urandom(3 << 20)  # a batch's bytes, after its Result: more than a socket holds
    sender = threading.Thread(target=lane.conn.send_bytes, args=(blob,))
    sender.start()
    into = bytearray(16 + len(blob))
    assert recv_bytes_into(taken.conn, memoryview(into)[16:]) == len(blob)
    assert into[16:] == blob
    sender.join()
    # What no slot has room for is refused, not written past the slot.
    lane.conn.send_bytes(b"x" * 100)
    with pytest.raises(OSError, match="100-byte message where 10 bytes"):
        recv_bytes_into(taken.conn, memoryview(bytearray(10)))
    # (Either error gives the lane up: what follows on it is not read again.) A batch that
    # stops coming is an error after the stall bound, not a wait for good.
    lane, taken = attach(lanes.address, 8, probe), lanes.take(8)
    assert lane is not None and taken is not None
    lane.conn._send(struct.pack("!i", 1000) + b"x" * 10)  # type: ignore[attr-defined]
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no byte of a batch for 0\.5 s"):
        recv_bytes_into(taken.conn, memoryview(bytearray(1000)), stall=0.5)
    # The same for a result cut off mid-message; a whole one reads as Connection.recv would.
    lane, taken = attach(lanes.address, 9, probe), lanes.take(9)
    assert lane is not None and taken is not None
    lane.conn.send(("result", 9))
    assert recv_message(taken.conn) == ("result", 9)
    lane.conn._send(struct.pack("!i", 1000) + b"x")  # type: ignore[attr-defined]
    with pytest.raises(TimeoutError):
        recv_message(taken.conn, stall=0.5)
    assert time.monotonic() - started < 2


def test_an_actor_that_cannot_reach_the_unix_listener_attaches_over_tcp() -> None:
    lanes = Lanes(tcp_host="127.0.0.1")
    try:
        assert lanes.address.tcp is not None and lanes.address.tcp[0] == "127.0.0.1"
        # As from another network namespace: the abstract socket is not there.
        elsewhere = dataclasses.replace(lanes.address, path="\0remote-loader-nowhere")
        probe = ActorProbe()
        lane = attach(elsewhere, 6, probe)
        assert lane is not None and not lane.copy  # this host after all: its memory maps
        taken = lanes.take(6)
        assert taken is not None
        lane.conn.send(("result", 6))
        assert taken.conn.recv() == ("result", 6)
    finally:
        lanes.close()


def test_no_lane_where_the_socket_cannot_be_reached() -> None:
    lanes = Lanes()
    address = lanes.address
    lanes.close()
    assert attach(address, 1, ActorProbe()) is None  # batches come through Ray instead


def test_a_slot_is_mapped_once_and_a_reused_descriptor_refused() -> None:
    buffer = torch.zeros(1 << 16, dtype=torch.uint8).share_memory_()
    ref = proc_fd(buffer)
    mapped = open_slot(ref)
    buffer[100] = 42
    assert int(mapped[100]) == 42 and mapped.numel() == 1 << 16
    with pytest.raises(OSError, match="not the actor's slot"):
        open_slot(ProcFd(ref.pid, ref.fd, ref.inode + 1, ref.size))
    with pytest.raises(OSError):
        open_slot(ProcFd(ref.pid, 10_000, ref.inode, ref.size))
