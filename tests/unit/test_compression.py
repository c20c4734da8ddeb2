"""Per-tensor compression (NOTE [ Compression ] in protos/compression.py) without a server: the
codec's leaves, the compressor turning itself off for data that does not shrink and keeping
what it learned across epochs, damaged leaves and unknown codecs refused.

The tests that start a server, a process or Ray: tests/integration/test_compression.py.
"""

from __future__ import annotations

from typing import Any, get_args

import numpy as np
import pytest
import torch

from remote_loader.client import RemoteLoader
from remote_loader.client.types import Compression
from remote_loader.protos import codec, compression


def batch() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {
        "mask": torch.zeros(64, 224, 224, dtype=torch.bool),  # compresses to almost nothing
        "noise": torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=gen),
        "ids": torch.arange(200_000, dtype=torch.int64).view(400, 500).t(),  # strided
        "half": torch.ones(70_000, dtype=torch.bfloat16),
        "cplx": torch.ones(10_000, dtype=torch.complex128).conj(),
        "array": np.zeros((300, 300), dtype=np.float32),
        "small": torch.zeros(10, dtype=torch.float32),
        "label": 3,
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return bool(a == b)


def leaves(encoded: codec.Encoded) -> dict[str, tuple[str, int]]:
    """Each named leaf's compression and payload bytes, read back from the header."""
    from remote_loader.protos import loader_pb2

    root = loader_pb2.Node.FromString(encoded.header)
    out = {}
    for key, value in zip(root.dict.keys, root.dict.values, strict=True):
        kind = value.WhichOneof("value")
        if kind in ("tensor", "ndarray"):
            msg = getattr(value, kind)
            out[key.str] = (msg.compression, msg.nbytes)
    return out


@pytest.mark.parametrize("name", compression.CODECS)
def test_compressed_leaves_decode_to_the_same_batch(name: str) -> None:
    original = batch()
    encoded = codec.encode(original, compression.Compressor(name))
    plain = codec.encode(original)
    assert encoded.total_nbytes < plain.total_nbytes / 2
    got = leaves(encoded)
    assert got["mask"][0] == name and got["ids"][0] == name and got["array"][0] == name
    assert got["noise"] == ("", 1 << 20)  # does not shrink: sent as it is
    assert got["small"] == ("", 40)  # below MIN_BYTES: not worth a codec
    assert same(codec.decode_blob(encoded.to_bytes(), len(encoded.header)), original)


def test_a_leaf_that_does_not_shrink_is_skipped_for_a_while_then_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compressor = compression.Compressor("lz4")
    calls: list[int] = []
    real = compressor._compress

    def counting(data: Any) -> bytes:
        calls.append(len(data))
        out: bytes = real(data)
        return out

    monkeypatch.setattr(compressor, "_compress", counting)
    noise = {"noise": torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)}
    for _ in range(compression.SKIP_BATCHES + 2):
        codec.encode(noise, compressor)
    # Tried on the first batch, skipped for SKIP_BATCHES, tried again on the next.
    assert len(calls) == 2


def test_a_damaged_compressed_leaf_is_a_decode_error() -> None:
    encoded = codec.encode(
        {"mask": torch.zeros(1 << 20, dtype=torch.uint8)}, compression.Compressor("lz4")
    )
    blob = memoryview(bytearray(encoded.to_bytes()))
    start = codec.payload_offset(len(encoded.header))
    blob[start : start + 16] = b"\xff" * 16
    with pytest.raises(codec.DecodeError, match="decompress"):
        codec.decode_blob(blob, len(encoded.header))


def test_the_compression_type_names_what_the_codecs_check_takes() -> None:
    # protos/modes.py's Literal, the type of RemoteLoader(compression=...), and the check.
    assert get_args(Compression) == ("none", *compression.CODECS)


def test_the_client_refuses_an_unknown_codec_with_the_choices() -> None:
    with pytest.raises(ValueError, match='"none", "lz4" or "zstd"'):
        RemoteLoader("127.0.0.1:1", compression="gzip")  # type: ignore[arg-type]


def test_a_worker_keeps_what_it_learned_across_epochs_of_the_same_codec() -> None:
    lz4 = compression.Compressor("lz4")
    assert compression.compressor_for("lz4", lz4) is lz4  # skipped leaves stay skipped
    zstd = compression.compressor_for("zstd", lz4)
    assert zstd is not None and zstd.name == "zstd"
    assert compression.compressor_for("", lz4) is None
