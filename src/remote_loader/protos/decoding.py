"""Decoding a blob into the batch it was encoded from: views into its payload, not copies.

A namedtuple, dataclass or Mapping node is rebuilt as the class its header names by
protos/batch_types.py (NOTE [ Batch types ]).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from google.protobuf.message import DecodeError as _ProtobufDecodeError

from remote_loader.protos import batch_types, compression, loader_pb2
from remote_loader.protos.layout import (
    ALIGN,
    NUMPY_KINDS,
    QUANTIZED,
    DecodeError,
    check_buffer,
    payload_offset,
)

__all__ = ["decode", "decode_blob"]


class _Decoder:
    def __init__(self, payload: torch.Tensor, tensor_base: torch.Tensor) -> None:
        self.payload = payload
        self.tensor_base = tensor_base
        self.limit = min(payload.numel(), tensor_base.numel())
        self._payload_np: np.ndarray | None = None
        self.types = batch_types.TYPES
        self.copy_tensors = False  # set for the CPU fields of a batch decoded onto a device

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
            seq = node.tuple
            if seq.type:
                return self.namedtuple(seq)
            return tuple(self.value(item) for item in seq.items)
        if kind == "dict":
            mapping = node.dict
            keys, values = mapping.keys, mapping.values
            if len(keys) != len(values):
                raise DecodeError(f"dict has {len(keys)} keys but {len(values)} values")
            items = {_decode_key(k): self.value(v) for k, v in zip(keys, values, strict=True)}
            return self.types.mapping(mapping.type, items) if mapping.type else items
        return _decode_scalar(node, kind)

    def namedtuple(self, msg: loader_pb2.Sequence) -> tuple[Any, ...]:
        fields = tuple(msg.fields)
        if len(fields) != len(msg.items):
            raise DecodeError(
                f"namedtuple {msg.type!r} has {len(fields)} fields but {len(msg.items)} items"
            )
        on_cpu = (
            batch_types.CPU_FIELDS.get(msg.type, ()) if self.tensor_base is not self.payload else ()
        )
        items = [
            self.on_cpu().value(item) if name in on_cpu else self.value(item)
            for name, item in zip(fields, msg.items, strict=True)
        ]
        return self.types.namedtuple(msg.type, fields, items)

    def on_cpu(self) -> _Decoder:
        """A decoder of this payload whose tensors are CPU copies (not views: the payload of a
        batch decoded onto a device need not be aligned)."""
        decoder = _Decoder(self.payload, self.payload)
        decoder.types, decoder.copy_tensors = self.types, True
        return decoder

    def tensor(self, msg: loader_pb2.Tensor) -> torch.Tensor:
        dtype = getattr(torch, msg.dtype, None) if msg.dtype.isidentifier() else None
        if not isinstance(dtype, torch.dtype) or dtype in QUANTIZED:
            raise DecodeError(f"unknown torch dtype {msg.dtype!r} in header")
        shape = _checked_shape(msg, dtype.itemsize)
        if msg.compression:
            self.check_range(msg, self.payload.numel())
            data = torch.frombuffer(self.unpacked(msg), dtype=torch.uint8)
            tensor = data.view(dtype).view(shape)
            return tensor.to(self.tensor_base.device)
        self.check_range(msg, self.limit)
        raw = self.tensor_base[msg.offset : msg.offset + msg.nbytes]
        if self.copy_tensors:
            raw = raw.clone()
        try:
            return raw.view(dtype).view(shape)
        except RuntimeError as exc:
            raise DecodeError(f"cannot view payload bytes as {dtype}{list(shape)}: {exc}") from exc

    def ndarray(self, msg: loader_pb2.Tensor) -> np.ndarray:
        try:
            dtype = np.dtype(msg.dtype)
        except (TypeError, ValueError) as exc:
            raise DecodeError(f"unknown numpy dtype {msg.dtype!r} in header") from exc
        if dtype.kind not in NUMPY_KINDS:
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
    check_buffer(payload, "payload", 0, aligned=device_payload is None)
    tensor_base = payload
    if device_payload is not None:
        check_buffer(device_payload, "device_payload", 0, cpu=False)
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
