"""Sharing one loader between consumers over real gRPC: partition, broadcast, dynamic.

The unit tests (no server, no process, no Ray): tests/unit/test_sharing.py.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from remote_loader.client import ConnectionLostError, RemoteLoader
from remote_loader.server.config.sampling import share, share_size
from remote_loader.server.config.spec import LoaderSpec
from tests.datasets import Squares, read_counts
from tests.helpers import (
    ROOT,
    SHARING_BATCH,
    SHARING_EPOCH,
    SHARING_SEED,
    StartServer,
    broadcast_spec,
    distributed,
    epoch_of,
    indices,
    local_epoch,
    run_concurrently,
)

PARTITION_SPECS = [
    LoaderSpec(
        name=f"n{n}-dl{int(dl)}-sh{int(sh)}-pdl{int(pdl)}",
        dataset="tests.datasets:Squares",
        dataset_kwargs={"n": n},
        batch_size=SHARING_BATCH,
        drop_last=dl,
        shuffle=sh,
        partition_drop_last=pdl,
    )
    for n, dl, sh, pdl in itertools.product([12, 13], [False, True], [False, True], [False, True])
]


def expected_share(spec: LoaderSpec, rank: int, world_size: int) -> list[list[int]]:
    """What rank `rank` would get from a local DataLoader (DistributedSampler for world > 1)."""
    dataset = Squares(**spec.dataset_kwargs)
    if world_size == 1:  # the loader's own epoch, as a local DataLoader with its generator
        local = DataLoader(
            dataset,
            batch_size=SHARING_BATCH,
            shuffle=bool(spec.shuffle),
            drop_last=spec.drop_last,
            generator=torch.Generator().manual_seed(SHARING_SEED + SHARING_EPOCH),
        )
        return indices(list(local))
    mine = distributed(
        len(dataset),
        world_size,
        rank,
        shuffle=bool(spec.shuffle),
        drop_last=spec.partition_drop_last,
        epoch=SHARING_EPOCH,
    )
    return indices(list(DataLoader(dataset, SHARING_BATCH, sampler=mine, drop_last=spec.drop_last)))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_partition_shares_are_distributed_samplers(
    start_server: StartServer, world_size: int
) -> None:
    address = start_server(*PARTITION_SPECS)
    for spec in PARTITION_SPECS:
        shares = run_concurrently(
            *(
                epoch_of(address, spec.name, rank=r, world_size=world_size, job=spec.name)
                for r in range(world_size)
            )
        )
        n = spec.dataset_kwargs["n"]
        for r, got in enumerate(shares):
            assert got == expected_share(spec, r, world_size), (spec.name, r)
        assert len({len(s) for s in shares}) == 1, f"{spec.name}: unequal shares"
        union = [i for s in shares for b in s for i in b]
        if spec.partition_drop_last:
            assert len(union) == len(set(union)), f"{spec.name}: a sample twice"
        elif not spec.drop_last:
            assert set(union) == set(range(n)), f"{spec.name}: a sample missing"
            padding = share_size(n, world_size, False) * world_size - n
            assert len(union) == n + padding


def test_partition_with_workers_reads_each_sample_once(
    start_server: StartServer, tmp_path: Path
) -> None:
    log = str(tmp_path / "reads")
    spec = LoaderSpec(
        name="counted",
        dataset="tests.datasets:Counted",
        dataset_kwargs={"log": log, "n": 48},
        batch_size=4,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
    )
    address = start_server(spec)
    for epoch in range(2):  # the second epoch reuses the persistent workers
        shares = run_concurrently(
            *(_rank_reader(address, r, 4, epoch) for r in range(4)),
        )
        for r, got in enumerate(shares):
            mine = distributed(48, 4, r, shuffle=True, epoch=epoch)
            assert [i for b in got for i in b] == mine
        assert {len(s) for s in shares} == {3}
    assert read_counts(log) == {i: 2 for i in range(48)}  # once per epoch, for all four ranks


def _rank_reader(address: str, rank: int, world_size: int, epoch: int) -> Callable[[], Any]:
    def consume() -> list[list[int]]:
        with RemoteLoader(address, seed=SHARING_SEED, rank=rank, world_size=world_size) as loader:
            loader.set_epoch(epoch)
            return indices(list(loader))

    return consume


def test_partition_of_custom_samplers_splits_the_loaders_own_order(
    start_server: StartServer,
) -> None:
    by_sample = LoaderSpec(
        name="reversed",
        dataset="tests.datasets:Squares",
        dataset_kwargs={"n": 11},
        batch_size=2,
        sampler="tests.datasets:Reversed",
    )
    by_batch = LoaderSpec(
        name="growing",
        dataset="tests.datasets:Squares",
        dataset_kwargs={"n": 20},
        batch_sampler="tests.datasets:GrowingBatches",
    )
    address = start_server(by_sample, by_batch)
    whole = epoch_of(address, "reversed")()
    samples = [i for b in whole for i in b]
    for r in range(3):
        got = epoch_of(address, "reversed", rank=r, world_size=3)()
        mine = share(samples, r, 3, drop_last=False)
        assert got == [mine[i : i + 2] for i in range(0, len(mine), 2)]
    batches = epoch_of(address, "growing")()  # the loader's own batches of this epoch
    assert sorted(i for b in batches for i in b) == list(range(20))
    for r in range(3):
        assert epoch_of(address, "growing", rank=r, world_size=3)() == share(batches, r, 3, False)


def test_a_slow_rank_does_not_hold_a_fast_one(start_server: StartServer, tmp_path: Path) -> None:
    log = str(tmp_path / "reads")
    spec = LoaderSpec(
        name="counted",
        dataset="tests.datasets:Counted",
        dataset_kwargs={"log": log, "n": 40},
        batch_size=2,
        num_workers=2,
    )
    address = start_server(spec)
    slow = RemoteLoader(address, rank=1, world_size=2, prefetch=1)
    slow_it = iter(slow)
    first = next(slow_it)["index"].tolist()  # rank 1 is attached, then stops reading
    # rank 0 reads its whole share meanwhile: its lane does not wait for rank 1's.
    with RemoteLoader(address, rank=0, world_size=2) as loader:
        fast_share = indices(list(loader))
    rest = indices(list(slow_it))
    slow.close()
    assert [first, *rest] == [[i, i + 2] for i in range(1, 40, 4)]
    assert fast_share == [[i, i + 2] for i in range(0, 40, 4)]
    assert read_counts(log) == {i: 1 for i in range(40)}  # one Run made both shares


# --- broadcast ------------------------------------------------------------------------------


def test_broadcast_reads_each_sample_once_for_three(
    start_server: StartServer, tmp_path: Path
) -> None:
    log = str(tmp_path / "reads")
    address = start_server(broadcast_spec(log))
    got = run_concurrently(
        *(epoch_of(address, "counted", sharing="broadcast", rank=r, world_size=3) for r in range(3))
    )
    assert got[0] == got[1] == got[2] == local_epoch(60, 4)
    assert read_counts(log) == {i: 1 for i in range(60)}


def test_broadcast_late_joiner_gets_the_whole_epoch(
    start_server: StartServer, tmp_path: Path
) -> None:
    log = str(tmp_path / "reads")
    address = start_server(broadcast_spec(log, num_workers=0, broadcast_window=2))
    expected = local_epoch(60, 4)
    early = RemoteLoader(address, seed=SHARING_SEED, sharing="broadcast", prefetch=1)
    early.set_epoch(SHARING_EPOCH)
    early_it = iter(early)
    head = [next(early_it)["index"].tolist() for _ in range(10)]  # well past the window
    # A consumer that joins after batch 0 was retired cannot share: it gets a Run of its own
    # and still receives the whole, identical epoch; only the data is read twice.
    late = epoch_of(address, "counted", sharing="broadcast")()
    tail = indices(list(early_it))
    early.close()
    assert head + tail == expected
    assert late == expected
    assert read_counts(log) == {i: 2 for i in range(60)}


def test_broadcast_group_waits_for_its_members(start_server: StartServer, tmp_path: Path) -> None:
    # With world_size=2 nothing is retired until both ranks have joined, so a rank that starts
    # late still shares the production (each sample read once).
    log = str(tmp_path / "reads")
    address = start_server(broadcast_spec(log, num_workers=0, broadcast_window=2))
    first = RemoteLoader(address, seed=SHARING_SEED, sharing="broadcast", rank=0, world_size=2)
    first.set_epoch(SHARING_EPOCH)
    first_it = iter(first)
    head = [next(first_it)["index"].tolist() for _ in range(2)]
    # The scenario, not a wait for a state: rank 1 comes 0.5 s late. Rank 0 is held at the window
    # meanwhile; were batches retired without rank 1, they would be read again for it below.
    time.sleep(0.5)
    second = epoch_of(address, "counted", sharing="broadcast", rank=1, world_size=2)
    got_second, rest = run_concurrently(second, lambda: indices(list(first_it)))
    first.close()
    assert head + rest == got_second == local_epoch(60, 4)
    assert read_counts(log) == {i: 1 for i in range(60)}


CONSUMER_SCRIPT = """
import sys
from remote_loader.client import RemoteLoader
loader = RemoteLoader(sys.argv[1], sharing="broadcast", rank=2, world_size=3, prefetch=1)
for i, batch in enumerate(loader):
    print(i, flush=True)
    if i >= 1:
        input()  # stalls here until killed
