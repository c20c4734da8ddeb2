"""The Ray pool backend on a real multi-node Ray cluster, simulated on this host.

Every node is bound to 127.0.0.1 (this machine may use loopback only; Ray would otherwise pick
the host's own address). One cluster serves the module: a head without CPUs (it holds no
actor) and two worker nodes, so SPREAD puts the actors of a loader on both and a removed node
takes some of them with it.

The unit tests (no server, no process, no Ray): tests/unit/test_ray.py.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from ray.cluster_utils import Cluster

from remote_loader.client import DatasetError, RemoteLoader
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import wire
from remote_loader.server.api.server import Server
from remote_loader.server.api.settings import ServerSettings
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.engine import autotune
from tests.helpers import (
    CASES,
    LOOPBACK,
    NODE,
    SEED,
    assert_same,
    first_error,
    loader_metric,
    local_batches,
    start_cluster,
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = start_cluster(2)
    yield c
    c.shutdown()  # type: ignore[no-untyped-call]


def ray_spec(name: str, case: str, num_workers: int = 2, **extra: Any) -> LoaderSpec:
    options = {**CASES[case], **extra}
    return LoaderSpec(name=name, num_workers=num_workers, pool="ray", ray_num_cpus=0.25, **options)


@pytest.fixture(scope="module")
def address(cluster: Cluster) -> Iterator[str]:
    specs = [
        ray_spec("aug", "random-aug"),
        ray_spec("sampler", "sampler", 3),
        ray_spec("unordered", "random-aug", in_order=False),
        ray_spec("persistent", "map-shuffle", persistent_workers=True),
        ray_spec("per-batch", "random-aug", seeding="per_batch"),
        LoaderSpec(name="aug-local", num_workers=2, **CASES["random-aug"]),
        LoaderSpec(
            name="per-batch-local", num_workers=2, seeding="per_batch", **CASES["random-aug"]
        ),
        LoaderSpec(name="persistent-local", num_workers=2, **CASES["map-shuffle"]),
    ]
    # ray_direct = false: these loaders' batches come through Ray's calls and object store, the
    # path of actors that reach no lane (tests/integration/test_pool_contract.py runs the lanes).
    settings = ServerSettings(
        address=f"{LOOPBACK}:0", ray_address=cluster.address, ray_direct=False
    )
    with Server(settings, specs) as server:
        assert server.hosts["persistent"].pool_info["direct"] == 0
        yield server.address
        server.stop(0)


def epoch_of(address: str, name: str, epoch: int = 3, **kwargs: Any) -> list[Any]:
    with RemoteLoader(address, name, seed=SEED, **kwargs) as loader:
        loader.set_epoch(epoch)
        return list(loader)


def epoch_of_local(case: str, epoch: int = 3) -> list[Any]:
    return local_batches(LoaderSpec(name=case, **CASES[case]), SEED, epoch)


def test_ray_workers_give_torchs_batches_with_a_custom_sampler(address: str) -> None:
    # Map-style and iterable datasets on both pools: tests/integration/test_pool_contract.py.
    remote = epoch_of(address, "sampler")
    expected = local_batches(LoaderSpec(name="sampler", num_workers=3, **CASES["sampler"]), SEED, 3)
    assert len(remote) == len(expected) > 0
    assert_same(remote, expected)


def test_ray_and_local_pools_give_the_same_batches(address: str) -> None:
    assert_same(epoch_of(address, "aug"), epoch_of(address, "aug-local"))
    # per_batch seeding: each batch seeded from its index, the same on either backend.
    assert_same(epoch_of(address, "per-batch"), epoch_of(address, "per-batch-local"))


@pytest.mark.timeout(120)
def test_without_ray_address_the_server_starts_a_local_ray_instance() -> None:
    spec = ray_spec("here", "map", persistent_workers=True)
    with Server(ServerSettings(address=f"{LOOPBACK}:0"), [spec]) as server:
        # Its actors share this host: their batches come on direct lanes.
        info = server.hosts["here"].pool_info
        assert info == {
            "backend": "ray",
            "nodes": 1,
            "workers": 2,
            "direct": 2,
            "copied": 0,
            "kept": 0,
            "remade": 0,
            # No node keeps batches here (none was fetched from its node).
            "kept_bytes": 0,
            "kept_peak": 0,
        }
        assert_same(epoch_of(server.address, "here"), epoch_of_local("map"))


def test_out_of_order_on_ray_is_the_same_multiset(address: str) -> None:
    remote = epoch_of(address, "unordered", epoch=0)
    spec = LoaderSpec(name="u", num_workers=2, **CASES["random-aug"])

    # With in_order = false a task goes to an actor with room (NOTE [ Dispatch ]): which one
    # makes a batch, and so what its RNGs draw, depends on timing; its samples do not.
    def samples(batches: list[Any]) -> list[Any]:
        return sorted((batch[0] for batch in batches), key=lambda indices: indices.tolist())

    assert_same(samples(remote), samples(local_batches(spec, SEED, 0)))


def test_sharing_and_resume_work_unchanged_on_ray(address: str) -> None:
    whole = epoch_of(address, "persistent")
    assert_same(whole, epoch_of(address, "persistent-local"))
    for rank in (0, 1):  # each rank's share is the local pool's share
        share = {"rank": rank, "world_size": 2}
        assert_same(
            epoch_of(address, "persistent", **share), epoch_of(address, "persistent-local", **share)
        )
    assert_same(epoch_of(address, "persistent", sharing="dynamic"), whole)
    with RemoteLoader(address, "persistent", seed=SEED, sharing="broadcast") as loader:
        loader.set_epoch(3)
        assert_same(list(loader), whole)
    with RemoteLoader(address, "persistent", seed=SEED) as loader:
        loader.set_epoch(3)
        it = iter(loader)
        before = [next(it) for _ in range(3)]
        state = json.loads(json.dumps(loader.state_dict()))
    with RemoteLoader(address, "persistent", seed=SEED) as loader:
        loader.load_state_dict(state)
        assert_same(before + list(loader), whole)


def test_describe_names_the_backend_and_its_nodes(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        describe = channel.unary_unary(
            f"/{wire.SERVICE_NAME}/Describe",
            request_serializer=pb.DescribeRequest.SerializeToString,
            response_deserializer=pb.LoaderInfo.FromString,
        )
        info = describe(pb.DescribeRequest(loader="persistent"), timeout=30)
    assert info.pool.backend == "ray"
    assert info.pool.workers == 2 and info.pool.nodes == 2  # SPREAD: one actor per node


@pytest.mark.timeout(240)
def test_a_removed_node_costs_nothing_of_the_epoch(cluster: Cluster) -> None:
    # A node of its own, so removing it leaves the module's cluster as it was.
    doomed = cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    spec = LoaderSpec(
        name="slow",
        dataset="tests.datasets:Slow",
        dataset_kwargs={"n": 30, "seconds": 0.05},
        batch_size=1,
        num_workers=3,
        persistent_workers=True,
        pool="ray",
        ray_num_cpus=0.25,
    )
    settings = ServerSettings(address=f"{LOOPBACK}:0", ray_address=cluster.address)
    with Server(settings, [spec]) as server, RemoteLoader(server.address) as loader:
        assert server.hosts["slow"].pool_info["nodes"] == 3
        got = []
        for i, batch in enumerate(loader):
            got.append(int(batch))
            if i == 5:
                cluster.remove_node(doomed)
        assert got == list(range(30))  # every batch once, in order, no error
        restarts = loader_metric(
            server.hosts["slow"], "remote_loader_worker_restarts_total", loader="slow"
        )
        assert restarts >= 1  # the actor on the removed node was replaced
        assert [int(b) for b in loader] == list(range(30))  # and the next epoch runs too


@pytest.mark.timeout(120)
def test_num_workers_auto_adds_actors_while_they_cannot_keep_up(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The host-idle rule has unit tests of its own (test_autotune.py); here three Ray nodes'
    # daemons share two cores with the test, so the machine's load must not decide.
    monkeypatch.setattr(autotune, "MIN_IDLE_CORES", 0.0)
    options: dict[str, Any] = {
        "dataset": "tests.datasets:Slow",  # sleeps: busy workers
        "dataset_kwargs": {"n": 200, "seconds": 0.05},
        "batch_size": 2,
        "shuffle": True,
        "seeding": "per_batch",
        "persistent_workers": True,
    }
    auto = LoaderSpec(
        name="auto",
        num_workers=1,
        autotune=True,
        max_workers=2,
        pool="ray",
        ray_num_cpus=0.25,
        **options,
    )
    fixed = LoaderSpec(name="fixed", num_workers=2, **options)
    settings = ServerSettings(address=f"{LOOPBACK}:0", ray_address=cluster.address)
    with Server(settings, [auto, fixed]) as server:
        pool = server.hosts["auto"].persistent_pool
        assert pool is not None and pool.describe()["workers"] == 1
        with RemoteLoader(server.address, "auto") as loader:
            got = [b.tolist() for b in loader]
        with RemoteLoader(server.address, "fixed") as loader:
            assert got == [b.tolist() for b in loader]  # the same batches, whatever the count
        assert pool.describe()["workers"] == 2
        labels = {"loader": "auto", "setting": "num_workers", "reason": "production"}
        assert (
            loader_metric(server.hosts["auto"], "remote_loader_autotune_changes_total", **labels)
            >= 1
        )


@pytest.mark.timeout(120)
def test_a_stuck_actor_is_stopped_after_timeout_and_the_epoch_goes_on(cluster: Cluster) -> None:
    spec = LoaderSpec(
        name="sleepy",
        dataset="tests.datasets:Sleepy",
        dataset_kwargs={"n": 10, "bad": 4},
        batch_size=1,
        num_workers=2,
        timeout=2.0,
        pool="ray",
        ray_num_cpus=0.25,
    )
    settings = ServerSettings(address=f"{LOOPBACK}:0", ray_address=cluster.address)
    with Server(settings, [spec]) as server, RemoteLoader(server.address) as loader:
        it = iter(loader)
        assert [int(next(it)) for _ in range(4)] == [0, 1, 2, 3]
        with pytest.raises(DatasetError) as info:
            next(it)
        assert info.value.position == 4 and info.value.remote_type == "TimeoutError"
        assert "Ray worker" in str(info.value) and "stopped and replaced" in str(info.value)
        assert [int(b) for b in it] == list(range(5, 10))  # the others, re-issued, in order


@pytest.mark.timeout(60)
def test_an_unreachable_ray_address_fails_streams_with_a_clear_error() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind((LOOPBACK, 0))
        dead = f"{LOOPBACK}:{s.getsockname()[1]}"
    message, took = first_error(dead, ray_spec("nowhere", "map"))
    assert f"cannot use the Ray cluster at {dead}" in message
    assert "nothing accepts connections" in message
    assert took < 30


@pytest.mark.timeout(180)
def test_losing_the_ray_cluster_mid_epoch_fails_the_stream_not_the_server() -> None:
    lost = start_cluster(1)
    spec = LoaderSpec(
        name="slow",
        dataset="tests.datasets:Slow",
        dataset_kwargs={"n": 200, "seconds": 0.05},
        batch_size=1,
        num_workers=1,
        pool="ray",
        ray_num_cpus=0.5,
    )
    ray_address = lost.address  # None once it is shut down
    settings = ServerSettings(address=f"{LOOPBACK}:0", ray_address=ray_address)
    started = time.monotonic()
    with Server(settings, [spec]) as server:
        with RemoteLoader(server.address) as loader:
            got = []
            with pytest.raises(DatasetError) as info:
                for batch in loader:
                    got.append(int(batch))
                    if len(got) == 3:
                        lost.shutdown()  # type: ignore[no-untyped-call]
        assert got == list(range(len(got)))  # what arrived was in order, nothing repeated
        assert "Ray driver process exited" in str(info.value)
        assert ray_address in str(info.value)
        assert time.monotonic() - started < 120  # an error, not a hang
        # The server lives on and says so: its health and Describe still answer.
        with grpc.insecure_channel(server.address) as channel:
            grpc.channel_ready_future(channel).result(timeout=10)
