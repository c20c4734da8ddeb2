r"""The simulated hosts of benchmarks/ray_hosts.py: network namespaces on one bridge, and a Ray
cluster on them whose every process runs in a PID namespace of its own.

Layout: a bridge in the root namespace, where this process is the trainer, and on it one
namespace per host, each with one veth end and an address of 10.213.77.0/24:

    coord  .2   the server (`remote-loader serve`) and the Ray head (no CPUs); the server
                with a private /dev/shm, so the trainer reads over the data connection as
                from another host (benchmarks/netns.py says why)
    node1  .3   a Ray worker node, 2 CPUs
    node2  .4   another (started for the 2-node run)
    node3  .5   a spare, joined to a running cluster by the fault rows that need a third
                host (benchmarks/ray_fault_table.py)

Every Ray process also runs in a PID namespace of its own (`unshare --pid --fork --kill-child
--mount-proc`), as on separate hosts: the server cannot map an actor's memory through /proc, so
each actor attaches a KEEP lane to the server's TCP listener and the trainer fetches each batch
from the node that made it (NOTE [ Node data connection ] in protos/node.py).
Nothing here uses an address outside these namespaces; `Hosts.close` kills what runs in them
and deletes them and the bridge.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.netns import _taken_networks, private_shm
from benchmarks.processes import subprocess_env

NETWORK = ipaddress.IPv4Network("10.213.77.0/24")
BRIDGE = "rlhbr0"
HOSTS = {"coord": 2, "node1": 3, "node2": 4, "node3": 5}
RAY_PORT = 6379
CONTAINED = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
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

    def start(
        self, host: str, argv: Sequence[str], env: dict[str, str], own_shm: bool = False, **kw: Any
    ) -> Any:
        """`argv` in `host`'s namespace; `own_shm`: with a private /dev/shm (netns.private_shm)."""
        namespace = f"rlh-{host}"
        wrapped = (
            private_shm(namespace, argv) if own_shm else ["ip", "netns", "exec", namespace, *argv]
        )
        proc = subprocess.Popen(wrapped, env=env, **kw)
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


def wait_for(what: str, check: Any, timeout: float, period: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not within {timeout:g} s")
        time.sleep(period)


class RayCluster:
    """A running Ray cluster of `cluster()`: its head's address, and the worker nodes started in
    it, which end with it."""

    def __init__(
        self, hosts: Hosts, env: dict[str, str], node_cpus: float | None, address: str
    ) -> None:
        self.hosts, self.env, self.node_cpus, self.address = hosts, env, node_cpus, address
        self.started: list[subprocess.Popen[str]] = []

    def start_node(self, name: str) -> Path:
        """`ray start` of worker node `name` (2 CPUs), in its namespace and a PID namespace of
        its own; the file it writes its output to."""
        own = Path(self.env["RAY_TMPDIR"]) / name
        own.mkdir(exist_ok=True)
        log = own / "ray-start.log"
        self.started.append(
            self.hosts.start(
                name,
                [
                    *CONTAINED,
                    *ray_command(),
                    f"--address={self.address}",
                    f"--node-ip-address={ip(name)}",
                    "--num-cpus=2",
                ],
                # Unbuffered: join() reads the file while `ray start` still runs.
                {**self.env, "PYTHONUNBUFFERED": "1"},
                stdout=log.open("w"),
                stderr=subprocess.STDOUT,
            )
        )
        return log

    def join(self, name: str) -> float:
        """Worker node `name` joins the running cluster (a host added while loaders run): the
        monotonic time at which Ray had registered it, which its `ray start` says ("Ray
        runtime started.") once the head knows the node (ray/_private/node.py). Confined as
        the others with `node_cpus`."""
        log = self.start_node(name)
        wait_for(f"{name} joining", lambda: "Ray runtime started" in log.read_text(), 120, 0.1)
        joined = time.monotonic()
        if self.node_cpus is not None:
            self.hosts.confine(name, self.node_cpus)
        return joined


@contextlib.contextmanager
def cluster(
    hosts: Hosts, nodes: int, env: dict[str, str], node_cpus: float | None
) -> Iterator[RayCluster]:
    """A Ray head in coord and `nodes` worker nodes, each in a PID namespace of its own."""
    head, port = ip("coord"), RAY_PORT + nodes  # a fresh port: the last head may be going
    quiet: dict[str, Any] = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    made = RayCluster(hosts, env, node_cpus, f"{head}:{port}")
    made.started.append(
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
    )
    status = [str(Path(sys.executable).parent / "ray"), "status", f"--address={head}:{port}"]

    def cpus() -> str:
        netns = ["ip", "netns", "exec", "rlh-coord"]
        return subprocess.run([*netns, *status], capture_output=True, text=True, env=env).stdout

    try:
        wait_for("the Ray head", lambda: "Resources" in cpus(), 60)
        for k in range(1, nodes + 1):
            log = made.start_node(f"node{k}")
            # One node at a time: started together, the second's raylet often missed the
            # 30 s its `ray start` gives it to register (six of twelve two-node starts on the
            # 2-core machine), and a node confined to half a core always did.
            try:
                joined = f"/{2 * k}.0 CPU"
                wait_for(f"worker node {k}", lambda joined=joined: joined in cpus(), 120)
            except RuntimeError:
                print(f"`ray status` said:\n{cpus()}", file=sys.stderr)
                print(f"its `ray start` said:\n{log.read_text()[-3000:]}")
                raise
        if node_cpus is not None:
            # Once started: what a node does from now on runs on `node_cpus` cores.
            for k in range(1, nodes + 1):
                hosts.confine(f"node{k}", node_cpus)
        yield made
    finally:
        for proc in made.started:
            proc.kill()  # --kill-child: its PID namespace goes with it
            proc.wait(30)