"""


def test_broadcast_killed_consumer_does_not_stall_the_others(
    start_server: StartServer, tmp_path: Path
) -> None:
    log = str(tmp_path / "reads")
    detach_timeout = 3.0
    address = start_server(
        broadcast_spec(log, num_workers=0, broadcast_window=2, detach_timeout=detach_timeout)
    )
    victim = subprocess.Popen(
        [sys.executable, "-c", CONSUMER_SCRIPT, address],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert victim.stdout is not None
        assert victim.stdout.readline().strip() == "0"  # attached, reading

        attached = [threading.Event(), threading.Event()]  # a first batch received

        def consumer(rank: int) -> Callable[[], list[list[int]]]:
            def consume() -> list[list[int]]:
                got = []
                with RemoteLoader(address, sharing="broadcast", rank=rank, world_size=3) as ld:
                    for batch in ld:
                        got.append(batch["index"].tolist())
                        attached[rank].set()
                return got

            return consume

        results: list[Any] = []
        runner = threading.Thread(
            target=lambda: results.extend(run_concurrently(consumer(0), consumer(1)))
        )
        started = time.monotonic()
        runner.start()
        for event in attached:  # both share the victim's Run before it dies
            assert event.wait(30)
        victim.send_signal(signal.SIGKILL)
        runner.join(timeout=detach_timeout + 30)
        elapsed = time.monotonic() - started
    finally:
        victim.kill()
        victim.communicate()
    assert not runner.is_alive()
    assert elapsed < detach_timeout + 10, elapsed
    assert results[0] == results[1] and len(results[0]) == 15


@pytest.mark.parametrize("retries", [0, 5])
def test_broadcast_stalled_consumer_is_detached(start_server: StartServer, retries: int) -> None:
    spec = LoaderSpec(
        name="blobs",
        dataset="tests.datasets:Blobs",
        dataset_kwargs={"n": 60, "nbytes": 1 << 20},
        batch_size=1,
        broadcast_window=2,
        detach_timeout=1.0,
    )
    address = start_server(spec)
    stalled = RemoteLoader(
        address, sharing="broadcast", rank=2, world_size=3, prefetch=1, retries=retries
    )
    stalled_it = iter(stalled)
    first = int(next(stalled_it)["index"][0])  # joined; it reads no further while others run

    def consumer(rank: int) -> Callable[[], int]:
        def consume() -> int:
            with RemoteLoader(address, sharing="broadcast", rank=rank, world_size=3) as loader:
                return sum(1 for _ in loader)

        return consume

    started = time.monotonic()
    counts = run_concurrently(consumer(0), consumer(1))
    assert counts == [60, 60]
    assert time.monotonic() - started < 20
    if retries == 0:
        # Once it reads again: what it had buffered, then a clear error.
        with pytest.raises(ConnectionLostError, match=r"detached .*detach_timeout"):
            for _ in stalled_it:
                pass
    else:
        # It resumes by itself from its next batch (a production of its own): nothing is lost
        # or repeated.
        rest = [int(b["index"][0]) for b in stalled_it]
        assert [first, *rest] == list(range(60))
    stalled.close()


# --- dynamic --------------------------------------------------------------------------------


def test_dynamic_each_batch_once_and_the_fastest_gets_most(start_server: StartServer) -> None:
    spec = LoaderSpec(
        name="blobs",
        dataset="tests.datasets:Blobs",
        dataset_kwargs={"n": 90, "nbytes": 1 << 20},
        batch_size=1,
        num_workers=2,
    )
    address = start_server(spec)

    def consumer(pause: float) -> Callable[[], list[int]]:
        def consume() -> list[int]:
            got = []
            with RemoteLoader(address, sharing="dynamic", prefetch=1) as loader:
                with pytest.raises(TypeError, match="dynamic"):
                    len(loader)
                for batch in loader:
                    got.append(int(batch["index"][0]))
                    assert int(batch["data"][0, -1]) == got[-1] % 256
                    time.sleep(pause)
            return got

        return consume

    fast, medium, slow = run_concurrently(consumer(0.0), consumer(0.02), consumer(0.1))
    assert sorted(fast + medium + slow) == list(range(90))  # each batch exactly once
    assert len(fast) > len(slow), (len(fast), len(medium), len(slow))
    assert fast == sorted(fast) and slow == sorted(slow)  # each in epoch order
