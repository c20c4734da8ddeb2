r"""The Ray pool across hosts, simulated with network namespaces on this machine: torch parity,
the bytes through the coordinator's interface, and 1 vs 2 worker nodes.

    python benchmarks/ray_hosts.py [--batches 40] [--batch-size 16] [--nodes 1,2]   # as root
        [--workload images|heavy] [--node-cpus 0.4]

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
`--node-cpus F` confines each worker node's processes, once the node has joined, to F of a core
(a cgroup's CPU quota, as a host with that many cores): on one machine the nodes otherwise
share its cores with each other, the server and the trainer, and a second node adds no CPU;
`--workload heavy` (a few ms of convolutions per sample, benchmarks/workloads.py) makes the
nodes' CPU what bounds an epoch.
`--through-server` sets ray_node_fetch = false: COPY lanes, every batch sent to the server on
its actor's lane (NOTE [ Ray direct lane ] in server/engine/ray/lane.py); `--through-store` sets
ray_direct = false: the batches go through Ray's object store and the bridge. Nothing here uses
an address outside these namespaces; `close` kills what runs in them and deletes them and the
bridge, also on Ctrl-C.

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
from benchmarks.workloads import Heavy, Images  # noqa: E402
from remote_loader.client import RemoteLoader  # noqa: E402

NETWORK = ipaddress.IPv4Network("10.213.77.0/24")
BRIDGE = "rlhbr0"
HOSTS = {"coord": 2, "node1": 3, "node2": 4}
RAY_PORT = 6379
PRIVATE_SHM = 'mount -t tmpfs -o size=2g tmpfs /dev/shm && exec "$@"'
CONTAINED = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
WORKLOADS = {"images": Images, "heavy": Heavy}
# cgroup v1's CPU controller (this machine's); each worker node gets a group under it.
CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
CFS_PERIOD_US = 100_000


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

    def confine(self, host: str, cpus: float) -> None:
        """Every process of `host` now, and those they start, into a CPU cgroup of the host's
        own with a quota of `cpus` cores."""
        group = CPU_CGROUP / f"rlh-{host}"
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(round(cpus * CFS_PERIOD_US)))
        for pid in run(["ip", "netns", "pids", f"rlh-{host}"]).split():
            with contextlib.suppress(ProcessLookupError, OSError):  # ended meanwhile
                (group / "cgroup.procs").write_text(pid)

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
        for host in HOSTS:
            group = CPU_CGROUP / f"rlh-{host}"
            if group.is_dir():
                with contextlib.suppress(OSError):  # still has tasks: left for the next run
                    group.rmdir()


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
def cluster(
    hosts: Hosts, nodes: int, env: dict[str, str], node_cpus: float | None
) -> Iterator[str]:
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
            own = Path(env["RAY_TMPDIR"]) / name  # its `ray start` log
            own.mkdir(exist_ok=True)
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
                    stdout=(own / "ray-start.log").open("w"),
                    stderr=subprocess.STDOUT,
                )
            )
            # One node at a time: started together, the second's raylet often missed the
            # 30 s its `ray start` gives it to register (six of twelve two-node starts on the
            # 2-core machine), and a node confined to half a core always did.
            try:
                joined = f"/{2 * k}.0 CPU"
                wait_for(f"worker node {k}", lambda joined=joined: joined in cpus(), 120)
            except RuntimeError:
                print(f"`ray status` said:\n{cpus()}", file=sys.stderr)
                print(f"its `ray start` said:\n{(own / 'ray-start.log').read_text()[-3000:]}")
                raise
        if node_cpus is not None:
            # Once started: what a node does from now on runs on `node_cpus` cores.
            for k in range(1, nodes + 1):
                hosts.confine(f"node{k}", node_cpus)
        yield f"{head}:{port}"
    finally:
        for proc in started:
            proc.kill()  # --kill-child: its PID namespace goes with it
            proc.wait(30)


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
        "coord",
        ["unshare", "-m", "sh", "-c", PRIVATE_SHM, "sh", *argv],
        env,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
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


# --faults: what is done to node2 after batch FAULT_AT of the measured epoch.
FAULTS = ("none", "node killed", "node silent")
FAULT_AT = 10


def black_hole(namespace: str | None, device: str, match: Sequence[str]) -> None:
    """What leaves `device` and matches (tc u32 `match` words) goes into a class of 8 bit/s:
    silence, as a partition (the first packet may pass); the rest flows."""
    tc = ["tc", *(["-n", namespace] if namespace else [])]
    parent = ["dev", device, "parent", "1:"]
    run([*tc, "qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", "10"])
    run([*tc, "class", "add", *parent, "classid", "1:10", "htb", "rate", "10gbit"])
    silent = ["rate", "8bit", "ceil", "8bit", "burst", "1", "cburst", "1"]
    run([*tc, "class", "add", *parent, "classid", "1:20", "htb", *silent])
    run(
        [
            *tc,
            "filter",
            "add",
            *parent,
            "protocol",
            "ip",
            "prio",
            "1",
            "u32",
            *match,
            "flowid",
            "1:20",
        ]
    )


def silence(on: bool) -> None:
    """node2 and the trainer (the root namespace, on the bridge) stop hearing each other."""
    node2, trainer = ip("node2"), str(NETWORK.network_address + 1)
    ends = [(None, BRIDGE, node2), ("rlh-node2", "rlhnode2i", trainer)]
    for namespace, device, peer in ends:
        if on:
            black_hole(namespace, device, ["match", "ip", "dst", f"{peer}/32"])
        else:
            where = ["-n", namespace] if namespace else []
            subprocess.run(
                ["tc", *where, "qdisc", "del", "dev", device, "root"], capture_output=True
            )


def inject(fault: str) -> None:
    if fault == "node killed":
        for pid in run(["ip", "netns", "pids", "rlh-node2"]).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    elif fault == "node silent":
        silence(True)


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
