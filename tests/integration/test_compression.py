"""Per-tensor compression (NOTE [ Compression ] in protos/compression.py) on real servers whose
workers compress what a stream asks for.

The unit tests (no server, no process, no Ray): tests/unit/test_compression.py.
"""

from __future__ import annotations

import pytest
import torch

from remote_loader.client import RemoteLoader
from remote_loader.client.types import Compression, Transport
from remote_loader.protos import compression
from remote_loader.server.config.spec import LoaderSpec
from tests.helpers import ServeLoaders, assert_same

# --- over a real server ------------------------------------------------------------------------


def masks_spec(num_workers: int) -> LoaderSpec:
    return LoaderSpec(
        name="masks",
        dataset="tests.datasets:Sizes",
        dataset_kwargs={"sizes": [200_000] * 16},
        batch_size=4,
        num_workers=num_workers,
    )


def expected() -> list[torch.Tensor]:
    return [
        torch.stack([torch.full((200_000,), i % 256, dtype=torch.uint8) for i in range(b, b + 4)])
        for b in range(0, 16, 4)
    ]


@pytest.mark.parametrize(("name", "num_workers"), [("lz4", 2), ("zstd", 0)])
@pytest.mark.parametrize("transport", ["grpc", "tcp", "auto"])
def test_workers_compress_what_the_stream_asks_for(
    serve_loaders: ServeLoaders,
    monkeypatch: pytest.MonkeyPatch,
    name: Compression,
    num_workers: int,
    transport: Transport,
) -> None:
    decompressed: list[int] = []
    real = compression.decompress

    def counting(codec_name: str, data: memoryview, raw_nbytes: int) -> bytearray:
        assert codec_name == name
        decompressed.append(raw_nbytes)
        return real(codec_name, data, raw_nbytes)

    monkeypatch.setattr(compression, "decompress", counting)
    served = serve_loaders(masks_spec(num_workers))
    with RemoteLoader(served.address, device="cpu", transport=transport, compression=name) as ld:
        assert_same(list(ld), expected())
    assert decompressed == [800_000] * 4  # every batch arrived compressed
    with RemoteLoader(served.address, device="cpu", transport=transport) as loader:
        assert_same(list(loader), expected())
    assert len(decompressed) == 4  # and without asking, none
