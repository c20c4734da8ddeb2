r"""The Ray pool across hosts, simulated with network namespaces on this machine: torch parity,
the bytes through the coordinator's interface, and 1 vs 2 worker nodes.

    python benchmarks/ray_hosts.py [--batches 40] [--batch-size 16] [--nodes 1,2]   # as root
        [--workload images|heavy] [--node-cpus 0.4] [--faults]

Layout (benchmarks/ray_cluster.py): a bridge in the root namespace, where this process is the
trainer, and on it one namespace per host: coord (the server, with a private /dev/shm, and the
Ray head), node1 and node2 (Ray worker nodes, 2 CPUs each; node3 a third, joined by
`--faults`), every Ray process in a PID namespace of its own, as on separate hosts; the server
in benchmarks/ray_server.py.
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

`--faults` measures instead, on fresh clusters of 2 worker nodes (4 actors), epochs with a
fault made to the nodes after batch FAULT_AT (the rows: benchmarks/ray_fault_table.py; the
faults: benchmarks/ray_faults.py): node2 killed (every process of its namespace, SIGKILL, as a
host that dies: Ray learns it from its health checks seconds later), then node3 joining the
pool left short; node2 silent to the trainer (tc sends what goes between them, both ways, into
a class of 8 bit/s, while node2 and the coordinator still talk); node2 killed and then node3,
the spare its actors' replacements were starting on; and without a fault, a slow trainer of a
free dataset. Per row: whether every epoch equals torch's, the seconds lost against the epoch
without a fault, the longest wait for a batch, the stream's resumes, the pool's workers on the
server's /metrics after the epoch, the seconds from a join to the pool whole, and the most
bytes of slots the actors kept against their bound.
Measured on the 2-core machine (`--faults --batches 80 --batch-size 8`, load 0.78), every
epoch exact: node killed, 5.1 s lost (its actors' tasks wait REPLACE_PATIENCE, then go to
node1's), one resume (a batch already named on node2), the pool 2 of 4; node3 joining, the
pool whole again 8.1 s after Ray registered it; node silent, 6.5 s lost, the longest wait 4.5 s
(NODE_SILENCE, client/transports/node.py, then a resume), node2's batches then through the
server (0.61 of the bytes from the nodes); two nodes lost (node3 killed 1.7 s after node2, both
replacements starting there), 6.7 s lost, the longest wait 5.1 s, one resume, the pool 2 of 4;
slow trainer, the actors' slots at most 70 MiB against the bound of 72.

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
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.ray_cluster import CPU_CGROUP, Hosts, cluster, ray_env  # noqa: E402
from benchmarks.ray_fault_table import faults  # noqa: E402
from benchmarks.ray_server import WORKLOADS, expected, same, serve  # noqa: E402
from remote_loader.client import RemoteLoader  # noqa: E402


def measure(hosts: Hosts, args: argparse.Namespace, nodes: int, env: dict[str, str]) -> str:
    with (
        cluster(hosts, nodes, env, args.node_cpus) as ray,
        tempfile.TemporaryFile("w+") as log,
    ):
        server, address = serve(hosts, args, ray.address, nodes, env, log)
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
        "--faults",
        action="store_true",
        help="nodes killed, silent, joining; kept bytes (module doc)",
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
