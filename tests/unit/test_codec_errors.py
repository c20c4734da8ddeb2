"""Tests for what the batch codec refuses: values it cannot encode (with the path to them),
malformed headers and short blobs on decode, and buffers too small to write into.
"""

import warnings
from typing import Any

import numpy as np
import pytest
import torch

from remote_loader.protos import codec, loader_pb2
from tests.helpers import roundtrip

# --- errors -----------------------------------------------------------------------------------


def _deep(levels: int) -> object:
    batch: object = 0
    for _ in range(levels):
        batch = [batch]
    return batch


def _quietly(make: Any) -> Any:
    with warnings.catch_warnings():  # sparse CSR and nested tensors warn that they are beta
        warnings.simplefilter("ignore")
        return make()


UNSUPPORTED = {
    "set": (lambda: {"a": [1, {2}]}, r"set at batch\['a'\]\[1\].*supported: torch.Tensor"),
    "object": (lambda: [object()], r"object at batch\[0\]; supported"),
    "int too big": (lambda: {"x": 2**63}, r"int 9223372036854775808 at batch\['x'\].*int64"),
    "int too small": (lambda: (-(2**63) - 1,), r"at batch\[0\] does not fit in int64"),
    "object array": (
        lambda: {"arr": np.array([None], dtype=object)},
        r"dtype object at batch\['arr'\].*bool and numeric",
    ),
    "string array": (lambda: {"s": np.array(["a"])}, r"dtype <U1 at batch\['s'\]"),
    "structured array": (lambda: [np.zeros(2, "i4,f4")], r"at batch\[0\].*structured"),
    "masked array": (lambda: [np.ma.masked_array([1])], r"masked array at batch\[0\]"),
    "sparse": (
        lambda: {"s": [torch.zeros(3).to_sparse()]},
        r"sparse_coo tensor at batch\['s'\]\[0\].*to_dense\(\)",
    ),
    "sparse csr": (lambda: [torch.eye(2).to_sparse_csr()], r"sparse_csr tensor at batch\[0\]"),
    "meta": (lambda: [torch.empty(2, device="meta")], r"device meta at batch\[0\].*\.cpu\(\)"),
    "nested": (
        lambda: {"n": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])},
        r"nested tensor at batch\['n'\]",
    ),
    "bad key": (lambda: {"a": {frozenset(): 1}}, r"key of type frozenset in batch\['a'\]"),
    "bytes key": (lambda: {b"k": 1}, r"key of type bytes in batch"),
    "surrogate": (lambda: ["\ud800"], r"str at batch\[0\] is not valid UTF-8"),
    "too deep": (lambda: _deep(codec.MAX_DEPTH + 1), rf"deeper than {codec.MAX_DEPTH} levels"),
}


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_unsupported_values_raise_encode_error_with_path(name: str) -> None:
    make, message = UNSUPPORTED[name]
    batch = _quietly(make)
    with pytest.raises(codec.EncodeError, match=message) as info:
        codec.encode(batch)
    assert isinstance(info.value, TypeError)


def test_max_depth_still_decodes() -> None:
    batch = _deep(codec.MAX_DEPTH)
    assert roundtrip(batch) == batch


def _tensor_node(dtype: str, shape: list[int], offset: int, nbytes: int) -> bytes:
    leaf = loader_pb2.Tensor(dtype=dtype, shape=shape, offset=offset, nbytes=nbytes)
    header: bytes = loader_pb2.Node(tensor=leaf).SerializeToString()
    return header


MALFORMED = {
    "offset out of range": (_tensor_node("float32", [2], 64, 8), r"outside the payload of 64"),
    "nbytes out of range": (_tensor_node("float32", [32], 0, 128), r"outside the payload"),
    "unknown dtype": (_tensor_node("float33", [1], 0, 4), r"unknown torch dtype 'float33'"),
    "not a dtype": (_tensor_node("Tensor", [1], 0, 4), r"unknown torch dtype 'Tensor'"),
    "dunder": (_tensor_node("__class__", [1], 0, 4), r"unknown torch dtype"),
    "dotted": (_tensor_node("torch.float32", [1], 0, 4), r"unknown torch dtype"),
    "quantized dtype": (_tensor_node("qint8", [1], 0, 1), r"unknown torch dtype 'qint8'"),
    "unaligned": (_tensor_node("uint8", [1], 3, 1), r"not a multiple of 64"),
    "wrong nbytes": (_tensor_node("float32", [2], 0, 4), r"needs 8 bytes, header says 4"),
    "negative dim": (_tensor_node("float32", [-1], 0, 0), r"negative dimension"),
    "object ndarray": (
        loader_pb2.Node(ndarray=loader_pb2.Tensor(dtype="|O", shape=[1], nbytes=8)),
        r"not a bool or numeric dtype",
    ),
    "bad ndarray dtype": (
        loader_pb2.Node(ndarray=loader_pb2.Tensor(dtype="nope", shape=[1], nbytes=4)),
        r"unknown numpy dtype 'nope'",
    ),
    "bytes out of range": (
        loader_pb2.Node(bytes=loader_pb2.Tensor(offset=0, nbytes=65)),
        r"outside the payload",
    ),
    "empty header": (b"", r"unknown node kind None"),
    "unknown field": (b"\x60\x01", r"unknown node kind None"),
    "garbage": (b"\xff\xff\xff", r"not a serialized Node"),
    "keys without values": (
        loader_pb2.Node(dict=loader_pb2.Mapping(keys=[loader_pb2.Node(none=True)])),
        r"1 keys but 0 values",
    ),
    "list key": (
        loader_pb2.Node(
            dict=loader_pb2.Mapping(
                keys=[loader_pb2.Node(list=loader_pb2.Sequence())],
                values=[loader_pb2.Node(none=True)],
            )
        ),
        r"a list cannot be a dict key",
    ),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_headers_raise_decode_error(name: str) -> None:
    node, message = MALFORMED[name]
    header = node.SerializeToString() if isinstance(node, loader_pb2.Node) else node
    assert isinstance(header, bytes)
    with pytest.raises(codec.DecodeError, match=message):
        codec.decode(header, torch.zeros(64, dtype=torch.uint8))


def test_decode_blob_rejects_a_short_blob() -> None:
    encoded = codec.encode(torch.ones(3))
    with pytest.raises(codec.DecodeError, match="shorter than its header"):
        codec.decode_blob(encoded.header, len(encoded.header))
    with pytest.raises(codec.DecodeError, match="empty"):
        codec.decode_blob(b"", 0)


@pytest.mark.parametrize(
    ("out", "message"),
    [
        (torch.zeros(16, dtype=torch.uint8), "holds 16 bytes, needs at least"),
        (torch.zeros(256, dtype=torch.int8), "1-D uint8 CPU tensor"),
        (torch.zeros(2, 256, dtype=torch.uint8), "1-D uint8 CPU tensor"),
        (torch.zeros(512, dtype=torch.uint8)[::2], "contiguous"),
        (torch.zeros(512, dtype=torch.uint8)[8:], "storage offset 8"),
    ],
)
def test_write_payload_checks_its_buffer(out: torch.Tensor, message: str) -> None:
    encoded = codec.encode([torch.ones(4).t(), b"x" * 30])
    with pytest.raises(ValueError, match=message):
        encoded.write_payload(out)
