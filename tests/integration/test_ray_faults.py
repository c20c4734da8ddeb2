"""Ray nodes that fail while trainers fetch from them (issue 39): no hang, a pool that grows
back, memory within its bound, and a silent node found in seconds.

Two kinds of cluster, both on this host: `ray.cluster_utils.Cluster` on 127.0.0.1 (tests/
test_ray.py), whose nodes a test kills as a host dies (SIGKILL to the raylet and everything
below it, so that Ray learns it only from its health checks, seconds later); and a node in a
PID namespace of its own (tests/helpers.py's ContainedCluster) on the root end of a veth pair
(benchmarks/netns.py's Link), so that its actors keep their batches for trainers (KEEP lanes)
and a trainer in the link's namespace reaches it across the veth, where `tc` can cut it off.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray._private.ray_constants as ray_constants
from ray.cluster_utils import Cluster
from torch.utils.data import DataLoader

from benchmarks.netns import Link
from remote_loader.client import RemoteLoader
from remote_loader.server.api.server import Server
from remote_loader.server.api.settings import ServerSettings
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.engine.pool import WorkerPool
from remote_loader.server.engine.ray.backend import RayBackend
from remote_loader.server.engine.ray.starts import REPLACE_PATIENCE, SLOW_START_PATIENCE
from remote_loader.server.transports.node import NAMED_AHEAD
from tests.datasets import Sizes, Slow
from tests.helpers import LOOPBACK, NODE, ContainedCluster, descendants, loader_metric

REPO = Path(__file__).parent.parent

# --- a node lost under its actor's replacement -------------------------------------------------

BATCHES = 60
# Ray's health checks of a node, 3 s apart by default.
HEALTH_CHECK_PERIOD = 3.0


def slow_spec() -> LoaderSpec:
    return LoaderSpec(
        name="slow",
        dataset="tests.datasets:Slow",
        dataset_kwargs={"n": BATCHES, "seconds": 0.05},
        batch_size=1,
        num_workers=2,
        persistent_workers=True,
        pool="ray",
        ray_num_cpus=1,
    )


def torch_batches() -> list[int]:
    """What torch's own DataLoader gives for slow_spec()."""
    return [int(b) for b in DataLoader(Slow(BATCHES, 0.0), batch_size=1)]


def kill_node(node: Any) -> None:
    """The node's host dies: its raylet and every process below it, at once (SIGKILL)."""
    raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    for pid in descendants(raylet) | {raylet}:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def cluster_with_a_spare_cpu(node_death: float | None = None) -> tuple[Cluster, Any]:
    """A head without CPUs, node A of 2 CPUs and node B of 1: SPREAD places one actor of 1 CPU
    on each, and A's second CPU is the only one free. Ray declares a node that stopped
    answering dead after its health checks failed for about `node_death` seconds (None: Ray's
    default, 5 checks 3 s apart). Returns the cluster and A."""
    head: dict[str, Any] = {**NODE, "num_cpus": 0, "include_dashboard": False}
    if node_death is not None:
        checks = max(1, round(node_death / HEALTH_CHECK_PERIOD))
        head["_system_config"] = {"health_check_failure_threshold": checks}
    for attempt in (1, 2):  # as tests/helpers.py's start_cluster: a loaded host may miss
        cluster: Cluster | None = None
        try:
            cluster = Cluster(initialize_head=True, head_node_args=head)
            doomed = cluster.add_node(**{**NODE, "num_cpus": 2})
            cluster.add_node(**{**NODE, "num_cpus": 1})
            cluster.wait_for_nodes()
            return cluster, doomed
        except Exception:
            if cluster is not None:
                cluster.shutdown()  # type: ignore[no-untyped-call]
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def epoch_losing(loader: RemoteLoader, node: Any) -> tuple[list[int], float]:
    """An epoch whose node A is killed at batch 5: its actor's replacement goes where Ray
    still offers A's spare CPU (a node is declared dead only after its health checks fail),
    and Ray fails its creation once it finds A dead. The batches, and the longest wait for one.
    """
    got: list[int] = []
    last, longest = time.monotonic(), 0.0
    for i, batch in enumerate(loader):
        now = time.monotonic()
        longest, last = max(longest, now - last), now
        got.append(int(batch))
        if i == 5:
            kill_node(node)
    return got, longest


