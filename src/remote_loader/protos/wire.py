"""Frames on the Stream RPC: cutting an encoded batch into Frames, and reading them back.

The server writes each Frame as a small serialized prefix followed by the `data` field, so the
bytes a worker encoded are copied once into the message and never re-serialized; the client
finds `data` without copying it. The result is byte for byte a serialized `Frame`.
"""

from __future__ import annotations

from collections.abc import Iterator

from remote_loader.protos import loader_pb2

SERVICE_NAME = "remote_loader.v1.Loader"
STREAM_METHOD = f"/{SERVICE_NAME}/Stream"

# 4 MiB: on this machine a grpcio server stream moves 1-4 MiB messages at about 2.0 GB/s and
# 64 MiB ones at 0.8 GB/s (larger messages are copied and reallocated inside gRPC); the largest
# size in that sweet spot means the fewest messages per batch.
DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024
# Frames larger than this are refused by the client (its max_receive_message_length): a chunk
# size above it would make every batch fail.
MAX_CHUNK_SIZE = 64 * 1024 * 1024
# Bytes a Frame adds around its data: the prefix fields (varints) and the data field's tag and
# length. Generous; used for the receive-size limit only.
FRAME_OVERHEAD = 1024

# Keepalive, the same on both sides (they must agree, or the server answers the client's pings
# with GOAWAY "too_many_pings"): the client pings a connection that has been silent for
# KEEPALIVE_TIME_MS and drops it when no answer comes within KEEPALIVE_TIMEOUT_MS, so a
# connection a network silently lost becomes UNAVAILABLE (and is resumed) instead of a hang;
# the server accepts pings that often (max_ping_strikes 0: it never penalises them).
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000
# NOTE [ Ping timeout ]: gRPC core keeps one ping in flight per connection, and its own
# flow-control (BDP) pings wait `grpc.http2.ping_timeout_ms` for their ack: a minute by default.
# A peer that froze with a BDP ping unanswered thus held off the keepalive ping, and was let go
# after 60 s rather than keepalive_timeout (measured: 1 run in 3 over loopback). Every ping gets
# the keepalive's timeout instead (grpc chttp2_transport.cc, GRPC_ARG_PING_TIMEOUT_MS).
CLIENT_KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
)

_DATA_FIELD = loader_pb2.Frame.DESCRIPTOR.fields_by_name["data"].number
_WIRETYPE_VARINT = 0
_WIRETYPE_FIXED64 = 1
_WIRETYPE_LEN = 2
_WIRETYPE_FIXED32 = 5
_DATA_TAG = bytes([(_DATA_FIELD << 3) | _WIRETYPE_LEN])


class FrameError(ValueError):
    """Bytes that are not a well-formed Frame."""


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise FrameError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise FrameError("varint longer than 10 bytes")


def num_parts(total_nbytes: int, chunk_size: int) -> int:
    """Frames needed for a blob of total_nbytes (at least one, even for an empty blob)."""
    return max(1, -(-total_nbytes // chunk_size))


def batch_frames(
    batch: int, blob: memoryview, header_nbytes: int, chunk_size: int
) -> Iterator[bytes]:
    """Serialized Frames carrying one encoded batch, each holding at most chunk_size data bytes.

    Each yielded message is the only copy made of its slice of `blob` (which may be shared
    memory a worker wrote into).
    """
    total = len(blob)
    parts = num_parts(total, chunk_size)
    for part in range(parts):
        start = part * chunk_size
        end = min(start + chunk_size, total)
        if part == 0:
            meta = loader_pb2.Frame(
                batch=batch, part=0, parts=parts, total_bytes=total, header_bytes=header_nbytes
            )
        else:
            meta = loader_pb2.Frame(batch=batch, part=part, parts=parts)
        prefix = meta.SerializeToString() + _DATA_TAG + _varint(end - start)
        yield prefix + blob[start:end]


def handle_frame(
    batch: int,
    total_bytes: int,
    header_nbytes: int,
    *,
    shm: loader_pb2.ShmBatch | None = None,
    on_tcp: bool = False,
    node: loader_pb2.NodeBatch | None = None,
) -> bytes:
    """The one Frame of a batch whose bytes travel outside gRPC: in a shared-memory ring
    (`shm` says where), on the stream's data connection (`on_tcp`) or on the node that made it
    (`node`)."""
    return control_frame(
        loader_pb2.Frame(
            batch=batch,
            part=0,
            parts=1,
            total_bytes=total_bytes,
            header_bytes=header_nbytes,
            shm=shm,
            on_tcp=on_tcp,
            node=node,
        )
    )


def control_frame(frame: loader_pb2.Frame) -> bytes:
    """A Frame without data (an error or the end of the stream), serialized."""
    return frame.SerializeToString()


def parse_frame(message: bytes) -> tuple[loader_pb2.Frame, memoryview]:
    """Splits a serialized Frame into its fields without `data`, and a view of `data`.

    Walks the top-level fields: everything before `data` is parsed by protobuf (a few bytes),
    `data` is returned as a zero-copy view. Fields after `data` (none today) are parsed too.
    """
    view = memoryview(message)
    pos = 0
    data = view[0:0]
    rest_start = None
    while pos < len(view):
        tag_start = pos
        key, pos = _read_varint(view, pos)
        field, wire = key >> 3, key & 7
        if wire == _WIRETYPE_VARINT:
            _, pos = _read_varint(view, pos)
        elif wire == _WIRETYPE_LEN:
            length, pos = _read_varint(view, pos)
            if pos + length > len(view):
                raise FrameError(f"field {field} runs past the end of the frame")
            if field == _DATA_FIELD:
                if rest_start is not None:
                    raise FrameError("a frame carries data twice")
                meta_bytes = view[:tag_start]
                data = view[pos : pos + length]
                rest_start = pos + length
            pos += length
        elif wire == _WIRETYPE_FIXED64:
            pos += 8
        elif wire == _WIRETYPE_FIXED32:
            pos += 4
        else:
            raise FrameError(f"unsupported wire type {wire} for field {field}")
    if pos != len(view):
        raise FrameError("truncated frame")
    try:
        if rest_start is None:
            return loader_pb2.Frame.FromString(message), data
        # Unknown or later fields after data are kept by parsing the two spans together.
        meta = loader_pb2.Frame.FromString(bytes(meta_bytes) + bytes(view[rest_start:]))
    except Exception as exc:  # protobuf raises DecodeError, a plain Exception subclass
        raise FrameError(f"malformed frame: {exc}") from exc
    return meta, data
