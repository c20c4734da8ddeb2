"""The server's view of its workers' shared-memory slots, shared by the pool backends.

A worker (a worker process, or the Ray pool's bridge) encodes each batch into one of its own
reusable shared-memory slots and names it in its Result; the first Result naming a new slot
carries the slot's tensor, which the server maps once. The server reads a slot until the
batch's last consumer is done with it, then hands the slot back with that worker's next Task.
Slots belong to one process (an incarnation): when it dies they are forgotten with it.

Bound: a worker reuses its free slots and drops those too small before making a new one, so the
slots of an incarnation are at most its tasks in flight plus the batches still being sent.
"""

from __future__ import annotations

import threading

from remote_loader.server.worker import Result


class SlotTable:
    """Slots by (incarnation, slot id), and those released per incarnation."""

    def __init__(self) -> None:
        self._views: dict[tuple[int, int], memoryview] = {}
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
            self._views[(result.incarnation, result.slot)] = result.new_buffer.numpy().data

    def view(self, incarnation: int, slot: int) -> memoryview | None:
        """The slot's bytes; None for a slot forgotten with its (replaced) process."""
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
