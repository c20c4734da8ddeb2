"""Reused buffers (NOTE [ Reused buffers ] in protos/buffers.py), the pool on its own: a buffer
is handed out again only when nothing holds its storage, the pool stays bounded, and small
buffers are left to the allocator.

The tests that start a server, a process or Ray: tests/integration/test_buffers.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from remote_loader.protos.buffers import GRANULE, MIN_POOLED_BYTES, BufferPool

SIZE = 2 * MIN_POOLED_BYTES


def test_a_buffer_nothing_holds_is_handed_out_again() -> None:
    pool = BufferPool(keep=2)
    first = pool.empty(SIZE)
    address = first.data_ptr()
    assert first.numel() == SIZE and first.dtype == torch.uint8
    del first
    again = pool.empty(SIZE - 100)  # a batch a little smaller fits the same buffer
    assert again.data_ptr() == address and again.numel() == SIZE - 100
    assert (pool.made, pool.reused) == (1, 1)


@pytest.mark.parametrize(
    "hold",
    [
        lambda t: t,  # the tensor itself
        lambda t: t[10:20],  # a view of it
        lambda t: t.numpy(),  # a numpy array of it
        lambda t: t.view(torch.int32).reshape(4, -1)[1],  # a view of a view, another dtype
        lambda t: t.untyped_storage(),  # its storage
    ],
    ids=["tensor", "view", "numpy", "view-of-view", "storage"],
)
def test_a_buffer_something_holds_is_never_handed_out(hold: Any) -> None:
    pool = BufferPool(keep=4)
    t = pool.empty(SIZE)
    t.fill_(7)
    held = hold(t)
    address = t.data_ptr()
    del t
    other = pool.empty(SIZE)
    assert other.data_ptr() != address
    other.fill_(9)
    assert _bytes(held).eq(7).all()
    del held, other
    pool.empty(SIZE)  # both free now
    assert pool.reused == 1


def _bytes(held: Any) -> torch.Tensor:
    if isinstance(held, torch.UntypedStorage):
        return torch.tensor([], dtype=torch.uint8).set_(held)
    return torch.as_tensor(held).contiguous().view(torch.uint8)


def test_the_pool_remembers_at_most_keep_buffers() -> None:
    pool = BufferPool(keep=3)
    held = [pool.empty(SIZE) for _ in range(10)]  # a loop that keeps every batch
    assert len(pool) == 3 and pool.made == 10 and pool.reused == 0
    held.clear()
    for n in (SIZE, 3 * SIZE, SIZE):  # a larger batch replaces a free buffer too small for it
        pool.empty(n)
    assert len(pool) == 3
    assert pool.made == 11 and pool.reused == 2
    assert sorted(b.numel() for b, _ in pool._buffers) == [SIZE, SIZE, 3 * SIZE]


def test_small_buffers_are_left_to_the_allocator() -> None:
    pool = BufferPool(keep=2)
    small = pool.empty(MIN_POOLED_BYTES - 1)
    assert small.numel() == MIN_POOLED_BYTES - 1 and len(pool) == 0
    assert pool.empty(MIN_POOLED_BYTES + 1).untyped_storage().nbytes() == 3 * GRANULE


def test_empty_as_gives_a_contiguous_tensor_of_the_shape_and_dtype() -> None:
    pool = BufferPool(keep=1)
    out = pool.empty_as((4, 3, 100, 100), torch.float32)
    assert out.shape == (4, 3, 100, 100) and out.dtype == torch.float32 and out.is_contiguous()
    torch.stack([torch.ones(3, 100, 100)] * 4, 0, out=out)
    assert out.sum().item() == 4 * 3 * 100 * 100
