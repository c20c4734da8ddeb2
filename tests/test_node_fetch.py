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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.netns import Link
from remote_loader.client import RemoteLoader
from remote_loader.server.server import Server
from remote_loader.server.settings import ServerSettings
from remote_loader.server.spec import LoaderSpec
from tests.conftest import wait_until
from tests.test_ray import ContainedCluster

# Batches of 1 to 3 MiB and a few small ones: striped over the node connections, and not.
SIZES = [(3 << 20) - 7, 100, 1 << 20, (2 << 20) + 5, 7, 3 << 20] * 4


def spec(name: str) -> LoaderSpec:
    return LoaderSpec(
        name=name,
        dataset="tests.datasets:Sizes",
        dataset_kwargs={"sizes": SIZES},
        batch_size=1,
        num_workers=2,
        persistent_workers=True,
        pool="ray",
        ray_num_cpus=0.5,  # two servers' actors on the node's 2 CPUs
    )


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
def servers(link: Link) -> Iterator[tuple[Server, Server]]:
    """One server whose trainers fetch from the node, one that sends every batch itself (the
    default)."""
    cluster = ContainedCluster()
    try:
        fetching = ServerSettings(
            address=f"{link.client_ip}:0", ray_address=cluster.address, ray_node_fetch=True
        )
        copying = ServerSettings(address=f"{link.client_ip}:0", ray_address=cluster.address)
        with Server(fetching, [spec("kept")]) as kept, Server(copying, [spec("copied")]) as copied:
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
    servers: tuple[Server, Server], transport: str
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
def test_by_default_the_server_sends_every_batch_itself(servers: tuple[Server, Server]) -> None:
    _, server = servers
    with RemoteLoader(server.address, "copied", transport="tcp") as loader:
        got = [(b.numel(), set(b.unique().tolist())) for b in loader]
        stats = loader.stats()
    assert got == expected()
    assert stats.node_bytes == 0 and stats.transport == "tcp", stats
    assert remote_bytes(server, "copied")["server"] >= stats.bytes
