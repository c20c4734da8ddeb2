"""The TCP data connection (NOTE [ TCP data connection ] in protos/tcp.py) without a server: where
the connection and the listener go, what recv_into says broke, and a send that stops when asked.

The tests that start a server, a process or Ray: tests/integration/test_tcp.py.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from remote_loader.protos import tcp
from remote_loader.server.api.server import resolve_data_address


@pytest.mark.parametrize(
    ("target", "host"),
    [
        ("127.0.0.1:50051", "127.0.0.1"),
        ("localhost:1", "localhost"),
        ("loader:50051", "loader"),
        ("[::1]:5", "::1"),
        ("dns:///loader:50051", "loader"),
        ("dns:loader:50051", "loader"),
        ("ipv4:10.0.0.1:5", "10.0.0.1"),
        ("ipv6:[::1]:5", "::1"),
        ("unix:/tmp/loader.sock", None),
        ("unix-abstract:loader", None),
        ("dns://8.8.8.8/loader:1", None),
        ("ipv4:10.0.0.1:5,10.0.0.2:5", None),
        ("loader", None),
        ("[::1:5", None),
    ],
)
def test_the_data_connection_goes_to_the_host_of_the_grpc_target(
    target: str, host: str | None
) -> None:
    assert tcp.target_host(target) == host


def test_the_data_listener_goes_on_the_grpc_host_unless_told() -> None:
    assert resolve_data_address("auto", "0.0.0.0:50051") == "0.0.0.0:0"
    assert resolve_data_address("auto", "[::]:50051") == "[::]:0"
    assert resolve_data_address("off", "0.0.0.0:50051") is None
    assert resolve_data_address("10.0.0.1:7", "0.0.0.0:50051") == "10.0.0.1:7"


def test_recv_into_says_what_broke() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.settimeout(tcp.POLL_INTERVAL)
        right.sendall(b"abc")
        right.shutdown(socket.SHUT_WR)
        out = bytearray(10)
        with pytest.raises(tcp.DataConnectionError, match=r"closed the data connection \(3 of 10"):
            tcp.recv_into(left, memoryview(out), lambda: False)
    left, right = socket.socketpair()
    with left, right:
        left.settimeout(tcp.POLL_INTERVAL)
        with pytest.raises(tcp.DataConnectionError, match=r"sent nothing for 0\.3 s"):
            tcp.recv_into(left, memoryview(bytearray(4)), lambda: False, stall_timeout=0.3)
        stop = threading.Event()
        threading.Timer(0.2, stop.set).start()
        assert not tcp.recv_into(left, memoryview(bytearray(4)), stop.is_set)


def test_send_stops_when_asked_while_the_reader_does_not_read() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.settimeout(tcp.POLL_INTERVAL)
        stop = threading.Event()
        threading.Timer(0.3, stop.set).start()
        big = torch.zeros(64 << 20, dtype=torch.uint8).numpy().data
        started = time.monotonic()
        assert not tcp.send(left, big, stop.is_set)  # the buffers fill; stop() ends the wait
        assert time.monotonic() - started < 2
        right.close()
        with pytest.raises(OSError):
            tcp.send(left, big, lambda: False)


def test_a_port_too_slow_to_handshake_is_told_from_one_out_of_reach() -> None:
    # NOTE [ A slow handshake ]: only the first is worth asking again in a later epoch.
    ticket = bytes(tcp.TICKET_BYTES)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # takes it, never answers
        port = silent.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(tcp.HandshakeTimeout, match=r"did not end within 0\.3 s"):
            tcp.connect("127.0.0.1", port, ticket, timeout=0.3)
        assert time.monotonic() - started < 2.0
    with socket.create_server(("127.0.0.1", 0)) as closing:  # takes it, closes it at once

        def close_one() -> None:
            conn, _ = closing.accept()
            conn.close()

        threading.Thread(target=close_one, daemon=True).start()
        port = closing.getsockname()[1]
        with pytest.raises(
            tcp.DataConnectionError, match=r"refused the data connection|reset"
        ) as info:
            tcp.connect("127.0.0.1", port, ticket, timeout=5.0)
        assert not isinstance(info.value, tcp.HandshakeTimeout)
    # Nothing listens there now: refused, which no later epoch would change.
    with pytest.raises(tcp.DataConnectionError, match="cannot connect") as info:
        tcp.connect("127.0.0.1", port, ticket, timeout=0.3)
    assert not isinstance(info.value, tcp.HandshakeTimeout)
