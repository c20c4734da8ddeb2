"""A worker's memory for its batches: the shared-memory slots the server reads them from, and
where default_collate stacks them (a worker process's, or a Ray actor's and its bridge's).

NOTE [ Collating in process memory ]

In a DataLoader worker (get_worker_info() is set) torch stacks a batch straight into a new
shared-memory tensor, so that the main process can map it without a copy. Here a batch never
leaves its worker as a tensor: it is encoded into one of the worker's reused slots. A fresh
shared-memory file per batch would only add its creation, page faults and zeroing: 6 ms instead
of 0.4 ms for a 9.6 MB batch on the benchmark machine, more than half of a local DataLoader's
time per batch. So collate_tensors stacks, with torch's values, dtype, shape and errors (nested
and sparse tensors get torch's own), into an `out` tensor of the first sample's dtype as torch's
does: into the slot itself when it can (below), else into one of the worker's reused buffers
(NOTE [ Reused buffers ] in protos/buffers.py), since a fresh one costs its page faults again.

NOTE [ Collating into the slot ]

The one copy a worker must make is the stack: default_collate gathers the samples into one
tensor. Encoding it into the slot the server sends it from was a second pass over every byte
(0.5 ms of a 9.6 MB batch here). So from its second batch on a worker takes the slot before it
fetches, sized for a batch like its last one (an Arena: the slot past SLOT_HEADER and
HEADER_ROOM), and collate_tensors stacks each tensor there, at the next ALIGN boundary. The
encoder finds those tensors where the payload will lie (codec.Placed) and leaves them there;
the header goes right before the payload, so a blob starts anywhere from SLOT_HEADER on (its
offset travels in the Result, then in ShmSlot's offset), and the other leaves are copied after
the stacked ones. What does not fit is done as before: a tensor the arena cannot hold is
stacked into a reused buffer; a blob the slot cannot hold (a header longer than HEADER_ROOM, a
larger batch) is copied whole into another slot, and the one taken goes back unused. With
compression nothing is stacked in the slot: the compressed bytes are what it holds.

A collate_fn may keep what default_collate gave it (a cache): a slot whose memory anything in
the worker still views when its turn comes again is never written over; the worker forgets it
(the holder keeps the memory) and makes another, as BufferPool does.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.data._utils.collate as torch_collate

from remote_loader.protos import codec
from remote_loader.protos import slots as slot_protocol
from remote_loader.protos.buffers import BufferPool, storage_users

# Shared-memory slots grow in steps of this, so batches of slightly varying size reuse them.
SLOT_GRANULE = 1 << 20
# The room an arena leaves before the payload for the blob's header (a batch's header is a few
# hundred bytes; a longer one is copied whole into another slot).
HEADER_ROOM = 16 * 1024
# Buffers a worker keeps for tensors it stacks outside a slot: a batch's large ones, twice over.
COLLATE_BUFFERS = 8


@dataclasses.dataclass(frozen=True)
class Taken:
    """A slot taken for one batch, marked as being written until `WorkerSlots.written`."""

    slot: int
    buffer: torch.Tensor  # the whole slot, its generation header included
    generation: int  # the slot's generation once the batch is written

    def blob(self, nbytes: int, offset: int = slot_protocol.SLOT_HEADER) -> torch.Tensor:
        return self.buffer[offset : offset + nbytes]


class WorkerSlots:
    """A worker's shared-memory buffers; the server reads a slot until it releases it.

    Each slot starts with its generation word (protos/slots.py): odd while a batch is being
    written, then the even value the Result carries, so a same-host client reading the slot
    directly can tell a batch from a slot reused under it. The server learns of a new slot, and
    of those dropped, from the next Result that `announce`s them.
    """

    def __init__(self, *, read_here: bool = False) -> None:
        # `read_here`: this process is the server, which maps each slot for as long as it
        # lives (a COPY lane's slots, server/engine/ray/backend.py): a released slot is free
        # whatever else views it, and the check below for views left behind would drop every slot.
        self._read_here = read_here
        # Each slot with its count of users when only this table holds it (storage_users).
        self._buffers: dict[int, tuple[torch.Tensor, int]] = {}
        self._free: set[int] = set()
        self._next_id = 0
        self._unannounced: set[int] = set()
        self._dropped: list[int] = []
        self._expected: int | None = None  # the payload of the last batch placed

    def release(self, ids: tuple[int, ...]) -> None:
        self._free.update(i for i in ids if i in self._buffers)

    def take(self, nbytes: int) -> Taken:
        """A free slot for an nbytes blob at SLOT_HEADER, marked as being written."""
        need = slot_protocol.SLOT_HEADER + nbytes
        for i in [i for i in self._free if not self._idle(i)]:
            self._drop(i)  # something in this process still views it: NOTE above
        fitting = [i for i in self._free if self._buffers[i][0].numel() >= need]
        if fitting:
            slot = min(fitting, key=lambda i: self._buffers[i][0].numel())
            self._free.discard(slot)
        else:
            # Nothing fits: replace the free slots that are too small rather than keep them, so
            # the number of slots stays bounded by the tasks in flight.
            for i in list(self._free):
                self._drop(i)
            size = -(-need // SLOT_GRANULE) * SLOT_GRANULE
            buffer = torch.zeros(size, dtype=torch.uint8).share_memory_()
            slot = self._next_id
            self._next_id += 1
            self._buffers[slot] = (buffer, storage_users(buffer))
            self._unannounced.add(slot)
        buffer = self._buffers[slot][0]
        generation = slot_protocol.begin_write(buffer.numpy().data)
        return Taken(slot, buffer, generation)

    def view(self, slot: int) -> memoryview:
        """The whole slot (its generation word included), for a worker that sends the bytes
        itself (a COPY lane: NOTE [ Ray direct lane ] in server/engine/ray/lane.py)."""
        view: memoryview = self._buffers[slot][0].numpy().data
        return view

    def _idle(self, slot: int) -> bool:
        if self._read_here:
            return True
        buffer, alone = self._buffers[slot]
        return storage_users(buffer) <= alone

    def _drop(self, slot: int) -> None:
        del self._buffers[slot]
        self._free.discard(slot)
        if slot in self._unannounced:
            self._unannounced.discard(slot)  # the server never saw it
        else:
            self._dropped.append(slot)

    def written(self, taken: Taken) -> None:
        """The batch is whole in the slot."""
        slot_protocol.end_write(taken.buffer.numpy().data, taken.generation)

    def give_back(self, taken: Taken) -> None:
        """A slot taken for nothing (its batch failed, or went to another slot): free again."""
        self.written(taken)
        self._free.add(taken.slot)

    def announce(self, slot: int) -> tuple[torch.Tensor | None, tuple[int, ...]]:
        """For the Result that names `slot`: the slot's tensor if the server has not seen it,
        and the slots dropped since the last announcement."""
        new = None
        if slot in self._unannounced:
            self._unannounced.discard(slot)
            new = self._buffers[slot][0]
        dropped, self._dropped = tuple(self._dropped), []
        return new, dropped

    def arena(self) -> Arena | None:
        """A slot to stack the next batch into, sized like the last batch placed; None before
        the first (NOTE [ Collating into the slot ])."""
        if self._expected is None:
            return None
        return Arena(self.take(HEADER_ROOM + self._expected))

    def place(self, encoded: codec.Encoded, arena: Arena | None) -> tuple[Taken, int]:
        """Writes `encoded` into a slot: the arena's, when the blob fits around what was
        stacked there, else a slot of its own. Returns the slot and the blob's offset in it."""
        self._expected = encoded.payload_nbytes
        total = encoded.total_nbytes
        if arena is not None:
            offset = arena.blob_offset(encoded)
            if offset is not None:
                encoded.write_blob(arena.taken.blob(total, offset))
                self.written(arena.taken)
                return arena.taken, offset
        taken = self.take(total)
        encoded.write_blob(taken.blob(total))
        self.written(taken)
        if arena is not None:
            self.give_back(arena.taken)
        return taken, slot_protocol.SLOT_HEADER