@pytest.mark.timeout(300)
def test_a_replacement_placed_on_a_dead_node_ends_in_an_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Its start failed with ActorDiedError and the bridge said nothing: its tasks waited in
    # RayBackend's `pending` for an ActorStarted that never came, and the epoch hung.
    caplog.set_level(logging.WARNING, logger="remote_loader")
    cluster, doomed = cluster_with_a_spare_cpu()
    try:
        settings = ServerSettings(address=f"{LOOPBACK}:0", ray_address=cluster.address)
        with (
            Server(settings, [slow_spec()]) as server,
            RemoteLoader(server.address, timeout=60) as loader,
        ):
            pool = server.hosts["slow"].persistent_pool
            assert isinstance(pool, WorkerPool) and server.hosts["slow"].pool_info["nodes"] == 2
            got, longest = epoch_losing(loader, doomed)
            assert got == torch_batches()  # every batch once, in order
            assert pool.working == 1  # no CPU for the replacement's replacement: short of it
    finally:
        cluster.shutdown()  # type: ignore[no-untyped-call]
    assert "failed to start" in caplog.text, caplog.text
    print(f"a replacement's start failed: the longest wait for a batch was {longest:.1f} s")
    # NOTE [ Every start ends ] in server/engine/ray/starts.py: answered by Ray's own verdict (its
    # health checks: 12.8 s here), and within SLOW_START_PATIENCE however Ray fails.
    assert longest < SLOW_START_PATIENCE + REPLACE_PATIENCE, longest


GROW_BACK = 90.0  # seconds from a node joining to the pool whole again (Ray's verdict included)


