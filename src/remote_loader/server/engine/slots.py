"""The server's view of its workers' shared-memory slots, shared by the pool backends.

A worker (a worker process, or the Ray pool's bridge) encodes each batch into one of its own
reusable shared-memory slots and names it in its Result; the first Result naming a new slot
carries the slot's tensor, which the server maps once (and whose descriptor a same-host client
may open: NOTE [ Zero-copy slots ] in protos/slots.py). The server reads a slot until the
batch's last consumer is done with it, then hands the slot back with that worker's next Task.
Slots belong to one process (an incarnation): when it dies they are forgotten with it.

Bound: a worker reuses its free slots and drops those too small before making a new one, so the
slots of an incarnation are at most its tasks in flight plus the batches still being sent.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import torch

from remote_loader.protos import slots as slot_protocol
from remote_loader.server.batch.delivery import SlotRef
from remote_loader.server.batch.messages import Result


@dataclasses.dataclass(frozen=True)
class Slot:
    """A mapped slot (its whole file, generation header included) and the descriptor this
    process holds it open on (None when the shared tensor has none to give: its batches are
    then never offered zero-copy)."""

    view: memoryview
    fd: int | None
    inode: int
    size: int

    def blob(self, offset: int, nbytes: int) -> memoryview:
        """The batch's blob, `offset` bytes into the slot (its Result says where)."""
        if offset < slot_protocol.SLOT_HEADER or offset + nbytes > len(self.view):
            raise ValueError(f"a {nbytes}-byte blob at {offset} lies outside its slot")
        return self.view[offset : offset + nbytes]

    def ref(self, offset: int, generation: int) -> SlotRef | None:
        if self.fd is None:
            return None
        return SlotRef(self.fd, self.inode, self.size, offset, generation)


def _slot(buffer: torch.Tensor) -> Slot:
    view = buffer.numpy().data
    try:
        # torch's file_descriptor strategy keeps the descriptor it mapped the slot from, and
        # hands the same one back here (no new descriptor per call).
        fd, size = buffer.untyped_storage()._share_fd_cpu_()
        inode = os.fstat(fd).st_ino
    except (RuntimeError, OSError):
        return Slot(view, None, 0, len(view))
    return Slot(view, fd, inode, size)


class SlotTable:
    """Slots by (incarnation, slot id), and those released per incarnation."""

    def __init__(self) -> None:
        self._views: dict[tuple[int, int], Slot] = {}
        self._released: dict[int, list[int]] = {}
        # Guards _released: releases come from the stream threads that sent the batches.
        self._lock = threading.Lock()

    def open(self, incarnation: int) -> None:
        """A new process whose slots will be named by `incarnation`."""
        with self._lock:
            self._released[incarnation] = []

    def accept(self, result: Result) -> None:
        """Maps the slot a Result hands over (if new) and forgets the ones its worker dropped."""
        for slot in result.dropped:
            self._views.pop((result.incarnation, slot), None)
        if result.new_buffer is not None:
            self._views[(result.incarnation, result.slot)] = _slot(result.new_buffer)

    def view(self, incarnation: int, slot: int) -> Slot | None:
        """The slot; None for a slot forgotten with its (replaced) process."""
        return self._views.get((incarnation, slot))

    def release(self, incarnation: int, slot: int) -> None:
        """The server is done with the slot (any thread)."""
        with self._lock:
            released = self._released.get(incarnation)
            if released is not None:  # else that process is gone, and its slots with it
                released.append(slot)

    def take_released(self, incarnation: int) -> tuple[int, ...]:
        """The slots to hand back with the incarnation's next Task."""
        with self._lock:
            released = self._released.get(incarnation, [])
            ids = tuple(released)
            released.clear()
        return ids

    def forget(self, incarnation: int) -> None:
        """The process is gone. Entries still being sent keep their own views of its slots."""
        with self._lock:
            self._released.pop(incarnation, None)
        for key in [k for k in self._views if k[0] == incarnation]:
            del self._views[key]

    def clear(self) -> None:
        self._views.clear()
