"""The service over real gRPC: listing, describing, errors at their position, many streams.

The unit tests (no server, no process, no Ray): tests/unit/test_service.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from remote_loader.client import (
    DatasetError,
    LoaderNotFoundError,
    RemoteLoader,
)
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import wire
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.engine.local import WORKER_JOIN_TIMEOUT
from tests.helpers import SQUARES, ServeLoaders, StartServer, process_alive, raw_stream, wait_until

# A ceiling for work that takes milliseconds on a quiet machine and seconds on a busy one.
BUSY_MACHINE = 30.0
FAILING = LoaderSpec(
    name="failing",
    dataset="tests.datasets:Failing",
    batch_size=2,
    num_workers=2,
    dataset_kwargs={"n": 20, "bad": 7},
)


def test_describe_and_only_loader(start_server: StartServer) -> None:
    address = start_server(SQUARES)
    with RemoteLoader(address) as loader:  # the server's only loader
        assert loader.name == "squares"
        assert len(loader) == 13
        assert loader.batch_size == 4
        assert loader.info.dataset_kind == "map"
        assert loader.info.dataset_length == 50
        assert loader.info.fingerprint == SQUARES.fingerprint()
        assert loader.info.options["batch_size"] == "4"


def test_loader_names_are_checked(start_server: StartServer) -> None:
    address = start_server(SQUARES, FAILING)
    with pytest.raises(LoaderNotFoundError, match=r"hosts 2 loaders .*failing, squares.*loader="):
        RemoteLoader(address)
    with pytest.raises(LoaderNotFoundError, match=r"no loader named 'nope'.*failing, squares"):
        RemoteLoader(address, "nope")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataset_error_arrives_at_its_batch(start_server: StartServer, num_workers: int) -> None:
    spec = LoaderSpec(
        name="failing",
        dataset="tests.datasets:Failing",
        batch_size=2,
        num_workers=num_workers,
        dataset_kwargs={"n": 20, "bad": 7},
    )
    address = start_server(spec, SQUARES)
    with RemoteLoader(address, "failing") as loader:
        it = iter(loader)
        got = [next(it).tolist() for _ in range(3)]
        assert got == [[0, 1], [2, 3], [4, 5]]
        with pytest.raises(DatasetError) as info:
            next(it)  # batch 3 holds index 7
        err = info.value
        assert err.position == 3 and err.remote_type == "ValueError"
        assert "sample 7 is corrupt" in str(err)
        assert "tests/datasets.py" in err.remote_traceback  # the remote frame, with its file
        assert "raise ValueError" in err.remote_traceback
        # The stream goes on after the error, as a torch DataLoader iterator does.
        assert next(it).tolist() == [8, 9]
        assert [b.tolist() for b in it][-1] == [18, 19]
    # ... and the server keeps serving other streams.
    with RemoteLoader(address, "squares") as loader:
        assert sum(len(b["index"]) for b in loader) == 50


def test_four_clients_at_once(start_server: StartServer) -> None:
    spec = LoaderSpec(
        name="shared",
        dataset="tests.datasets:Squares",
        batch_size=3,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        dataset_kwargs={"n": 60},
    )
    address = start_server(spec)
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def consume(i: int) -> None:
        try:
            with RemoteLoader(address, seed=7) as loader:
                loader.set_epoch(i % 2)
                results[i] = torch.cat([b["index"] for b in loader]).tolist()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert all(sorted(r) == list(range(60)) for r in results.values())
    assert results[0] == results[2] and results[1] == results[3] and results[0] != results[1]


def test_stream_frames_are_plain_protobuf(start_server: StartServer) -> None:
    # A client without our codec (any gRPC stack) reads the hand-written frames as Frames.
    spec = LoaderSpec(name="big", dataset="tests.datasets:Squares", batch_size=10)
    address = start_server(spec, chunk_size=100)
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(
            wire.STREAM_METHOD,
            request_serializer=pb.StreamRequest.SerializeToString,
            response_deserializer=pb.Frame.FromString,
        )
        frames = list(call(pb.StreamRequest(loader="big"), timeout=30))
    assert frames[-1].HasField("end") and frames[-1].end.batches == 5
    first = [f for f in frames if f.batch == 0 and not f.HasField("end")]
    assert len(first) == first[0].parts > 1
    assert all(len(f.data) <= 100 for f in frames)
    assert sum(len(f.data) for f in first) == first[0].total_bytes


def test_small_chunks_reassemble(start_server: StartServer) -> None:
    spec = LoaderSpec(name="big", dataset="tests.datasets:Squares", batch_size=10, num_workers=1)
    address = start_server(spec, chunk_size=64)
    with RemoteLoader(address) as loader:
        batches = list(loader)
    assert torch.cat([b["x"] for b in batches]).shape == (50, 2, 3)
    assert torch.cat([b["index"] for b in batches]).tolist() == list(range(50))


def test_breaking_out_stops_the_server_work(start_server: StartServer) -> None:
    spec = LoaderSpec(
        name="probe",
        dataset="tests.datasets:WorkerProbe",
        batch_size=1,
        num_workers=2,
        dataset_kwargs={"n": 10_000},
    )
    address = start_server(spec)
    pids = set()
    with RemoteLoader(address) as loader:
        for i, (_, _, _, pid) in enumerate(loader):
            pids.add(int(pid))
            if i == 3:
                break
    # The stream's workers (a pool of its own: not persistent) exit once the client has gone.
    assert pids
    assert wait_until(lambda: not any(process_alive(pid) for pid in pids), 5)


def slowest_unary_calls(channel: grpc.Channel, rounds: int = 5, pause: float = 0.0) -> float:
    """The slowest of `rounds` Describe + health check pairs on `channel`, in seconds."""
    describe = channel.unary_unary(
        f"/{wire.SERVICE_NAME}/Describe",
        request_serializer=pb.DescribeRequest.SerializeToString,
        response_deserializer=pb.LoaderInfo.FromString,
    )
    health = health_pb2_grpc.HealthStub(channel)
    slowest = 0.0
    for _ in range(rounds):
        asked = time.monotonic()
        describe(pb.DescribeRequest(), timeout=BUSY_MACHINE)
        health.Check(health_pb2.HealthCheckRequest(service=""), timeout=BUSY_MACHINE)
        slowest = max(slowest, time.monotonic() - asked)
        time.sleep(pause)
    return slowest


def test_cancelled_streams_do_not_stall_other_calls(serve_loaders: ServeLoaders) -> None:
    """A cancel's cleanup (the Run's join, a non-persistent pool joining workers busy in a 3 s
    `__getitem__`) happens off gRPC's thread: unary calls and health stay quick meanwhile."""
    served = serve_loaders(
        LoaderSpec(
            name="sleepy",
            dataset="tests.datasets:Slow",
            dataset_kwargs={"n": 40, "seconds": 3.0},
            num_workers=2,
        )
    )
    host = served.hosts["sleepy"]
    slowest = 0.0
    with grpc.insecure_channel(served.address) as channel:
        for _ in range(3):
            stream_channel, call = raw_stream(served.address, pb.StreamRequest())
            # Workers are in __getitem__ now: their pool joins them when the stream ends.
            assert wait_until(lambda: bool(host.runs.active()), BUSY_MACHINE)
            call.cancel()
            stream_channel.close()
            slowest = max(slowest, slowest_unary_calls(channel))
    # Unstalled, both answer in milliseconds; stalled, they waited for worker joins (seconds).
    assert slowest < 1.0, slowest
    assert wait_until(lambda: not host.runs.active(), BUSY_MACHINE)


