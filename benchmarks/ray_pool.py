r"""pool = "ray" against pool = "local": throughput, the per-batch overhead Ray adds, scaling.

    python benchmarks/ray_pool.py                      # heavy workload, 2 workers, 1-3 nodes
    python benchmarks/ray_pool.py --workload images --nodes 1
    python benchmarks/ray_pool.py --ray-address HEAD:6379 --workers 16   # a real cluster

One `remote-loader serve` process serves two loaders that differ only in `pool`; a
RemoteLoader in this process reads their epochs in alternation (a warm-up epoch each first,
persistent workers, so pool start-up is not timed). Without --ray-address the Ray cluster is
simulated on this host with `ray.cluster_utils.Cluster`, every node on 127.0.0.1: a head without
CPUs and N worker nodes of --cpus-per-node CPUs each; the scaling run repeats the comparison for
each N in --nodes. On a small machine the simulated nodes share its cores, so more nodes show
Ray's overhead, not a speed-up: run it unchanged on a bigger box (or a real cluster) for that.

Simulated nodes share this host, so their actors hand batches over in shared memory on direct
lanes (NOTE [ Ray direct lane ] in server/engine/ray/lane.py); --through-store sends them through
Ray's object store instead. Actors whose memory the server cannot map (another host or container)
send their batches as bytes on their lanes; to measure that on one host, start a node in a PID
namespace of its own and pass --ray-address (as root; RESULTS.md has the figures):

    unshare --pid --fork --kill-child --mount-proc ray start --block --head \
        --node-ip-address=127.0.0.2 --port=6399 --num-cpus=0 --include-dashboard=false &
    unshare --pid --fork --kill-child --mount-proc ray start --block \
        --address=127.0.0.2:6399 --node-ip-address=127.0.0.2 --num-cpus=2 &
    python benchmarks/ray_pool.py --workload images \
        --ray-address 127.0.0.2:6399

Printed per node count: batches/s of each pool (median over --rounds), their ratio, the time per
batch each takes and the difference (what Ray adds per batch), and the encoded bytes per batch
that cross the server host (every batch does, once in, once out: NOTE [ Ray data path ]).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.processes import start_server, stop_process  # noqa: E402
from remote_loader.client import RemoteLoader  # noqa: E402

WORKLOADS = {"heavy": "benchmarks.workloads:Heavy", "images": "benchmarks.workloads:Images"}
LOOPBACK = "127.0.0.1"


def config(args: argparse.Namespace, ray_address: str) -> str:
    """A config file with the two loaders (and the Ray address)."""
    samples = args.batches * args.batch_size
    loaders = []
    for pool in ("local", "ray"):
        loaders.append(
            f"""
[loaders.{pool}]
dataset = "{WORKLOADS[args.workload]}"
dataset_kwargs = {{ n = {samples} }}
batch_size = {args.batch_size}
num_workers = {args.workers}
persistent_workers = true
pool = "{pool}"
ray_num_cpus = {args.ray_num_cpus}
"""
        )
    direct = "false" if args.through_store else "true"
    text = f'[server]\nray_address = "{ray_address}"\nray_direct = {direct}\n' + "".join(loaders)
    fd, path = tempfile.mkstemp(suffix=".toml", prefix="ray-bench-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def epoch(address: str, name: str, number: int) -> tuple[float, int, int]:
    """Seconds, batches and encoded bytes of one epoch of loader `name`."""
    with RemoteLoader(address, name, transport="auto") as loader:
        loader.set_epoch(number)
        start = time.perf_counter()
        batches = sum(1 for _ in loader)
        seconds = time.perf_counter() - start
        return seconds, batches, loader.stats().bytes


def compare(args: argparse.Namespace, ray_address: str) -> dict[str, Any]:
    path = config(args, ray_address)
    proc, address = start_server(["--config", path, "--address", f"{LOOPBACK}:0"])
    try:
        for name in ("local", "ray"):
            epoch(address, name, 0)  # warm-up: workers, datasets, the first batches
        rates: dict[str, list[float]] = {"local": [], "ray": []}
        per_batch_bytes = 0.0
        for r in range(args.rounds):
            for name in ("local", "ray"):
                seconds, batches, nbytes = epoch(address, name, r + 1)
                rates[name].append(batches / seconds)
                if name == "ray":
                    per_batch_bytes = nbytes / batches
        return {
            "local": statistics.median(rates["local"]),
            "ray": statistics.median(rates["ray"]),
            "bytes": per_batch_bytes,
        }
    finally:
        stop_process(proc)
        os.unlink(path)


def simulated(nodes: int, cpus: float) -> Any:
    from ray.cluster_utils import Cluster

    # Keeps every Ray process of this host on 127.0.0.1 (see tests/helpers.py).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    node: dict[str, Any] = {"node_ip_address": LOOPBACK, "object_store_memory": 200 << 20}
    cluster = Cluster(
        initialize_head=True, head_node_args={**node, "num_cpus": 0, "include_dashboard": False}
    )
    for _ in range(nodes):
        cluster.add_node(**node, num_cpus=cpus)
    cluster.wait_for_nodes()
    return cluster


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=WORKLOADS, default="heavy")
    parser.add_argument("--batches", type=int, default=40, help="batches per epoch")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2, help="workers of each pool")
    parser.add_argument("--ray-num-cpus", type=float, default=0.5, help="CPUs per Ray actor")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--nodes", default="1,2,3", help="simulated worker nodes, one run each (default 1,2,3)"
    )
    parser.add_argument("--cpus-per-node", type=float, default=2.0)
    parser.add_argument("--ray-address", help="a running cluster instead of simulated nodes")
    parser.add_argument(
        "--through-store",
        action="store_true",
        help="ray_direct = false: this host's actors hand batches over through Ray's object "
        "store, as actors on other hosts do (NOTE [ Ray direct lane ])",
    )
    args = parser.parse_args(argv)

    print(
        f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; workload "
        f"{args.workload}, {args.batches} batches of {args.batch_size}, {args.workers} workers "
        f"per pool, {args.rounds} rounds; same-host actors "
        f"{'through the object store' if args.through_store else 'on direct lanes'}"
    )
    print(
        f"{'nodes':>5} {'local b/s':>10} {'ray b/s':>9} {'ray/local':>9} "
        f"{'local ms/b':>10} {'ray ms/b':>9} {'+ms/b':>7} {'MB/b via server':>16}"
    )
    runs = [("cluster", None)] if args.ray_address else [(n, None) for n in args.nodes.split(",")]
    for label, _ in runs:
        cluster = None
        if args.ray_address:
            address = args.ray_address
        else:
            cluster = simulated(int(label), args.cpus_per_node)
            address = cluster.address
        try:
            result = compare(args, address)
        finally:
            if cluster is not None:
                cluster.shutdown()
        local_ms, ray_ms = 1000 / result["local"], 1000 / result["ray"]
        print(
            f"{label:>5} {result['local']:>10.1f} {result['ray']:>9.1f} "
            f"{result['ray'] / result['local']:>9.2f} {local_ms:>10.1f} {ray_ms:>9.1f} "
            f"{ray_ms - local_ms:>7.1f} {result['bytes'] / 1e6:>16.3f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
