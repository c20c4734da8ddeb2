"""Reused buffers (NOTE [ Reused buffers ] in protos/buffers.py): a buffer is handed out again
only when nothing holds its storage, the pool stays bounded, and neither a training loop that
keeps its batches nor a collate_fn that keeps its output ever sees one written over.

The unit tests (no server, no process, no Ray): tests/unit/test_buffers.py.
"""

from __future__ import annotations

import pytest
import torch

from remote_loader.client import RemoteLoader
from remote_loader.client.types import Transport
from remote_loader.protos.buffers import MIN_POOLED_BYTES
from remote_loader.server.config.spec import LoaderSpec
from tests.helpers import ServeLoaders, assert_same, expected, sizes_spec

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
