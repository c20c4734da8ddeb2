"""A RemoteLoader in a trainer's place of a DataLoader (DESIGN.md, "Same data as DataLoader"),
each part against torch's own DataLoader where torch has one: the epoch is the one the user or
framework says, an iterator never read from uses none; the rank comes from the job, never a
silent 0; the attributes scripts read are there and true; a batch's exception is raised as its
own type with torch's message; torch's warnings are given in the trainer.

The unit tests (no server, no process, no Ray): tests/unit/test_dropin.py.
"""

from __future__ import annotations

import pickle
import socket
import warnings
from collections.abc import Iterable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    Sampler,
)

from remote_loader.client import DatasetError, LoaderBrokenError, RemoteLoader
from remote_loader.client.standins import ServerSideError
from remote_loader.server.config.spec import LoaderSpec
from tests import dropin_datasets
from tests.datasets import Squares
from tests.helpers import WORKER_0, ServeLoaders, StartServer

SEED = 7
N = 50
SHUFFLED = LoaderSpec(
    name="shuffled",
    dataset="tests.datasets:Squares",
    dataset_kwargs={"n": N},
    batch_size=4,
    shuffle=True,
    seed=SEED,
)


def _epoch_of_torch(epoch: int, batch_size: int = 4) -> list[list[int]]:
    """Epoch `epoch` of a local DataLoader over the same dataset and options, as the server
    seeds each epoch's generator (seed + epoch)."""
    generator = torch.Generator().manual_seed(SEED + epoch)
    local = DataLoader(Squares(N), batch_size=batch_size, shuffle=True, generator=generator)
    return [batch["index"].tolist() for batch in local]


def _share_of_torch(rank: int, epoch: int) -> list[list[int]]:
    """Rank `rank` of 2's batches of epoch `epoch` under torch's DistributedSampler, as the
    server partitions SHUFFLED."""
    sampler: DistributedSampler[int] = DistributedSampler(
        Squares(N), num_replicas=2, rank=rank, shuffle=True, seed=SEED
    )
    sampler.set_epoch(epoch)
    share = list(sampler)
    return [share[i : i + 4] for i in range(0, len(share), 4)]


def _indices(batches: Iterable[Any]) -> list[list[int]]:
    return [batch["index"].tolist() for batch in batches]


def _len(sized: Any) -> int:
    """len() of what torch types as maybe unsized (a DataLoader's sampler, dataset)."""
    return len(sized)


def test_iterators_never_read_use_no_epoch(start_server: StartServer) -> None:
    address = start_server(SHUFFLED)
    with RemoteLoader(address, device="cpu") as loader:
        # Lightning's probe: iter() on anything that is not a DataLoader, then dropped.
        probe = iter(loader)
        assert (probe.epoch, len(probe)) == (0, 13)
        del probe
        # A second iter() before the first was read from: the same epoch again.
        unread = iter(loader)
        it = iter(loader)
        with pytest.raises(StopIteration):  # one stream at a time: the older one is closed
            next(unread)
        assert loader.epoch == 0 and loader.state_dict()["epoch"] == 0
        assert _indices(it) == _epoch_of_torch(0)
        assert loader.epoch == 1
        assert _indices(loader) == _epoch_of_torch(1)


def test_set_epoch_reaches_an_iterator_made_before_it(start_server: StartServer) -> None:
    # Lightning's order on a resumed run: the iterator is made in setup_data, the epoch is set
    # through loader.sampler.set_epoch in on_advance_start, and only then is it read.
    address = start_server(SHUFFLED)
    with RemoteLoader(address, device="cpu") as loader:
        it = iter(loader)
        loader.sampler.set_epoch(3)
        assert it.epoch == 3
        assert _indices(it) == _epoch_of_torch(3)
        assert loader.epoch == 4
        # A peek reads a batch: it uses its epoch, and set_epoch still says the next one.
        peeked = next(iter(loader))
        assert peeked["index"].tolist() == _epoch_of_torch(4)[0]
        batch_sampler = loader.batch_sampler
        assert batch_sampler is not None
        batch_sampler.set_epoch(4)
        assert _indices(loader) == _epoch_of_torch(4)


