"""The CUDA path: pinned receive buffers, a side-stream copy, batches on the device.

Run where a GPU exists with `pytest -m gpu` (deselected by default; on a machine without CUDA
these fail rather than pass vacuously).
"""

from __future__ import annotations

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
