"""Batch types as torch's DataLoader keeps them (NOTE [ Batch types ] in protos/batch_types.py): a
namedtuple, a dataclass or a Mapping subclass comes back as its class where the client can import
it, else as a stand-in with a warning; headers without a type decode as before.

The tests that start a server, a process or Ray: tests/integration/test_codec_types.py.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import pytest
import torch
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence
from torch.utils.data import default_collate

from remote_loader.protos import codec, loader_pb2
from tests.helpers import assert_exact, packed, roundtrip
from tests.helpers import assert_same as assert_same_batches

# Type lookups and warnings as in a fresh process, so each test sees its own warnings.
pytestmark = pytest.mark.usefixtures("fresh_types")


Point = collections.namedtuple("Point", ["x", "y"])


class Sample(NamedTuple):
    image: torch.Tensor
    label: int


@dataclasses.dataclass
class Record:
    features: torch.Tensor
    count: int


@dataclasses.dataclass(frozen=True)
class Frozen:
    name: str
    values: torch.Tensor
    inner: Record | None = None


@dataclasses.dataclass
class Derived:
    size: int
    double: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.double = 2 * self.size


class ReadOnly(Mapping[str, Any]):
    """A Mapping that is no dict and has no update: rebuilt as ReadOnly(items)."""

    def __init__(self, items: dict[str, Any]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class NeedsArgs(dict[str, Any]):
    """A dict subclass whose constructor needs an argument: cannot be rebuilt as cls()."""

    def __init__(self, tag: str, **items: Any) -> None:
        super().__init__(**items)
        self.tag = tag


def header(obj: object) -> loader_pb2.Node:
    return loader_pb2.Node.FromString(codec.encode(obj).header)


def decode_node(node: loader_pb2.Node) -> Any:
    """Decode a header that has no leaves in the payload."""
    return codec.decode(node.SerializeToString(), torch.empty(0, dtype=torch.uint8))


def typed_tuple(type_name: str, fields: list[str], items: list[int]) -> loader_pb2.Node:
    nodes = [loader_pb2.Node(int=i) for i in items]
    return loader_pb2.Node(tuple=loader_pb2.Sequence(items=nodes, type=type_name, fields=fields))


# --- namedtuples ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch",
    [Point(torch.arange(3), 2.5), Sample(torch.ones(2, 2), 7)],
    ids=["collections.namedtuple", "typing.NamedTuple"],
)
def test_a_namedtuple_comes_back_as_its_class(batch: Any) -> None:
    got = roundtrip(batch)
    assert type(got) is type(batch)
    assert_exact(tuple(got), tuple(batch))
    seq = header(batch).tuple
    assert seq.type == f"tests.unit.test_codec_types:{type(batch).__qualname__}"
    assert list(seq.fields) == list(type(batch)._fields)


def test_nested_namedtuples_in_a_dict_in_a_list() -> None:
    batch = [{"p": Point(Sample(torch.zeros(1), 1), [Point(1, 2)]), "plain": (1, 2)}, 3]
    got = roundtrip(batch)
    assert type(got[0]["p"]) is Point
    assert type(got[0]["p"].x) is Sample
    assert type(got[0]["p"].y[0]) is Point
    assert type(got[0]["plain"]) is tuple
    assert_exact(got[0]["p"].x.image, torch.zeros(1))
    assert got[0]["p"].y == [Point(1, 2)]


def test_default_collate_of_namedtuple_samples_keeps_its_type() -> None:
    samples = [Sample(torch.full((2,), float(i)), i) for i in range(4)]
    batch = default_collate(samples)
    assert type(batch) is Sample  # torch keeps it: elem_type(*(collate(samples) ...))
    got = roundtrip(batch)
    assert type(got) is Sample
    assert_same_batches(got, batch)


def test_other_tuple_subclasses_stay_plain_tuples() -> None:
    values_indices = torch.max(torch.arange(6.0).view(2, 3), 1)  # a structseq, no _fields
    for batch in (torch.Size([2, 3]), values_indices):
        got = roundtrip(batch)
        assert type(got) is tuple
        assert header(batch).tuple.type == ""
    assert_exact(roundtrip(values_indices), tuple(values_indices))


# --- PackedSequence ---------------------------------------------------------------------------


@pytest.mark.parametrize("enforce_sorted", [True, False])
def test_a_packed_sequence_round_trips_and_unpacks(enforce_sorted: bool) -> None:
    sequence, padded, lengths = packed(enforce_sorted)
    got = roundtrip({"packed": sequence})["packed"]
    assert type(got) is PackedSequence
    for name in PackedSequence._fields:
        assert_same_batches(getattr(got, name), getattr(sequence, name), name)
    unpacked, got_lengths = pad_packed_sequence(got, batch_first=True)
    assert torch.equal(unpacked, padded)
    assert torch.equal(got_lengths, lengths)


def test_a_packed_sequence_decoded_onto_a_device_keeps_batch_sizes_on_the_cpu() -> None:
    # A copy of the payload stands for the device one: tensors are views of it, but batch_sizes
    # is decoded from the CPU payload, as PackedSequence.to(device) keeps it there.
    sequence, padded, _ = packed(enforce_sorted=False)
    encoded = codec.encode(sequence)
    blob = torch.frombuffer(bytearray(encoded.to_bytes()), dtype=torch.uint8)
    payload = blob[codec.payload_offset(len(encoded.header)) :]
    device_payload = payload.clone()
    got = codec.decode(encoded.header, payload, device_payload)
    assert type(got) is PackedSequence

    def in_device_payload(t: torch.Tensor) -> bool:
        start = device_payload.data_ptr()
        return start <= t.data_ptr() < start + device_payload.numel()

    assert got.sorted_indices is not None
    assert in_device_payload(got.data) and in_device_payload(got.sorted_indices)
    assert not in_device_payload(got.batch_sizes)
    assert got.batch_sizes.data_ptr() != payload.data_ptr()  # a copy, not a view of the payload
    assert torch.equal(got.batch_sizes, sequence.batch_sizes)
    assert torch.equal(pad_packed_sequence(got, batch_first=True)[0], padded)


# --- dataclasses and Mappings -----------------------------------------------------------------


def test_a_dataclass_with_a_tensor_and_an_int_comes_back_as_its_class() -> None:
    batch = Record(torch.arange(6.0).view(2, 3), 4)
    got = roundtrip([batch])[0]
    assert type(got) is Record
    assert_exact(got.features, batch.features)
    assert got.count == 4
    mapping = header(batch).dict
    assert mapping.type == "tests.unit.test_codec_types:Record"
    assert [key.str for key in mapping.keys] == ["features", "count"]


def test_a_frozen_dataclass_nesting_another_comes_back_as_its_class() -> None:
    batch = Frozen("a", torch.ones(2), Record(torch.zeros(1), 1))
    got = roundtrip(batch)
    assert type(got) is Frozen and type(got.inner) is Record
    assert got.name == "a" and got.inner.count == 1
    assert_exact(got.values, batch.values)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.name = "b"  # type: ignore[misc]


def test_a_dataclass_with_an_init_false_field_is_refused() -> None:
    with pytest.raises(codec.EncodeError, match=r"Derived at batch\['d'\]: its field 'double'"):
        codec.encode({"d": Derived(3)})


def test_mapping_subclasses_come_back_as_their_class() -> None:
    ordered = collections.OrderedDict([("b", torch.ones(1)), ("a", 2)])
    counts = collections.defaultdict(list, {"x": [1]})
    got = roundtrip({"ordered": ordered, "counts": counts, "read-only": ReadOnly({"k": 1})})
    assert type(got["ordered"]) is collections.OrderedDict
    assert list(got["ordered"]) == ["b", "a"]
    # Rebuilt from its items alone: a defaultdict's default_factory is code and is not sent.
    assert type(got["counts"]) is collections.defaultdict
    assert got["counts"].default_factory is None and got["counts"] == {"x": [1]}
    assert type(got["read-only"]) is ReadOnly and dict(got["read-only"]) == {"k": 1}
    assert header({"d": 1}).dict.type == ""


def test_a_mapping_that_cannot_be_made_empty_arrives_as_a_dict() -> None:
    with pytest.warns(UserWarning, match=r"NeedsArgs.*raised TypeError.*arrive as a dict"):
        got = roundtrip(NeedsArgs("tag", a=1))
    assert type(got) is dict and got == {"a": 1}


# --- fallbacks --------------------------------------------------------------------------------


def local_namedtuples() -> dict[str, tuple[Any, str]]:
    class Local(NamedTuple):
        a: int
        b: torch.Tensor

    # collections.namedtuple gives its class the qualname "Local" alone: the lookup finds none.
    return {
        "typing.NamedTuple": (Local, r"Local'.*inside a function \(<locals>\)"),
        "collections.namedtuple": (
            collections.namedtuple("Local", ["a", "b"]),
            r"Local'.*tests.unit.test_codec_types has no Local here",
        ),
    }


@pytest.mark.parametrize("kind", ["typing.NamedTuple", "collections.namedtuple"])
def test_a_namedtuple_defined_in_a_function_arrives_as_a_stand_in(kind: str) -> None:
    cls, why = local_namedtuples()[kind]
    with pytest.warns(UserWarning, match=rf"{why}.*arrive as a namedtuple Local"):
        got = roundtrip(cls(1, torch.ones(2)))
    assert type(got) is not cls and type(got).__name__ == "Local"
    assert got._fields == ("a", "b") and got.a == 1
    assert_exact(got.b, torch.ones(2))


@pytest.mark.parametrize(
    ("module", "why"),
    [
        ("__main__", r"server's __main__ script"),
        ("server_only_batches", r"cannot be imported here.*server_only_batches"),
    ],
)
def test_a_namedtuple_the_client_cannot_import_arrives_as_a_stand_in(module: str, why: str) -> None:
    Remote = collections.namedtuple("Remote", ["a"], module=module)
    message = rf"'{module}:Remote'.*{why}.*make the module that defines it importable"
    with pytest.warns(UserWarning, match=message):
        got = roundtrip([Remote(1), Remote(2)])
    assert got == [(1,), (2,)]
    assert type(got[0]) is type(got[1])  # one stand-in per type and fields
    assert type(got[0]).__name__ == "Remote" and got[1].a == 2


def test_a_class_with_other_fields_here_arrives_as_a_stand_in() -> None:
    node = typed_tuple("tests.unit.test_codec_types:Point", ["x", "z"], [1, 2])
    with pytest.warns(UserWarning, match=r"not a namedtuple with the server's fields"):
        got = decode_node(node)
    assert type(got) is not Point and got._fields == ("x", "z") and got == (1, 2)


def test_a_name_that_is_no_class_is_never_called(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    monkeypatch.setattr(os, "system", lambda *args: calls.append(args))
    with pytest.warns(UserWarning, match=r"os.system is not a class here"):
        got = decode_node(typed_tuple("os:system", ["command"], [1]))
    assert got == (1,) and calls == []


def test_a_dataclass_the_client_cannot_import_arrives_as_a_dict() -> None:
    @dataclasses.dataclass
    class Local:
        features: torch.Tensor
        count: int

    with pytest.warns(UserWarning, match=r"Local'.*inside a function.*arrive as a dict"):
        got = roundtrip(Local(torch.ones(2), 3))
    assert type(got) is dict and list(got) == ["features", "count"] and got["count"] == 3


def test_each_type_warns_once_and_is_looked_up_once(monkeypatch: pytest.MonkeyPatch) -> None:
    imported: list[str] = []
    real_import = importlib.import_module

    def counting(name: str, package: str | None = None) -> Any:
        imported.append(name)
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", counting)
    Remote = collections.namedtuple("Remote", ["a"], module="server_only_batches")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            roundtrip([Remote(1), Point(1, 2), Remote(2)])
    assert len(caught) == 1 and "'server_only_batches:Remote'" in str(caught[0].message)
    assert sorted(imported) == ["server_only_batches", "tests.unit.test_codec_types"]


# --- wire compatibility -----------------------------------------------------------------------


def strip_types(node: loader_pb2.Node) -> None:
    """What a decoder that predates the type fields reads of a header: it ignores them."""
    kind = node.WhichOneof("value")
    if kind in ("list", "tuple"):
        seq = getattr(node, kind)
        seq.ClearField("type")
        seq.ClearField("fields")
        for item in seq.items:
            strip_types(item)
    elif kind == "dict":
        node.dict.ClearField("type")
        for value in node.dict.values:
            strip_types(value)


def test_headers_without_types_decode_as_plain_tuples_and_dicts() -> None:
    batch = {"p": Point(torch.ones(2), [Sample(torch.zeros(1), 3)]), "r": Record(torch.ones(1), 2)}
    encoded = codec.encode(batch)
    node = loader_pb2.Node.FromString(encoded.header)
    strip_types(node)
    old_header = node.SerializeToString()
    payload = torch.frombuffer(bytearray(encoded.to_bytes()), dtype=torch.uint8)[
        codec.payload_offset(len(encoded.header)) :
    ]
    got = codec.decode(old_header, payload.clone())
    expected = {
        "p": (torch.ones(2), [(torch.zeros(1), 3)]),
        "r": {"features": torch.ones(1), "count": 2},
    }
    assert_exact(got, expected)
    assert decode_node(typed_tuple("", [], [1, 2])) == (1, 2)


# --- what stays refused -----------------------------------------------------------------------


def test_a_namedtuple_header_with_fewer_fields_than_items_is_refused() -> None:
    with pytest.raises(
        codec.DecodeError, match=r"'tests.unit.test_codec_types:Point' has 1 fields"
    ):
        decode_node(typed_tuple("tests.unit.test_codec_types:Point", ["x"], [1, 2]))


class Custom:
    pass


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ({"c": Custom()}, r"tests.unit.test_codec_types.Custom at batch\['c'\]"),
        ([Record], r"type at batch\[0\]"),  # a dataclass itself, not an instance
    ],
    ids=["custom object", "dataclass type"],
)
def test_other_objects_are_refused_saying_what_is_supported(batch: object, message: str) -> None:
    with pytest.raises(codec.EncodeError, match=message) as info:
        codec.encode(batch)
    assert "namedtuple, dataclass instance or Mapping" in str(info.value)
    assert "collate_fn" in str(info.value)