def test_a_pool_of_stuck_workers_shuts_down_within_one_join_timeout(
    serve_loaders: ServeLoaders, tmp_path: Path
) -> None:
    """Ending a Run stops its non-persistent pool in WORKER_JOIN_TIMEOUT in all, then terminates
    the workers still inside a 60 s `__getitem__`: not WORKER_JOIN_TIMEOUT per worker."""
    pids = tmp_path / "pids"
    served = serve_loaders(
        LoaderSpec(
            name="stuck",
            dataset="tests.datasets:Slow",
            dataset_kwargs={"n": 40, "seconds": 60.0, "log": str(pids)},
            num_workers=4,
        )
    )
    channel, call = raw_stream(served.address, pb.StreamRequest(loader="stuck"))

    def stuck() -> set[int]:
        return {int(p) for p in pids.read_text().split()} if pids.exists() else set()

    assert wait_until(lambda: len(stuck()) == 4, BUSY_MACHINE)
    call.cancel()
    channel.close()
    cancelled = time.monotonic()
    assert wait_until(lambda: not any(process_alive(pid) for pid in stuck()), BUSY_MACHINE)
    # One join timeout (5 s) plus terminate; per worker it took 4 x 5 s.
    assert time.monotonic() - cancelled < WORKER_JOIN_TIMEOUT + 5.0


def test_a_cancel_while_another_stream_plans_its_epoch_stalls_no_call(
    serve_loaders: ServeLoaders, tmp_path: Path
) -> None:
    """A cancel's callback does not wait for the loader's registry, which a stream planning its
    epoch (here a sampler that takes 4 s to make) holds: unary calls and health stay quick."""
    plans = tmp_path / "plans"
    served = serve_loaders(
        LoaderSpec(
            name="planned",
            dataset="tests.datasets:Slow",
            dataset_kwargs={"n": 40, "seconds": 0.5},
            sampler="tests.datasets:SlowPlan",
            sampler_kwargs={"log": str(plans), "seconds": 4.0},
        )
    )
    host = served.hosts["planned"]

    def made() -> int:  # samplers made: the server made one as it built the loader
        return len(plans.read_text().splitlines())

    first_channel, first = raw_stream(served.address, pb.StreamRequest(loader="planned"))
    assert wait_until(lambda: bool(host.runs.active()), BUSY_MACHINE)
    second_channel, second = raw_stream(served.address, pb.StreamRequest(loader="planned", epoch=1))
    assert wait_until(lambda: made() == 3, BUSY_MACHINE)  # epoch 1 is being planned now
    first.cancel()
    first_channel.close()
    with grpc.insecure_channel(served.address) as channel:
        slowest = slowest_unary_calls(channel, pause=0.1)
    second.cancel()
    second_channel.close()
    # Stalled, the calls waited for the epoch's plan (seconds); unstalled, milliseconds.
    assert slowest < 1.0, slowest
    assert wait_until(lambda: not host.runs.active(), BUSY_MACHINE)
