r"""The Ray pool across hosts, simulated with network namespaces on this machine: torch parity,
the bytes through the coordinator's interface, and 1 vs 2 worker nodes.

    python benchmarks/ray_hosts.py [--batches 40] [--batch-size 16] [--nodes 1,2]   # as root
        [--workload images|heavy] [--node-cpus 0.4]

Layout (benchmarks/ray_cluster.py): a bridge in the root namespace, where this process is the
trainer, and on it one namespace per host: coord (the server, with a private /dev/shm, and the
Ray head), node1 and node2 (Ray worker nodes, 2 CPUs each), every Ray process in a PID
namespace of its own, as on separate hosts.
`--node-cpus F` confines each worker node's processes, once the node has joined, to F of a core
(a cgroup's CPU quota, as a host with that many cores): on one machine the nodes otherwise
share its cores with each other, the server and the trainer, and a second node adds no CPU;
`--workload heavy` (a few ms of convolutions per sample, benchmarks/workloads.py) makes the
nodes' CPU what bounds an epoch.
`--through-server` sets ray_node_fetch = false: COPY lanes, every batch sent to the server on
its actor's lane (NOTE [ Ray direct lane ] in server/engine/ray/lane.py); `--through-store` sets
ray_direct = false: the batches go through Ray's object store and the bridge. Nothing here uses
an address outside these namespaces; the namespaces, what runs in them and the bridge go at the
end, also on Ctrl-C.

`--faults` measures instead, on 2 worker nodes, an epoch during which node2 is killed (every
process of its namespace, SIGKILL, as a host that dies: Ray learns it from its health checks
seconds later) or falls silent to the trainer (tc sends what goes between the trainer and node2,
both ways, into a class of 8 bit/s, while node2 and the coordinator still talk), after batch
FAULT_AT, each on a fresh cluster: whether the epoch still equals torch's, the seconds it lost
against the same epoch without a fault, the longest wait for a batch and the stream's resumes.
Measured on the 2-core machine (`--faults --batches 80 --batch-size 8`): node killed, the
epoch exact, 5.1 s lost (its actors' tasks wait REPLACE_PATIENCE, then go to node1's), one
resume (a batch already named on node2); node silent, exact, 6.5 s lost, the longest wait
3.6 s (NODE_SILENCE, client/transports/node.py), one resume, then node2's batches through the
server (0.61 of the bytes from the nodes).

Printed per node count: batches/s of the epoch, whether the batches equal a local torch
DataLoader's, and the bytes that crossed the coordinator's interface (`ip -s link`, received
and sent) per byte of encoded batch the trainer got: through the server each batch comes in
from the node that made it and goes out to the trainer (about 1.0 and 1.0); fetched from the
nodes, only the Frames and the server's own control traffic cross it. `node` is the share of
the trainer's bytes it fetched from nodes (RemoteLoader.stats().node_bytes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from benchmarks.ray_cluster import CPU_CGROUP, Hosts, cluster, ip, ray_env  # noqa: E402
from benchmarks.ray_faults import FAULT_AT, FAULTS, inject, silence  # noqa: E402
from benchmarks.workloads import Heavy, Images  # noqa: E402
from remote_loader.client import RemoteLoader  # noqa: E402

WORKLOADS = {"images": Images, "heavy": Heavy}


def serve(
    hosts: Hosts,
    args: argparse.Namespace,
    ray_address: str,
    nodes: int,
    env: dict[str, str],
    log: Any,
) -> tuple[subprocess.Popen[str], str]:
    """The server in coord, logging at INFO into the file `log` (a pipe nobody reads while the
    epochs run would fill and stop it)."""
    text = f"""
