"""One dataset per loader, its epoch hooks, and fresh workers that start warm.

Every worker starts from the dataset the server built, once (NOTE [ One dataset per loader ]
in server/worker/dataset.py); each copy is told its epoch before the epoch's first sample, and an
IterDataPipe is seeded and sharded as torch's DataLoader does it (NOTE [ Epoch hooks ]); a new
worker finds the dataset's modules and the main module imported by the fork server (NOTE
[ Fork server preload ] in server/engine/forkserver.py). Compared with torch's DataLoader over the
same pipeline, batch for batch, where torch defines the answer.
"""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from remote_loader.client import RemoteLoader
from remote_loader.server.config.spec import LoaderSpec
from tests.datasets import EpochBatches, Squares, datapipe
from tests.helpers import ServeLoaders, subprocess_env

SEED = 11
# Not fork: this process runs gRPC threads (grpc/grpc#16001).
CONTEXT = "forkserver"


def _served(loader: RemoteLoader, epoch: int) -> list[Any]:
    loader.set_epoch(epoch)
    return list(loader)


def _ids(batches: list[Any], key: str = "id") -> list[list[int]]:
    return [batch[key].tolist() for batch in batches]


# --- one dataset per loader --------------------------------------------------------------


def test_an_unseeded_hf_shuffle_buffer_is_one_dataset_for_all_workers(
    serve_loaders: ServeLoaders,
) -> None:
    # The shuffle draws its seed when the factory builds the dataset: built once and shared,
    # every worker shuffles its shards alike and each id comes once an epoch; built by each
    # worker, ids were lost and doubled (48/32/64 distinct of 64). Each epoch is what a local
    # DataLoader over the same object gives once the user has called set_epoch.
    spec = LoaderSpec(
        name="hf",
        dataset="tests.library_datasets:hf_stream",  # 64 ids in 4 shards, a buffer of 8
        dataset_kwargs={"seed": None},
        batch_size=4,
        num_workers=2,
    )
    served = serve_loaders(spec)
    # A copy of the server's object, as torch's workers get one ("spawn", "forkserver").
    dataset = pickle.loads(pickle.dumps(served.hosts["hf"].dataset))
    with RemoteLoader(served.address, "hf", device="cpu") as loader:
        epochs = []
        for epoch in range(3):
            remote = _ids(_served(loader, epoch))
            ids = [i for batch in remote for i in batch]
            assert sorted(ids) == list(range(64)), f"epoch {epoch}: {Counter(ids)}"
            dataset.set_epoch(epoch)
            local = DataLoader(
                dataset, batch_size=4, num_workers=2, multiprocessing_context=CONTEXT
            )
            assert remote == _ids(list(local)), f"epoch {epoch}"
            epochs.append(remote)
    assert epochs[0] != epochs[1] != epochs[2]


@pytest.mark.parametrize("persistent", [False, True])
def test_every_worker_starts_from_the_servers_dataset(
    serve_loaders: ServeLoaders, persistent: bool
) -> None:
    spec = LoaderSpec(
        name="drawn",
        dataset="tests.datasets:DrawnWhenBuilt",
        batch_size=3,
        num_workers=2,
        persistent_workers=persistent,
    )
    served = serve_loaders(spec)
    order = served.hosts["drawn"].dataset.order.tolist()  # drawn once, in the server
    with RemoteLoader(served.address, "drawn", device="cpu") as loader:
        for epoch in range(2):
            batches = _served(loader, epoch)
            indices = [i for batch in _ids(batches, "index") for i in batch]
            assert indices == list(range(24))
            assert [d for batch in _ids(batches, "drawn") for d in batch] == order
            assert {w for batch in _ids(batches, "worker") for w in batch} == {0, 1}


def test_an_unpicklable_dataset_is_built_by_each_worker_with_one_warning_to_trainers_too(
    serve_loaders: ServeLoaders, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="remote_loader.server.worker.dataset")
    spec = LoaderSpec(
        name="locked",
        dataset="tests.datasets:DrawnWhenBuilt",
        dataset_kwargs={"lock": True},
        batch_size=3,
        num_workers=2,
    )
    served = serve_loaders(spec)
    (warning,) = [r.getMessage() for r in caplog.records if "cannot be pickled" in r.getMessage()]
    assert "'locked'" in warning and "TypeError" in warning and "lock" in warning
    assert "differs between workers" in warning
    order = served.hosts["locked"].dataset.order.tolist()
    # The trainer is told too, at iter(), as torch's own warnings are.
    with (
        RemoteLoader(served.address, "locked", device="cpu") as loader,
        pytest.warns(UserWarning, match=r"'locked' \(DrawnWhenBuilt\) cannot be pickled"),
    ):
        batches = list(loader)
    assert [i for batch in _ids(batches, "index") for i in batch] == list(range(24))
    # Each worker drew its own permutation (24! of them: not the server's, but by a fluke).
    assert [d for batch in _ids(batches, "drawn") for d in batch] != order


