"""A job's consumers over real gRPC, beside how they share an epoch
(tests/integration/test_sharing.py): several clients at once, the memberships a server refuses and
the defaults a client takes, and the job's persistent workers across epochs and closes."""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from remote_loader.client import ConnectionLostError, RemoteLoader, RequestError
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import wire
from remote_loader.server.config.spec import LoaderSpec
from tests.helpers import (
    ServeLoaders,
    StartServer,
    broadcast_spec,
    distributed,
    epoch_of,
    local_epoch,
    run_concurrently,
    wait_until,
)

# --- four at once, and what is refused ------------------------------------------------------


def test_four_clients_stream_at_once(start_server: StartServer, tmp_path: Path) -> None:
    log = str(tmp_path / "reads")
    partitioned = LoaderSpec(
        name="squares", dataset="tests.datasets:Squares", batch_size=5, num_workers=2
    )
    address = start_server(partitioned, broadcast_spec(log))
    results = run_concurrently(
        epoch_of(address, "squares", rank=0, world_size=2),
        epoch_of(address, "squares", rank=1, world_size=2),
        epoch_of(address, "counted", sharing="broadcast", world_size=2, rank=0),
        epoch_of(address, "counted", sharing="broadcast", world_size=2, rank=1),
    )
    for r in range(2):
        assert [i for b in results[r] for i in b] == distributed(50, 2, r, shuffle=False)
    assert results[2] == results[3] == local_epoch(60, 4)


def describe(address: str, **consumer: Any) -> grpc.Call:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            f"/{wire.SERVICE_NAME}/Describe",
            request_serializer=pb.DescribeRequest.SerializeToString,
            response_deserializer=pb.LoaderInfo.FromString,
        )
        with pytest.raises(grpc.RpcError) as info:
            call(pb.DescribeRequest(consumer=pb.Consumer(**consumer)), timeout=10)
    assert isinstance(info.value, grpc.Call)
    return info.value


def test_wrong_membership_is_invalid_argument(start_server: StartServer) -> None:
    only_partition = LoaderSpec(
        name="squares", dataset="tests.datasets:Squares", sharing=("partition",)
    )
    address = start_server(only_partition)
    cases: dict[str, dict[str, Any]] = {
        r"rank 2 is out of range for world_size 2: it must be in \[0, 1\]": {
            "rank": 2,
            "world_size": 2,
        },
        r"world_size must be between 1 and 1048576, got 0": {"world_size": 0},
        r"world_size must be between 1 and 1048576, got 4294967295": {"world_size": 2**32 - 1},
        r"unknown sharing mode 'gossip'; the modes are partition, broadcast, dynamic": {
            "sharing": "gossip"
        },
        r"does not allow sharing='broadcast'; it allows partition": {"sharing": "broadcast"},
    }
    for message, consumer in cases.items():
        error = describe(address, **consumer)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = error.details() or ""
        assert re.search(message, details), details
    with pytest.raises(RequestError, match="does not allow sharing='dynamic'"):
        RemoteLoader(address, sharing="dynamic")


def test_an_iterable_dataset_is_not_partitioned(start_server: StartServer) -> None:
    spec = LoaderSpec(name="sharded", dataset="tests.datasets:Sharded", batch_size=2, num_workers=2)
    address = start_server(spec)
    with pytest.raises(RequestError, match=r"cannot split.*sharing='dynamic'"):
        RemoteLoader(address, rank=0, world_size=2)
    halves = run_concurrently(*(lambda: _all_values(address, sharing="dynamic") for _ in range(2)))
    assert sorted(halves[0] + halves[1]) == sorted(_all_values(address))


def _all_values(address: str, **kwargs: Any) -> list[int]:
    with RemoteLoader(address, **kwargs) as loader:
        return [int(v) for b in loader for v in b]


