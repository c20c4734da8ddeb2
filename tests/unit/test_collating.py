"""Collating into the slot (NOTE [ Collating into the slot ] in server/worker/collating.py):
from its second batch a worker stacks default_collate's tensors where the server will read them, and
encoding leaves them there (codec.Placed); whatever does not fit is copied as before."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data._utils.collate as torch_collate
from torch.utils.data import default_collate

from remote_loader.protos import codec, encoding
from remote_loader.protos import slots as slot_protocol
from remote_loader.server.worker import collating
from remote_loader.server.worker.collating import HEADER_ROOM, WorkerSlots
from tests.helpers import assert_same

IMAGE = torch.arange(3 * 64 * 64, dtype=torch.int32).view(3, 64, 64)


def samples(n: int, size: int = 64) -> list[dict[str, Any]]:
    return [
        {"image": (IMAGE[:, :size, :size] + i).clone(), "label": i, "name": f"s{i}"}
        for i in range(n)
    ]


@pytest.fixture(autouse=True)
def worker_collate() -> Iterator[None]:
    """This process collates as a worker does, and as torch does again afterwards."""
    before = torch_collate.default_collate_fn_map[torch.Tensor]
    collating.use_collate_buffers()
    yield
    torch_collate.default_collate_fn_map[torch.Tensor] = before
    collating._collate_buffers = None


@dataclasses.dataclass
class Made:
    batch: Any  # decoded from the slot
    offset: int  # of the blob in its slot
    slot: int
    header: int  # bytes
    dropped: tuple[int, ...]  # announced with it


def make(slots: WorkerSlots, batch_samples: list[Any], collate: Any = default_collate) -> Made:
    """One task as worker._run_task does it. Its slot is released at once, as the server does
    after sending it."""
    arena = slots.arena()
    with collating.stacking_into(arena):
        batch = collate(batch_samples)
    encoded = codec.encode(batch, None, arena.placed if arena is not None else None)
    taken, offset = slots.place(encoded, arena)
    header, total = len(encoded.header), encoded.total_nbytes
    del batch, encoded, arena
    _, dropped = slots.announce(taken.slot)
    decoded = codec.decode_blob(taken.blob(total, offset).clone(), header)
    slots.release((taken.slot,))
    return Made(decoded, offset, taken.slot, header, dropped)


def test_from_the_second_batch_tensors_are_stacked_where_the_server_reads_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    copies: list[int] = []
    real = encoding._copy_tensor

    def counting(src: torch.Tensor, dst: torch.Tensor) -> None:
        copies.append(dst.numel())
        real(src, dst)

    monkeypatch.setattr(encoding, "_copy_tensor", counting)
    slots = WorkerSlots()
    first = make(slots, samples(8))
    assert first.offset == slot_protocol.SLOT_HEADER and len(copies) == 2  # no arena yet
    assert_same(first.batch, default_collate(samples(8)))
    for _ in range(5):
        copies.clear()
        made = make(slots, samples(8))
        assert_same(made.batch, default_collate(samples(8)))
        assert copies == [8 * 8], "the image was copied again"  # only the int64 labels
        # The header right before the payload, which starts past HEADER_ROOM.
        start = slot_protocol.SLOT_HEADER + HEADER_ROOM
        assert made.offset + codec.payload_offset(made.header) == start
    assert list(slots._buffers) == [0]  # one slot serves them all


def test_a_batch_larger_than_the_arena_goes_to_a_slot_of_its_own() -> None:
    slots = WorkerSlots()
    make(slots, samples(2, size=8))  # a tiny first batch sizes the next arena: one 1 MiB slot
    grown = samples(400)  # 400 images of 48 KiB
    made = make(slots, grown)
    assert_same(made.batch, default_collate(grown))
    assert made.offset == slot_protocol.SLOT_HEADER
    assert len(slots._buffers) == 2 and slots._free == {0, made.slot}  # arena's went back
    again = make(slots, grown)  # the next arena is sized for it
    assert_same(again.batch, default_collate(grown))
    assert again.offset > slot_protocol.SLOT_HEADER and again.slot == made.slot


def test_a_header_longer_than_the_room_is_copied_with_its_batch() -> None:
    slots = WorkerSlots()
    make(slots, samples(4))
    wide = [{f"key{k:05d}": torch.full((3,), k) for k in range(2000)} for _ in range(4)]
    for sample in wide:
        sample["image"] = IMAGE.clone()
    made = make(slots, wide)
    assert made.header > HEADER_ROOM and made.offset == slot_protocol.SLOT_HEADER
    assert_same(made.batch, default_collate(wide))


def test_a_failing_collate_gives_the_slot_back() -> None:
    slots = WorkerSlots()
    make(slots, samples(4))
    arena = slots.arena()
    assert arena is not None and not slots._free
    with pytest.raises(RuntimeError), collating.stacking_into(arena):
        default_collate([IMAGE, IMAGE[:2]])  # torch's own error: shapes differ
    slots.give_back(arena.taken)
    assert slot_protocol.generation(arena.taken.buffer.numpy().data) % 2 == 0  # not mid-write
    del arena
    made = make(slots, samples(4))
    assert made.offset > slot_protocol.SLOT_HEADER and list(slots._buffers) == [0]


def test_a_slot_something_still_views_is_never_reused() -> None:
    slots = WorkerSlots()
    make(slots, samples(4))
    kept: list[torch.Tensor] = []

    def keeping(batch: list[Any]) -> Any:
        out = default_collate(batch)
        kept.append(out["image"])  # stacked into the arena's slot
        return out

    held = make(slots, samples(4), keeping)
    before = kept[0].clone()
    zeros = [{**sample, "image": sample["image"] * 0} for sample in samples(4)]
    other = make(slots, zeros)
    assert other.slot != held.slot and torch.equal(kept[0], before)
    assert other.dropped == (held.slot,) and held.slot not in slots._buffers
    assert_same(other.batch, default_collate(zeros))


# --- codec.Placed ----------------------------------------------------------------------------


def test_placed_tensors_keep_their_offsets_and_the_rest_goes_after_them() -> None:
    region = torch.zeros(1 << 16, dtype=torch.uint8)
    placed = codec.Placed(region.data_ptr(), region.numel())
    a = region[128 : 128 + 400].view(torch.int32)  # in place, at 128
    b = torch.arange(10, dtype=torch.int64)  # elsewhere: copied
    c = region[4096 : 4096 + 64]  # in place, at 4096
    unaligned = region[8000 + 3 : 8000 + 3 + 16]  # not at a multiple of ALIGN: copied
    overlapping = region[128:192]  # overlaps a: copied
    strided = region[10000:10400:2]  # not contiguous: copied
    a.copy_(torch.arange(100, dtype=torch.int32))
    c.fill_(5)
    unaligned.fill_(7)
    strided.fill_(9)
    batch = {"a": a, "b": b, "c": c, "u": unaligned, "o": overlapping, "s": strided, "n": 3}
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    encoded = codec.encode(batch, placed=placed)
    offsets = [leaf.offset for leaf in encoded._leaves]  # in place first, then the rest
    assert offsets[:2] == [128, 4096]
    assert min(offsets[2:]) >= 4096 + 64 and len(offsets) == 6
    # Written where it was placed, the in-place bytes are left as they are.
    out = region[: encoded.payload_nbytes]
    encoded.write_payload(out)
    start = codec.payload_offset(len(encoded.header))
    blob = encoded.header.ljust(start, b"\0") + out.numpy().tobytes()
    assert_same(codec.decode_blob(blob, len(encoded.header)), expected)
    # Written anywhere else, every leaf is copied.
    assert_same(codec.decode_blob(encoded.to_bytes(), len(encoded.header)), expected)


def test_without_placed_the_layout_is_unchanged() -> None:
    batch = {"x": torch.ones(100), "y": np.zeros(7), "z": b"abc", "w": torch.arange(3)}
    encoded = codec.encode(batch)
    offsets = [leaf.offset for leaf in encoded._leaves]
    assert offsets == [0, 448, 512, 576]  # in order, each at the next multiple of ALIGN