# --- epoch hooks ---------------------------------------------------------------------------


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_set_epoch_gets_the_epoch_the_stream_asked_for(
    serve_loaders: ServeLoaders, workers: int, persistent: bool
) -> None:
    # The client's epoch, not the pool's count of epochs: 5 after 0, then 1.
    spec = LoaderSpec(
        name="epochs",
        dataset="tests.datasets:DrawnWhenBuilt",
        batch_size=6,
        num_workers=workers,
        persistent_workers=persistent,
    )
    with RemoteLoader(serve_loaders(spec).address, "epochs", device="cpu") as loader:
        for epoch in (0, 5, 1):
            seen = {e for batch in _ids(_served(loader, epoch), "epoch") for e in batch}
            assert seen == {epoch}


def test_a_batch_samplers_set_epoch_is_called_as_a_trainer_calls_it(
    serve_loaders: ServeLoaders,
) -> None:
    spec = LoaderSpec(
        name="batches",
        dataset="tests.datasets:Squares",
        dataset_kwargs={"n": 16},
        batch_sampler="tests.datasets:EpochBatches",
        num_workers=1,
    )
    dataset = Squares(16)
    with RemoteLoader(serve_loaders(spec).address, "batches", device="cpu") as loader:
        for epoch in (0, 2):
            batch_sampler = EpochBatches(dataset)
            batch_sampler.set_epoch(epoch)
            local = list(DataLoader(dataset, batch_sampler=batch_sampler))
            assert _ids(_served(loader, epoch), "index") == _ids(local, "index")


# --- IterDataPipe --------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_an_iterdatapipe_is_sharded_and_seeded_as_dataloader_does(
    serve_loaders: ServeLoaders, workers: int, shuffle: bool
) -> None:
    # sharding_filter: each sample once between the workers (not once per worker); a shuffle
    # seeded from the epoch's generator as torch seeds it.
    n = 20 if shuffle else 10
    spec = LoaderSpec(
        name="pipe",
        dataset="tests.datasets:datapipe",
        dataset_kwargs={"n": n, "shuffle": shuffle},
        batch_size=2,
        num_workers=workers,
    )
    with RemoteLoader(serve_loaders(spec).address, "pipe", seed=SEED, device="cpu") as loader:
        for epoch in range(2):
            remote = [b.tolist() for b in _served(loader, epoch)]
            local = DataLoader(
                datapipe(n, shuffle),
                batch_size=2,
                num_workers=workers,
                generator=torch.Generator().manual_seed(SEED + epoch),
                multiprocessing_context=CONTEXT if workers else None,
            )
            assert remote == [b.tolist() for b in local], f"epoch {epoch}"
            assert sorted(i for batch in remote for i in batch) == list(range(n))


# --- fresh workers start warm ---------------------------------------------------------------

SCRIPT = """
import os
import sys

MAIN_IMPORTED_BY = os.getpid()


def main():
    from remote_loader.server import LoaderSpec, Server, ServerSettings

    spec = LoaderSpec(
        name="where", dataset="tests.preloaded:WhereImported", batch_size=4, num_workers=2
    )
    with Server(ServerSettings(address="127.0.0.1:0"), [spec]) as server:
        print(server.port, flush=True)
        sys.stdin.read()  # until the test closes it


if __name__ == "__main__":
    main()
"""


@pytest.mark.timeout(180)
def test_new_workers_find_the_datasets_and_main_modules_imported(tmp_path: Path) -> None:
    # Without persistent_workers every epoch has new workers: each is forked from the fork
    # server, which imported the dataset's module and the script (main) once, before it forked
    # anything; no worker imports them again.
    script = tmp_path / "serve_where.py"
    script.write_text(SCRIPT)
    with subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=subprocess_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None and proc.stdin is not None
        try:
            port = int(proc.stdout.readline())
            with RemoteLoader(f"127.0.0.1:{port}", "where", device="cpu") as loader:
                rows = [row.tolist() for _ in range(2) for batch in loader for row in batch]
        finally:
            proc.stdin.close()  # the script's server stops
            proc.wait(timeout=60)
    assert len(rows) == 16
    workers = {pid for pid, _, _, _ in rows}
    assert len(workers) == 4  # two workers an epoch, new each epoch
    for pid, parent, module_by, main_by in rows:
        assert module_by == main_by == parent != pid  # the fork server imported both
