"""Decoding a blob into the batch it was encoded from: views into its payload, not copies.

NOTE [ Batch types ]

torch's default_collate keeps a namedtuple's type, and a collate_fn may return a dataclass, a
Mapping subclass or a PackedSequence (a namedtuple). The header names such a class, and the
client rebuilds the batch as that class when it has it:

    server (encoding.py)                      client (here)
    namedtuple    -> Sequence(type, fields)   cls(*items)       cls: a tuple subclass, same _fields
    dataclass     -> Mapping(type), keys =    cls(**fields)     cls: a dataclass
                     its fields (init=True)
    Mapping that  -> Mapping(type)            cls() + update()  cls: a MutableMapping subclass
    is no dict                                cls(dict)         cls: another Mapping subclass
    dict, tuple   -> type "" (as before)      dict, tuple       (fields of an old header)

`type` is "module:qualname". The class is found by `importlib.import_module(module)` and getattr
along `qualname`, once per type (cached); nothing else is looked up or run, and nothing is
unpickled: the only code that runs is the import of a module installed here (its top-level
code, as any import runs it) and the constructor of a class that passed the check above (the
call default_collate itself makes). A class whose qualname has `<locals>`, one of `__main__` or
`__mp_main__` (the server's script is not the trainer's), one not importable here, one that
fails the check, or a constructor that raises: the batch arrives as a stand-in instead, a
namedtuple of the same name and fields made here (cached per type and fields) or a plain dict,
and a UserWarning names the type, once per type, with what to do (make the module importable on
the trainer).

Rules kept small on purpose:
- Only a tuple subclass with `_fields` is a namedtuple; another (torch.Size, a structseq such as
  torch.return_types.max) travels as a plain tuple, and a list subclass as a list.
- A Mapping is rebuilt from its items alone: a defaultdict comes back with default_factory None
  (the factory is code, and code is not sent), an attribute of a dict subclass is lost. A
  dataclass field with init=False is refused when encoding (EncodeError): __init__ could not
  set it.
- A dict key stays a plain tuple even if it was a namedtuple (it hashes and compares the same).
- A PackedSequence decoded onto a device keeps `batch_sizes` on the CPU (a small copy), as
  PackedSequence.to() keeps it and as its constructor requires (_CPU_FIELDS).
A decoder that predates these fields ignores them: it gives plain tuples and dicts, as before.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import keyword
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import numpy as np
import torch
from google.protobuf.message import DecodeError as _ProtobufDecodeError

from remote_loader.protos import compression, loader_pb2
from remote_loader.protos.layout import (
    ALIGN,
    NUMPY_KINDS,
    QUANTIZED,
    DecodeError,
    check_buffer,
    payload_offset,
)

__all__ = ["decode", "decode_blob"]

# Distinct type names whose lookups are cached: a server names a handful; the bound only keeps a
# misbehaving one from growing the caches without end.
CACHED_TYPES = 1024
# Namedtuple fields that stay on the CPU when the batch is decoded onto a device, as the class
# keeps them there (NOTE [ Batch types ]).
_CPU_FIELDS = {"torch.nn.utils.rnn:PackedSequence": frozenset({"batch_sizes"})}
_NOT_IMPORTABLE_MODULES = ("__main__", "__mp_main__")

_Found = type | str  # the class a header names, or why there is none here
_Rebuild = Callable[[dict[Any, Any]], Any]


def _find_class(type_name: str) -> _Found:
    """The class `type_name` ("module:qualname") names here: an import and attribute lookups,
    nothing else (NOTE [ Batch types ])."""
    module, _, qualname = type_name.partition(":")
    parts = qualname.split(".")
    if "<locals>" in parts:
        return "it is defined inside a function (<locals>); define it at module level"
    if module in _NOT_IMPORTABLE_MODULES:
        return f"it is defined in the server's {module} script, which the trainer does not run"
    names = [*module.split("."), *parts]
    if not all(name.isidentifier() for name in names):
        return "it is not named module:qualname"
    try:
        found: object = importlib.import_module(module)
        for part in parts:
            found = getattr(found, part)
    except ImportError as exc:
        return f"its module cannot be imported here ({exc})"
    except AttributeError:
        return f"module {module} has no {qualname} here"
    except Exception as exc:  # the module's own code raised while being imported
        return f"importing its module raised {type(exc).__name__}: {exc}"
    if not isinstance(found, type):
        return f"{module}.{qualname} is not a class here"
    return found


def _tuple_class(type_name: str, fields: tuple[str, ...]) -> _Found:
    found = _find_class(type_name)
    if isinstance(found, str):
        return found
    if not issubclass(found, tuple) or getattr(found, "_fields", None) != fields:
        return f"the class here is not a namedtuple with the server's fields {fields}"
    return found


def _mapping_rebuild(type_name: str) -> _Rebuild | str:
    """How to rebuild a Mapping node of this type from its items (NOTE [ Batch types ])."""
    found = _find_class(type_name)
    if isinstance(found, str):
        return found
    if issubclass(found, MutableMapping):
        return functools.partial(_filled, found)
    if issubclass(found, Mapping):
        return found
    if dataclasses.is_dataclass(found):
        return functools.partial(_from_fields, found)
    return "the class here is neither a dataclass nor a Mapping"


def _filled(cls: type[MutableMapping[Any, Any]], items: dict[Any, Any]) -> Any:
    mapping = cls()
    mapping.update(items)
    return mapping


def _from_fields(cls: type, items: dict[Any, Any]) -> Any:
    return cls(**items)


def _stand_in(type_name: str, fields: tuple[str, ...]) -> type[Any]:
    """A namedtuple made here for a class the client does not have."""
    name = type_name.rpartition(".")[2].rpartition(":")[2]
    if not name.isidentifier() or keyword.iskeyword(name):
        name = "Batch"
    return collections.namedtuple(name, fields, rename=True)


class _Types:
    """The classes headers name, each looked up once, and the types warned about."""

    def __init__(self) -> None:
        cache = functools.lru_cache(maxsize=CACHED_TYPES)
        self.tuple_class = cache(_tuple_class)
        self.mapping_rebuild = cache(_mapping_rebuild)
        self.stand_in = cache(_stand_in)
        self.warned: set[str] = set()

    def warn(self, type_name: str, why: str, instead: str) -> None:
        if type_name in self.warned or len(self.warned) >= CACHED_TYPES:
            return
        self.warned.add(type_name)
        warnings.warn(
            f"the server's batches hold a {type_name!r}, which cannot be rebuilt here: {why}. "
            f"They arrive as {instead} instead. To get the class itself, make the module "
            "that defines it importable on the trainer, with the same class at its top level "
            "(NOTE [ Batch types ] in remote_loader.protos.decoding).",
            UserWarning,
            stacklevel=2,
        )


_TYPES = _Types()


class _Decoder:
    def __init__(self, payload: torch.Tensor, tensor_base: torch.Tensor) -> None:
        self.payload = payload
        self.tensor_base = tensor_base
        self.limit = min(payload.numel(), tensor_base.numel())
        self._payload_np: np.ndarray | None = None
        self.types = _TYPES
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
            return self.mapping(mapping.type, items) if mapping.type else items
        return _decode_scalar(node, kind)

    def namedtuple(self, msg: loader_pb2.Sequence) -> tuple[Any, ...]:
        fields = tuple(msg.fields)
        if len(fields) != len(msg.items):
            raise DecodeError(
                f"namedtuple {msg.type!r} has {len(fields)} fields but {len(msg.items)} items"
            )
        found = self.types.tuple_class(msg.type, fields)
        on_cpu = _CPU_FIELDS.get(msg.type, ()) if self.tensor_base is not self.payload else ()
        items = [
            self.on_cpu().value(item) if name in on_cpu else self.value(item)
            for name, item in zip(fields, msg.items, strict=True)
        ]
        if isinstance(found, str):
            why = found
        else:
            try:
                rebuilt: tuple[Any, ...] = found(*items)
                return rebuilt
            except Exception as exc:
                why = f"{found.__qualname__}(*fields) raised {type(exc).__name__}: {exc}"
        stand_in = self.types.stand_in(msg.type, fields)
        made_here = f"a namedtuple {stand_in.__name__}({', '.join(stand_in._fields)}) made here"
        self.types.warn(msg.type, why, made_here)
        made: tuple[Any, ...] = stand_in(*items)
        return made

    def mapping(self, type_name: str, items: dict[Any, Any]) -> Any:
        rebuild = self.types.mapping_rebuild(type_name)
        if isinstance(rebuild, str):
            why = rebuild
        else:
            try:
                return rebuild(items)
            except Exception as exc:
                why = f"rebuilding it from its items raised {type(exc).__name__}: {exc}"
        self.types.warn(type_name, why, "a dict")
        return items

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