@pytest.mark.timeout(400)
def test_a_pool_short_after_a_node_loss_grows_back_when_a_node_joins(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # tests/integration/test_ray_life.py removes its node gracefully: Ray knows at once, no
    # replacement is placed on it, and its pool grows back. A host that dies leaves Ray offering its
    # CPUs until its health checks fail; here that takes longer than SLOW_START_PATIENCE, so the
    # replacement placed there is short first (its tasks go to the other actor and the epoch
    # completes), and then Ray fails its start. That was said to nobody: the worker stayed
    # short for good, whatever joined later.
    caplog.set_level(logging.WARNING, logger="remote_loader")
    cluster, doomed = cluster_with_a_spare_cpu(node_death=SLOW_START_PATIENCE + 15)
    try:
        settings = ServerSettings(address=f"{LOOPBACK}:0", ray_address=cluster.address)
        with (
            Server(settings, [slow_spec()]) as server,
            RemoteLoader(server.address, timeout=60) as loader,
        ):
            host = server.hosts["slow"]
            pool = host.persistent_pool
            assert isinstance(pool, WorkerPool)

            def pool_workers() -> float:  # the gauge, as /metrics shows it
                return loader_metric(
                    host, "remote_loader_pool_workers", loader="slow", backend="ray"
                )

            got, _ = epoch_losing(loader, doomed)
            assert got == torch_batches()
            assert pool.working == 1 and pool_workers() == 1
            cluster.add_node(**{**NODE, "num_cpus": 2})  # CPUs return
            joined = time.monotonic()
            # WorkerReady is read while an epoch polls the bridge.
            while pool.working < 2 and time.monotonic() - joined < GROW_BACK:
                assert [int(b) for b in loader] == torch_batches()
            took = time.monotonic() - joined
            assert pool.working == 2, f"still short {took:.0f} s after a node joined"
            assert pool_workers() == 2
            # ... and the grown-back pool makes batches (the worker takes tasks again).
            assert [int(b) for b in loader] == torch_batches()
    finally:
        cluster.shutdown()  # type: ignore[no-untyped-call]
    assert "failed to start" in caplog.text, caplog.text
    assert "started again: 2 of 2 workers" in caplog.text, caplog.text
    print(f"short after a node loss: whole again {took:.1f} s after a node joined")


# --- batches kept on a node: bounded, and a node gone silent ------------------------------------

# 1 MiB slots exactly (a batch, its header's room and the slot's header within one granule).
SLOT = 1 << 20
SIZES = [SLOT - (64 << 10)]
# The trainer cut off from a node: its epoch, and the batch after which it is cut off.
CUT_BATCHES = 60
# Ray's health checks of a node, 3 s apart by default.
HEALTH_CHECK_PERIOD = 3.0
CUT_AT = 10


def kept_spec(name: str, batches: int) -> LoaderSpec:
    return LoaderSpec(
        name=name,
        dataset="tests.datasets:Sizes",
        dataset_kwargs={"sizes": SIZES * batches},
        batch_size=1,
        num_workers=2,
        persistent_workers=True,
        pool="ray",
        ray_num_cpus=0.5,  # two loaders' actors on the node's 2 CPUs
    )


def expected(batches: int) -> list[tuple[int, set[int]]]:
    dataset = Sizes(SIZES * batches)
    return [(b.numel(), set(b.unique().tolist())) for b in DataLoader(dataset, batch_size=1)]


@pytest.fixture(scope="module")
def link() -> Iterator[Link]:
    with Link.create() as made:
        yield made


@pytest.fixture(scope="module")
def server(link: Link) -> Iterator[Server]:
    """A Ray node in a PID namespace of its own on the link's root end (so a trainer in the
    link's namespace reaches it), and a server there whose actors keep their batches."""
    linked = type("LinkedCluster", (ContainedCluster,), {"HOST": link.client_ip})
    cluster = linked()
    try:
        settings = ServerSettings(address=f"{link.client_ip}:0", ray_address=cluster.address)
        with Server(settings, [kept_spec("free", 80), kept_spec("cut", CUT_BATCHES)]) as made:
            for name in ("free", "cut"):
                assert made.hosts[name].pool_info["kept"] == 2, made.hosts[name].pool_info
            yield made
            made.stop(0)
    finally:
        cluster.shutdown()


def pool_of(server: Server, name: str) -> WorkerPool:
    pool = server.hosts[name].persistent_pool
    assert isinstance(pool, WorkerPool)
    return pool


@pytest.mark.timeout(300)
def test_a_slow_trainer_keeps_the_nodes_batches_within_the_bound(server: Server) -> None:
    # Naming a batch on its node is one Frame, and each named batch held its slot there until
    # fetched: a free dataset had the whole epoch named ahead of its trainer.
    pool = pool_of(server, "free")
    with RemoteLoader(server.address, "free", transport="tcp") as loader:
        got = []
        for batch in loader:
            got.append((batch.numel(), set(batch.unique().tolist())))
            time.sleep(0.05)  # a trainer slower than the actors
        stats = loader.stats()
    assert got == expected(80)
    assert stats.node_bytes == stats.bytes, stats  # all fetched from the node
    info = pool.describe()
    workers, prefetch = 2, 2
    in_flight = prefetch * workers
    made_not_sent = max(2, prefetch * workers)
    nodes = 2  # each actor's data server
    # ... and per actor a slot released since its last task (a release rides on the next one).
    bound = (in_flight + made_not_sent + NAMED_AHEAD * nodes + workers) * SLOT
    print(f"kept on the node: at most {int(info['kept_peak']) >> 20} MiB, bound {bound >> 20}")
    assert 0 < int(info["kept_peak"]) <= bound, info  # unbounded: 43-64 MiB of the epoch's 80


CUT_TRAINER = (
    f"CUT_AT = {CUT_AT}\n"
    """
import json, sys, time
from remote_loader.client import RemoteLoader
with RemoteLoader(sys.argv[1], "cut", transport="tcp") as loader:
    got, times = [], []
    for i, batch in enumerate(loader):
        got.append([batch.numel(), sorted(set(batch.unique().tolist()))])
        times.append(time.monotonic())
        if i == CUT_AT:
            print("cut me", flush=True)
            sys.stdin.readline()  # the test cuts this trainer off from a node meanwhile
            times[-1] = time.monotonic()
        time.sleep(0.05)
    stats = loader.stats()
print(json.dumps({"got": got, "times": times, "reconnects": stats.reconnects,
                  "node_bytes": stats.node_bytes, "bytes": stats.bytes}))
"""
)


def tc(link: Link, inside: bool, *args: str) -> None:
    where = ["-n", link.namespace] if inside else []
    subprocess.run(["tc", *where, *args], check=True, capture_output=True, timeout=30)


def cut_off(link: Link, port: int) -> None:
    """Packets between the link's namespace and `port` of its root end go into a class of 8
    bit/s, both ways: the trainer's connections to that node fall silent (the first packet
    each way still passes), and everything else flows."""
    for inside, device, match in ((True, link.ns_veth, "dport"), (False, link.host_veth, "sport")):
        dev = ["dev", device, "parent", "1:"]
        tc(
            link,
            inside,
            "qdisc",
            "add",
            "dev",
            device,
            "root",
            "handle",
            "1:",
            "htb",
            "default",
            "10",
        )
        tc(link, inside, "class", "add", *dev, "classid", "1:10", "htb", "rate", "10gbit")
        silent = ["rate", "8bit", "ceil", "8bit", "burst", "1", "cburst", "1"]
        tc(link, inside, "class", "add", *dev, "classid", "1:20", "htb", *silent)
        u32 = ["protocol", "ip", "prio", "1", "u32", "match", "ip", match, str(port), "0xffff"]
        tc(link, inside, "filter", "add", *dev, *u32, "flowid", "1:20")


@pytest.mark.timeout(300)
def test_a_node_that_falls_silent_costs_seconds_and_one_resume(server: Server, link: Link) -> None:
    # A trainer cut off from one node waited 30 s (a data connection's stall timeout) for the
    # batch named there, then resumed.
    pool = pool_of(server, "cut")
    argv = link.wrap([sys.executable, "-c", CUT_TRAINER, server.address])
    trainer = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert trainer.stdout is not None and trainer.stdin is not None
        assert trainer.stdout.readline().strip() == "cut me"
        backend = pool._backend
        assert isinstance(backend, RayBackend) and backend._lanes is not None
        directory = backend._lanes._directory
        assert directory is not None
        nodes = sorted(directory.nodes())
        assert len(nodes) == 2, nodes  # each actor's data server, both reached
        cut_off(link, nodes[0][1])
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        out, _ = trainer.communicate(timeout=240)
    finally:
        trainer.kill()
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    assert [(n, set(v)) for n, v in result["got"]] == expected(CUT_BATCHES)
    times = result["times"][CUT_AT:]
    longest = max(b - a for a, b in itertools.pairwise(times))
    print(
        f"a node fell silent: the longest wait for a batch was {longest:.1f} s, "
        f"{result['reconnects']} resume(s), {result['node_bytes'] / result['bytes']:.2f} of "
        "the bytes from the nodes"
    )
    # The batch named on the silent node: NODE_SILENCE (3 s), a resume, REACH_WAIT (1 s).
    assert longest < 10.0, longest
    assert result["reconnects"] == 1, result  # that batch's; none for the node's others
    assert 0 < result["node_bytes"] < result["bytes"], result  # the silent node's via the server