def test_state_and_resume_are_exact_around_unread_iterators(start_server: StartServer) -> None:
    address = start_server(SHUFFLED)
    with RemoteLoader(address, device="cpu") as loader:
        loader.set_epoch(2)
        it = iter(loader)
        head = [next(it) for _ in range(5)]
        mid = loader.state_dict()
        iter(loader)  # a probe closes the running epoch and reads nothing
        assert loader.state_dict()["epoch"] == 3 and loader.state_dict()["batches"] == 0
    assert (mid["epoch"], mid["batches"]) == (2, 5)
    with RemoteLoader(address, device="cpu") as loader:
        loader.load_state_dict(mid)
        probe = iter(loader)
        assert (probe.epoch, probe.batches) == (2, 5) and loader.state_dict() == mid
        loader.set_epoch(2)  # the epoch the state resumes: its position is kept
        assert _indices(head + list(iter(loader))) == _epoch_of_torch(2)
        loader.load_state_dict(mid)
        loader.set_epoch(4)  # another epoch: from its beginning
        assert _indices(loader) == _epoch_of_torch(4)


def test_a_rank_nobody_says_is_an_error_not_rank_0(
    start_server: StartServer, job_env: pytest.MonkeyPatch
) -> None:
    address = start_server(SHUFFLED)
    job_env.setenv("WORLD_SIZE", "2")
    with RemoteLoader(address, device="cpu") as loader:  # made before the job says the rank
        for read in (iter, len, lambda loader: loader.rank):
            with pytest.raises(ValueError, match="nothing says this process's rank"):
                read(loader)
        assert "rank=?" in repr(loader)


def test_the_rank_is_read_when_the_first_epoch_starts(
    start_server: StartServer, job_env: pytest.MonkeyPatch
) -> None:
    address = start_server(SHUFFLED)
    job_env.setenv("WORLD_SIZE", "2")
    loader = RemoteLoader(address, device="cpu")
    job_env.setenv("RANK", "1")  # the launcher says it after the loader was made
    with loader:
        assert (loader.rank, loader.world_size) == (1, 2)
        assert len(loader) == 7 and len(loader.sampler) == 25
        rank_1 = _indices(loader)
        job_env.setenv("RANK", "0")  # too late: the first iter() kept the membership
        assert loader.rank == 1 and loader.state_dict()["rank"] == 1
    assert rank_1 == _share_of_torch(1, 0)


def test_a_pickled_loader_connects_anew_where_the_copy_runs(
    start_server: StartServer, job_env: pytest.MonkeyPatch
) -> None:
    # Lightning's ddp_spawn pickles the DataModule, loader and all, to the ranks it starts: a
    # RemoteLoader could not be pickled (NOTE [ A pickled loader ] in client/options.py).
    address = start_server(SHUFFLED)
    with RemoteLoader(address, device="cpu", seed=SEED + 1) as loader:
        # Its place goes with it: a resumed epoch's position and the state's seed.
        loader.load_state_dict({**loader.state_dict(), "seed": SEED, "epoch": 3, "batches": 2})
        with pickle.loads(pickle.dumps(loader)) as copy:
            assert (copy.epoch, copy.seed) == (3, SEED)
            assert _indices(copy) == _epoch_of_torch(3)[2:]
        job_env.setenv("WORLD_SIZE", "2")  # the launching process knows no rank ...
        unplaced = RemoteLoader(address, device="cpu")
    with unplaced:
        unplaced.set_epoch(1)
        pickled = pickle.dumps(unplaced)
    job_env.setenv("RANK", "1")  # ... the rank it starts does
    with pickle.loads(pickled) as copy:
        assert (copy.rank, copy.world_size, copy.epoch) == (1, 2, 1)
        assert _indices(copy) == _share_of_torch(1, 1)


def test_an_initialized_process_group_gives_the_rank(
    start_server: StartServer, job_env: pytest.MonkeyPatch
) -> None:
    address = start_server(SHUFFLED)
    job_env.setenv("WORLD_SIZE", "2")  # alone, an error: the group, made later, decides
    loader = RemoteLoader(address, device="cpu")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        with loader:
            assert (loader.rank, loader.world_size) == (0, 1)
            assert _indices(loader) == _epoch_of_torch(0)
    finally:
        dist.destroy_process_group()


# --- 3. the attributes scripts read ---------------------------------------------------------

WORKERS = LoaderSpec(
    name="workers",
    dataset="tests.datasets:Squares",
    dataset_kwargs={"n": N},
    batch_size=4,
    drop_last=True,
    num_workers=1,
    prefetch_factor=3,
    persistent_workers=True,
    in_order=False,
)
UNBATCHED = LoaderSpec(
    name="unbatched", dataset="tests.datasets:Squares", dataset_kwargs={"n": N}, batch_size=None
)


def _local_twin(spec: LoaderSpec) -> DataLoader[Any]:
    """A DataLoader with the spec's options (no worker is started: nothing iterates it)."""
    return DataLoader(
        Squares(N),
        batch_size=spec.batch_size,
        shuffle=bool(spec.shuffle),
        drop_last=spec.drop_last,
        num_workers=spec.num_workers,
        prefetch_factor=spec.prefetch_factor,
        persistent_workers=spec.persistent_workers,
        in_order=spec.in_order,
    )


