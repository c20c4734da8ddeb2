"""The batch codec: a collated batch as a protobuf header plus one flat, aligned payload.

Workers encode straight into shared memory and clients decode into zero-copy views; no pickle.

NOTE [ Blob layout ]

    blob = header | zero padding to payload_offset(len(header)) | payload

The header is a serialized `loader_pb2.Node` describing the batch. Every tensor, array and bytes
leaf refers to a range `[offset, offset + nbytes)` of the payload; each offset is a multiple of
ALIGN relative to the payload start, and the padding between leaves is unspecified. The header's
length is not stored in the blob: it travels beside it (`Frame.header_bytes`).

Supported values: dict, list and tuple, nested, of torch.Tensor (any strided CPU tensor that is not
quantized), numpy.ndarray (bool and numeric dtypes), int (int64 range), float, bool, str, bytes,
bytearray, memoryview and None. Subclasses decode as their base type: a namedtuple comes back as a
plain tuple, an OrderedDict as a dict, bytearray and memoryview as bytes, and a numpy scalar
(`np.float32(1)`) as a 0-d array. Dict keys may be str, int, float, bool, None or tuples of those.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
import torch
from google.protobuf.message import DecodeError as _ProtobufDecodeError

# Relative: mypy cannot follow the editable install's import hook to remote_loader.protos.
from remote_loader.protos import compression, loader_pb2
from remote_loader.protos.compression import Compressor

__all__ = [
    "ALIGN",
    "DecodeError",
    "EncodeError",
    "Encoded",
    "Placed",
    "decode",
    "decode_blob",
    "encode",
]

# Every dtype's element size (at most 16 bytes, complex128) divides 64, so a leaf at a multiple of
# ALIGN can be viewed as its dtype in place; 64 bytes is also a cache line, so no two leaves share
# one and copies start on a line boundary.
ALIGN: int = 64

# protobuf parsers (upb) refuse messages nested deeper than 100, and each container level costs two
# (Node, then Sequence or Mapping): 32 levels leave a header that any peer parses, and no real
# batch nests anywhere near as deep, so hitting it means a self-referencing structure.
MAX_DEPTH: int = 32

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1

# Quantized tensors carry scale and zero point beside their bytes; the header has no place for them.
_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})

# Non-contiguous tensors are copied as a same-width integer: bit-exact, and it works for dtypes
# whose own copy kernel is missing (int1..int7, uint1..uint7).
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# bool, signed, unsigned, float and complex: plain bytes, safe to view in place on decode.
_NUMPY_KINDS = "biufc"

_SUPPORTED = (
    "supported: torch.Tensor, numpy.ndarray, int, float, bool, str, bytes, None, "
    "and dict/list/tuple of these"
)
_SUPPORTED_KEYS = "dict keys must be str, int, float, bool, None or tuples of those"

_Buffer: TypeAlias = bytes | bytearray | memoryview
_Source: TypeAlias = torch.Tensor | np.ndarray | _Buffer


class EncodeError(TypeError):
    """A batch holds a value the codec cannot carry; the message names it and where it is."""


class DecodeError(ValueError):
    """A header or payload is malformed: not produced by `encode`, or damaged on the way."""


def payload_offset(header_nbytes: int) -> int:
    """Where the payload starts in a blob: the header's length rounded up to ALIGN."""
    if header_nbytes < 0:
        raise ValueError(f"header_nbytes must be >= 0, got {header_nbytes}")
    return -(-header_nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class _Leaf:
    offset: int
    nbytes: int
    source: _Source


@dataclass(frozen=True)
class Placed:
    """Memory the payload will be written to, from `address` for `nbytes` bytes: a contiguous
    tensor leaf already inside it, at a multiple of ALIGN from `address`, keeps its place there
    (its offset is where it lies) and is not copied when the payload is written to that memory;
    the other leaves go after the last such one. Used by workers that collate into the slot the
    batch is sent from (NOTE [ Collating into the slot ] in server/worker.py)."""

    address: int
    nbytes: int


@dataclass(frozen=True)
class Encoded:
    """An encoded batch: its header, and the leaves still in their own memory until written.

    The leaves are referenced, not copied, so the batch must not be mutated before it is written.
    """

    header: bytes = field(repr=False)  # serialized Node; kept out of repr, it can be kilobytes
    payload_nbytes: int
    _leaves: tuple[_Leaf, ...] = field(default=(), repr=False, compare=False)

    @property
    def total_nbytes(self) -> int:
        return payload_offset(len(self.header)) + self.payload_nbytes

    def write_payload(self, out: torch.Tensor) -> None:
        """Copy every leaf into its range of `out`, a 1-D uint8 CPU tensor (one copy per leaf)."""
        _check_buffer(out, "out", self.payload_nbytes)
        out_np: np.ndarray | None = None
        for leaf in self._leaves:
            if leaf.nbytes == 0:
                continue
            dst = out[leaf.offset : leaf.offset + leaf.nbytes]
            src = leaf.source
            if isinstance(src, torch.Tensor):
                if src.data_ptr() != dst.data_ptr():  # else it was made in place (Placed)
                    _copy_tensor(src, dst)
                continue
            if out_np is None:
                out_np = out.numpy()
            dst_np = out_np[leaf.offset : leaf.offset + leaf.nbytes]
            if isinstance(src, np.ndarray):
                np.copyto(dst_np.view(src.dtype).reshape(src.shape), src, casting="no")
            else:
                dst_np[:] = np.frombuffer(src, dtype=np.uint8)

    def write_blob(self, out: torch.Tensor) -> None:
        """Write the whole blob (see NOTE [ Blob layout ]) into `out`, a 1-D uint8 CPU tensor."""
        _check_buffer(out, "out", self.total_nbytes)
        start = payload_offset(len(self.header))
        out.numpy()[: len(self.header)] = np.frombuffer(self.header, dtype=np.uint8)
        out[len(self.header) : start].zero_()
        self.write_payload(out[start : start + self.payload_nbytes])

    def to_bytes(self) -> bytes:
        """The whole blob as bytes (one extra copy: for tests and the in-process path)."""
        buf = bytearray(self.total_nbytes)
        self.write_blob(torch.frombuffer(buf, dtype=torch.uint8))
        return bytes(buf)


def _check_buffer(
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


def _copy_tensor(src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.is_contiguous() and not src.is_conj() and not src.is_neg():
        # Not reshape(-1): a contiguous tensor may keep any stride on a size-1 dimension, and
        # view(uint8) needs stride 1. Its elements are dense from storage_offset either way.
        dst.copy_(src.as_strided((src.numel(),), (1,)).view(torch.uint8))
        return
    # Strided (or lazily conjugated/negated) source: copy straight into a typed, shaped view of the
    # destination, so the strided gather is the only copy.
    width = _SAME_WIDTH_INT.get(src.element_size())
    if width is None or src.is_conj() or src.is_neg():
        # Only complex128 has no same-width integer; conj/neg bits must be applied by a real copy.
        dst.view(src.dtype).view(src.shape).copy_(src)
    else:
        dst.view(width).view(src.shape).copy_(src.view(width))


class _Encoder:
    def __init__(self, compressor: Compressor | None = None, placed: Placed | None = None) -> None:
        self.leaves: list[_Leaf] = []
        self.cursor = 0  # the end of the last leaf placed: the payload's length so far
        self.compressor = compressor
        self.arrays = 0  # tensor and array leaves so far: a leaf's number for the compressor
        self.placed = placed
        # Leaves found in `placed`, as (start, end) offsets, and the others, placed after them
        # once all are known (place_the_rest).
        self._in_place: list[tuple[int, int]] = []
        self._rest: list[tuple[loader_pb2.Tensor, int, _Source]] = []

    def array_leaf(
        self, msg: loader_pb2.Tensor, nbytes: int, source: torch.Tensor | np.ndarray
    ) -> None:
        """A tensor or array leaf: compressed when a compressor is given and it pays (NOTE
        [ Compression ] in protos/compression.py)."""
        number, self.arrays = self.arrays, self.arrays + 1
        if self.compressor is not None and nbytes:
            packed = self.compressor.compress(number, compression.leaf_bytes(source))
            if packed is not None:
                msg.compression = self.compressor.name
                msg.raw_nbytes = nbytes
                self.leaf(msg, len(packed), packed)
                return
        self.leaf(msg, nbytes, source)

    def leaf(self, msg: loader_pb2.Tensor, nbytes: int, source: _Source) -> None:
        offset = self._offset_in_place(nbytes, source)
        if offset is None:
            self._rest.append((msg, nbytes, source))
            return
        self._in_place.append((offset, offset + nbytes))
        self._add(msg, offset, nbytes, source)

    def _offset_in_place(self, nbytes: int, source: _Source) -> int | None:
        """Where `source` lies in `placed`, if it is a tensor that may stay there: whole inside,
        aligned, contiguous, and apart from the leaves already kept in place (two leaves never
        share bytes, as when both are copied)."""
        placed = self.placed
        if placed is None or not nbytes or not isinstance(source, torch.Tensor):
            return None
        offset = source.data_ptr() - placed.address
        if offset < 0 or offset % ALIGN or offset + nbytes > placed.nbytes:
            return None
        if not source.is_contiguous() or source.is_conj() or source.is_neg():
            return None
        if any(offset < end and start < offset + nbytes for start, end in self._in_place):
            return None
        return offset

    def place_the_rest(self) -> None:
        """Places the leaves not in place, in order, after the last one that is."""
        self.cursor = max((end for _, end in self._in_place), default=0)
        for msg, nbytes, source in self._rest:
            self._add(msg, -(-self.cursor // ALIGN) * ALIGN, nbytes, source)
        self._rest.clear()

    def _add(self, msg: loader_pb2.Tensor, offset: int, nbytes: int, source: _Source) -> None:
        self.leaves.append(_Leaf(offset, nbytes, source))
        self.cursor = max(self.cursor, offset + nbytes)
        msg.offset = offset
        msg.nbytes = nbytes

    def value(self, node: loader_pb2.Node, obj: object, path: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise EncodeError(
                f"batch nests deeper than {MAX_DEPTH} levels at {path}: is it self-referencing?"
            )
        if isinstance(obj, torch.Tensor):
            self.tensor(node.tensor, obj, path)
        elif isinstance(obj, np.ndarray | np.generic):
            self.ndarray(node.ndarray, obj, path)
        elif isinstance(obj, bytes | bytearray | memoryview):
            node.bytes.SetInParent()
            if isinstance(obj, memoryview) and not obj.c_contiguous:
                obj = obj.tobytes()  # rare; np.frombuffer in write_payload needs contiguous bytes
            self.leaf(node.bytes, obj.nbytes if isinstance(obj, memoryview) else len(obj), obj)
        elif isinstance(obj, list):
            node.list.SetInParent()
            for i, item in enumerate(obj):
                self.value(node.list.items.add(), item, f"{path}[{i}]", depth + 1)
        elif isinstance(obj, tuple):
            node.tuple.SetInParent()
            for i, item in enumerate(obj):
                self.value(node.tuple.items.add(), item, f"{path}[{i}]", depth + 1)
        elif isinstance(obj, dict):
            node.dict.SetInParent()
            for key, item in obj.items():
                _encode_key(node.dict.keys.add(), key, path, depth + 1)
                self.value(node.dict.values.add(), item, f"{path}[{key!r}]", depth + 1)
        elif not _encode_scalar(node, obj, path):
            raise EncodeError(f"cannot encode {type(obj).__qualname__} at {path}; {_SUPPORTED}")

    def tensor(self, msg: loader_pb2.Tensor, t: torch.Tensor, path: str) -> None:
        if t.is_nested:
            fix = "pad it (torch.nested.to_padded_tensor) or return a list of tensors"
            raise EncodeError(f"cannot encode a nested tensor at {path}: {fix} in collate_fn")
        if t.layout != torch.strided:
            raise EncodeError(
                f"cannot encode a {t.layout} tensor at {path}: only strided (dense) tensors are "
                "supported; call .to_dense() in collate_fn"
            )
        if t.device.type != "cpu":
            raise EncodeError(
                f"cannot encode a tensor on device {t.device} at {path}: only CPU tensors are "
                "supported; call .cpu() in collate_fn (a meta tensor has no data to send)"
            )
        if t.dtype in _QUANTIZED:
            raise EncodeError(
                f"cannot encode a quantized {t.dtype} tensor at {path}: call .dequantize() or "
                ".int_repr() in collate_fn"
            )
        t = t.detach()
        msg.dtype = str(t.dtype).removeprefix("torch.")
        msg.shape.extend(t.shape)
        self.array_leaf(msg, t.numel() * t.element_size(), t)

    def ndarray(self, msg: loader_pb2.Tensor, a: np.ndarray | np.generic, path: str) -> None:
        if isinstance(a, np.ma.MaskedArray):
            raise EncodeError(
                f"cannot encode a numpy masked array at {path}: its mask would be lost; send "
                "np.ma.getdata(x) and np.ma.getmaskarray(x) instead"
            )
        if a.dtype.kind not in _NUMPY_KINDS:
            raise EncodeError(
                f"cannot encode a numpy array of dtype {a.dtype} at {path}: only bool and numeric "
                "dtypes are supported (no object, string, structured, void or datetime arrays)"
            )
        arr = np.asarray(a)
        msg.dtype = arr.dtype.str
        msg.shape.extend(arr.shape)
        self.array_leaf(msg, arr.nbytes, arr)


def _encode_scalar(node: loader_pb2.Node, obj: object, path: str) -> bool:
    """Set `node` to a scalar `obj` and return True, or return False when obj is no scalar."""
    if obj is None:
        node.none = True
    elif isinstance(obj, bool):  # before int: bool is a subclass of int
        node.bool = obj
    elif isinstance(obj, int):
        if not _INT64_MIN <= obj <= _INT64_MAX:
            raise EncodeError(
                f"int {obj} at {path} does not fit in int64; send it as a str or a tensor"
            )
        node.int = int(obj)
    elif isinstance(obj, float):
        node.float = float(obj)
    elif isinstance(obj, str):
        try:
            node.str = str(obj)
        except (ValueError, UnicodeError) as exc:
            raise EncodeError(f"str at {path} is not valid UTF-8 text: {exc}") from exc
    else:
        return False
    return True


def _encode_key(node: loader_pb2.Node, key: object, path: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise EncodeError(f"dict key in {path} nests deeper than {MAX_DEPTH} levels")
    if isinstance(key, tuple):
        node.tuple.SetInParent()
        for item in key:
            _encode_key(node.tuple.items.add(), item, path, depth + 1)
    elif isinstance(key, np.generic) and key.dtype.kind in "biuf":
        # A numpy scalar key equals (and hashes like) its Python value, which is what comes back.
        _encode_key(node, key.item(), path, depth)
    elif isinstance(key, np.generic) or not _encode_scalar(node, key, f"a key of {path}"):
        kind = type(key).__qualname__
        raise EncodeError(f"cannot encode a dict key of type {kind} in {path}; {_SUPPORTED_KEYS}")


def encode(
    obj: object, compressor: Compressor | None = None, placed: Placed | None = None
) -> Encoded:
    """Describe `obj` as a header and record its leaves; no tensor data is copied (but for the
    leaves `compressor` compresses). Tensors already in `placed` keep their place there."""
    if compressor is not None:
        compressor.next_batch()
    encoder = _Encoder(compressor, placed)
    root = loader_pb2.Node()
    encoder.value(root, obj, "batch", 0)
    encoder.place_the_rest()
    return Encoded(root.SerializeToString(), encoder.cursor, tuple(encoder.leaves))


class _Decoder:
    def __init__(self, payload: torch.Tensor, tensor_base: torch.Tensor) -> None:
        self.payload = payload
        self.tensor_base = tensor_base
        self.limit = min(payload.numel(), tensor_base.numel())
        self._payload_np: np.ndarray | None = None

    @property
    def payload_np(self) -> np.ndarray:
        if self._payload_np is None:
            self._payload_np = self.payload.numpy()
        return self._payload_np

    def check_range(self, msg: loader_pb2.Tensor, limit: int) -> None:
        if msg.offset % ALIGN:
            raise DecodeError(f"leaf offset {msg.offset} is not a multiple of {ALIGN}")
        if msg.offset + msg.nbytes > limit:
            raise DecodeError(
                f"leaf [{msg.offset}, {msg.offset + msg.nbytes}) lies outside the payload of "
                f"{limit} bytes"
            )

    def value(self, node: loader_pb2.Node) -> Any:
        kind = node.WhichOneof("value")
        if kind == "tensor":
            return self.tensor(node.tensor)
        if kind == "ndarray":
            return self.ndarray(node.ndarray)
        if kind == "bytes":
            self.check_range(node.bytes, self.payload.numel())
            return self.payload_np[
                node.bytes.offset : node.bytes.offset + node.bytes.nbytes
            ].tobytes()
        if kind == "list":
            return [self.value(item) for item in node.list.items]
        if kind == "tuple":
            return tuple(self.value(item) for item in node.tuple.items)
        if kind == "dict":
            keys, values = node.dict.keys, node.dict.values
            if len(keys) != len(values):
                raise DecodeError(f"dict has {len(keys)} keys but {len(values)} values")
            return {_decode_key(k): self.value(v) for k, v in zip(keys, values, strict=True)}
        return _decode_scalar(node, kind)

    def tensor(self, msg: loader_pb2.Tensor) -> torch.Tensor:
        dtype = getattr(torch, msg.dtype, None) if msg.dtype.isidentifier() else None
        if not isinstance(dtype, torch.dtype) or dtype in _QUANTIZED:
            raise DecodeError(f"unknown torch dtype {msg.dtype!r} in header")
        shape = _checked_shape(msg, dtype.itemsize)
        if msg.compression:
            self.check_range(msg, self.payload.numel())
            data = torch.frombuffer(self.unpacked(msg), dtype=torch.uint8)
            tensor = data.view(dtype).view(shape)
            return tensor.to(self.tensor_base.device)
        self.check_range(msg, self.limit)
        raw = self.tensor_base[msg.offset : msg.offset + msg.nbytes]
        try:
            return raw.view(dtype).view(shape)
        except RuntimeError as exc:
            raise DecodeError(f"cannot view payload bytes as {dtype}{list(shape)}: {exc}") from exc

    def ndarray(self, msg: loader_pb2.Tensor) -> np.ndarray:
        try:
            dtype = np.dtype(msg.dtype)
        except (TypeError, ValueError) as exc:
            raise DecodeError(f"unknown numpy dtype {msg.dtype!r} in header") from exc
        if dtype.kind not in _NUMPY_KINDS:
            raise DecodeError(f"numpy dtype {msg.dtype!r} in header is not a bool or numeric dtype")
        shape = _checked_shape(msg, dtype.itemsize)
        self.check_range(msg, self.payload.numel())
        if msg.compression:
            unpacked: np.ndarray = np.frombuffer(self.unpacked(msg), dtype=dtype).reshape(shape)
            return unpacked
        raw = self.payload_np[msg.offset : msg.offset + msg.nbytes]
        view: np.ndarray = raw.view(dtype).reshape(shape)
        return view

    def unpacked(self, msg: loader_pb2.Tensor) -> bytearray:
        """A compressed leaf's bytes (range already checked)."""
        packed = self.payload_np[msg.offset : msg.offset + msg.nbytes]
        try:
            return compression.decompress(msg.compression, packed.data, msg.raw_nbytes)
        except compression.CompressionError as exc:
            raise DecodeError(str(exc)) from exc


def _checked_shape(msg: loader_pb2.Tensor, itemsize: int) -> tuple[int, ...]:
    shape = tuple(msg.shape)
    nbytes = msg.raw_nbytes if msg.compression else msg.nbytes
    numel = 1
    for dim in shape:
        if dim < 0:
            raise DecodeError(f"negative dimension in shape {list(shape)}")
        numel *= dim
    if numel * itemsize != nbytes:
        raise DecodeError(
            f"shape {list(shape)} of {itemsize}-byte elements needs {numel * itemsize} bytes, "
            f"header says {nbytes}"
        )
    return shape


def _decode_scalar(node: loader_pb2.Node, kind: str | None) -> Any:
    if kind == "int":
        return node.int
    if kind == "float":
        return node.float
    if kind == "bool":
        return node.bool
    if kind == "str":
        return node.str
    if kind == "none":
        return None
    raise DecodeError(
        f"unknown node kind {kind!r} in header (written by a newer codec, or not a header)"
    )


def _decode_key(node: loader_pb2.Node) -> Any:
    kind = node.WhichOneof("value")
    if kind == "tuple":
        return tuple(_decode_key(item) for item in node.tuple.items)
    if kind in ("tensor", "ndarray", "bytes", "list", "dict"):
        raise DecodeError(f"a {kind} cannot be a dict key")
    return _decode_scalar(node, kind)


def decode(
    header: bytes | memoryview,
    payload: torch.Tensor,
    device_payload: torch.Tensor | None = None,
) -> Any:
    """Rebuild a batch from its header and payload, a 1-D uint8 CPU tensor (may be pinned).

    Tensors are views into `device_payload` (a copy of `payload` on a CUDA device) when given, else
    into `payload`; numpy arrays are views into `payload`; nothing is copied but bytes and scalars.
    """
    # Only tensors need an aligned base: numpy views and bytes work at any offset.
    _check_buffer(payload, "payload", 0, aligned=device_payload is None)
    tensor_base = payload
    if device_payload is not None:
        _check_buffer(device_payload, "device_payload", 0, cpu=False)
        tensor_base = device_payload
    try:
        root = loader_pb2.Node.FromString(bytes(header))
    except _ProtobufDecodeError as exc:
        raise DecodeError(f"header is not a serialized Node: {exc}") from exc
    return _Decoder(payload, tensor_base).value(root)


def decode_blob(blob: bytes | memoryview | torch.Tensor, header_nbytes: int) -> Any:
    """Decode a whole blob (see NOTE [ Blob layout ]) whose header is `header_nbytes` long.

    A tensor or writable memoryview is decoded in place; read-only bytes are copied once first,
    since decoded tensors are writable views.
    """
    if isinstance(blob, torch.Tensor):
        data = blob
    elif isinstance(blob, memoryview) and not blob.readonly and blob.c_contiguous and blob.nbytes:
        data = torch.frombuffer(blob.cast("B"), dtype=torch.uint8)
    else:
        copy = bytearray(blob)
        if not copy:
            raise DecodeError("blob is empty: it has no header")
        data = torch.frombuffer(copy, dtype=torch.uint8)
    start = payload_offset(header_nbytes)
    if start > data.numel():
        raise DecodeError(
            f"blob of {data.numel()} bytes is shorter than its header of {header_nbytes} bytes "
            "and padding"
        )
    header = data[:header_nbytes].numpy().tobytes()
    return decode(header, data[start:])
