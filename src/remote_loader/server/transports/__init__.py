"""The send stage: how one stream's batches leave the server, one module per transport.

- base.py: the `Sender` seam, and `InbandSender` (Frames inside the gRPC stream: always works,
  and every other transport's fallback);
- shm.py: a ring in /dev/shm, for a client on this host that proved it (protos/shm.py);
- tcp.py: data connections beside the gRPC stream, for a client on another host
  (protos/tcp.py); listener.py: the `DataListener` that accepts them (over TLS on a TLS
  server) and holds them after their stream's end until the client has read them.

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
    """What a stream gets: a sender ready now, or (`tickets`) data connections to `connect`."""

    sender: Sender
    # How the stream's start line describes it ("shm", "tcp", "grpc (shm offered, declined)").
    described: str
    # One per data connection the stream announces (NOTE [ TCP data connection ]); none: no
    # data connection.
    tickets: list[bytes] = dataclasses.field(default_factory=list)

    @property
    def ticket(self) -> bytes | None:
        """The first data connection's ticket; None when the stream has none."""
        return self.tickets[0] if self.tickets else None


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
    now, either way), else data connections (as many as it asked for, up to
    tcp.MAX_DATA_CONNECTIONS) if it asked for them and this server listens, else Frames.
    `shared`: the stream's entries are read by several consumers (broadcast)."""
    inband = InbandSender(chunk_size, shared)
    if request.HasField("shm"):
        ring = accept_offer(request.shm, max_ring_bytes, inband, client_silence, zero_copy)
        if ring is not None:
            return Negotiated(ring, "shm (zero-copy)" if ring.zero_copy else ring.name)
    described = "grpc (shm offered, declined)" if request.HasField("shm") else "grpc"
    if request.tcp and listener is not None:
        # 0 is a client from before striping: one connection.
        n = min(max(request.data_connections, 1), tcp_protocol.MAX_DATA_CONNECTIONS)
        tickets = [listener.expect() for _ in range(n)]
        return Negotiated(inband, "tcp" if n == 1 else f"tcp ({n} connections)", tickets)
    return Negotiated(inband, described)


def connect(
    negotiated: Negotiated,
    listener: DataListener,
    cancelled: Callable[[], bool],
    client_silence: float,
    who: str,
) -> Generator[bytes, None, Sender | None]:
    """For data connections: yields the Frame that announces them, waits for the client to
    make them all (at most protos.tcp.ACCEPT_TIMEOUT), and returns their sender, or the in-band
    one if not all came (those that did are closed); None if the stream was cancelled
    meanwhile."""
    if not negotiated.tickets:
        raise ValueError("connect() is for a stream that announces data connections")
    first, *more = negotiated.tickets
    announce = pb.TcpChannel(port=listener.port, ticket=first, more_tickets=more)
    yield wire.control_frame(pb.Frame(tcp_channel=announce))
    socks = listener.wait(negotiated.tickets, cancelled)
    arrived = [sock for sock in socks if sock is not None]
    if cancelled() or len(arrived) < len(socks):
        for sock in arrived:
            sock.close()
        if cancelled():
            return None  # the client went, or cancelled to go on without a data connection
        timeout = tcp_protocol.ACCEPT_TIMEOUT
        log.warning(
            "%d of %d data connections within %g s, sending Frames: %s",
            len(arrived),
            len(socks),
            timeout,
            who,
        )
        return negotiated.sender
    return TcpSender(arrived, client_silence, retire=listener.retire)
