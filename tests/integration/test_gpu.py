"""The CUDA path: pinned receive buffers, a side-stream copy, batches on the device.

Run where a GPU exists with `pytest -m gpu` (deselected by default; on a machine without CUDA
these fail rather than pass vacuously).
"""

from __future__ import annotations

import gc
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from remote_loader.client import RemoteLoader
from remote_loader.client.types import Transport
from remote_loader.server.config.spec import LoaderSpec
from tests.helpers import StartServer, assert_same, subprocess_env

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


def test_the_device_is_the_current_one_at_the_first_iter(start_server: StartServer) -> None:
    # NOTE [ The device at the first iter() ] in client/options.py: Lightning builds loaders
    # before it sets each rank's device; made then, a loader initializes no CUDA.
    address = start_server(MIXED)
    made = (
        "import torch\n"
        "from remote_loader.client import RemoteLoader\n"
        f"loader = RemoteLoader({address!r})\n"
        "print(loader.device, torch.cuda.is_initialized())\n"
        "batch = next(iter(loader))\n"
        "print(loader.device, batch['x'].device, torch.cuda.current_device())\n"
        "loader.close()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", made],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    before, after = done.stdout.splitlines()
    assert before == "cuda False"
    device, on, current = after.split()
    assert device == on == f"cuda:{current}"


@pytest.mark.parametrize(("transport", "way"), [("auto", "shm"), ("tcp", "tcp"), ("grpc", "grpc")])
def test_every_transport_lands_on_the_device_intact(
    start_server: StartServer, transport: Transport, way: str
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


def _empty_host_cache() -> None:
    """Returns every free pinned block to CUDA, so what the allocator holds next is live."""
    gc.collect()
    torch.cuda.synchronize()
    accelerator = getattr(torch, "accelerator", None)
    empty = getattr(accelerator, "empty_host_cache", None) or torch._C._host_emptyCache
    empty()


def _pinned_bytes() -> int:
    """Pinned host memory the caching allocator holds from CUDA (blocks in use or cached).

    It grows only when no cached block is free, so after `_empty_host_cache()` its growth is the
    most pinned memory live at once. Not `active_bytes`: in some torch releases (2.11 with CUDA
    13) it only ever grows, for a plain DataLoader(pin_memory=True) too.
    """
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


def test_the_pinned_memory_measure_sees_live_buffers_and_only_those() -> None:
    torch.cuda.init()
    _empty_host_cache()
    before = _pinned_bytes()
    held = [torch.empty(BATCH, dtype=torch.uint8, pin_memory=True) for _ in range(5)]
    assert _pinned_bytes() - before == 5 * PINNED_BLOCK
    del held
    _empty_host_cache()
    assert _pinned_bytes() == before


@pytest.mark.parametrize("transport", ["auto", "tcp", "grpc"])
@pytest.mark.parametrize("prefetch", [1, 3])
def test_pinned_memory_stays_within_the_prefetch_depth(
    start_server: StartServer, transport: Transport, prefetch: int
) -> None:
    """Pinned buffers live at once: at most `prefetch` queued batches, the one being received
    and the one the training loop holds, however slow the loop is."""
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
    _empty_host_cache()
    before = _pinned_bytes()
    with RemoteLoader(address, device="cuda", prefetch=prefetch, transport=transport) as loader:
        received = 0
        for batch in loader:
            time.sleep(0.02)  # a slow step: the receiver fills the queue and waits
            assert batch.is_cuda and batch.numel() == BATCH
            received += 1
        grown = _pinned_bytes() - before
        assert loader.last_transport == {"auto": "shm"}.get(transport, transport)
    assert received == 24
    assert 0 < grown <= (prefetch + 2) * PINNED_BLOCK, (grown, prefetch)
