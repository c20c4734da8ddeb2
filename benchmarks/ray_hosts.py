r"""The Ray pool across hosts, simulated with network namespaces on this machine: torch parity,
the bytes through the coordinator's interface, and 1 vs 2 worker nodes.

    python benchmarks/ray_hosts.py [--batches 40] [--batch-size 16] [--nodes 1,2]   # as root

Layout: a bridge in the root namespace, where this process is the trainer, and on it one
namespace per host, each with one veth end and an address of 10.213.77.0/24:

    coord  .2   the server (`remote-loader serve`) and the Ray head (no CPUs); the server
                with a private /dev/shm, so the trainer reads over the data connection as
                from another host (benchmarks/netns.py says why)
    node1  .3   a Ray worker node, 2 CPUs
    node2  .4   another (started for the 2-node run)

Every Ray process also runs in a PID namespace of its own (`unshare --pid --fork --kill-child
--mount-proc`), as on separate hosts: the server cannot map an actor's memory through /proc, so
each actor attaches a KEEP lane to the server's TCP listener and the trainer fetches each batch
from the node that made it (NOTE [ Node data connection ] in protos/node.py).
`--through-server` sets ray_node_fetch = false: COPY lanes, every batch sent to the server on
its actor's lane (NOTE [ Ray direct lane ] in server/ray_lane.py); `--through-store` sets
ray_direct = false: the batches go through Ray's object store and the bridge. Nothing here uses
an address outside these namespaces; `close` kills what runs in them and deletes them and the
bridge, also on Ctrl-C.

Printed per node count: batches/s of the epoch, whether the batches equal a local torch
DataLoader's, and the bytes that crossed the coordinator's interface (`ip -s link`, received
and sent) per byte of encoded batch the trainer got: through the server each batch comes in
from the node that made it and goes out to the trainer (about 1.0 and 1.0); fetched from the
nodes, only the Frames and the server's own control traffic cross it. `node` is the share of
the trainer's bytes it fetched from nodes (RemoteLoader.stats().node_bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from benchmarks.netns import _taken_networks  # noqa: E402
from benchmarks.processes import subprocess_env  # noqa: E402
from benchmarks.workloads import Images  # noqa: E402
from remote_loader.client import RemoteLoader  # noqa: E402

NETWORK = ipaddress.IPv4Network("10.213.77.0/24")
BRIDGE = "rlhbr0"
HOSTS = {"coord": 2, "node1": 3, "node2": 4}
RAY_PORT = 6379
PRIVATE_SHM = 'mount -t tmpfs -o size=2g tmpfs /dev/shm && exec "$@"'
CONTAINED = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]


def ip(host: str) -> str:
    return str(NETWORK.network_address + HOSTS[host])


def run(argv: Sequence[str]) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


class Hosts:
    """The bridge and a namespace per host (module doc)."""

    def __init__(self) -> None:
        if os.geteuid() != 0:
            raise SystemExit("ray_hosts.py needs root (network namespaces, a bridge, tmpfs)")
        if any(NETWORK.overlaps(net) for net in _taken_networks()):
            raise SystemExit(f"{NETWORK} is in use on this machine: edit NETWORK")
        self.procs: list[subprocess.Popen[str]] = []
        run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        run(["ip", "addr", "add", f"{NETWORK.network_address + 1}/24", "dev", BRIDGE])
        run(["ip", "link", "set", BRIDGE, "up"])
        for host in HOSTS:
            ns, outside, inside = f"rlh-{host}", f"rlh{host}o", f"rlh{host}i"
            run(["ip", "netns", "add", ns])
            run(["ip", "link", "add", outside, "type", "veth", "peer", "name", inside])
            run(["ip", "link", "set", inside, "netns", ns])
            run(["ip", "link", "set", outside, "master", BRIDGE, "up"])
            run(["ip", "-n", ns, "addr", "add", f"{ip(host)}/24", "dev", inside])
            run(["ip", "-n", ns, "link", "set", inside, "up"])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def start(self, host: str, argv: Sequence[str], env: dict[str, str], **kw: Any) -> Any:
        proc = subprocess.Popen(["ip", "netns", "exec", f"rlh-{host}", *argv], env=env, **kw)
        self.procs.append(proc)
        return proc

    def counters(self, host: str) -> tuple[int, int]:
        """Bytes received and sent by the host's interface."""
        (info,) = json.loads(
            run(["ip", "-n", f"rlh-{host}", "-s", "-j", "link", "show", f"rlh{host}i"])
        )
        stats = info["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        for host in HOSTS:
            pids = subprocess.run(
                ["ip", "netns", "pids", f"rlh-{host}"], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        for host in HOSTS:
            subprocess.run(["ip", "netns", "del", f"rlh-{host}"], capture_output=True)
            subprocess.run(["ip", "link", "del", f"rlh{host}o"], capture_output=True)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


def ray_env(tmp: str) -> dict[str, str]:
    """This environment for Ray's processes and the server: no token authentication (a test
    cluster on addresses of its own), sessions under `tmp`, workloads importable."""
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("RAY_AUTH_")}
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # it refuses `ray start --address`
    env.update(RAY_AUTH_MODE="disabled", RAY_TMPDIR=tmp)
    return env


def ray_command() -> list[str]:
    return [str(Path(sys.executable).parent / "ray"), "start", "--block"]


def wait_for(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not within {timeout:g} s")
        time.sleep(0.5)


@contextlib.contextmanager
def cluster(hosts: Hosts, nodes: int, env: dict[str, str]) -> Iterator[str]:
    """A Ray head in coord and `nodes` worker nodes, each in a PID namespace of its own."""
    head, port = ip("coord"), RAY_PORT + nodes  # a fresh port: the last head may be going
    quiet: dict[str, Any] = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    started = [
        hosts.start(
            "coord",
            [
                *CONTAINED,
                *ray_command(),
                "--head",
                f"--node-ip-address={head}",
                f"--port={port}",
                "--num-cpus=0",
                "--include-dashboard=false",
            ],
            env,
            **quiet,
        )
    ]
    status = [str(Path(sys.executable).parent / "ray"), "status", f"--address={head}:{port}"]

    def cpus() -> str:
        netns = ["ip", "netns", "exec", "rlh-coord"]
        return subprocess.run([*netns, *status], capture_output=True, text=True, env=env).stdout

    try:
        wait_for("the Ray head", lambda: "Resources" in cpus(), 60)
        for k in range(1, nodes + 1):
            name = f"node{k}"
            started.append(
                hosts.start(
                    name,
                    [
                        *CONTAINED,
                        *ray_command(),
                        f"--address={head}:{port}",
                        f"--node-ip-address={ip(name)}",
                        "--num-cpus=2",
                    ],
                    env,
                    **quiet,
                )
            )
        try:
            wait_for(f"{nodes} worker node(s)", lambda: f"/{2 * nodes}.0 CPU" in cpus(), 180)
        except RuntimeError:
            # Within 90 s, two nodes failed to join in six of twelve starts on the 2-core
            # machine; 180 s since. Still none: rerun.
            print(f"`ray status` said:\n{cpus()}", file=sys.stderr)
            raise
        yield f"{head}:{port}"
    finally:
        for proc in started:
            proc.kill()  # --kill-child: its PID namespace goes with it
            proc.wait(30)


def serve(
    hosts: Hosts, args: argparse.Namespace, ray_address: str, nodes: int, env: dict[str, str]
) -> tuple[subprocess.Popen[str], str]:
    text = f"""
[server]
ray_address = "{ray_address}"
ray_direct = {"false" if args.through_store else "true"}
ray_node_fetch = {"false" if args.through_server else "true"}
[loaders.images]
dataset = "benchmarks.workloads:Images"
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
        "remote_loader.server.cli",
        "serve",
        "--config",
        path,
        "--address",
        f"{ip('coord')}:0",
        "--log-level",
        "INFO",
    ]
    proc = hosts.start(
        "coord",
        ["unshare", "-m", "sh", "-c", PRIVATE_SHM, "sh", *argv],
        env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "remote-loader: serving ... on port N"
    if "port" not in line:
        proc.kill()
        raise RuntimeError(f"the server did not start: {proc.stderr.read() if proc.stderr else ''}")
    return proc, f"{ip('coord')}:{line.strip().rsplit(' ', 1)[-1]}"


def expected(args: argparse.Namespace) -> list[Any]:
    dataset: Any = Images(args.batches * args.batch_size)  # map-style by protocol, not class
    return list(DataLoader(dataset, batch_size=args.batch_size))


def same(got: list[Any], want: list[Any]) -> bool:
    return len(got) == len(want) and all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want, strict=True)
    )


def measure(hosts: Hosts, args: argparse.Namespace, nodes: int, env: dict[str, str]) -> str:
    with cluster(hosts, nodes, env) as ray_address:
        server, address = serve(hosts, args, ray_address, nodes, env)
        try:
            with RemoteLoader(address, "images", transport="auto", device="cpu") as loader:
                list(loader)  # warm-up: the actors' first slots, the connections
                rx0, tx0 = hosts.counters("coord")
                start = time.perf_counter()
                got = list(loader)
                seconds = time.perf_counter() - start
                rx1, tx1 = hosts.counters("coord")
                stats = loader.stats()
        finally:
            server.send_signal(signal.SIGTERM)
            _, err = server.communicate(timeout=60)
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
    parser.add_argument("--through-store", action="store_true")
    parser.add_argument("--through-server", action="store_true")
    args = parser.parse_args(argv)
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found (iproute2, util-linux)")
    print(
        f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; images, "
        f"{args.batches} batches of {args.batch_size}; server and Ray head in a namespace, "
        "worker nodes (2 CPUs, 2 actors each) in others, the trainer in the root one; "
        + (
            "through Ray's object store"
            if args.through_store
            else "COPY lanes: through the server"
            if args.through_server
            else "KEEP lanes: the trainer fetches from the nodes"
        )
    )
    print(
        f"{'nodes':>5} {'b/s':>8} {'MB/s':>8} {'torch':>7} {'coord in':>8} {'out':>8} "
        f"{'node':>6}   (coord: bytes through the coordinator's interface per batch byte; "
        "node: share of batch bytes fetched from the nodes)"
    )
    tmp = tempfile.mkdtemp(prefix="rl-ray-", dir="/tmp")
    hosts = Hosts()
    try:
        for nodes in (int(n) for n in args.nodes.split(",")):
            sessions = tempfile.mkdtemp(prefix=f"{nodes}-", dir=tmp)  # a cluster's own
            print(measure(hosts, args, nodes, ray_env(sessions)), flush=True)
    finally:
        hosts.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
