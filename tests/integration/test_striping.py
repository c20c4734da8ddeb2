"""Several data connections per stream (NOTE [ TCP data connection ]: striping) on real servers on
port 0: exact batches on 1, 2 and 4 connections around MIN_STRIPE, the server's cap and its
fallback when only some connections come, a connection cut mid-stripe (resumed, no batch lost
or repeated), a stream stopped mid-stripe, and no socket or thread left behind.

The unit tests (no server, no process, no Ray): tests/unit/test_striping.py.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from remote_loader.client import RemoteLoader
from remote_loader.client.transports import StreamEnds
from remote_loader.client.transports.tcp import STRIPE_THREAD_NAME as RECV_THREADS
from remote_loader.protos import codec, tcp
from remote_loader.protos import loader_pb2 as pb
from remote_loader.server.transports.tcp import STRIPE_THREAD_NAME as SEND_THREADS
from tests.helpers import (
    MiB,
    ServeLoaders,
    assert_same,
    data_sockets,
    expected,
    raw_stream,
    sizes_spec,
    wait_until,
)


def payload_for(total: int) -> int:
    """The size of a Sizes sample whose encoded batch is `total` bytes (header included)."""
    size = total
    for _ in range(3):  # the header's length depends a little on the size it describes
        header = codec.encode(torch.empty(size, dtype=torch.uint8)).header
        size = total - codec.payload_offset(len(header))
    assert codec.encode(torch.empty(size, dtype=torch.uint8)).total_nbytes == total
    return size


# Encoded batches below, at and well above MIN_STRIPE and its multiples.
SIZES = [
    1000,
    payload_for(MiB - 1),
    payload_for(MiB),
    payload_for(2 * MiB - 1),
    payload_for(2 * MiB),
    0,
    payload_for(3 * MiB + 12345),
    12_000_000,
    44,
]


def stripe_threads(prefix: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


# --- on real servers -----------------------------------------------------------------------


@pytest.mark.parametrize("connections", [None, 1, 2, 4])
def test_batches_arrive_exactly_striped_over_several_connections(
    serve_loaders: ServeLoaders, recv_spy: set[int], connections: int | None
) -> None:
    served = serve_loaders(sizes_spec(SIZES))
    with RemoteLoader(served.address, transport="tcp", data_connections=connections) as loader:
        for _ in range(2):  # a new stream, and new connections, per epoch
            recv_spy.clear()
            assert_same(list(loader), expected(SIZES))
            assert loader.last_transport == "tcp"
            # The 12 MB batch came on every connection: the stripes really were spread.
            assert len(recv_spy) == (connections or tcp.DEFAULT_DATA_CONNECTIONS)


def test_a_stream_asks_for_its_connections_and_the_server_grants_at_most_eight(
    serve_loaders: ServeLoaders,
) -> None:
    for asked, offered in ((None, tcp.DEFAULT_DATA_CONNECTIONS), (2, 2)):
        request = pb.StreamRequest()
        ends = StreamEnds("test", None, "127.0.0.1", lambda: False, data_connections=asked)
        ends.offer(request)
        ends.close()
        assert request.tcp and request.data_connections == offered
    served = serve_loaders(sizes_spec([1000]))

    def announced(**request: Any) -> int:
        channel, call = raw_stream(served.address, pb.StreamRequest(tcp=True, **request))
        with channel:
            first = next(iter(call))
            call.cancel()
        tickets = [first.tcp_channel.ticket, *first.tcp_channel.more_tickets]
        assert all(len(t) == tcp.TICKET_BYTES for t in tickets) and len(set(tickets)) == len(
            tickets
        )
        return len(tickets)

    assert announced() == 1  # a client from before striping
    assert announced(data_connections=3) == 3
    assert announced(data_connections=100) == tcp.MAX_DATA_CONNECTIONS


def test_a_server_that_gets_only_some_connections_sends_frames_and_closes_them(
    serve_loaders: ServeLoaders, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tcp, "ACCEPT_TIMEOUT", 0.5)
    served = serve_loaders(sizes_spec([1000, 2000]))
    port = served.server.data_port
    assert port is not None
    channel, call = raw_stream(served.address, pb.StreamRequest(tcp=True, data_connections=3))
    with channel:
        frames = iter(call)
        announce = next(frames).tcp_channel
        made = [tcp.connect("127.0.0.1", port, t) for t in announce.more_tickets]  # not the first
        rest = list(frames)
        assert [(f.batch, f.on_tcp, len(f.data) > 0) for f in rest[:-1]] == [
            (0, False, True),
            (1, False, True),
        ]
        assert rest[-1].end.batches == 2
        for sock in made:
            sock.settimeout(5)
            assert sock.recv(1) == b""  # closed by the server
            sock.close()


@pytest.mark.parametrize("stripe", ["first", "another"])
def test_a_connection_cut_mid_stripe_is_resumed_exactly(
    serve_loaders: ServeLoaders, monkeypatch: pytest.MonkeyPatch, stripe: str
) -> None:
    sizes = [payload_for(3 * MiB + 5000)] * 5
    served = serve_loaders(sizes_spec(sizes))
    real: Callable[..., bool] = tcp.recv_into
    payload_reads = 0
    cut = threading.Event()
    lock = threading.Lock()

    def cut_once(sock: socket.socket, out: memoryview, *args: Any) -> bool:
        nonlocal payload_reads
        on_pool = threading.current_thread().name.startswith(RECV_THREADS)
        if len(out) < MiB // 2 or on_pool != (stripe == "another"):
            return real(sock, out, *args)
        with lock:
            payload_reads += 1
            now = payload_reads == 3 and not cut.is_set()  # in batch 1 or 2 of 5
            if now:
                cut.set()
        if not now:
            return real(sock, out, *args)
        # Half the stripe arrives, then its socket breaks under the reader for good (after a
        # mere shutdown, what the kernel buffered could still be read).
        half = len(out) // 2
        assert real(sock, out[:half], *args)
        sock.close()
        return real(sock, out[half:], *args)

    monkeypatch.setattr(tcp, "recv_into", cut_once)
    with RemoteLoader(served.address, transport="tcp", data_connections=3, backoff=0.05) as loader:
        assert_same(list(loader), expected(sizes))  # each batch once, in order
        assert cut.is_set()
        assert loader.stats().reconnects == 1
        assert loader.last_transport == "tcp"
    # The server's side of it ended too, its threads with it.
    assert wait_until(lambda: served.server.service.admission.running == 0, 5)
    assert wait_until(lambda: not stripe_threads(SEND_THREADS), 5)


@pytest.mark.parametrize("break_off", [False, True])
def test_no_socket_or_thread_outlives_its_stream(
    serve_loaders: ServeLoaders, break_off: bool
) -> None:
    sizes = [payload_for(4 * MiB)] * 8
    served = serve_loaders(sizes_spec(sizes, prefetch_factor=2))
    port = served.server.data_port
    assert port is not None
    assert not stripe_threads(SEND_THREADS) and not stripe_threads(RECV_THREADS)
    assert data_sockets(port) == 0
    with RemoteLoader(served.address, transport="tcp", data_connections=4, prefetch=1) as loader:
        it = iter(loader)
        next(it)
        next(it)
        # Both ends of 4 connections, and 3 threads on each side (bounded whatever the load).
        assert data_sockets(port) == 8
        assert len(stripe_threads(SEND_THREADS)) == 3
        assert len(stripe_threads(RECV_THREADS)) == 3
        if break_off:
            it.close()  # mid-epoch, likely mid-stripe on the server
        else:
            assert sum(1 for _ in it) == len(sizes) - 2
    assert wait_until(lambda: served.server.service.admission.running == 0, 5)
    assert wait_until(lambda: data_sockets(port) == 0, 5)
    assert not stripe_threads(SEND_THREADS)
    assert not stripe_threads(RECV_THREADS)


def _next_quietly(it: Iterator[Any]) -> None:
    with contextlib.suppress(Exception):  # closed under it: StopIteration or an error
        next(it)


def test_a_stream_stopped_mid_stripe_ends_at_once(
    serve_loaders: ServeLoaders, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes = [payload_for(3 * MiB)] * 4
    served = serve_loaders(sizes_spec(sizes))
    real: Callable[..., bool] = tcp.send
    stalled = threading.Event()
    release = threading.Event()

    def stall_second_stripe(sock: socket.socket, data: memoryview, *args: Any) -> bool:
        # The server's writer of stripe 1 or 2 of batch 0 sends half, then the network stalls.
        if threading.current_thread().name.startswith(SEND_THREADS) and not stalled.is_set():
            stalled.set()
            if not real(sock, data[: len(data) // 2], *args):
                return False
            release.wait(30)
            return real(sock, data[len(data) // 2 :], *args)
        return real(sock, data, *args)

    monkeypatch.setattr(tcp, "send", stall_second_stripe)
    try:
        with RemoteLoader(served.address, transport="tcp", data_connections=3) as loader:
            it = iter(loader)
            # The stream opens at the first next() (NOTE [ An iterator's epoch ]), which waits
            # on the stalled stripe: in a thread, whose next() ends when the stream is closed.
            asking = threading.Thread(target=_next_quietly, args=(it,), daemon=True)
            asking.start()
            assert stalled.wait(10)
            # The client's readers are up, waiting on the stalled stripe.
            assert wait_until(lambda: bool(stripe_threads(RECV_THREADS)), 10)
            started = time.monotonic()
            it.close()
            assert time.monotonic() - started < 2  # every reader honoured stopped()
            assert not it._receiver.is_alive()
            asking.join(timeout=5)
            assert not asking.is_alive()
    finally:
        release.set()
    assert wait_until(lambda: not stripe_threads(RECV_THREADS), 5)
    assert wait_until(lambda: served.server.service.admission.running == 0, 5)
    assert wait_until(lambda: not stripe_threads(SEND_THREADS), 5)
