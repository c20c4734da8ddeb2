"""The TCP data connection (NOTE [ TCP data connection ] in protos/tcp.py).

Real servers on port 0: the negotiation and its fallbacks (a server without a listener, a client
that cannot connect, one that never connects), a connection that breaks mid-epoch (resumed, no
batch lost or repeated), the listener's guard against stray connections, and a killed client.

The unit tests (no server, no process, no Ray): tests/unit/test_tcp.py.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import pytest

from remote_loader.client import RemoteLoader, TransportError
from remote_loader.client.types import Transport
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import tcp
from tests.helpers import (
    ROOT,
    ServeLoaders,
    assert_same,
    expected,
    raw_stream,
    serve_sizes,
    sizes_spec,
    stop_process,
    wait_until,
)

SIZES = [1000, 5_000_000, 7, 300_000, 12_000_000, 0, 44]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_arrive_exactly_on_the_data_connection(
    serve_loaders: ServeLoaders, num_workers: int
) -> None:
    served = serve_loaders(sizes_spec(SIZES, num_workers))
    assert served.server.data_port is not None
    with RemoteLoader(served.address, transport="tcp") as loader:
        for _ in range(2):  # a new stream, and a new connection, per epoch
            assert_same(list(loader), expected(SIZES))
            assert loader.last_transport == "tcp"
            assert loader.stats().transport == "tcp"
    # "auto" on one host takes shared memory first, and the data connection when it cannot.
    served = serve_loaders(sizes_spec(SIZES, num_workers), max_ring_bytes=0)
    with RemoteLoader(served.address) as loader:
        assert_same(list(loader), expected(SIZES))
        assert loader.last_transport == "tcp"


def test_a_server_with_its_listener_off_streams_inside_grpc(serve_loaders: ServeLoaders) -> None:
    served = serve_loaders(sizes_spec(SIZES), data_address="off", max_ring_bytes=0)
    assert served.server.data_port is None
    with RemoteLoader(served.address) as loader:  # "auto": the next way
        assert_same(list(loader), expected(SIZES))
        assert loader.last_transport == "grpc"
    # transport="tcp" never becomes gRPC behind the caller's back: it says why, at batch 0.
    refused = r'transport="tcp", but the server sends batch 0'
    with (
        RemoteLoader(served.address, transport="tcp") as loader,
        pytest.raises(TransportError, match=refused),
    ):
        next(iter(loader))


def test_a_client_that_cannot_connect_goes_on_inside_grpc_at_once(
    serve_loaders: ServeLoaders, caplog: pytest.LogCaptureFixture
) -> None:
    # The listener is on 127.0.0.2, the client reaches gRPC at 127.0.0.1: its connect is
    # refused, as behind a firewall that lets only the gRPC port through.
    served = serve_loaders(sizes_spec(SIZES), data_address="127.0.0.2:0", max_ring_bytes=0)
    with RemoteLoader(served.address) as loader:
        started = time.monotonic()
        assert_same(list(loader), expected(SIZES))
        elapsed = time.monotonic() - started
        assert loader.last_transport == "grpc"
        assert loader.stats().reconnects == 0  # falling back is not a failure
        assert_same(list(loader), expected(SIZES))  # the next epoch does not try again
        assert loader.last_transport == "grpc"
    # The client cancelled and went on: the server did not wait out its ACCEPT_TIMEOUT.
    assert elapsed < tcp.ACCEPT_TIMEOUT / 2, elapsed
    assert caplog.text.count("continuing inside the gRPC stream from batch 0") == 1
    # transport="tcp" raises instead, saying what failed.
    with (
        RemoteLoader(served.address, transport="tcp") as loader,
        pytest.raises(TransportError, match=r'transport="tcp", but .*cannot connect to 127.0.0.1'),
    ):
        next(iter(loader))
    with pytest.raises(ValueError, match='transport="tcp" needs an address naming one TCP host'):
        RemoteLoader("unix:/tmp/nothing.sock", transport="tcp")


class SlowPort:
    """A TCP relay from 127.0.0.1:`port` to 127.0.0.2:`port` (a server's data listener there)
    that holds each connection's first bytes from the client `hold` seconds while `slow` is
    set: a client too busy to send its HELLO in time, as seen by both ends."""

    def __init__(self, port: int, hold: float) -> None:
        self.hold = hold
        self.slow = True
        self.listener = socket.create_server(("127.0.0.1", port))
        threading.Thread(target=self._accept, args=(port,), daemon=True).start()

    def _accept(self, port: int) -> None:
        with contextlib.suppress(OSError):  # closed
            while True:
                client, _ = self.listener.accept()
                hold = self.hold if self.slow else 0.0
                threading.Thread(target=self._relay, args=(client, port, hold), daemon=True).start()

    def _relay(self, client: socket.socket, port: int, hold: float) -> None:
        with client, socket.create_connection(("127.0.0.2", port)) as server:
            back = threading.Thread(target=self._pass, args=(server, client, 0.0), daemon=True)
            back.start()
            self._pass(client, server, hold)
            back.join()

    @staticmethod
    def _pass(a: socket.socket, b: socket.socket, wait: float) -> None:
        time.sleep(wait)
        with contextlib.suppress(OSError):
            while data := a.recv(1 << 16):
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)


def test_a_handshake_too_slow_is_tried_again_next_epoch(
    serve_loaders: ServeLoaders, caplog: pytest.LogCaptureFixture
) -> None:
    # Trainers starting together on a host of a quarter core missed the handshake, and every
    # later epoch of theirs went inside gRPC too (NOTE [ A slow handshake ] in protos/tcp.py).
    served = serve_loaders(sizes_spec(SIZES), data_address="127.0.0.2:0", max_ring_bytes=0)
    assert served.server.data_port is not None
    port = SlowPort(served.server.data_port, hold=tcp.CONNECT_TIMEOUT + 0.5)
    try:
        with RemoteLoader(served.address, data_connections=2) as loader:
            assert_same(list(loader), expected(SIZES))
            assert loader.last_transport == "grpc"  # this epoch went on inside gRPC
            port.slow = False
            assert_same(list(loader), expected(SIZES))
            assert loader.last_transport == "tcp"  # ... and the next asked again
    finally:
        port.listener.close()
    assert "did not end within 3 s" in caplog.text, caplog.text


def test_a_handshake_too_slow_for_every_epoch_is_given_up(serve_loaders: ServeLoaders) -> None:
    served = serve_loaders(sizes_spec(SIZES[:3]), data_address="127.0.0.2:0", max_ring_bytes=0)
    assert served.server.data_port is not None
    port = SlowPort(served.server.data_port, hold=tcp.CONNECT_TIMEOUT + 0.5)
    try:
        with RemoteLoader(served.address, data_connections=1) as loader:
            took = []
            for _ in range(tcp.SLOW_HANDSHAKES + 1):
                started = time.monotonic()
                assert_same(list(loader), expected(SIZES[:3]))
                took.append(time.monotonic() - started)
                assert loader.last_transport == "grpc"
    finally:
        port.listener.close()
    # Each of the first SLOW_HANDSHAKES epochs waited out the handshake; the next did not ask.
    assert min(took[:-1]) >= tcp.CONNECT_TIMEOUT and took[-1] < tcp.CONNECT_TIMEOUT, took


def test_a_client_that_never_connects_gets_frames_after_the_accept_timeout(
    serve_loaders: ServeLoaders, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tcp, "ACCEPT_TIMEOUT", 0.5)
    served = serve_loaders(sizes_spec([1000, 2000]))
    channel, call = raw_stream(served.address, pb.StreamRequest(tcp=True))
    with channel:
        frames = list(call)
    assert frames[0].HasField("tcp_channel") and len(frames[0].tcp_channel.ticket) == 32
    assert [(f.batch, f.on_tcp, len(f.data)) for f in frames[1:-1]] == [
        (0, False, frames[1].total_bytes),
        (1, False, frames[2].total_bytes),
    ]
    assert frames[-1].end.batches == 2


def test_a_ticket_opens_one_connection_and_nothing_else_does(serve_loaders: ServeLoaders) -> None:
    served = serve_loaders(sizes_spec([1000, 2000]))
    port = served.server.data_port
    assert port is not None

    def answer(hello: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(hello)
            try:
                return sock.recv(1)  # b"": closed without a word
            except ConnectionResetError:  # closed with bytes it did not read: also no word
                return b""

    assert answer(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 16) == b""
    assert answer(tcp.hello(tcp.new_ticket())) == b""  # a ticket no stream gave out
    channel, call = raw_stream(served.address, pb.StreamRequest(tcp=True))
    with channel:
        frames = iter(call)
        ticket = next(frames).tcp_channel.ticket
        sock = tcp.connect("127.0.0.1", port, ticket)
        with sock:
            assert answer(tcp.hello(ticket)) == b""  # used once
            first = next(frames)
            assert first.on_tcp and first.batch == 0 and not first.data
            data = bytearray(first.total_bytes)
            assert tcp.recv_into(sock, memoryview(data), lambda: False)
            call.cancel()


def test_stray_connections_neither_block_streams_nor_pile_up(
    serve_loaders: ServeLoaders, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As many as the client's own connections, made at once: they must not evict each other.
    monkeypatch.setattr(tcp, "MAX_HANDSHAKES", tcp.DEFAULT_DATA_CONNECTIONS)
    monkeypatch.setattr(tcp, "HANDSHAKE_TIMEOUT", 1.0)
    served = serve_loaders(sizes_spec(SIZES))
    port = served.server.data_port
    assert port is not None
    silent = [
        socket.create_connection(("127.0.0.1", port), timeout=5)
        for _ in range(tcp.MAX_HANDSHAKES + 1)
    ]
    # Over MAX_HANDSHAKES the oldest silent one is evicted (closed: recv gives b"").
    assert silent[0].recv(1) == b""
    # So silent connections cannot crowd out a real client, who says HELLO at once.
    with RemoteLoader(served.address, transport="tcp") as loader:
        assert_same(list(loader), expected(SIZES))
        assert loader.last_transport == "tcp"
    started = time.monotonic()
    for sock in silent[1:]:
        assert sock.recv(1) == b""  # evicted, or closed after HANDSHAKE_TIMEOUT
    assert time.monotonic() - started < 3
    for sock in silent:
        sock.close()


def test_a_data_connection_that_breaks_mid_epoch_is_resumed_exactly(
    serve_loaders: ServeLoaders, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = serve_loaders(sizes_spec(SIZES))
    real: Callable[..., bool] = tcp.recv_into
    cut = False

    def cut_once(sock: socket.socket, out: memoryview, *args: Any) -> bool:
        nonlocal cut
        if len(out) == SIZES[1] and not cut:  # batch 1's payload: the socket breaks for good
            cut = True  # (after a mere shutdown, what the kernel buffered could still be read)
            sock.close()
        return real(sock, out, *args)

    monkeypatch.setattr(tcp, "recv_into", cut_once)  # the module the receiver calls through
    # One connection: a batch is one read of its payload (tests/unit/test_striping.py cuts stripes).
    with RemoteLoader(served.address, transport="tcp", data_connections=1, backoff=0.05) as loader:
        assert_same(list(loader), expected(SIZES))
        assert cut
        assert loader.stats().reconnects == 1
        assert loader.last_transport == "tcp"
    # The server's side of it ended too: no stream is left running.
    assert wait_until(lambda: served.server.service.admission.running == 0, 5)


def test_broadcast_consumers_on_every_transport_get_the_same_batches(
    serve_loaders: ServeLoaders,
) -> None:
    sizes = [150_000] * 10
    served = serve_loaders(sizes_spec(sizes, sharing=["broadcast"]))
    consumers = {"auto0": "shm", "grpc1": "grpc", "auto2": "shm", "tcp3": "tcp"}
    results: dict[str, list[Any]] = {}
    transports: dict[str, str | None] = {}

    def consume(name: str) -> None:
        transport, rank = cast(Transport, name[:-1]), int(name[-1])
        with RemoteLoader(
            served.address,
            sharing="broadcast",
            rank=rank,
            world_size=len(consumers),
            transport=transport,
        ) as loader:
            results[name] = list(loader)
            transports[name] = loader.last_transport

    threads = [threading.Thread(target=consume, args=(name,)) for name in consumers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert transports == consumers
    for batches in results.values():
        assert_same(batches, expected(sizes))


def test_a_killed_client_ends_its_stream_on_the_server(serve_loaders: ServeLoaders) -> None:
    served = serve_loaders(sizes_spec([4_000_000] * 100, prefetch_factor=2))
    client = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from remote_loader.client import RemoteLoader\n"
            f"loader = RemoteLoader({served.address!r}, transport='tcp', prefetch=1)\n"
            "for i, batch in enumerate(loader):\n"
            "    if i == 2:\n"
            "        print(loader.last_transport, flush=True)\n"
            "    time.sleep(0.05)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "tcp"
        assert served.server.service.admission.running == 1
        client.kill()
        client.wait(10)
        # The server's send fails (the socket is reset) or the call is cancelled, whichever is
        # first: either way the stream ends and gives its workers back.
        assert wait_until(lambda: served.server.service.admission.running == 0, 5)
    finally:
        client.kill()
        client.wait(10)
        if client.stdout is not None:
            client.stdout.close()
    with RemoteLoader(served.address, transport="tcp") as loader:
        assert sum(1 for _ in loader) == 100  # the loader still serves


def test_serve_data_address_flag() -> None:
    for flag in ("127.0.0.1:0", "off"):
        proc, address = serve_sizes([1000, 1000], 0, "--data-address", flag)
        try:
            with RemoteLoader(address, transport="tcp") as loader:
                if flag == "off":
                    with pytest.raises(TransportError, match="offers no data connection"):
                        list(loader)
                else:
                    assert_same(list(loader), expected([1000, 1000]))
                    assert loader.last_transport == "tcp"
        finally:
            code, err = stop_process(proc)
        assert code == 0, err
