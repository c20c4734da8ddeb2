"""Reused buffers (NOTE [ Reused buffers ] in protos/buffers.py): a buffer is handed out again
only when nothing holds its storage, the pool stays bounded, and neither a training loop that
keeps its batches nor a collate_fn that keeps its output ever sees one written over."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from remote_loader.client import RemoteLoader
from remote_loader.client.types import Transport
from remote_loader.protos.buffers import GRANULE, MIN_POOLED_BYTES, BufferPool
from remote_loader.server.config.spec import LoaderSpec
from tests.helpers import ServeLoaders, assert_same, expected, sizes_spec

SIZE = 2 * MIN_POOLED_BYTES


@pytest.mark.unit
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
@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
def test_small_buffers_are_left_to_the_allocator() -> None:
    pool = BufferPool(keep=2)
    small = pool.empty(MIN_POOLED_BYTES - 1)
    assert small.numel() == MIN_POOLED_BYTES - 1 and len(pool) == 0
    assert pool.empty(MIN_POOLED_BYTES + 1).untyped_storage().nbytes() == 3 * GRANULE


@pytest.mark.unit
def test_empty_as_gives_a_contiguous_tensor_of_the_shape_and_dtype() -> None:
    pool = BufferPool(keep=1)
    out = pool.empty_as((4, 3, 100, 100), torch.float32)
    assert out.shape == (4, 3, 100, 100) and out.dtype == torch.float32 and out.is_contiguous()
    torch.stack([torch.ones(3, 100, 100)] * 4, 0, out=out)
    assert out.sum().item() == 4 * 3 * 100 * 100


# --- a real server ---------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["auto", "tcp", "grpc"])
def test_batches_the_loop_keeps_are_never_written_over(
    serve_loaders: ServeLoaders, transport: Transport
) -> None:
    sizes = [300_000, 500_000, 300_000] * 6
    served = serve_loaders(sizes_spec(sizes, num_workers=2))
    with RemoteLoader(served.address, transport=transport) as loader:
        kept = list(loader)  # every batch held to the end of the epoch
        assert_same(kept, expected(sizes))
        assert loader._buffers is not None and loader._buffers.reused == 0
        for batch, want in zip(loader, expected(sizes), strict=True):  # each dropped in turn
            assert torch.equal(batch, want)
        assert loader._buffers.reused >= len(sizes) // 2  # the second epoch reuses
        assert_same(kept, expected(sizes))  # the first epoch's batches, still intact


def test_a_collate_fn_that_keeps_its_batches_never_sees_them_written_over(
    serve_loaders: ServeLoaders,
) -> None:
    """Its first batch is stacked into a reused buffer, the others into their slots (NOTE
    [ Collating into the slot ] in server/worker/collating.py): neither is reused while kept."""
    spec = LoaderSpec(
        name="keeping",
        dataset="tests.datasets:Blobs",
        dataset_kwargs={"n": 24, "nbytes": MIN_POOLED_BYTES},
        batch_size=2,
        num_workers=1,
        collate_fn="tests.datasets:keeping_collate",
    )
    served = serve_loaders(spec)
    with RemoteLoader(served.address) as loader:
        batches = list(loader)
    assert len(batches) == 12
    for i, batch in enumerate(batches):
        first_bytes = torch.arange(2 * (i + 1), dtype=torch.uint8).view(i + 1, 2)
        assert torch.equal(batch["kept"], first_bytes), i
