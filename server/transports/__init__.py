"""The send stage: how one stream's batches leave the server, one module per transport.

- base.py: the `Sender` seam, and `InbandSender` (Frames inside the gRPC stream: always works,
  and every other transport's fallback);
- shm.py: a ring in /dev/shm, for a client on this host that proved it (protos/shm.py);
- tcp.py: a data connection beside the gRPC stream, for a client on another host
  (protos/tcp.py), and the `DataListener` that accepts those connections.

`negotiate` picks the transport from what the request offers and what this server allows; the
stream's send loop only iterates `Sender.send` and knows none of them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Generator

from remote_loader.protos import loader_pb2 as pb

# Aliased: importing this package's own `tcp` submodule binds the name `tcp` here to it.
from remote_loader.protos import tcp as tcp_protocol
from remote_loader.protos import wire
from remote_loader.server.transports.base import (
    DEFAULT_CLIENT_SILENCE,
    InbandSender,
    Sender,
    StreamStopped,
)
from remote_loader.server.transports.shm import ShmSender, accept_offer
from remote_loader.server.transports.tcp import DataListener, TcpSender

__all__ = [
    "DEFAULT_CLIENT_SILENCE",
    "DataListener",
    "InbandSender",
    "Negotiated",
    "Sender",
    "ShmSender",
    "StreamStopped",
    "TcpSender",
    "connect",
    "negotiate",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Negotiated:
    """What a stream gets: a sender ready now, or (`ticket`) a data connection to `connect`."""

    sender: Sender
    # How the stream's start line describes it ("shm", "tcp", "grpc (shm offered, declined)").
    described: str
    ticket: bytes | None = None


def negotiate(
    request: pb.StreamRequest,
    *,
    chunk_size: int,
    shared: bool,
    max_ring_bytes: int,
    zero_copy: bool = True,
    client_silence: float,
    listener: DataListener | None,
) -> Negotiated:
    """Shared memory if the client proved it is on this host (its probe is read and removed
    now, either way), else a data connection if it asked for one and this server listens,
    else Frames. `shared`: the stream's entries are read by several consumers (broadcast)."""
    inband = InbandSender(chunk_size, shared)
    if request.HasField("shm"):
        ring = accept_offer(request.shm, max_ring_bytes, inband, client_silence, zero_copy)
        if ring is not None:
            return Negotiated(ring, "shm (zero-copy)" if ring.zero_copy else ring.name)
    described = "grpc (shm offered, declined)" if request.HasField("shm") else "grpc"
    if request.tcp and listener is not None:
        return Negotiated(inband, "tcp", listener.expect())
    return Negotiated(inband, described)


def connect(
    negotiated: Negotiated,
    listener: DataListener,
    cancelled: Callable[[], bool],
    client_silence: float,
    who: str,
) -> Generator[bytes, None, Sender | None]:
    """For a data connection: yields the Frame that announces it, waits for the client to
    connect (at most protos.tcp.ACCEPT_TIMEOUT), and returns its sender, or the in-band one if no
    connection came; None if the stream was cancelled meanwhile."""
    assert negotiated.ticket is not None
    announce = pb.TcpChannel(port=listener.port, ticket=negotiated.ticket)
    yield wire.control_frame(pb.Frame(tcp_channel=announce))
    sock = listener.wait(negotiated.ticket, cancelled)
    if cancelled():
        if sock is not None:
            sock.close()
        return None  # the client went, or cancelled to go on without a data connection
    if sock is None:
        timeout = tcp_protocol.ACCEPT_TIMEOUT
        log.warning("no data connection within %g s, sending Frames: %s", timeout, who)
        return negotiated.sender
    return TcpSender(sock, client_silence)
