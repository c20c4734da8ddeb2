"""Client-side behaviour that needs no GPU: arguments, CPU fallback, closing, timeouts.

The unit tests (no server, no process, no Ray): tests/unit/test_client.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from remote_loader.client import LoaderTimeoutError, RemoteLoader, RemoteLoaderError
from remote_loader.client.types import Transport
from remote_loader.server.config.spec import LoaderSpec
from tests.helpers import SQUARES, StartServer


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback where CUDA is absent")
def test_cpu_fallback(start_server: StartServer) -> None:
    address = start_server(SQUARES)
    with pytest.raises(RemoteLoaderError, match="CUDA is not available"):
        RemoteLoader(address, device="cuda")
    with RemoteLoader(address, pin_memory=True) as loader:
        assert loader.device == torch.device("cpu") and not loader.pin_memory
        batch = next(iter(loader))
        assert batch["x"].device.type == "cpu" and not batch["x"].is_pinned()


def test_the_arguments_are_read_only_and_resolved_once(start_server: StartServer) -> None:
    address = start_server(SQUARES)
    with RemoteLoader(address, device="cpu", job="", compression="none", token="s3cret") as loader:
        options = loader.options  # client/options.py LoaderOptions: made once, frozen
        assert (loader.address, loader.job, loader.compression) == (address, "default", "")
        assert loader.device == options.device == torch.device("cpu")
        assert loader.sharing == "partition" and loader.transport == "auto" and loader.tls is None
        assert "s3cret" not in repr(options)
        for name in ("address", "sharing", "job", "device", "transport", "compression", "seed"):
            with pytest.raises(AttributeError):
                setattr(loader, name, None)


def test_close_and_context_manager(start_server: StartServer) -> None:
    address = start_server(SQUARES)
    loader = RemoteLoader(address)
    it = iter(loader)
    next(it)
    loader.close()
    loader.close()  # idempotent
    with pytest.raises(StopIteration):
        next(it)
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)
    assert "closed" in repr(loader)


def test_new_iter_replaces_the_running_stream(start_server: StartServer) -> None:
    address = start_server(SQUARES)
    with RemoteLoader(address) as loader:
        first = iter(loader)
        next(first)
        second = iter(loader)  # epoch 1, like a DataLoader's single iterator
        assert second.epoch == 1
        assert len(list(second)) == 13
        with pytest.raises(StopIteration):
            next(first)


def test_timeout_names_the_batch_and_is_torchs_runtime_error(start_server: StartServer) -> None:
    spec = LoaderSpec(
        name="slow", dataset="tests.datasets:Slow", batch_size=1, dataset_kwargs={"seconds": 2.0}
    )
    address = start_server(spec)
    with (
        RemoteLoader(address, timeout=0.3) as loader,
        pytest.raises(
            LoaderTimeoutError, match=r"timed out after 0\.3 seconds waiting for batch 0 of epoch 0"
        ) as raised,
    ):
        next(iter(loader))
    # torch raises RuntimeError("DataLoader timed out after ..."): `except RuntimeError` works.
    assert isinstance(raised.value, RuntimeError) and isinstance(raised.value, TimeoutError)


@pytest.mark.parametrize("transport", ["auto", "tcp", "grpc"])
@pytest.mark.parametrize("prefetch", [1, 3])
def test_receive_buffers_stay_within_the_prefetch_depth(
    start_server: StartServer, transport: Transport, prefetch: int
) -> None:
    """Every batch lands in a receive buffer (pinned where there is CUDA:
    tests/integration/test_gpu.py checks the pinned allocator there; on the CPU a reused one, NOTE
    [ Reused buffers ]); however slow the loop, no more are in use at once than the queue
    (`prefetch`), the one the receiver fills or holds, and the loop's batches (on the CPU the
    loop's batch *is* its buffer: the one it holds and the one it just dropped), so no more are
    ever made."""
    address = start_server(
        LoaderSpec(
            name="sizes",
            dataset="tests.datasets:Sizes",
            dataset_kwargs={"sizes": [1_000_000] * 24},
            batch_size=None,
            num_workers=2,
        )
    )
    with RemoteLoader(address, device="cpu", prefetch=prefetch, transport=transport) as loader:
        received = 0
        for batch in loader:
            time.sleep(0.02)  # a slow step: the receiver fills the queue and waits for room
            assert batch.numel() == 1_000_000
            received += 1
        buffers = loader._buffers
    assert received == 24 and buffers is not None
    assert buffers.made + buffers.reused == 24
    assert buffers.made <= prefetch + 3, (buffers.made, prefetch)
