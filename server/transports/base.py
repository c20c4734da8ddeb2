"""The seam every transport fills: a `Sender` turns a stream's entries into the Frames the
gRPC stream carries (the bytes themselves may travel beside them), and falls back to in-band
Frames by itself when it cannot take a batch. `InbandSender` is that fallback, and the
transport of a stream nothing better was negotiated for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import wire
from remote_loader.server.lanes import Entry

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

    def send(self, batch: int, entry: Entry, stopped: Callable[[], bool]) -> Iterator[bytes]:
        """The Frames that hand `entry` over as batch number `batch`. Raises StreamStopped
        when `stopped()` turned true while waiting for the client, ClientSilent when the client
        gave no sign of life for too long, DataConnectionLost when its connection broke."""
        ...

    def finish(self, stopped: Callable[[], bool]) -> None:
        """After the last batch, before the end Frame: whatever the client still needs."""
        ...

    def close(self) -> None: ...


class InbandSender:
    """Batches as Frames inside the gRPC stream (wire.batch_frames), cut at `chunk_size`.

    `shared`: the entries are read by several consumers (broadcast), so each entry's Frames are
    built once and kept for all of them."""

    name = "grpc"

    def __init__(self, chunk_size: int, shared: bool) -> None:
        self.chunk_size = chunk_size
        self.shared = shared
        self.batches = 0

    def send(self, batch: int, entry: Entry, stopped: Callable[[], bool]) -> Iterator[bytes]:
        self.batches += 1
        if self.shared:
            return iter(entry.frames(batch, self.chunk_size))
        header_nbytes = entry.delivery.header_nbytes
        return wire.batch_frames(batch, payload(entry), header_nbytes, self.chunk_size)

    def finish(self, stopped: Callable[[], bool]) -> None:
        pass

    def close(self) -> None:
        pass


def payload(entry: Entry) -> memoryview:
    """The encoded batch, where its worker wrote it: valid while the entry is being sent (the
    policy releases it after that; a broadcast entry is read by every consumer from the same
    slot, never copied for them)."""
    blob = entry.delivery.blob
    assert blob is not None, "an entry without an error has a blob"
    return blob


def error_frame(batch: int, entry: Entry) -> bytes:
    """The Frame that says batch `batch` failed, with the original exception."""
    e = entry.error
    assert e is not None
    error = pb.RemoteError(where=e.where, type=e.type, message=e.message, traceback=e.traceback)
    return wire.control_frame(pb.Frame(batch=batch, error=error))
