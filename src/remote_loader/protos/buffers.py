"""Large host buffers kept and handed out again once nothing uses them.

NOTE [ Reused buffers ]

A process that makes a large tensor for every batch pays more for the memory than for the
bytes it puts there. glibc serves an allocation above its mmap threshold (128 KiB at first) with
mmap, and keeps doing so for a block as large as the last one freed (the dynamic threshold only
moves up to the freed size, and an equal request is not below it), so each batch of the same
shape is a fresh mapping, faulted in and zero-filled page by page when it is first written,
then unmapped when freed. Measured on the 2-core benchmark machine for 9.6 MB batches: a copy
into a fresh `torch.empty` costs 2.6-5 ms, into one already mapped 0.48 ms. Two places do that
once per batch: a client receiving a batch into host memory (client/assembly.py) and a worker
stacking a batch it cannot stack into its slot (server/worker/collating.py collate_tensors).

A BufferPool keeps the last few such buffers and hands one out again when nothing else holds
its storage: torch counts the users of a storage (every tensor viewing it, hence every numpy
array made from one) and Python the holders of its storage object, so a buffer whose batch the
training loop (or a collate_fn) still holds is never written over; it is just not free, and a
new one is made. The pool remembers at most `keep` buffers, forgetting the oldest it could not
reuse (whoever holds it keeps it alive; the allocator frees it later), so it adds at most `keep`
buffers to what the process holds anyway. Without torch's counter nothing is kept.

Pinned memory is not pooled: torch's pinned allocator already caches its blocks.
"""

from __future__ import annotations

import sys
import threading

import torch

# glibc's initial M_MMAP_THRESHOLD: smaller blocks come from the heap, which keeps them mapped.
MIN_POOLED_BYTES = 128 * 1024
# Buffers are made in whole granules, so batches that vary a little in size share them.
GRANULE = 64 * 1024


_use_count = getattr(torch._C, "_storage_Use_Count", None)
# Whether this torch counts a storage's users; without it nothing is reused.
COUNTED = _use_count is not None


def storage_users(t: torch.Tensor) -> int:
    """How many hold the storage of `t` (0 when torch cannot tell): torch's count of its users
    (tensors viewing it, and the storage object while one exists), plus the references to that
    storage object, which is one per storage (torch preserves it) and counts once in torch's
    count however many hold it."""
    if _use_count is None:
        return 0
    storage = t.untyped_storage()
    return int(_use_count(storage._cdata)) + sys.getrefcount(storage)


class BufferPool:
    """Up to `keep` reusable uint8 buffers of at least MIN_POOLED_BYTES (NOTE [ Reused buffers ]).
    Thread-safe."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        # The buffers, oldest first, each with its count of users when only the pool holds it.
        self._buffers: list[tuple[torch.Tensor, int]] = []
        self._lock = threading.Lock()
        self.made = 0  # buffers allocated
        self.reused = 0  # buffers handed out again

    def empty(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 CPU tensor of `nbytes` bytes, contents undefined: a view of a free pooled
        buffer, or of a new one."""
        if nbytes < MIN_POOLED_BYTES or not COUNTED:
            return torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            buffer = self._free(nbytes)
            if buffer is None:
                buffer = self._make(nbytes)
            else:
                self.reused += 1
            return buffer[:nbytes]

    def empty_as(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of `shape` and `dtype` on a buffer from `empty`."""
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self.empty(nbytes).view(dtype).view(shape)

    def _free(self, nbytes: int) -> torch.Tensor | None:
        best: torch.Tensor | None = None
        for buffer, alone in self._buffers:
            fits = buffer.numel() >= nbytes and (best is None or buffer.numel() < best.numel())
            if fits and storage_users(buffer) <= alone:
                best = buffer
        return best

    def _make(self, nbytes: int) -> torch.Tensor:
        if len(self._buffers) >= self.keep:
            # Forget a free buffer that was too small, else the oldest (still in use).
            free = [i for i, (b, alone) in enumerate(self._buffers) if storage_users(b) <= alone]
            del self._buffers[free[0] if free else 0]
        buffer = torch.empty(-(-nbytes // GRANULE) * GRANULE, dtype=torch.uint8)
        self._buffers.append((buffer, storage_users(buffer)))
        self.made += 1
        return buffer

    def __len__(self) -> int:
        return len(self._buffers)
