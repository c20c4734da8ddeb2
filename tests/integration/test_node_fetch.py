"""Trainers fetch a batch from the Ray node that made it (NOTE [ Node data connection ] in
protos/node.py), on this host: a Ray node in a PID namespace of its own (ContainedCluster, on
127.0.0.2), so the server cannot map its actors' memory and they keep their batches; a trainer
in this process reaches the node, one in a network namespace of its own (benchmarks/netns.py)
reaches the server through a veth pair but not the node, and gets every batch through the
server, per batch, losing and repeating nothing. benchmarks/ray_hosts.py runs the same path
across namespaces with the bytes through the server's interface counted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.netns import Link
from remote_loader.client import RemoteLoader
from remote_loader.client.types import Transport
from remote_loader.server.api.server import Server
from remote_loader.server.api.settings import ServerSettings
from remote_loader.server.config.spec import LoaderSpec
from tests.helpers import ContainedCluster, kill_a_worker, persistent_pool, wait_until

# Batches of 1 to 3 MiB and a few small ones: striped over the node connections, and not.
SIZES = [(3 << 20) - 7, 100, 1 << 20, (2 << 20) + 5, 7, 3 << 20] * 4


def spec(name: str, **options: Any) -> LoaderSpec:
    settings: dict[str, Any] = {
        "dataset": "tests.datasets:Sizes",
        "dataset_kwargs": {"sizes": SIZES},
        "batch_size": 1,
        "num_workers": 2,
        "persistent_workers": True,
        "pool": "ray",
        "ray_num_cpus": 0.3,  # three loaders' actors on the node's 2 CPUs, and a replacement
        **options,
    }
    return LoaderSpec(name=name, **settings)


def expected() -> list[tuple[int, set[int]]]:
    return [(n, {i % 256} if n else set()) for i, n in enumerate(SIZES)]


def remote_bytes(server: Server, name: str) -> dict[str, float]:
    """remote_loader_remote_batch_bytes by path."""
    got: dict[str, float] = {}
    for family in server.hosts[name].metrics.collect():
        if family.name == "remote_loader_remote_batch_bytes":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    got[sample.labels["path"]] = sample.value
    return got


@pytest.fixture(scope="module")
def link() -> Iterator[Link]:
    with Link.create() as made:
        yield made


@pytest.fixture(scope="module")
def servers(
    link: Link, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Server]]:
    """One server whose trainers fetch from the node (the default), one told not to."""
    cluster = ContainedCluster()
    try:
        fetching = ServerSettings(address=f"{link.client_ip}:0", ray_address=cluster.address)
        copying = ServerSettings(
            address=f"{link.client_ip}:0", ray_address=cluster.address, ray_node_fetch=False
        )
        readers = str(tmp_path_factory.mktemp("readers") / "pids")
        # 8 MB batches: a trainer that stops reading fills its connections' buffers with a few,
        # and the pool makes more ahead, which wait on their node.
        slow = spec(
            "slow",
            dataset="tests.datasets:Logged",
            dataset_kwargs={"n": 24, "nbytes": 8 << 20, "log": readers},
        )
        loaders = [spec("kept"), slow]
        with Server(fetching, loaders) as kept, Server(copying, [spec("copied")]) as copied:
            assert kept.hosts["kept"].pool_info["kept"] == 2, kept.hosts["kept"].pool_info
            assert copied.hosts["copied"].pool_info["copied"] == 2, copied.hosts["copied"].pool_info
            yield kept, copied
            kept.stop(0)
            copied.stop(0)
    finally:
        cluster.shutdown()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["auto", "tcp", "grpc"])
def test_a_trainer_fetches_every_batch_from_the_node_that_made_it(
    servers: tuple[Server, Server], transport: Transport
) -> None:
    server, _ = servers
    before = remote_bytes(server, "kept")
    with RemoteLoader(server.address, "kept", transport=transport) as loader:
        for epoch in range(2):  # the second makes its batches in slots the first released
            loader.set_epoch(epoch)
            got = [(b.numel(), set(b.unique().tolist())) for b in loader]
            assert got == expected()
            stats = loader.stats()
            assert stats.node_bytes == stats.bytes > sum(SIZES), stats
            assert stats.transport == "node" and stats.reconnects == 0, stats
    # Nothing of those batches crossed the server, which counts what the node served (as its
    # node says: soon after).
    fetched = 2 * stats.bytes + before.get("node", 0)
    assert wait_until(lambda: remote_bytes(server, "kept").get("node") == fetched, 10)
    assert remote_bytes(server, "kept").get("server", 0) == before.get("server", 0)


TRAINER = """
import json, sys
from remote_loader.client import RemoteLoader
with RemoteLoader(sys.argv[1], "kept") as loader:
    sizes = [[b.numel(), sorted(set(b.unique().tolist()))] for b in loader]
    stats = loader.stats()
