"""The CUDA path: pinned receive buffers, a side-stream copy, batches on the device.

Run where a GPU exists with `pytest -m gpu` (deselected by default; on a machine without CUDA
these fail rather than pass vacuously).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from remote_loader.client import RemoteLoader
from remote_loader.server.spec import LoaderSpec
from tests.conftest import StartServer, assert_same

pytestmark = pytest.mark.gpu

MIXED = LoaderSpec(
    name="mixed",
    dataset="tests.datasets:Squares",
    batch_size=5,
    shuffle=True,
    num_workers=1,
    collate_fn="tests.datasets:mixed_collate",
)


def test_batches_arrive_on_the_device_equal_to_the_cpu_path(start_server: StartServer) -> None:
    address = start_server(MIXED)
    with RemoteLoader(address, device="cuda") as gpu, RemoteLoader(address, device="cpu") as cpu:
        assert gpu.pin_memory and gpu.device.type == "cuda"
        pairs = list(zip(gpu, cpu, strict=True))
    for on_gpu, on_cpu in pairs:
        assert on_gpu["x"].device == torch.device("cuda", torch.cuda.current_device())
        assert on_gpu["mask"].device.type == "cuda" and on_gpu["mask"].dtype == torch.bool
        assert isinstance(on_gpu["array"], np.ndarray)  # numpy stays on the host, as in torch
        assert_same(on_gpu, on_cpu)


def test_default_device_is_the_current_cuda_device(start_server: StartServer) -> None:
    address = start_server(MIXED)
    with RemoteLoader(address) as loader:
        batch = next(iter(loader))
        # Work on the default stream sees the copy made on the side stream.
        total = (batch["x"] * 2).sum().item()
    assert batch["x"].is_cuda
    assert total == pytest.approx(2 * float(batch["x"].double().sum().item()))


@pytest.mark.parametrize(("transport", "way"), [("auto", "shm"), ("tcp", "tcp"), ("grpc", "grpc")])
def test_every_transport_lands_on_the_device_intact(
    start_server: StartServer, transport: str, way: str
) -> None:
    address = start_server(MIXED)
    with (
        RemoteLoader(address, device="cuda", transport=transport) as gpu,
        RemoteLoader(address, device="cpu", transport="grpc") as cpu,
    ):
        pairs = list(zip(gpu, cpu, strict=True))
        assert gpu.last_transport == way
    for on_gpu, on_cpu in pairs:
        assert on_gpu["x"].is_cuda
        assert_same(on_gpu, on_cpu)


BATCH = 4_000_000  # bytes of one batch's tensor; the pinned allocator rounds it up to 4 MiB
PINNED_BLOCK = 1 << 22


@pytest.mark.parametrize("transport", ["auto", "tcp", "grpc"])
@pytest.mark.parametrize("prefetch", [1, 3])
def test_pinned_memory_stays_within_the_prefetch_depth(
    start_server: StartServer, transport: str, prefetch: int
) -> None:
    """Pinned buffers checked out at once: at most `prefetch` queued batches, the one being
    received and the one the training loop holds, however slow the loop is."""
    address = start_server(
        LoaderSpec(
            name="sizes",
            dataset="tests.datasets:Sizes",
            dataset_kwargs={"sizes": [BATCH] * 24},
            batch_size=None,
            num_workers=2,
        )
    )
    torch.cuda.init()
    with RemoteLoader(address, device="cuda", prefetch=prefetch, transport=transport) as loader:
        it = iter(loader)
        next(it)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_host_memory_stats()
        received = 1
        for batch in it:
            time.sleep(0.02)  # a slow step: the receiver fills the queue and waits
            assert batch.is_cuda and batch.numel() == BATCH
            received += 1
        peak = torch.cuda.host_memory_stats()["active_bytes.peak"]
    assert received == 24
    assert 0 < peak <= (prefetch + 2) * PINNED_BLOCK, (peak, prefetch)
