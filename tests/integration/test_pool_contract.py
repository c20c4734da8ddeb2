"""The pool contract, once for each backend: torch's batches, batches of any size whole, a poison
sample given up after MAX_TASK_ATTEMPTS, a stuck batch timed out at its position, a worker death
costing nothing.

Both backends run on one pool core (server/engine/pool.py): these tests hold every backend to what
the core promises, with the real thing behind it (worker processes; Ray actors on a cluster of
two nodes on 127.0.0.1, their batches in shared memory on direct lanes, "ray"; a node in a PID
namespace of its own, as in a container, whose actors keep their batches on their node for
the trainer to fetch, "ray-node"; as bytes on their lanes, tests/integration/test_node_fetch.py;
through Ray's object store, tests/integration/test_ray.py). What only one backend has (the fork
server, a removed Ray node, Ray's start-up errors) is tested beside it, in test_supervision.py
and test_ray.py / test_ray_life.py; the lanes' handshake in test_ray_lane.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from ray.cluster_utils import Cluster

from remote_loader.client import DatasetError, RemoteLoader
from remote_loader.server.api.server import Server
from remote_loader.server.api.settings import ServerSettings
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.engine.ledger import MAX_TASK_ATTEMPTS
from tests.helpers import (
    CASES,
    LOOPBACK,
    SEED,
    ContainedCluster,
    assert_same,
    kill_a_worker,
    local_batches,
    persistent_pool,
    start_cluster,
)

TIMEOUT = 1.0
# Batch sizes that grow, shrink and spike: workers' slots (the Ray bridge's, per actor) grow,
# are dropped when too small and are reused (a slot carries every size below its own).
SIZES = [1 << 10, 3 << 20, 10, 5 << 20, 0, 2 << 20, 100 << 10, 7 << 20, 1, 3 << 20, 64, 6 << 20]


def contract_specs(pool: str, log: str) -> list[LoaderSpec]:
    # Ray: 0.1 CPU an actor, so the loaders' actors and their replacements fit on the two
    # one-CPU nodes together (and the timeouts count from the cluster's start-up, on a
    # loaded machine).
    ray: dict[str, Any] = {"pool": "ray", "ray_num_cpus": 0.1} if pool != "local" else {}
    return [
        LoaderSpec(name="aug", num_workers=2, **CASES["random-aug"], **ray),
        LoaderSpec(
            name="drawn",
            dataset="tests.datasets:DrawnWhenBuilt",
            batch_size=4,
            num_workers=2,
            **ray,
        ),
        LoaderSpec(name="iterable", num_workers=2, **CASES["iterable"], **ray),
        LoaderSpec(
            name="sizes",
            dataset="tests.datasets:Sizes",
            dataset_kwargs={"sizes": SIZES},
            batch_size=1,
            num_workers=2,
            **ray,
        ),
        LoaderSpec(
            name="crash",
            dataset="tests.datasets:Crashing",
            dataset_kwargs={"n": 8, "bad": 3},
            batch_size=1,
            num_workers=2,
            persistent_workers=True,
            **ray,
        ),
        LoaderSpec(
            name="sleepy",
            dataset="tests.datasets:Sleepy",
            dataset_kwargs={"n": 8, "bad": 3, "seconds": 60},
            batch_size=1,
            num_workers=2,
            persistent_workers=True,
            timeout=TIMEOUT,
            **ray,
        ),
        LoaderSpec(
            name="slow",
            dataset="tests.datasets:Slow",
            dataset_kwargs={"n": 24, "seconds": 0.02, "log": log},
            batch_size=1,
            num_workers=2,
            persistent_workers=True,
            **ray,
        ),
    ]


@pytest.fixture(scope="module", params=["local", "ray", "ray-node"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    ray_address = None
    cluster: Cluster | ContainedCluster | None = None
    if request.param == "ray-node":
        cluster = ContainedCluster()
        ray_address = cluster.address
    elif request.param != "local":
        cluster = start_cluster(2)
        ray_address = cluster.address
    settings = ServerSettings(
        address=f"{LOOPBACK}:0", ray_address=ray_address, ray_node_fetch=request.param == "ray-node"
    )
    try:
        log = str(tmp_path_factory.mktemp(request.param) / "slow-readers")
        with Server(settings, contract_specs(request.param, log)) as server:
            # Each Ray actor's batches came the way the parameter says.
            info = [server.hosts[n].pool_info for n in ("crash", "slow")]
            lanes = [(i.get("direct"), i.get("copied"), i.get("kept")) for i in info]
            if request.param != "local":
                expected = {"ray": (2, 0, 0), "ray-node": (2, 0, 2)}
                assert lanes == [expected[request.param]] * 2, info
            yield server
            server.stop(0)
    finally:
        if cluster is not None:
            cluster.shutdown()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "case"), [("aug", "random-aug"), ("iterable", "iterable")])
def test_workers_give_torchs_batches(served: Server, name: str, case: str) -> None:
    with RemoteLoader(served.address, name, seed=SEED) as loader:
        loader.set_epoch(3)
        remote = list(loader)
    expected = local_batches(LoaderSpec(name=name, num_workers=2, **CASES[case]), SEED, 3)
    assert len(remote) == len(expected) > 0
    assert_same(remote, expected)


@pytest.mark.timeout(300)
def test_workers_start_from_the_servers_dataset_and_get_its_epoch(served: Server) -> None:
    # NOTE [ One dataset per loader ], NOTE [ Epoch hooks ]: what the dataset drew when the
    # server built it is every worker's; set_epoch gets the epoch the stream asked for (a Ray
    # pool is kept between epochs: its actors take a new copy each).
    order = served.hosts["drawn"].dataset.order.tolist()
    with RemoteLoader(served.address, "drawn", device="cpu") as loader:
        for epoch in (0, 4):
            loader.set_epoch(epoch)
            batches = list(loader)
            assert [d for b in batches for d in b["drawn"].tolist()] == order
            assert {e for b in batches for e in b["epoch"].tolist()} == {epoch}
            assert {w for b in batches for w in b["worker"].tolist()} == {0, 1}


@pytest.mark.timeout(300)
def test_batches_of_any_size_arrive_whole_in_order(served: Server) -> None:
    with RemoteLoader(served.address, "sizes") as loader:
        for epoch in range(2):  # the second reuses what the first grew
            loader.set_epoch(epoch)
            got = [(b.numel(), set(b.unique().tolist())) for b in loader]
            assert got == [(n, {i % 256} if n else set()) for i, n in enumerate(SIZES)]


@pytest.mark.timeout(300)
def test_a_sample_that_kills_its_worker_is_given_up_and_the_epoch_goes_on(served: Server) -> None:
    restarts_before = persistent_pool(served, "crash").restarts
    with RemoteLoader(served.address, "crash") as loader:
        it = iter(loader)
        assert [int(next(it)) for _ in range(3)] == [0, 1, 2]
        with pytest.raises(DatasetError) as info:
            next(it)
        assert info.value.position == 3 and info.value.remote_type == "WorkerDiedError"
        assert f"{MAX_TASK_ATTEMPTS} times: it is given up" in str(info.value)
        assert [int(b) for b in it] == [4, 5, 6, 7]
    # A replacement per death, each charged to the poison sample: a lane's results are in the
    # kernel's socket buffer before the next task starts, so the first unanswered task is the
    # one the actor was making (through Ray's object store a death may cost one more: NOTE
    # on which task a death costs, in server/engine/ray/bridge.py).
    assert persistent_pool(served, "crash").restarts - restarts_before == MAX_TASK_ATTEMPTS


@pytest.mark.timeout(300)
def test_a_batch_past_the_timeout_is_an_error_at_its_position(served: Server) -> None:
    with RemoteLoader(served.address, "sleepy") as loader:
        it = iter(loader)
        assert [int(next(it)) for _ in range(3)] == [0, 1, 2]
        started = time.monotonic()
        with pytest.raises(DatasetError) as info:
            next(it)
        waited = time.monotonic() - started
        assert info.value.position == 3 and info.value.remote_type == "TimeoutError"
        assert f"timed out after {TIMEOUT} seconds" in str(info.value)
        assert waited < TIMEOUT + 2, waited  # the core's check, whatever the backend
        # The stuck worker was replaced: the batches after it come (a new actor takes seconds).
        assert [int(b) for b in it] == [4, 5, 6, 7]


@pytest.mark.timeout(300)
def test_a_worker_killed_mid_epoch_costs_nothing(served: Server) -> None:
    pool = persistent_pool(served, "slow")
    with RemoteLoader(served.address, "slow") as loader:
        got = []
        for i, batch in enumerate(loader):
            got.append(int(batch))
            if i == 5:
                kill_a_worker(pool)
        assert got == list(range(24))  # every batch once, in order, no error
        assert [int(b) for b in loader] == list(range(24))  # and the next epoch too
    assert pool.restarts >= 1
