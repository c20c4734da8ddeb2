"""The blob both sides agree on: its layout, alignment, limits and errors.

NOTE [ Blob layout ]

    blob = header | zero padding to payload_offset(len(header)) | payload

The header is a serialized `loader_pb2.Node` describing the batch. Every tensor, array and bytes
leaf refers to a range `[offset, offset + nbytes)` of the payload; each offset is a multiple of
ALIGN relative to the payload start, and the padding between leaves is unspecified. The header's
length is not stored in the blob: it travels beside it (`Frame.header_bytes`).
"""

from __future__ import annotations

import torch

__all__ = [
    "ALIGN",
    "MAX_DEPTH",
    "NUMPY_KINDS",
    "QUANTIZED",
    "DecodeError",
    "EncodeError",
    "check_buffer",
    "payload_offset",
]

# Every dtype's element size (at most 16 bytes, complex128) divides 64, so a leaf at a multiple of
# ALIGN can be viewed as its dtype in place; 64 bytes is also a cache line, so no two leaves share
# one and copies start on a line boundary.
ALIGN: int = 64

# protobuf parsers (upb) refuse messages nested deeper than 100, and each container level costs two
# (Node, then Sequence or Mapping): 32 levels leave a header that any peer parses, and no real
# batch nests anywhere near as deep, so hitting it means a self-referencing structure.
MAX_DEPTH: int = 32

# Quantized tensors carry scale and zero point beside their bytes; the header has no place for them.
QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})

# bool, signed, unsigned, float and complex: plain bytes, safe to view in place on decode.
NUMPY_KINDS = "biufc"


class EncodeError(TypeError):
    """A batch holds a value the codec cannot carry; the message names it and where it is."""


class DecodeError(ValueError):
    """A header or payload is malformed: not produced by `encode`, or damaged on the way."""


def payload_offset(header_nbytes: int) -> int:
    """Where the payload starts in a blob: the header's length rounded up to ALIGN."""
    if header_nbytes < 0:
        raise ValueError(f"header_nbytes must be >= 0, got {header_nbytes}")
    return -(-header_nbytes // ALIGN) * ALIGN


def check_buffer(
    buf: torch.Tensor, name: str, min_nbytes: int, *, cpu: bool = True, aligned: bool = True
) -> None:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8 or buf.dim() != 1 or (cpu and buf.device.type != "cpu"):
        where = "CPU " if cpu else ""
        raise ValueError(
            f"{name} must be a 1-D uint8 {where}tensor, got {buf.dim()}-D {buf.dtype} on "
            f"{buf.device}"
        )
    if buf.stride(0) != 1 and buf.numel() > 1:
        raise ValueError(f"{name} must be contiguous, got stride {buf.stride(0)}")
    if buf.numel() < min_nbytes:
        raise ValueError(f"{name} holds {buf.numel()} bytes, needs at least {min_nbytes}")
    if aligned and buf.storage_offset() % ALIGN:
        # torch views bytes as a wider dtype only at a storage offset that the width divides.
        raise ValueError(
            f"{name} must start a multiple of {ALIGN} bytes into its storage, got storage offset "
            f"{buf.storage_offset()}: slice it at an aligned offset"
        )