@pytest.mark.parametrize("spec", [SHUFFLED, WORKERS, UNBATCHED], ids=lambda s: s.name)
def test_the_attributes_are_a_dataloaders(start_server: StartServer, spec: LoaderSpec) -> None:
    address = start_server(spec)
    local = _local_twin(spec)
    with RemoteLoader(address, spec.name, device="cpu") as loader:
        for name in (
            "batch_size",
            "drop_last",
            "num_workers",
            "prefetch_factor",
            "persistent_workers",
            "in_order",
            "generator",
            "timeout",
            "pin_memory",
        ):
            assert getattr(loader, name) == getattr(local, name), name
        assert len(loader) == len(local)
        assert isinstance(loader.dataset, Dataset) and len(loader.dataset) == _len(local.dataset)
        assert not isinstance(loader.dataset, IterableDataset)
        assert isinstance(loader.sampler, Sampler) and len(loader.sampler) == _len(local.sampler)
        local_batches: Any = local.batch_sampler
        if local_batches is None:
            assert loader.batch_sampler is None
        else:
            batch_sampler = loader.batch_sampler
            assert batch_sampler is not None and batch_sampler.sampler is loader.sampler
            assert len(batch_sampler) == len(local_batches)
            assert batch_sampler.batch_size == local_batches.batch_size
            assert batch_sampler.drop_last == local_batches.drop_last
        for name in ("num_workers", "batch_size", "drop_last", "rank", "dataset", "sampler"):
            with pytest.raises(AttributeError):
                setattr(loader, name, None)


