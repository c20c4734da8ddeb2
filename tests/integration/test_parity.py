"""RemoteLoader yields what torch's DataLoader yields for the same dataset, options and seed.

The reference is `DataLoader(..., generator=torch.Generator().manual_seed(seed + epoch))`, the
convention of DistributedSampler; random augmentations inside __getitem__ included.

The unit tests (no server, no process, no Ray): tests/unit/test_parity.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from remote_loader.client import RemoteLoader
from remote_loader.server.api.server import Server
from remote_loader.server.api.settings import ServerSettings
from remote_loader.server.config.spec import LoaderSpec, resolve
from tests.helpers import CASES, SEED, ServeLoaders, _factory, assert_same, local_batches

WORKERS = (0, 1, 3)


def _spec(case: str, num_workers: int, **extra: Any) -> LoaderSpec:
    suffix = "".join(f"-{k}={v}" for k, v in sorted(extra.items()))
    return LoaderSpec(
        name=f"{case}-{num_workers}{suffix}", num_workers=num_workers, **{**CASES[case], **extra}
    )


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    specs = [_spec(case, n) for case in CASES for n in WORKERS]
    specs += [_spec("random-aug", 2, in_order=False), _spec("iterable", 3, in_order=False)]
    with Server(ServerSettings(address="127.0.0.1:0"), specs) as server:
        yield server.address
        server.stop(0)


@pytest.mark.parametrize("num_workers", WORKERS)
@pytest.mark.parametrize("case", CASES)
def test_same_batches_as_torch(address: str, case: str, num_workers: int) -> None:
    spec = _spec(case, num_workers)
    with RemoteLoader(address, spec.name, seed=SEED) as loader:
        loader.set_epoch(3)
        remote = list(loader)
    expected = local_batches(spec, SEED, 3)
    assert len(remote) == len(expected) > 0
    assert_same(remote, expected)


@pytest.mark.parametrize("case", ["random-aug", "iterable"])
def test_out_of_order_is_the_same_multiset(address: str, case: str) -> None:
    workers = 2 if case == "random-aug" else 3
    spec = _spec(case, workers, in_order=False)
    with RemoteLoader(address, spec.name, seed=SEED) as loader:
        remote = list(loader)

    def key(batch: Any) -> Any:
        return batch[0].tolist() if isinstance(batch, tuple | list) else batch.tolist()

    expected = local_batches(spec, SEED, 0)
    if case == "random-aug":
        # Which worker makes a batch, and so what its RNGs draw, depends on timing with
        # in_order = false (a task goes to a worker with room, as in torch): the same batches
        # of the same samples, each once, is what both promise.
        remote, expected = [b[0] for b in remote], [b[0] for b in expected]
    assert_same(sorted(remote, key=key), sorted(expected, key=key))


@pytest.mark.parametrize("case", ["map", "drop-last", "batch-sampler", "no-batching", "iterable"])
def test_len_matches_torch(address: str, case: str) -> None:
    spec = _spec(case, 0)
    dataset = resolve(spec.dataset)(**spec.dataset_kwargs)
    batch_sampler = _factory(spec.batch_sampler, dataset, None) if spec.batch_sampler else None
    local = DataLoader(
        dataset, batch_size=spec.batch_size, drop_last=spec.drop_last, batch_sampler=batch_sampler
    )
    with RemoteLoader(address, spec.name) as loader:
        if case == "iterable":  # no __len__: both refuse, with the same exception type
            with pytest.raises(TypeError):
                len(local)
            with pytest.raises(TypeError, match="no len"):
                len(loader)
        else:
            assert len(loader) == len(local) > 0


def test_epochs_follow_each_other_and_set_epoch(address: str) -> None:
    spec = _spec("map-shuffle", 1)
    with RemoteLoader(address, spec.name, seed=SEED) as loader:
        epochs = [list(loader) for _ in range(3)]
        loader.set_epoch(1)
        again = list(loader)
    for e, batches in enumerate(epochs):
        assert_same(batches, local_batches(spec, SEED, e))
    assert_same(again, epochs[1])
    orders = [torch.cat([b["index"] for b in batches]).tolist() for batches in epochs]
    assert orders[0] != orders[1] != orders[2]
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(50))


def test_workers_collate_into_process_memory(serve_loaders: ServeLoaders) -> None:
    # NOTE [ Collating in process memory ]: the same values as torch, without the shared-memory
    # file torch's collate makes per batch in a worker (the batch is encoded into a slot).
    spec = LoaderSpec(
        name="collate",
        dataset="tests.datasets:Sizes",
        dataset_kwargs={"sizes": [5] * 8},
        batch_size=4,
        num_workers=2,
        collate_fn="tests.datasets:sharing_collate",
    )
    with RemoteLoader(serve_loaders(spec).address) as loader:
        batches = list(loader)
    assert [b["shared"] for b in batches] == [False, False]
    expected = torch.stack([torch.full((5,), i, dtype=torch.uint8) for i in range(8)])
    assert_same(torch.cat([b["batch"] for b in batches]), expected)
