"""The seam every transport fills: a `Sender` turns a stream's batches (each an `Outgoing`,
server/batch/outgoing.py) into the Frames the gRPC stream carries (the bytes themselves may travel
beside them), and falls back to in-band Frames by itself when it cannot take a batch.
`InbandSender` is that fallback, and the transport of a stream nothing better was negotiated
for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import wire
from remote_loader.server.batch.outgoing import Outgoing

if TYPE_CHECKING:  # the worker stage, below this one: only its error's fields are read
    from remote_loader.server.errors import CapturedError

# How long a client may leave its heartbeat still while the server waits on it, unless the
# server says otherwise (create_server: keepalive_time_ms + keepalive_timeout_ms).
DEFAULT_CLIENT_SILENCE = 30.0


class StreamStopped(Exception):
    """The stream was cancelled, or its consumer detached, while waiting for the client."""


class Sender(Protocol):
    """How one stream's batches leave the server; owns what it opened until `close()`."""

    # "shm", "tcp" or "grpc": what the stream's log lines call it.
    name: str
    # Batches this transport carried itself (not its in-band fallback's), for the log.
    batches: int

    def send(self, batch: int, outgoing: Outgoing, stopped: Callable[[], bool]) -> Iterator[bytes]:
        """The Frames that hand `outgoing` over as batch number `batch`. Raises StreamStopped
        when `stopped()` turned true while waiting for the client, ClientSilent when the client
        gave no sign of life for too long, DataConnectionLost when its connection broke."""
        ...

    def finish(self, stopped: Callable[[], bool]) -> None:
        """After the last batch, before the end Frame: whatever the client still needs."""
        ...

    def close(self) -> None: ...


class InbandSender:
    """Batches as Frames inside the gRPC stream (wire.batch_frames), cut at `chunk_size`.

    `shared`: the batches are read by several consumers (broadcast), so each batch's Frames are
    built once and kept for all of them."""

    name = "grpc"

    def __init__(self, chunk_size: int, shared: bool) -> None:
        self.chunk_size = chunk_size
        self.shared = shared
        self.batches = 0

    def send(self, batch: int, outgoing: Outgoing, stopped: Callable[[], bool]) -> Iterator[bytes]:
        self.batches += 1
        if self.shared:
            return iter(outgoing.frames(batch, self.chunk_size))
        return wire.batch_frames(batch, outgoing.blob, outgoing.header_nbytes, self.chunk_size)

    def finish(self, stopped: Callable[[], bool]) -> None:
        pass

    def close(self) -> None:
        pass


def captured_error(e: CapturedError) -> pb.CapturedError:
    """`e` as the wire carries it: in an error Frame, and in the trailing metadata of a loader
    that cannot make any batch (protos/reasons.py, ERROR_KEY)."""
    return pb.CapturedError(
        where=e.where,
        type=e.type,
        message=e.message,
        traceback=e.traceback,
        module=e.module,
        qualname=e.qualname,
    )


def error_frame(batch: int, e: CapturedError) -> bytes:
    """The Frame that says batch `batch` failed, with the original exception `e`."""
    return wire.control_frame(pb.Frame(batch=batch, error=captured_error(e)))
