"""The end of a stream on its data connections (NOTE [ End of a stream ] in
protos/tcp_closing.py): the server's last batch may still be in the kernel's buffers when its
stream ends, and a slower trainer must get all of it, without a reset, a resume or a batch made
twice.

Real servers on port 0 and real sockets on loopback; a client with a small receive buffer keeps
most of the last batch in the server's send buffer, as a slow trainer across a network does.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import pytest

from remote_loader.client import RemoteLoader
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import tcp
from tests.helpers import (
    Served,
    ServeLoaders,
    assert_same,
    data_sockets,
    expected,
    raw_stream,
    sizes_spec,
    wait_until,
)

# Small enough that nearly all of a batch waits in the server's send buffer (4 MiB asked,
# twice that granted), not in this client's.
SMALL_RCVBUF = 64 * 1024


def slow_connection(port: int, ticket: bytes) -> socket.socket:
    """A data connection made by hand, with a small receive buffer set before connecting (so
    the window it offers stays small)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_RCVBUF)
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    sock.sendall(tcp.hello(ticket))
    assert sock.recv(1) == tcp.ACK
    sock.settimeout(tcp.POLL_INTERVAL)
    return sock


@contextlib.contextmanager
def slow_stream(served: Served) -> Iterator[tuple[Iterator[pb.Frame], socket.socket, int]]:
    """A raw tcp stream of `served`'s only loader with one slow_connection: its Frames after
    the one handing out the ticket, the connection, and the server's data port."""
    port = served.server.data_port
    assert port is not None
    channel, call = raw_stream(served.address, pb.StreamRequest(tcp=True, data_connections=1))
    with channel:
        frames = iter(call)
        with slow_connection(port, next(frames).tcp_channel.ticket) as sock:
            yield frames, sock, port


def test_the_last_batch_outlives_its_stream_and_a_heartbeat_the_server_never_read(
    serve_loaders: ServeLoaders,
) -> None:
    sizes = [10, 3_000_000]
    served = serve_loaders(sizes_spec(sizes, num_workers=0))
    with slow_stream(served) as (frames, sock, port):
        first = next(frames)
        assert first.on_tcp and first.batch == 0
        assert tcp.recv_into(sock, memoryview(bytearray(first.total_bytes)), lambda: False)
        last = next(frames)
        assert last.on_tcp and last.batch == 1
        # A trainer whose queue is full beats before it reads: a byte the server has no
        # reason to read (its send of the last batch went into its buffer at once).
        tcp.beat(sock)
        end = next(frames)
        assert end.end.batches == 2
        # The stream is over on the server (its handler returned, its sender closed) while
        # nearly all of the last batch is still in the kernel: a close now would reset the
        # connection and drop what the server's buffer holds.
        assert wait_until(lambda: served.server.service.admission.running == 0, 10)
        # A time, not a state: what is checked is that the stream's end does NOT reset the
        # connection; a reset would follow the handler's return within milliseconds, and this
        # lets it arrive before the read below (the server keeps its end open meanwhile, so no
        # state of ours changes when it is right).
        time.sleep(0.2)
        data = bytearray(last.total_bytes)
        assert tcp.recv_into(sock, memoryview(data), lambda: False)  # all of it
        assert data[-sizes[1] :] == bytes([1]) * sizes[1]  # batch 1: bytes equal to 1
        assert sock.recv(1) == b""  # then the server's FIN, not a reset
    # Closed here: the server lets go of its end at once.
    assert wait_until(lambda: data_sockets(port) == 0, 10)


def test_a_client_that_never_closes_is_let_go_after_its_silence(
    serve_loaders: ServeLoaders,
) -> None:
    # keepalive 0.5 + 0.5 s: the client's silence allowance is 1 s.
    served = serve_loaders(
        sizes_spec([10], num_workers=0), keepalive_time_ms=500, keepalive_timeout_ms=500
    )
    with slow_stream(served) as (frames, sock, port):
        first = next(frames)
        assert tcp.recv_into(sock, memoryview(bytearray(first.total_bytes)), lambda: False)
        assert next(frames).end.batches == 1
        assert data_sockets(port) == 2  # the server holds its end for the client ...
        # ... which neither closes nor beats: it is let go after about a second.
        assert wait_until(lambda: data_sockets(port) == 1, 10)


@pytest.mark.parametrize("connections", [1, 3])
def test_a_slow_trainer_gets_every_epoch_without_a_resume(
    serve_loaders: ServeLoaders, connections: int
) -> None:
    # Batches several times the socket buffers, a trainer slower than its loader: the server
    # ends each stream with the last batch mostly unread.
    sizes = [3_000_000] * 6
    served = serve_loaders(sizes_spec(sizes, num_workers=1))
    with RemoteLoader(
        served.address, transport="tcp", data_connections=connections, prefetch=1
    ) as loader:
        for _ in range(3):
            got = []
            for batch in loader:
                got.append(batch)
                time.sleep(0.15)  # the training step
            assert_same(got, expected(sizes))
            assert loader.last_transport == "tcp"
        assert loader.stats().reconnects == 0
