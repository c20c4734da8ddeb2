"""Exactly-once resume over real gRPC: state_dict, broken connections, a server restart."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from remote_loader.client import RemoteLoader, RequestError
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import wire
from remote_loader.server.config.spec import LoaderSpec
from tests.datasets import read_counts
from tests.helpers import (
    SLOW_SAMPLES,
    CuttingProxy,
    StartServer,
    assert_same,
    free_port,
    port_free,
    serve_process,
    stop_process,
    wait_until,
)

EPOCH, SEED = 1, 3


def squares(name: str, **options: Any) -> LoaderSpec:
    values: dict[str, Any] = {
        "name": name,
        "dataset": "tests.datasets:Squares",
        "dataset_kwargs": {"n": 23},
        "batch_size": 2,
        "seed": SEED,
    }
    values.update(options)
    return LoaderSpec(**values)


def whole_epoch(address: str, name: str, epoch: int = EPOCH, **kwargs: Any) -> list[Any]:
    with RemoteLoader(address, name, **kwargs) as loader:
        loader.set_epoch(epoch)
        return list(loader)


def interrupted(address: str, name: str, stop_after: int | None, **kwargs: Any) -> list[Any]:
    """Reads `stop_after` batches (None: the whole epoch, to StopIteration), saves the state
    through JSON, and reads on with a fresh RemoteLoader; returns both parts' batches."""
    with RemoteLoader(address, name, **kwargs) as loader:
        loader.set_epoch(EPOCH)
        it = iter(loader)
        before = list(it) if stop_after is None else [next(it) for _ in range(stop_after)]
        state = json.loads(json.dumps(loader.state_dict()))
    with RemoteLoader(address, name, **kwargs) as loader:
        loader.load_state_dict(state)
        after = list(loader)
    return before + after


RESUME_SPECS = [
    squares(f"sh{int(shuffle)}-w{workers}", shuffle=shuffle, num_workers=workers)
    for shuffle in (False, True)
    for workers in (0, 2)
]