[server]
ray_address = "{ray_address}"
ray_direct = {"false" if args.through_store else "true"}
ray_node_fetch = {"false" if args.through_server else "true"}
[loaders.bench]
dataset = "benchmarks.workloads:{WORKLOADS[args.workload].__name__}"
dataset_kwargs = {{ n = {args.batches * args.batch_size} }}
batch_size = {args.batch_size}
num_workers = {2 * nodes}
persistent_workers = true
pool = "ray"
ray_num_cpus = 1
"""
    fd, path = tempfile.mkstemp(suffix=".toml", prefix="ray-hosts-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    argv = [
        sys.executable,
        "-m",
        "remote_loader.server.cli.main",
        "serve",
        "--config",
        path,
        "--address",
        f"{ip('coord')}:0",
        "--log-level",
        "INFO",
    ]
    proc = hosts.start(
        "coord", argv, env, own_shm=True, stdout=subprocess.PIPE, stderr=log, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "remote-loader: serving ... on port N"
    if "port" not in line:
        proc.kill()
        log.seek(0)
        raise RuntimeError(f"the server did not start: {log.read()}")
    return proc, f"{ip('coord')}:{line.strip().rsplit(' ', 1)[-1]}"


def expected(args: argparse.Namespace) -> list[Any]:
    # Map-style by protocol, not class.
    dataset: Any = WORKLOADS[args.workload](args.batches * args.batch_size)
    return list(DataLoader(dataset, batch_size=args.batch_size))


def same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and torch.equal(got, want)
    if isinstance(want, list | tuple):
        return len(got) == len(want) and all(same(a, b) for a, b in zip(got, want, strict=True))
    return bool(got == want)


def measure(hosts: Hosts, args: argparse.Namespace, nodes: int, env: dict[str, str]) -> str:
    with (
        cluster(hosts, nodes, env, args.node_cpus) as ray_address,
        tempfile.TemporaryFile("w+") as log,
    ):
        server, address = serve(hosts, args, ray_address, nodes, env, log)
        try:
            with RemoteLoader(address, "bench", transport="auto", device="cpu") as loader:
                list(loader)  # warm-up: the actors' first slots, the connections
                rx0, tx0 = hosts.counters("coord")
                start = time.perf_counter()
                got = list(loader)
                seconds = time.perf_counter() - start
                rx1, tx1 = hosts.counters("coord")
                stats = loader.stats()
        finally:
            server.send_signal(signal.SIGTERM)
            server.communicate(timeout=60)
            log.seek(0)
            err = log.read()
    lanes = next(
        (line.split(": ", 1)[-1] for line in err.splitlines() if "Ray actor(s)" in line), "?"
    )
    batch_bytes = stats.bytes / max(1, stats.batches) * len(got)
    return (
        f"{nodes:>5} {len(got) / seconds:>8.1f} {stats.bytes / seconds / 1e6:>8.1f} "
        f"{'yes' if same(got, expected(args)) else 'NO':>7} "
        f"{(rx1 - rx0) / batch_bytes:>8.4f} {(tx1 - tx0) / batch_bytes:>8.4f} "
        f"{stats.node_bytes / max(1, stats.bytes):>6.3f}   {lanes}"
    )


def measure_fault(
    hosts: Hosts, args: argparse.Namespace, fault: str, env: dict[str, str]
) -> tuple[float, str]:
    """One epoch on 2 worker nodes with `fault` made after batch FAULT_AT: its seconds and the
    row's columns after them."""
    with (
        cluster(hosts, 2, env, args.node_cpus) as ray_address,
        tempfile.TemporaryFile("w+") as log,
    ):
        server, address = serve(hosts, args, ray_address, 2, env, log)
        try:
            with RemoteLoader(
                address, "bench", transport="auto", device="cpu", timeout=300
            ) as loader:
                list(loader)  # warm-up: the actors' first slots, the connections
                got, longest = [], 0.0
                start = last = time.perf_counter()
                for i, batch in enumerate(loader):
                    now = time.perf_counter()
                    longest, last = max(longest, now - last), now
                    got.append(batch)
                    if i == FAULT_AT:
                        inject(fault)
                seconds = time.perf_counter() - start
                stats = loader.stats()
        finally:
            silence(False)
            server.send_signal(signal.SIGTERM)
            server.communicate(timeout=60)
    return seconds, (
        f"{'yes' if same(got, expected(args)) else 'NO':>7} {longest:>8.1f} "
        f"{stats.reconnects:>7} {stats.node_bytes / max(1, stats.bytes):>6.3f}"
    )


def faults(hosts: Hosts, args: argparse.Namespace, tmp: str) -> None:
    print(
        f"{'fault':<12} {'seconds':>8} {'lost':>6} {'torch':>7} {'longest':>8} {'resumes':>7} "
        f"{'node':>6}   (lost: seconds against the epoch without a fault; longest: the "
        "longest wait for a batch, s; node: share of batch bytes fetched from the nodes)"
    )
    baseline = None
    for fault in FAULTS:
        sessions = tempfile.mkdtemp(prefix=f"{fault.replace(' ', '-')}-", dir=tmp)
        seconds, row = measure_fault(hosts, args, fault, ray_env(sessions))
        baseline = seconds if baseline is None else baseline
        print(f"{fault:<12} {seconds:>8.1f} {seconds - baseline:>6.1f} {row}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--nodes", default="1,2")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="images")
    parser.add_argument(
        "--node-cpus",
        type=float,
        help="confine each worker node to this many cores (a CPU cgroup's quota)",
    )
    parser.add_argument("--through-store", action="store_true")
    parser.add_argument("--through-server", action="store_true")
    parser.add_argument(
        "--faults", action="store_true", help="a node killed, a node silent (module doc)"
    )
    args = parser.parse_args(argv)
    if args.node_cpus is not None and not (
        0.01 <= args.node_cpus <= (os.cpu_count() or 1) and (CPU_CGROUP / "tasks").exists()
    ):
        raise SystemExit(
            f"--node-cpus {args.node_cpus:g}: needs a value from 0.01 to the machine's "
            f"{os.cpu_count()} cores and cgroup v1's CPU controller at {CPU_CGROUP}"
        )
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found (iproute2, util-linux)")
    print(
        f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; {args.workload}, "
        f"{args.batches} batches of {args.batch_size}; server and Ray head in a namespace, "
        "worker nodes (2 CPUs, 2 actors each"
        + ("" if args.node_cpus is None else f", confined to {args.node_cpus:g} of a core")
        + ") in others, the trainer in the root one; "
        + (
            "through Ray's object store"
            if args.through_store
            else "COPY lanes: through the server"
            if args.through_server
            else "KEEP lanes: the trainer fetches from the nodes"
        )
    )
    tmp = tempfile.mkdtemp(prefix="rl-ray-", dir="/tmp")
    hosts = Hosts()
    try:
        if args.faults:
            faults(hosts, args, tmp)
            return 0
        print(
            f"{'nodes':>5} {'b/s':>8} {'MB/s':>8} {'torch':>7} {'coord in':>8} {'out':>8} "
            f"{'node':>6}   (coord: bytes through the coordinator's interface per batch byte; "
            "node: share of batch bytes fetched from the nodes)"
        )
        for nodes in (int(n) for n in args.nodes.split(",")):
            sessions = tempfile.mkdtemp(prefix=f"{nodes}-", dir=tmp)  # a cluster's own
            print(measure(hosts, args, nodes, ray_env(sessions)), flush=True)
    finally:
        hosts.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
