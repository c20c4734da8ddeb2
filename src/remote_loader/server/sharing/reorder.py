"""The reorder stage: results arrive in completion order and leave in task order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Reorderer(Generic[T]):
    """Buffers results by task id and releases them in task-id order, from `start` on.

    Assumes each task id is put once; a duplicate (or, in order, an id already released) is an
    error, since it would mean a batch is delivered twice. With `in_order=False` results are
    released as they are put, like torch's `in_order=False`.
    """

    def __init__(self, start: int = 0, *, in_order: bool = True) -> None:
        self.in_order = in_order
        self._buffer: dict[int, T] = {}
        self.next_id = start  # in order: always the smallest id not yet released

    def __len__(self) -> int:
        return len(self._buffer)

    def put(self, task_id: int, item: T) -> None:
        if task_id in self._buffer or (self.in_order and task_id < self.next_id):
            raise ValueError(f"task {task_id} was already received")
        self._buffer[task_id] = item

    def ready(self) -> Iterator[T]:
        """Pops the results that can be released now."""
        if not self.in_order:
            items = list(self._buffer.values())
            self._buffer.clear()
            yield from items
            return
        while self.next_id in self._buffer:
            item = self._buffer.pop(self.next_id)
            self.next_id += 1
            yield item