class Arena:
    """The part of a taken slot that a batch's tensors are stacked into, in order, each at a
    multiple of codec.ALIGN from `start` (where the payload will begin)."""

    def __init__(self, taken: Taken) -> None:
        self.taken = taken
        self.start = slot_protocol.SLOT_HEADER + HEADER_ROOM
        self._region = taken.buffer[self.start :]
        self._used = 0

    @property
    def placed(self) -> codec.Placed:
        return codec.Placed(self._region.data_ptr(), self._region.numel())

    def empty_as(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A contiguous tensor of `shape` and `dtype` in the arena; None if it has no room."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        start = -(-self._used // codec.ALIGN) * codec.ALIGN
        if not nbytes or start + nbytes > self._region.numel():
            return None
        self._used = start + nbytes
        return self._region[start : start + nbytes].view(dtype).view(shape)

    def blob_offset(self, encoded: codec.Encoded) -> int | None:
        """Where `encoded`'s blob starts so that its payload begins at `start`; None when its
        header is longer than the room before `start` or its payload runs past the slot."""
        offset = self.start - codec.payload_offset(len(encoded.header))
        if offset < slot_protocol.SLOT_HEADER:
            return None
        if self.start + encoded.payload_nbytes > self.taken.buffer.numel():
            return None
        return offset


# --- default_collate's tensors ----------------------------------------------------------------

# This process's reused buffers (None outside a worker: inline loading stacks as torch does),
# and the arena of the batch being fetched, if any.
_collate_buffers: BufferPool | None = None
_arena: Arena | None = None


def collate_tensors(batch: Any, *, collate_fn_map: Any = None) -> torch.Tensor:
    """torch's `collate_tensor_fn`, stacking into the batch's slot or a reused buffer instead of
    new shared memory (NOTE [ Collating in process memory ])."""
    elem = batch[0]
    if elem.is_nested or elem.layout != torch.strided:
        # torch raises for nested and sparse tensors, and handles any other layout its way.
        theirs: torch.Tensor = torch_collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
        return theirs
    out = None
    if elem.device.type == "cpu":
        shape = (len(batch), *elem.shape)
        if _arena is not None:
            out = _arena.empty_as(shape, elem.dtype)
        if out is None and _collate_buffers is not None:
            out = _collate_buffers.empty_as(shape, elem.dtype)
    return torch.stack(batch, 0, out=out)


def use_collate_buffers() -> None:
    """Makes this process a worker's: collate_tensors for default_collate (and any collate_fn
    calling it, through torch's map, which is this process's own), into reused buffers."""
    global _collate_buffers
    _collate_buffers = BufferPool(COLLATE_BUFFERS)
    torch_collate.default_collate_fn_map[torch.Tensor] = collate_tensors


@contextlib.contextmanager
def stacking_into(arena: Arena | None) -> Iterator[None]:
    """While fetching one batch: collate_tensors stacks into `arena` first."""
    global _arena
    _arena = arena
    try:
        yield
    finally:
        _arena = None
