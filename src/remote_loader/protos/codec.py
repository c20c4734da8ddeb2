"""The batch codec: a collated batch as a protobuf header plus one flat, aligned payload.

Workers encode straight into shared memory and clients decode into zero-copy views; no pickle.
The blob's layout is NOTE [ Blob layout ] in protos/layout.py; encoding is protos/encoding.py and
decoding protos/decoding.py. This module is the one the rest of the package imports.

Supported values: dict, list, tuple, namedtuple, dataclass instance and Mapping, nested, of
torch.Tensor (any strided CPU tensor that is not quantized), numpy.ndarray (bool and numeric
dtypes), int (int64 range), float, bool, str, bytes, bytearray, memoryview and None. A namedtuple
(PackedSequence included), a dataclass or a Mapping subclass comes back as its own class where the
client can import it, else as a namedtuple made there or a dict, with a warning (NOTE [ Batch
types ] in protos/batch_types.py). Other subclasses decode as their base type: a list or tuple
subclass as a list or tuple, bytearray and memoryview as bytes, and a numpy scalar
(`np.float32(1)`) as a 0-d array. Dict keys may be str, int, float, bool, None or tuples of those.
"""

from __future__ import annotations

from remote_loader.protos.decoding import decode, decode_blob
from remote_loader.protos.encoding import Encoded, Placed, encode
from remote_loader.protos.layout import (
    ALIGN,
    MAX_DEPTH,
    DecodeError,
    EncodeError,
    payload_offset,
)

__all__ = [
    "ALIGN",
    "MAX_DEPTH",
    "DecodeError",
    "EncodeError",
    "Encoded",
    "Placed",
    "decode",
    "decode_blob",
    "encode",
    "payload_offset",
]
