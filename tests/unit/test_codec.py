"""Tests for the batch codec: exact round trips of every supported value, alignment and zero
copy. What it refuses, on either end, is in tests/unit/test_codec_errors.py.
"""

import collections
import itertools
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from remote_loader.protos import codec, loader_pb2
from tests.helpers import assert_exact, roundtrip

ALL_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
# Quantized tensors carry a scale and zero point the header has no room for: encode refuses them.
QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
# Everything else, including float8, complex32, bits* and the sub-byte int1..uint7, round-trips.
SUPPORTED = [d for d in ALL_DTYPES if d not in QUANTIZED]

NUMPY_DTYPES = ["|b1", "|i1", "|u1", "<i2", ">i4", "<u4", ">u8", "<i8", "<f2", ">f4", "<f8", "<c8"]
NUMPY_DTYPES += [">c16"]


Point = collections.namedtuple("Point", ["x", "y"])


def leaf_ranges(header: bytes) -> list[tuple[int, int]]:
    """(offset, nbytes) of every tensor, array and bytes leaf in a header."""
    ranges = []
    stack = [loader_pb2.Node.FromString(header)]
    while stack:
        node = stack.pop()
        kind = node.WhichOneof("value")
        if kind in ("tensor", "ndarray", "bytes"):
            leaf = getattr(node, kind)
            ranges.append((leaf.offset, leaf.nbytes))
        elif kind in ("list", "tuple"):
            stack.extend(getattr(node, kind).items)
        elif kind == "dict":
            stack.extend(node.dict.keys)
            stack.extend(node.dict.values)
    return ranges


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A contiguous tensor of random bits, made without allocating in `dtype` (complex32 warns)."""
    numel = 1
    for dim in shape:
        numel *= dim
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).view(shape)


def make_tensor(dtype: torch.dtype, layout: str) -> torch.Tensor:
    if layout == "contiguous":
        return random_tensor(dtype, (3, 4))
    if layout == "transposed":
        return random_tensor(dtype, (4, 3)).t()
    if layout == "strided":
        return random_tensor(dtype, (4, 8))[1:, ::2]
    if layout == "expanded":
        return random_tensor(dtype, (3, 1)).expand(3, 4)
    if layout == "one-element":  # contiguous, yet stride 2 and an odd storage offset
        return random_tensor(dtype, (4,))[1::2][:1]
    if layout == "0-d":
        return random_tensor(dtype, ())
    if layout == "empty":
        return random_tensor(dtype, (0, 3))
    raise ValueError(layout)


LAYOUTS = ["contiguous", "transposed", "strided", "expanded", "one-element", "0-d", "empty"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", SUPPORTED, ids=str)
def test_every_torch_dtype_round_trips(dtype: torch.dtype, layout: str) -> None:
    t = make_tensor(dtype, layout)
    got = roundtrip({"t": t})["t"]
    assert_exact(got, t)
    assert got.is_contiguous()
    header = loader_pb2.Node.FromString(codec.encode(t).header)
    assert header.tensor.dtype == str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("dtype", sorted(QUANTIZED, key=str), ids=str)
def test_quantized_dtypes_are_refused(dtype: torch.dtype) -> None:
    with warnings.catch_warnings():  # torch deprecates quantized tensor creation
        warnings.simplefilter("ignore")
        t = torch.empty(3, dtype=dtype)
    with pytest.raises(codec.EncodeError, match=r"quantized .* at batch\['q'\].*dequantize"):
        codec.encode({"q": t})


def test_lazy_conjugate_and_negative_views_are_materialized() -> None:
    z = torch.tensor([1 + 2j, 3 - 4j, 5 + 0j])
    for t in (z.conj(), z.conj().unsqueeze(1).expand(3, 2), torch.tensor([1.0, -2.0])._neg_view()):
        assert_exact(roundtrip(t), t.resolve_conj().resolve_neg())


def test_requires_grad_is_detached() -> None:
    t = torch.arange(6.0).view(2, 3).requires_grad_()
    assert_exact(roundtrip([t, t.t()]), [t.detach(), t.detach().t()])


def make_array(dtype: str, layout: str) -> np.ndarray:
    dt = np.dtype(dtype)
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        size = int(np.prod(shape)) * dt.itemsize
        raw = rng.integers(0, 256, size, dtype=np.uint8)
        if dt.kind == "b":
            raw &= 1
        arr: np.ndarray = raw.view(dt).reshape(shape)
        return arr

    return {
        "contiguous": lambda: rand(3, 4),
        "fortran": lambda: np.asfortranarray(rand(3, 4)),
        "transposed": lambda: rand(4, 3).T,
        "strided": lambda: rand(4, 8)[1:, ::2],
        "0-d": lambda: rand(),
        "empty": lambda: rand(0, 3),
    }[layout]()


@pytest.mark.parametrize(
    "layout", ["contiguous", "fortran", "transposed", "strided", "0-d", "empty"]
)
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_arrays_round_trip(dtype: str, layout: str) -> None:
    a = make_array(dtype, layout)
    got = roundtrip((a,))[0]
    assert_exact(got, a)
    assert got.dtype.str == a.dtype.str  # byte order kept, not swapped


def test_documented_normalizations() -> None:
    batch = {
        "point": Point(1, torch.ones(2)),
        "ordered": collections.OrderedDict(a=1),
        "bytearray": bytearray(b"ab"),
        "memoryview": memoryview(b"cd"),
        "strided view": memoryview(bytes(range(10)))[::3],
        "np scalar": np.float32(1.5),
        np.int64(7): "numpy scalar key",
        "tuple key": {(1, ("a", None), 2.5, True): 0},
    }
    got = roundtrip(batch)
    assert type(got["point"]) is Point  # its class, importable here (NOTE [ Batch types ])
    assert type(got["ordered"]) is collections.OrderedDict
    assert got["bytearray"] == b"ab"
    assert got["memoryview"] == b"cd"
    assert got["strided view"] == bytes([0, 3, 6, 9])
    assert got["np scalar"].shape == () and got["np scalar"].dtype == np.float32
    assert type(next(k for k in got if not isinstance(k, str))) is int
    assert_exact(got["tuple key"], batch["tuple key"])


@pytest.mark.parametrize(
    ("header_nbytes", "offset"), [(0, 0), (1, 64), (63, 64), (64, 64), (65, 128)]
)
def test_payload_offset_rounds_up_to_align(header_nbytes: int, offset: int) -> None:
    assert codec.ALIGN == 64
    assert codec.payload_offset(header_nbytes) == offset


def test_payload_offset_rejects_negative_lengths() -> None:
    with pytest.raises(ValueError, match="header_nbytes"):
        codec.payload_offset(-1)


def test_leaves_are_aligned_and_disjoint() -> None:
    batch = [b"abc", torch.zeros(5, dtype=torch.int8), np.zeros(3, ">f8"), torch.ones(7), b""]
    encoded = codec.encode([*batch, torch.empty(0), torch.tensor(1.0, dtype=torch.float64)])
    ranges = sorted(leaf_ranges(encoded.header))
    assert all(offset % codec.ALIGN == 0 for offset, _ in ranges)
    for (offset, nbytes), (next_offset, _) in itertools.pairwise(ranges):
        assert offset + nbytes <= next_offset
    assert encoded.payload_nbytes == max(offset + nbytes for offset, nbytes in ranges)
    assert (
        encoded.total_nbytes == codec.payload_offset(len(encoded.header)) + encoded.payload_nbytes
    )


# --- property test over nested batches of every supported leaf --------------------------------


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(SUPPORTED))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    seed = draw(st.integers(0, 2**32 - 1))
    if layout == "transposed" and len(shape) >= 2:
        return random_tensor(dtype, shape[::-1], seed).permute(*reversed(range(len(shape))))
    if layout == "strided" and shape:
        return random_tensor(dtype, (*shape[:-1], shape[-1] * 2), seed)[..., ::2]
    return random_tensor(dtype, shape, seed)


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    arr: np.ndarray = draw(hnp.arrays(dtype, shape))
    if draw(st.booleans()) and arr.ndim:
        arr = arr.T if draw(st.booleans()) else arr[..., ::2]
    return arr


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),
    st.text(),
)
leaves = st.one_of(
    scalars,
    st.binary(),
    st.binary().map(bytearray),
    st.binary().map(lambda b: memoryview(b)),
    st.floats(width=32).map(np.float32),
    tensors(),
    arrays(),
)
keys = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text()),
    lambda inner: st.lists(inner, max_size=3).map(tuple),
    max_leaves=4,
).filter(lambda k: all(not isinstance(x, int) or -(2**63) <= x < 2**63 for x in _flatten(k)))


def _flatten(key: object) -> list[object]:
    return [y for x in key for y in _flatten(x)] if isinstance(key, tuple) else [key]


batches = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.builds(Point, inner, inner),
        st.dictionaries(keys, inner, max_size=4),
    ),
    max_leaves=12,
)


@settings(max_examples=100, deadline=None)
@given(batches)
def test_round_trip_property(batch: object) -> None:
    assert_exact(roundtrip(batch), batch)
    encoded = codec.encode(batch)
    assert all(offset % codec.ALIGN == 0 for offset, _ in leaf_ranges(encoded.header))
    assert_exact(codec.decode_blob(encoded.to_bytes(), len(encoded.header)), batch)


# --- zero copy --------------------------------------------------------------------------------


def test_decode_returns_views_into_the_payload() -> None:
    encoded = codec.encode({"t": torch.zeros(4), "a": np.zeros(4, np.int32), "b": b"\0"})
    blob = torch.zeros(encoded.total_nbytes, dtype=torch.uint8)
    encoded.write_blob(blob)
    got = codec.decode_blob(blob, len(encoded.header))
    blob[codec.payload_offset(len(encoded.header)) :].fill_(1)
    assert torch.equal(got["t"].view(torch.uint8), torch.ones(16, dtype=torch.uint8))
    assert (got["a"] == 0x01010101).all()
    assert got["b"] == b"\0"  # bytes are copied out
    got["t"].fill_(0)
    assert blob[codec.payload_offset(len(encoded.header)) :][:16].eq(0).all()


def test_decode_blob_of_a_writable_memoryview_is_zero_copy() -> None:
    encoded = codec.encode(torch.zeros(2))
    buf = bytearray(encoded.to_bytes())
    got = codec.decode_blob(memoryview(buf), len(encoded.header))
    buf[codec.payload_offset(len(encoded.header))] = 0xFF
    assert got.view(torch.uint8)[0] == 0xFF


def test_encode_references_leaves_until_written() -> None:
    t, a = torch.zeros(3), np.zeros(3)
    encoded = codec.encode([t, a])
    t.fill_(2.0)
    a.fill(3.0)
    assert_exact(codec.decode_blob(encoded.to_bytes(), len(encoded.header)), [t, a])


def test_to_bytes_is_the_written_blob() -> None:
    encoded = codec.encode({"x": torch.arange(10).t(), "y": [b"abc", 1, "s"]})
    blob = torch.zeros(encoded.total_nbytes, dtype=torch.uint8)
    encoded.write_blob(blob)
    assert encoded.to_bytes() == blob.numpy().tobytes()


@pytest.mark.gpu
def test_device_payload_gives_cuda_views() -> None:
    # `pytest -m gpu` only: without CUDA this fails (pin_memory raises) rather than skip.
    batch = {"t": torch.arange(12.0).view(3, 4).t(), "a": np.arange(3), "e": torch.empty(0, 2)}
    encoded = codec.encode(batch)
    blob = torch.zeros(encoded.total_nbytes, dtype=torch.uint8).pin_memory()
    encoded.write_blob(blob)
    payload = blob[codec.payload_offset(len(encoded.header)) :]
    device_payload = payload.to("cuda", non_blocking=True)
    got = codec.decode(encoded.header, payload, device_payload)
    assert got["t"].device.type == "cuda"
    assert got["t"].data_ptr() >= device_payload.data_ptr()
    assert_exact({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in got.items()}, batch)
