"""Data connections of a TLS server (NOTE [ TLS data connection ] in protos/tcp.py): wrapped in
TLS with the gRPC port's certificate (and client CA, for mutual TLS), their tickets still given
inside the authenticated stream; real servers on port 0 and certificates made by
the `pki` fixture (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import time
from pathlib import Path

import pytest

from remote_loader.client import TLS, RemoteLoader
from remote_loader.protos import tcp
from remote_loader.server.transports import DataListener
from tests.helpers import PKI, ServeLoaders, assert_same, expected, sizes_spec

SIZES = [1000, 5_000_000, 7, 300_000, 12_000_000, 0, 44]


def listener_of(served: object) -> DataListener:
    listener = served.server.service.listener  # type: ignore[attr-defined]
    assert isinstance(listener, DataListener)
    return listener


@pytest.mark.parametrize("connections", [1, 3])
def test_a_tls_server_carries_batches_on_tls_data_connections(
    serve_loaders: ServeLoaders,
    pki: PKI,
    connections: int,
) -> None:
    # Silence allowed: 1 s (keepalive 0.5 + 0.5 s), so the pause below needs TLS heartbeats.
    served = serve_loaders(
        sizes_spec(SIZES, prefetch_factor=2),
        **pki.server_settings(),
        keepalive_time_ms=500,
        keepalive_timeout_ms=500,
    )
    assert listener_of(served).tls is not None
    tls = TLS(ca=pki.ca)
    with RemoteLoader(
        served.address, tls=tls, transport="tcp", data_connections=connections, prefetch=1
    ) as loader:
        for _ in range(2):
            got = []
            for i, batch in enumerate(loader):
                got.append(batch)
                if i == 1:
                    time.sleep(2.5)  # a long step: the client beats, over TLS
            assert_same(got, expected(SIZES))
            assert loader.last_transport == "tcp"
        assert loader.stats().reconnects == 0
    # "auto" takes them too, once shared memory is out of the way.
    served = serve_loaders(sizes_spec(SIZES), **pki.server_settings(), max_ring_bytes=0)
    with RemoteLoader(served.address, tls=tls) as loader:
        assert_same(list(loader), expected(SIZES))
        assert loader.last_transport == "tcp"


def test_mutual_tls_data_connections_need_the_client_certificate(
    serve_loaders: ServeLoaders,
    pki: PKI,
) -> None:
    served = serve_loaders(sizes_spec(SIZES), **pki.server_settings(mutual=True))
    mutual = TLS(ca=pki.ca, cert=pki.client_cert, key=pki.client_key, server_name="localhost")
    with RemoteLoader(served.address, tls=mutual, transport="tcp", data_connections=2) as loader:
        assert_same(list(loader), expected(SIZES))
        assert loader.last_transport == "tcp"
    # A data connection with the CA but no client certificate is refused, with a ticket or not.
    listener = listener_of(served)
    port = listener.port
    listener.expect()
    ticket = listener.expect()
    with pytest.raises(tcp.DataConnectionError, match=r"127\.0\.0\.1"):
        tcp.connect("127.0.0.1", port, ticket, tls=TLS(ca=pki.ca).data_context())
    sock = tcp.connect("127.0.0.1", port, listener.expect(), tls=mutual.data_context())
    sock.close()


@pytest.mark.parametrize(
    ("cpus", "tls", "asked"),
    [
        (1, True, 1),
        (2, True, 1),
        (3, True, 1),
        (4, True, 2),
        (7, True, 3),
        (8, True, 4),
        (64, True, 4),
        (1, False, 4),
        (2, False, 4),
        (64, False, 4),
    ],
)
def test_a_tls_client_asks_for_a_stripe_per_two_cpus(cpus: int, tls: bool, asked: int) -> None:
    # NOTE [ TLS data connection ], stripes under TLS: at most DEFAULT_DATA_CONNECTIONS.
    assert tcp.default_connections(tls=tls, cpus=cpus) == asked
    assert tcp.default_connections(tls=False) == tcp.DEFAULT_DATA_CONNECTIONS


@pytest.mark.parametrize("cpus", [2, 8])
def test_a_tls_loader_that_names_no_count_stripes_by_its_cpus(
    serve_loaders: ServeLoaders,
    pki: PKI,
    monkeypatch: pytest.MonkeyPatch,
    recv_spy: set[int],
    cpus: int,
) -> None:
    # A real TLS server and a 12 MB batch (enough MiB for every stripe): the connections it
    # came on are those the client asked for by its CPUs (1 on two, 4 on eight), not 4 always.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    sizes = [12_000_000, 1000]
    served = serve_loaders(sizes_spec(sizes), **pki.server_settings())
    with RemoteLoader(served.address, tls=TLS(ca=pki.ca), transport="tcp") as loader:
        assert_same(list(loader), expected(sizes))
        assert loader.last_transport == "tcp"
    assert len(recv_spy) == tcp.default_connections(tls=True, cpus=cpus) == (1 if cpus == 2 else 4)


def test_a_client_that_does_not_trust_the_server_fails_clearly(
    serve_loaders: ServeLoaders,
    pki: PKI,
    tmp_path: Path,
) -> None:
    served = serve_loaders(sizes_spec(SIZES), **pki.server_settings())
    listener = listener_of(served)
    # The system's CAs, not the test CA: the certificate check fails, and says so.
    with pytest.raises(tcp.DataConnectionError, match="failed the certificate check"):
        tcp.connect("127.0.0.1", listener.port, listener.expect(), tls=TLS().data_context())
    # A name the certificate does not carry: likewise.
    with pytest.raises(tcp.DataConnectionError, match="failed the certificate check"):
        tcp.connect(
            "127.0.0.1",
            listener.port,
            listener.expect(),
            tls=TLS(ca=pki.ca).data_context(),
            server_name="elsewhere",
        )
    # Plaintext to a TLS listener: no ACK, even with a good ticket.
    with pytest.raises(tcp.DataConnectionError):
        tcp.connect("127.0.0.1", listener.port, listener.expect())
    # And a file ssl cannot use is refused when the loader is made, naming it.
    bad = tmp_path / "bad.pem"
    bad.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    with pytest.raises(ValueError, match="for the data connections"):
        RemoteLoader(served.address, tls=TLS(ca=bad))


def test_tls_data_connections_end_their_streams_without_a_reset(
    serve_loaders: ServeLoaders,
    pki: PKI,
) -> None:
    # NOTE [ End of a stream ] over TLS: a slow trainer, the last batch mostly unread when the
    # stream ends; the server half-closes under TLS too.
    sizes = [3_000_000] * 5
    served = serve_loaders(sizes_spec(sizes, num_workers=1), **pki.server_settings())
    with RemoteLoader(served.address, tls=TLS(ca=pki.ca), transport="tcp", prefetch=1) as loader:
        for _ in range(2):
            got = []
            for batch in loader:
                got.append(batch)
                time.sleep(0.15)
            assert_same(got, expected(sizes))
        assert loader.stats().reconnects == 0


def test_the_tls_listener_drops_a_client_that_never_finishes_its_handshake(
    serve_loaders: ServeLoaders,
    pki: PKI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tcp, "HANDSHAKE_TIMEOUT", 0.5)
    served = serve_loaders(sizes_spec([10]), **pki.server_settings())
    port = listener_of(served).port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"\x16\x03\x01")  # the start of a TLS record, and nothing more
        with contextlib.suppress(ConnectionResetError):  # closed within the handshake's time
            assert sock.recv(1) == b""
    # The listener is still there for real clients.
    context = TLS(ca=pki.ca).data_context()
    tcp.connect("127.0.0.1", port, listener_of(served).expect(), tls=context).close()
    assert isinstance(context, ssl.SSLContext)
