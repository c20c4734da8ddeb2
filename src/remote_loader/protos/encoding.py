"""Encoding a collated batch: a header that describes it and the leaves still in their memory.

Nothing is copied until `Encoded.write_payload`, which puts each leaf at its offset of the blob
(NOTE [ Blob layout ] in protos/layout.py) with one copy per leaf, or none for a leaf already
there (`Placed`). A namedtuple, dataclass or Mapping subclass carries its class's name so the
client can rebuild it (NOTE [ Batch types ] in protos/batch_types.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
import torch

from remote_loader.protos import compression, loader_pb2
from remote_loader.protos.compression import Compressor
from remote_loader.protos.layout import (
    ALIGN,
    MAX_DEPTH,
    NUMPY_KINDS,
    QUANTIZED,
    EncodeError,
    check_buffer,
    payload_offset,
)

__all__ = ["Encoded", "Placed", "encode"]

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1

# Non-contiguous tensors are copied as a same-width integer: bit-exact, and it works for dtypes
# whose own copy kernel is missing (int1..int7, uint1..uint7).
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_SUPPORTED = (
    "supported: torch.Tensor, numpy.ndarray, int, float, bool, str, bytes, None, and dict, list, "
    "tuple, namedtuple, dataclass instance or Mapping of these; return the batch's data in those "
    "from the dataset or collate_fn"
)
_SUPPORTED_KEYS = "dict keys must be str, int, float, bool, None or tuples of those"

_Buffer: TypeAlias = bytes | bytearray | memoryview
_Source: TypeAlias = torch.Tensor | np.ndarray | _Buffer


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
    batch is sent from (NOTE [ Collating into the slot ] in server/worker/collating.py)."""

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
        check_buffer(out, "out", self.payload_nbytes)
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
        check_buffer(out, "out", self.total_nbytes)
        start = payload_offset(len(self.header))
        out.numpy()[: len(self.header)] = np.frombuffer(self.header, dtype=np.uint8)
        out[len(self.header) : start].zero_()
        self.write_payload(out[start : start + self.payload_nbytes])

    def to_bytes(self) -> bytes:
        """The whole blob as bytes (one extra copy: for tests and the in-process path)."""
        buf = bytearray(self.total_nbytes)
        self.write_blob(torch.frombuffer(buf, dtype=torch.uint8))
        return bytes(buf)


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
            if type(obj) is not tuple:
                _name_namedtuple(node.tuple, obj)
            for i, item in enumerate(obj):
                self.value(node.tuple.items.add(), item, f"{path}[{i}]", depth + 1)
        elif isinstance(obj, dict):
            self.mapping(node.dict, obj, path, depth)
        elif not _encode_scalar(node, obj, path):
            self.other(node, obj, path, depth)

    def mapping(
        self, msg: loader_pb2.Mapping, obj: Mapping[Any, Any], path: str, depth: int
    ) -> None:
        msg.SetInParent()
        if type(obj) is not dict:
            msg.type = _type_name(type(obj))
        for key, item in obj.items():
            _encode_key(msg.keys.add(), key, path, depth + 1)
            self.value(msg.values.add(), item, f"{path}[{key!r}]", depth + 1)

    def other(self, node: loader_pb2.Node, obj: object, path: str, depth: int) -> None:
        """A value no fast case took: a Mapping that is no dict, a dataclass instance, or an
        error."""
        if isinstance(obj, Mapping):
            self.mapping(node.dict, obj, path, depth)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            msg = node.dict
            msg.SetInParent()
            msg.type = _type_name(type(obj))
            for name in _init_fields(type(obj), dataclasses.fields(obj), path):
                msg.keys.add().str = name
                self.value(msg.values.add(), getattr(obj, name), f"{path}.{name}", depth + 1)
        else:
            cls = type(obj)
            what = cls.__qualname__ if cls.__module__ == "builtins" else _dotted(cls)
            raise EncodeError(f"cannot encode {what} at {path}; {_SUPPORTED}")

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
        if t.dtype in QUANTIZED:
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
        if a.dtype.kind not in NUMPY_KINDS:
            raise EncodeError(
                f"cannot encode a numpy array of dtype {a.dtype} at {path}: only bool and numeric "
                "dtypes are supported (no object, string, structured, void or datetime arrays)"
            )
        arr = np.asarray(a)
        msg.dtype = arr.dtype.str
        msg.shape.extend(arr.shape)
        self.array_leaf(msg, arr.nbytes, arr)


def _type_name(cls: type) -> str:
    """How a header names a class: "module:qualname" (NOTE [ Batch types ])."""
    return f"{cls.__module__}:{cls.__qualname__}"


def _dotted(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _name_namedtuple(msg: loader_pb2.Sequence, obj: tuple[Any, ...]) -> None:
    """Names a namedtuple's class and fields in `msg`; any other tuple subclass (torch.Size, a
    structseq such as torch.return_types.max) travels as a plain tuple."""
    fields = getattr(type(obj), "_fields", None)
    if (
        isinstance(fields, tuple)
        and len(fields) == len(obj)
        and all(isinstance(name, str) for name in fields)
    ):
        msg.type = _type_name(type(obj))
        msg.fields.extend(fields)


def _init_fields(cls: type, fields: tuple[dataclasses.Field[Any], ...], path: str) -> list[str]:
    """The names of a dataclass's fields, all of which its __init__ must take."""
    names = []
    for f in fields:
        if not f.init:
            raise EncodeError(
                f"cannot encode dataclass {_dotted(cls)} at {path}: its field {f.name!r} has "
                f"init=False, so the client could not rebuild it as {cls.__qualname__}(**fields); "
                "make it an init field, or return a dict"
            )
        names.append(f.name)
    return names


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