@pytest.mark.parametrize("rank", [None, 0, 1])  # None: world size 1; else rank of 2
def test_resume_continues_exactly(start_server: StartServer, rank: int | None) -> None:
    address = start_server(*RESUME_SPECS)
    membership = {} if rank is None else {"rank": rank, "world_size": 2}
    for spec in RESUME_SPECS:
        epoch = whole_epoch(address, spec.name, **membership)
        following = whole_epoch(address, spec.name, EPOCH + 1, **membership)
        n = len(epoch)
        for stop_after in (0, 1, n // 2, n - 1):
            assert_same(interrupted(address, spec.name, stop_after, **membership), epoch)
        # After the last batch (with or without reaching StopIteration) the state points at
        # the start of the next epoch, so the resumed loader reads that one.
        for end in (n, None):
            assert_same(interrupted(address, spec.name, end, **membership), epoch + following)


def test_state_dict_is_small_plain_json(start_server: StartServer) -> None:
    address = start_server(squares("a"))
    with RemoteLoader(address, rank=1, world_size=2, job="j") as loader:
        assert loader.state_dict() == {
            "version": 1,
            "loader": "a",
            "fingerprint": loader.info.fingerprint,
            "seed": SEED,
            "epoch": 0,
            "batches": 0,
            "sharing": "partition",
            "job": "j",
            "rank": 1,
            "world_size": 2,
            "reshard": None,
        }
        it = iter(loader)
        next(it)
        next(it)
        state = loader.state_dict()
        assert (state["epoch"], state["batches"]) == (0, 2)  # consumed, not prefetched
        assert json.loads(json.dumps(state)) == state
    with (
        RemoteLoader(address) as other,  # another job: not the consumer that saved it
        pytest.raises(ValueError, match=r"another consumer: .*\('partition', 'j'\)"),
    ):
        other.load_state_dict(state)
    with RemoteLoader(address, rank=0, world_size=2, job="j") as other:  # another rank of 2
        other.load_state_dict(state)  # DDP ranks are in step: its position, in rank 0's share
        assert (other.rank, other.epoch, other.state_dict()["batches"]) == (0, 0, 2)
        with pytest.raises(ValueError, match="'batches' should be int"):
            other.load_state_dict({**state, "batches": "2"})


def test_per_batch_seeding_resumes_on_other_worker_counts(start_server: StartServer) -> None:
    # Random augmentations depend on the worker that made a batch, unless seeding = per_batch:
    # then a batch is the same whatever the worker count or where the epoch resumed.
    options: dict[str, Any] = {
        "dataset": "tests.datasets:RandomAug",
        "dataset_kwargs": {"n": 30},
        "batch_size": 3,
        "shuffle": True,
        "seeding": "per_batch",
    }
    two = LoaderSpec(name="aug", num_workers=2, **options)
    none = LoaderSpec(name="aug", num_workers=0, **options)
    three = LoaderSpec(name="aug", num_workers=3, **options)
    assert two.fingerprint() == none.fingerprint() == three.fingerprint()
    first, second = start_server(two), start_server(none)
    epoch = whole_epoch(first, "aug")

    def without_worker_id(batches: list[Any]) -> list[Any]:
        return [b[:4] for b in batches]  # the last field says which worker made the sample

    assert_same(
        without_worker_id(whole_epoch(start_server(three), "aug")), without_worker_id(epoch)
    )
    for stop_after in (1, 5):
        with RemoteLoader(first) as loader:
            loader.set_epoch(EPOCH)
            it = iter(loader)
            before = [next(it) for _ in range(stop_after)]
            state = json.loads(json.dumps(loader.state_dict()))
        with RemoteLoader(second) as loader:  # a server with another num_workers
            loader.load_state_dict(state)
            after = list(loader)
        assert_same(without_worker_id(before + after), without_worker_id(epoch))


def test_resume_does_not_read_the_samples_before_it_again(
    start_server: StartServer, tmp_path: Path
) -> None:
    log = str(tmp_path / "reads")
    spec = LoaderSpec(
        name="counted",
        dataset="tests.datasets:Counted",
        dataset_kwargs={"log": log, "n": 40},
        batch_size=4,
        shuffle=True,
        num_workers=2,
    )
    address = start_server(spec)
    with RemoteLoader(address, prefetch=1) as loader:
        it = iter(loader)
        consumed = [next(it)["index"].tolist() for _ in range(4)]
        state = loader.state_dict()
    before = {i for batch in consumed for i in batch}
    with RemoteLoader(address) as loader:
        loader.load_state_dict(state)
        rest = [b["index"].tolist() for b in loader]
    counts = read_counts(log)
    assert sorted(before | {i for b in rest for i in b}) == list(range(40))
    assert all(counts[i] == 1 for i in before), counts  # the sampler skipped them
    # The rest is read by the resumed stream, and at most once more if the first stream had
    # prefetched it (or was still making it when its client went away).
    assert all(1 <= counts[i] <= 2 for i in range(40)), counts


def test_changed_spec_is_refused(start_server: StartServer) -> None:
    old = start_server(squares("a"))
    changed = start_server(squares("a", batch_size=3))
    with RemoteLoader(old) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    with (
        RemoteLoader(changed) as loader,
        pytest.raises(RequestError, match=r"'a' .* has changed since the state was saved"),
    ):
        loader.load_state_dict(state)
    # The server checks too: a stream naming another fingerprint is refused, not served.
    with grpc.insecure_channel(changed) as channel:
        stream = channel.unary_stream(
            wire.STREAM_METHOD,
            request_serializer=pb.StreamRequest.SerializeToString,
            response_deserializer=pb.Frame.FromString,
        )
        with pytest.raises(grpc.RpcError) as info:
            list(stream(pb.StreamRequest(fingerprint=state["fingerprint"], start=1), timeout=10))
    error = info.value
    assert isinstance(error, grpc.Call)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "has changed" in (error.details() or "")


# --- broken connections and a restarted server ------------------------------------------------


@pytest.fixture
def proxy() -> Iterator[Callable[[str], CuttingProxy]]:
    made: list[CuttingProxy] = []

    def make(upstream: str) -> CuttingProxy:
        made.append(CuttingProxy(upstream))
        return made[-1]

    yield make
    for p in made:
        p.close()


def reconnects(loader: RemoteLoader) -> int:
    """How often the loader's last epoch resumed a broken stream."""
    return loader.stats().reconnects


def test_cut_connections_are_resumed_exactly(
    start_server: StartServer, proxy: Callable[[str], CuttingProxy]
) -> None:
    address = start_server(squares("cut", shuffle=True, num_workers=2, **SLOW_SAMPLES))
    expected = whole_epoch(address, "cut")
    middle = proxy(address)
    got = []
    with RemoteLoader(middle.address, prefetch=1, backoff=0.05) as loader:
        loader.set_epoch(EPOCH)
        for i, batch in enumerate(loader):
            got.append(batch)
            if i % 12 == 6:
                middle.cut()
        assert reconnects(loader) >= 3
    assert middle.cuts == 5
    assert_same(got, expected)


@pytest.mark.timeout(60)
def test_server_killed_and_restarted_mid_epoch(tmp_path: Path) -> None:
    port = free_port()
    flags = [
        "--dataset",
        SLOW_SAMPLES["dataset"],
        "--dataset-kwargs",
        json.dumps(SLOW_SAMPLES["dataset_kwargs"]),
        "--batch-size",
        "2",
        "--shuffle",
        "--num-workers",
        "2",
        "--seed",
        str(SEED),
        "--address",
        f"127.0.0.1:{port}",
    ]
    first, address = serve_process(*flags)
    assert address == f"127.0.0.1:{port}"
    second: subprocess.Popen[str] | None = None
    try:
        expected = whole_epoch(address, "default")
        got = []
        with RemoteLoader(address, prefetch=1, backoff=0.2) as loader:
            loader.set_epoch(EPOCH)
            for i, batch in enumerate(loader):
                got.append(batch)
                if i == 5:
                    first.kill()  # SIGKILL: no goodbye to the client
                    first.wait(timeout=10)
                    # Not communicate(): the dead server's worker processes may still hold
                    # its pipes for a few seconds (until their watchdog sees it gone).
                    for pipe in (first.stdout, first.stderr):
                        if pipe is not None:
                            pipe.close()
                    assert wait_until(lambda: port_free(port), 30)  # its listener is gone
                    second, _ = serve_process(*flags)  # same port, same spec
            assert reconnects(loader) >= 1
        assert_same(got, expected)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                stop_process(proc)


def test_broadcast_consumer_resumes_at_its_position(start_server: StartServer) -> None:
    # A broadcast consumer resumed on its own gets a production from its position: the rest of
    # the same sequence.
    address = start_server(squares("b", shuffle=True, num_workers=2))
    epoch = whole_epoch(address, "b", sharing="broadcast")
    for stop_after in (1, 6):
        assert_same(interrupted(address, "b", stop_after, sharing="broadcast"), epoch)