@pytest.mark.parametrize("drop", [False, True])
def test_a_ranks_sampler_counts_its_share(serve_loaders: ServeLoaders, drop: bool) -> None:
    spec = LoaderSpec(
        name="odd",
        dataset="tests.datasets:Squares",
        dataset_kwargs={"n": 51},
        batch_size=4,
        partition_drop_last=drop,
    )
    address = serve_loaders(spec).address
    for rank in (0, 1):
        share: DistributedSampler[int] = DistributedSampler(
            Squares(51), num_replicas=2, rank=rank, drop_last=drop
        )
        with RemoteLoader(address, rank=rank, world_size=2, device="cpu") as loader:
            assert len(loader.sampler) == len(share)
            assert len(loader) == -(-len(share) // 4) == len(list(loader))
        with RemoteLoader(address, sharing="broadcast", device="cpu") as loader:
            assert len(loader.sampler) == 51


def test_what_lives_on_the_server_is_said_plainly(start_server: StartServer) -> None:
    spec = LoaderSpec(
        name="overlong",
        dataset="tests.dropin_datasets:Overlong",
        batch_size=1,
        collate_fn="tests.datasets:sharing_collate",
    )
    address = start_server(SHUFFLED, spec)
    with RemoteLoader(address, "shuffled", device="cpu") as loader:
        dataset = loader.dataset
        assert "tests.datasets:Squares(n=50)" in repr(dataset)
        with pytest.raises(ServerSideError, match="lives on the server") as info:
            dataset.n  # noqa: B018  # the attribute a script would read
        assert isinstance(info.value, AttributeError) and "load_state_dict" in str(info.value)
        assert not hasattr(dataset, "n") and getattr(dataset, "n", None) is None
        with pytest.raises(TypeError, match="lives on the server"):
            dataset[0]
        with pytest.raises(TypeError, match=r"drawn on the server.*load_state_dict"):
            iter(loader.sampler)
        assert not hasattr(loader, "collate_fn") and not hasattr(loader, "worker_init_fn")
        pickle.loads(pickle.dumps(dataset))  # plain values: no probe reaches the server
    with RemoteLoader(address, "overlong", device="cpu") as loader:
        assert isinstance(loader.dataset, IterableDataset) and len(loader.dataset) == 3
        with pytest.raises(TypeError, match="lives on the server"):
            iter(loader.dataset)
        with pytest.raises(TypeError, match="_InfiniteConstantSampler"):
            len(loader.sampler)
        with pytest.raises(ServerSideError, match=r"tests\.datasets:sharing_collate"):
            loader.collate_fn  # noqa: B018
    with (
        RemoteLoader(address, "shuffled", sharing="dynamic", device="cpu") as loader,
        pytest.raises(TypeError, match="sharing='dynamic'"),
    ):
        len(loader.sampler)


def test_accelerate_skip_first_batches_is_refused_at_the_call(start_server: StartServer) -> None:
    accelerate = pytest.importorskip("accelerate")
    address = start_server(SHUFFLED)
    with RemoteLoader(address, device="cpu") as loader:
        with pytest.raises(TypeError, match=r"skip_first_batches.*load_state_dict"):
            accelerate.skip_first_batches(loader, 2)
        # The way it names: the state after 2 batches, loaded, reads from the third.
        it = iter(loader)
        head = [next(it) for _ in range(2)]
        state = loader.state_dict()
    with RemoteLoader(address, device="cpu") as loader:
        loader.load_state_dict(state)
        assert _indices(head + list(loader)) == _epoch_of_torch(0)


def test_each_batchs_error_is_its_own_type_and_the_epoch_goes_on(
    start_server: StartServer,
) -> None:
    spec = LoaderSpec(
        name="raising", dataset="tests.dropin_datasets:Raising", batch_size=None, num_workers=1
    )
    address = start_server(spec)
    # torch's own worker (not fork: this process runs gRPC threads, grpc/grpc#16001).
    local = iter(
        DataLoader(
            dropin_datasets.Raising(),
            batch_size=None,
            num_workers=1,
            multiprocessing_context="forkserver",
        )
    )
    with RemoteLoader(address, device="cpu") as loader:
        it = iter(loader)
        for i, kind in enumerate(dropin_datasets.RAISES):
            if kind is None:
                assert next(it) == next(local) == i
                continue
            with pytest.raises(Exception) as by_torch:
                next(local)
            with pytest.raises(DatasetError) as info:
                next(it)
            error, expected = info.value, by_torch.value
            assert isinstance(error, type(expected)), (kind, type(error).__mro__)
            assert type(error).__name__ == type(expected).__name__  # RuntimeError for NeedsTwo
            head = f"Caught {kind.__name__} {WORKER_0}.\nOriginal Traceback"
            assert str(error).startswith(head) and str(expected).startswith(head)
            assert str(error).splitlines()[-1] == str(expected).splitlines()[-1]
            assert error.position == i
        with pytest.raises(StopIteration):
            next(it)


@pytest.mark.timeout(90)
def test_a_broken_loader_is_its_exceptions_type(start_server: StartServer) -> None:
    spec = LoaderSpec(
        name="broken",
        dataset="tests.datasets:Squares",
        num_workers=1,
        worker_init_fn="tests.datasets:failing_init",
    )
    address = start_server(spec)
    with RemoteLoader(address, device="cpu") as loader, pytest.raises(LoaderBrokenError) as info:
        next(iter(loader))
    assert isinstance(info.value, RuntimeError)  # failing_init's, as torch raises it
    assert "worker_init_fn fails on purpose" in str(info.value)


# --- 5. torch's warnings ---------------------------------------------------------------------


def test_torchs_warnings_about_the_loader_are_given_at_each_iter(
    serve_loaders: ServeLoaders,
) -> None:
    workers = len(__import__("os").sched_getaffinity(0)) + 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DataLoader(Squares(), num_workers=workers).check_worker_number_rationality()
    expected = {(w.category, str(w.message)) for w in caught}
    assert expected
    spec = LoaderSpec(name="crowded", dataset="tests.datasets:Squares", num_workers=workers)
    address = serve_loaders(spec).address
    with RemoteLoader(address, device="cpu") as loader:
        for _ in range(2):
            with pytest.warns(UserWarning) as given:
                iter(loader)
            assert {(w.category, str(w.message)) for w in given} == expected
        # A category this side does not know is a UserWarning; a builtin one is itself.
        loader.info.warnings.add(category="FutureWarning", message="later")
        loader.info.warnings.add(category="NoSuchWarning", message="unknown")
        with pytest.warns(Warning) as given:
            iter(loader)
        categories = {str(w.message): w.category for w in given}
        assert categories["later"] is FutureWarning
        assert categories["unknown"] is UserWarning


def test_an_iterable_datasets_overlong_epoch_warns_as_torch(start_server: StartServer) -> None:
    spec = LoaderSpec(name="overlong", dataset="tests.dropin_datasets:Overlong", batch_size=1)
    address = start_server(spec)

    def warned(loader: Any) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            list(loader)
            assert len(loader) == 3  # torch warns only once len() was asked
            list(loader)
        return [str(w.message) for w in caught]

    local = warned(DataLoader(dropin_datasets.Overlong(), batch_size=1))
    with RemoteLoader(address, device="cpu") as loader:
        remote = warned(loader)
        dataset = repr(loader.dataset)
    assert len(remote) == len(local) == 2  # the 4th and the 5th batch of the second epoch
    for got, want in zip(remote, local, strict=True):
        assert got.split(" was reported")[1] == want.split(" was reported")[1]
        assert got.startswith(f"Length of IterableDataset {dataset} was reported to be 3")
