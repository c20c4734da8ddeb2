"""The seam every transport's receiving end fills: an `End` puts the batch a Frame announces
into its Assembly (from the Frame's own data, or from beside the gRPC stream), tells the server
the client is alive while the training loop is busy, and closes what it opened. `InbandEnd`
reads the Frames' own data: it always works, and is every other transport's fallback.
"""

from __future__ import annotations

from typing import Protocol

from remote_loader.client.assembly import Assembly
from remote_loader.client.errors import ConnectionLostError
from remote_loader.protos import loader_pb2 as pb


class TransportUnusable(Exception):
    """The server offered a transport this process cannot use (a ring it cannot open, a data
    connection it cannot make): the stream is opened again from its next batch without it.

    One type for every transport, so the receiver falls back in one place; `transport` says
    which to give up on ("shm", "tcp"), `instead` how the batches go on (for the log), `again`
    whether it failed only at that moment (a handshake too slow), so later epochs may offer it.
    """

    def __init__(self, transport: str, reason: str, instead: str, again: bool = False) -> None:
        super().__init__(reason)
        self.transport = transport
        self.instead = instead
        self.again = again


class BatchReused(ConnectionLostError):
    """A worker's slot was reused under the client's read: the server let go of the stream (a
    broadcast consumer detached, a stream it thought over). The stream is resumed from that
    batch, unless the call's status says it must not."""


class End(Protocol):
    """One stream's receiving end of a transport; owns what it opened until `close()`."""

    # "grpc", "shm" or "tcp": how the batches it fills arrived (Ready.transport).
    name: str

    def fill(self, meta: pb.Frame, data: memoryview, assembly: Assembly) -> bool:
        """Puts what the batch Frame `meta` (with its `data`) carries into `assembly`. True
        when the batch is complete; False when more Frames are to come, or when the receiver
        was stopped while this end waited. Raises ProtocolError for what contradicts the
        protocol, ConnectionLostError when the transport broke (the stream is resumed), and
        TransportUnusable when this process cannot use it."""
        ...

    def beat(self) -> None:
        """Tells the server, which may be waiting for room on this end, that the client is
        alive though the training loop is busy (NOTE [ Ring space ], NOTE [ TCP data
        connection ])."""
        ...

    def close(self) -> None: ...


class InbandEnd:
    """Batches as Frames inside the gRPC stream, copied part by part into place."""

    name = "grpc"

    def fill(self, meta: pb.Frame, data: memoryview, assembly: Assembly) -> bool:
        return assembly.add(meta, data)

    def beat(self) -> None:
        pass  # gRPC's own keepalive speaks for this client

    def close(self) -> None:
        pass