def test_membership_defaults_from_the_environment(
    start_server: StartServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    address = start_server(LoaderSpec(name="squares", dataset="tests.datasets:Squares"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with RemoteLoader(address) as loader:
        assert (loader.rank, loader.world_size) == (1, 4)
        assert len(loader) == 13 == len(list(loader))  # ceil(50 / 4)
    with RemoteLoader(address, world_size=2) as loader:  # an explicit value wins
        assert (loader.rank, loader.world_size) == (1, 2)
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError, match="RANK='one' is not an integer"):
        RemoteLoader(address)
    with pytest.raises(ValueError, match="rank 3 is out of range for world_size 2"):
        RemoteLoader(address, rank=3, world_size=2)
    with pytest.raises(ValueError, match="sharing must be one of"):
        RemoteLoader(address, rank=0, world_size=1, sharing="everyone")  # type: ignore[arg-type]


def worker_pids(loader: RemoteLoader) -> set[int]:
    """Reads an epoch of WorkerProbe batches; returns the pids of the workers that made them."""
    return {pid for batch in loader for pid in batch[3].tolist()}


def test_next_epoch_of_a_job_waits_for_its_persistent_workers(start_server: StartServer) -> None:
    spec = LoaderSpec(
        name="probe",
        dataset="tests.datasets:WorkerProbe",
        dataset_kwargs={"n": 16},
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
    )
    address = start_server(spec)
    ranks = [RemoteLoader(address, rank=r, world_size=2) for r in range(2)]
    pids: list[set[int]] = []
    try:
        pids.append(worker_pids(ranks[0]))  # rank 0 is done with epoch 0 ...
        # ... and starts epoch 1 while rank 1 has not begun epoch 0: its Run waits for the
        # workers the job's previous Run holds, rather than starting workers of its own.
        ahead = run_concurrently(
            lambda: worker_pids(ranks[0]),
            lambda: worker_pids(ranks[1]),
        )
        pids.extend(ahead)
        pids.append(worker_pids(ranks[1]))
    finally:
        for loader in ranks:
            loader.close()
    assert all(len(p) == 2 for p in pids)
    assert pids[0] == pids[1] == pids[2] == pids[3]  # the same two persistent workers throughout


def test_closing_the_loader_mid_epoch_is_an_error_not_an_end(serve_loaders: ServeLoaders) -> None:
    spec = LoaderSpec(
        name="slow", dataset="tests.datasets:Slow", dataset_kwargs={"n": 50, "seconds": 0.05}
    )
    served = serve_loaders(spec)
    # retries=0: the error itself, rather than attempts to resume against a closed loader.
    with RemoteLoader(served.address, prefetch=1, retries=0) as loader:
        it = iter(loader)
        next(it)
        served.hosts["slow"].close()  # what server shutdown does after the grace period
        with pytest.raises(ConnectionLostError, match="shutting down mid-epoch"):
            for _ in it:
                pass


def _next_quietly(it: Iterator[Any]) -> None:
    with contextlib.suppress(Exception):  # the stream is cancelled under it: expected
        next(it)


def test_a_run_waiting_for_the_jobs_workers_ends_when_its_consumer_goes(
    serve_loaders: ServeLoaders,
) -> None:
    spec = LoaderSpec(
        name="blobs",
        # 1 MB samples: gRPC's flow control, not its buffers, holds a rank that stops reading.
        dataset="tests.datasets:Blobs",
        dataset_kwargs={"n": 60, "nbytes": 1 << 20},
        batch_size=1,
        num_workers=2,
        persistent_workers=True,
        detach_timeout=30.0,
    )
    served = serve_loaders(spec)
    runs = served.hosts["blobs"].runs

    def active(n: int) -> bool:
        return wait_until(lambda: len(runs.active()) == n, 5)

    slow = RemoteLoader(served.address, rank=1, world_size=2, prefetch=1)
    slow_it = iter(slow)
    first = [int(next(slow_it)["index"][0])]  # epoch 0's Run holds the workers for rank 1
    fast = RemoteLoader(served.address, rank=0, world_size=2)
    assert len(list(fast)) == 30
    # Epoch 1: its Run waits for the workers epoch 0 still holds. The stream opens at the first
    # next() (NOTE [ An iterator's epoch ]), which waits too: in a thread, whose next() ends
    # with an error once fast is closed.
    ahead = iter(fast)
    asking = threading.Thread(target=_next_quietly, args=(ahead,), daemon=True)
    asking.start()
    assert active(2)
    (waiting,) = [run for run in runs.active() if run.key.epoch == 1]
    fast.close()  # rank 0 goes away: its waiting Run ends now, not after detach_timeout
    assert active(1)
    assert waiting.wait_closed(timeout=5)
    rest = [int(batch["index"][0]) for batch in slow_it]
    assert first + rest == list(range(1, 60, 2))  # epoch 0 goes on for rank 1
    slow.close()
    asking.join(timeout=10)
    assert not asking.is_alive()