print(json.dumps({"sizes": sizes, "node_bytes": stats.node_bytes, "bytes": stats.bytes,
                  "reconnects": stats.reconnects, "transport": stats.transport}))
"""


@pytest.mark.timeout(300)
def test_a_trainer_that_cannot_reach_the_node_gets_every_batch_through_the_server(
    servers: tuple[Server, Server], link: Link
) -> None:
    server, _ = servers
    before = remote_bytes(server, "kept")
    # In a network namespace of its own: the server's address is reached through the veth
    # pair, the node's (127.0.0.2 of this namespace) is not there at all.
    argv = link.wrap([sys.executable, "-c", TRAINER, server.address])
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=240, cwd=Path(__file__).parent.parent
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(n, set(v)) for n, v in result["sizes"]] == expected()
    assert result["node_bytes"] == 0 and result["reconnects"] == 0, result
    assert result["transport"] == "tcp", result  # the stream's own data connections
    after = remote_bytes(server, "kept")
    assert after["server"] - before.get("server", 0) == result["bytes"]


@pytest.mark.timeout(300)
def test_an_actor_lost_after_its_batches_were_named_costs_one_resume(
    servers: tuple[Server, Server],
) -> None:
    server, _ = servers
    pool = persistent_pool(server, "slow")
    with RemoteLoader(server.address, "slow", transport="tcp") as loader:
        batches = iter(loader)
        got = [int(next(batches)[0, 0])]
        # Meanwhile the pool makes ahead (prefetch_factor * num_workers tasks, the lane's
        # window) and the server names each batch on its node as it comes: this trainer has
        # fetched none of them. A time, not a state: no public count says how many batches a
        # node keeps, and a kill that lands sooner only makes less ahead (the test still holds).
        time.sleep(1.0)
        kill_a_worker(pool)  # the one that made the latest of them
        got += [int(b[0, 0]) for b in batches]
        stats = loader.stats()
    assert got == list(range(24))  # every batch once, in order, no error
    # The first batch named on the lost node breaks the stream once; resumed, it is made again.
    assert stats.reconnects <= 1, stats
    assert pool.restarts >= 1


SLOW_TRAINER = """
import json, sys
from remote_loader.client import RemoteLoader
with RemoteLoader(sys.argv[1], "slow") as loader:
    batches = iter(loader)
    got = [int(next(batches)[0, 0])]
    print("waiting", flush=True)
    sys.stdin.readline()  # the test kills an actor meanwhile
    got += [int(b[0, 0]) for b in batches]
    stats = loader.stats()
print(json.dumps({"got": got, "reconnects": stats.reconnects, "node_bytes": stats.node_bytes}))
"""


@pytest.mark.timeout(300)
def test_an_actor_lost_with_batches_not_yet_sent_costs_nothing(
    servers: tuple[Server, Server], link: Link
) -> None:
    """NOTE [ Node lost ] in server/batch/node_directory.py: a trainer that cannot reach the node
    gets every batch from the server, which fetches each when it sends it; those made ahead wait on
    their node, and are made again by another actor when theirs is lost."""
    server, _ = servers
    pool = persistent_pool(server, "slow")
    remade = int(pool.describe()["remade"])
    argv = link.wrap([sys.executable, "-c", SLOW_TRAINER, server.address])
    trainer = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    try:
        assert trainer.stdout is not None and trainer.stdin is not None
        assert trainer.stdout.readline().strip() == "waiting"
        # The pool makes ahead: batches kept on the node, not sent. A time, not a state (no
        # public count of the batches a node keeps; see the test above).
        time.sleep(1.0)
        kill_a_worker(pool)
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        out, _ = trainer.communicate(timeout=240)
    finally:
        trainer.kill()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["got"] == list(range(24)), result  # every batch once, in order, no error
    assert result["reconnects"] == 0 and result["node_bytes"] == 0, result
    assert int(pool.describe()["remade"]) > remade  # made again by the other actor, not lost


@pytest.mark.timeout(300)
def test_a_server_told_not_to_sends_every_batch_itself(servers: tuple[Server, Server]) -> None:
    _, server = servers
    with RemoteLoader(server.address, "copied", transport="tcp") as loader:
        got = [(b.numel(), set(b.unique().tolist())) for b in loader]
        stats = loader.stats()
    assert got == expected()
    assert stats.node_bytes == 0 and stats.transport == "tcp", stats
    assert remote_bytes(server, "copied")["server"] >= stats.bytes
