"""Hosts with little CPU, for benchmarks/headline.py: benchmarks/bridge.py's namespaces on one
bridge (a private /dev/shm each, so that only TCP joins them), each in cgroups of its own.

    with Hosts({"server": None, "trainers": 0.25}) as hosts:    # root, iproute2, cgroup v1
        proc = subprocess.Popen(hosts.wrap("trainers", [sys.executable, "train.py"]))
        hosts.cpu_seconds("trainers")                            # CPU its processes used

CPU. Every host gets a group in cgroup v1's cpu controller and one in cpuacct
(/sys/fs/cgroup/{cpu,cpuacct}/rlhl-TAG-NAME); a process joins its host's groups before it starts
(`wrap`), so its children (a DataLoader's workers, the server's) are in them too. `cpuacct.usage`
counts the CPU of all of a host's processes, those that already ended included. A quota of F
cores is cfs_quota_us = F x cfs_period_us (the period 100 ms), as Docker's `--cpus F` sets: a
cap, not a reservation. The scheduler weighs a group as one task against the machine's other
processes, however many it runs; each host's weighs as HOST_SHARES, so that under other people's
load (this machine is shared) a host still gets a fair part of the cores, as a machine of its own
would have them all.

Cleanup. `close()` (the `with` block's end, atexit, or SIGTERM / SIGINT: netns.CloseOnSignal)
kills every process in the hosts' namespaces and groups (only this run's can be there: the names
carry a random tag), removes the groups, then the namespaces and the bridge (Topology.close).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shlex
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from benchmarks.bridge import Topology
from benchmarks.netns import CloseOnSignal, NetnsError, check_prerequisites

# cgroup v1's controllers on this machine (separate hierarchies: `cpu` caps, `cpuacct` counts).
CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
CPUACCT_CGROUP = Path("/sys/fs/cgroup/cpuacct")
# Docker's period for `--cpus`; the quota is a share of it.
CFS_PERIOD_US = 100_000
# A host's weight against the machine's other processes: four busy tasks outside a group (1024
# each). A capped host so gets its cap under other people's load as far as it can, and the
# uncapped server as much as four of their busy processes, not one.
HOST_SHARES = 4 * 1024
# Seconds close() keeps killing a host's processes and waiting for them to leave their groups.
DRAIN_TIMEOUT = 10.0


def check_cgroups() -> None:
    """NetnsError naming what is missing to make hosts: root, iproute2, cgroup v1 cpu/cpuacct."""
    check_prerequisites(rate=None)
    for controller in (CPU_CGROUP, CPUACCT_CGROUP):
        if not (controller / "cgroup.procs").exists():
            raise NetnsError(
                f"no cgroup v1 controller at {controller} (the hosts are capped and counted "
                "with cgroup v1's cpu and cpuacct controllers)"
            )


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, which waits for its parent to reap it, does not)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2 :].split()[0] != "Z"


class Hosts:
    """A Topology of namespaces, one per name of `quotas` (cores, None: uncapped), with their
    cgroups (module doc)."""

    def __init__(self, quotas: Mapping[str, float | None]) -> None:
        check_cgroups()
        for name, cores in quotas.items():
            if cores is not None and not 0.01 <= cores <= (os.cpu_count() or 1):
                raise ValueError(f"host {name}: a quota is 0.01 to {os.cpu_count()} cores")
        self.quotas = dict(quotas)
        self.tag = secrets.token_hex(3)
        self._groups: list[Path] = []
        self._closed = False
        self._guard = CloseOnSignal.arm(self.close)
        try:
            self.topology = Topology(list(quotas), nft=False)
            for name, cores in quotas.items():
                self._mkdir(self._group(CPUACCT_CGROUP, name))
                cpu = self._group(CPU_CGROUP, name)
                self._mkdir(cpu)
                (cpu / "cpu.shares").write_text(str(HOST_SHARES))
                self.set_quota(name, cores)
        except BaseException:
            self.close()
            raise

    def _group(self, controller: Path, name: str) -> Path:
        return controller / f"rlhl-{self.tag}-{name}"

    def _mkdir(self, group: Path) -> None:
        group.mkdir()
        self._groups.append(group)

    def ip(self, name: str) -> str:
        return self.topology.ip[name]

    def set_quota(self, name: str, cores: float | None) -> None:
        """Host `name` from now on runs on at most `cores` (None: no cap)."""
        cpu = self._group(CPU_CGROUP, name)
        (cpu / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
        (cpu / "cpu.cfs_quota_us").write_text(
            str(-1 if cores is None else round(cores * CFS_PERIOD_US))
        )
        self.quotas[name] = cores

    def wrap(self, name: str, argv: Sequence[str]) -> list[str]:
        """`argv` run on host `name`: in its cgroups (joined first: `ip netns exec` mounts a
        fresh /sys without /sys/fs/cgroup), then its namespace with a private /dev/shm. Each
        wrapper execs the next, so a Popen's pid is the program's own."""
        groups = [self._group(c, name) for c in (CPU_CGROUP, CPUACCT_CGROUP)]
        join = " && ".join(f"echo $$ > {shlex.quote(str(g / 'cgroup.procs'))}" for g in groups)
        return ["sh", "-c", f'{join} && exec "$@"', "sh", *self.topology.wrap(name, argv)]

    def cpu_seconds(self, name: str) -> float:
        """CPU seconds used so far by every process that ran on host `name`."""
        return int((self._group(CPUACCT_CGROUP, name) / "cpuacct.usage").read_text()) / 1e9

    def throttled(self, name: str) -> int:
        """Periods in which host `name` hit its cap so far."""
        for line in (self._group(CPU_CGROUP, name) / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "nr_throttled":
                return int(value)
        return 0

    def describe(self) -> str:
        caps = ", ".join(
            f"{name} {self.ip(name)} ({'uncapped' if q is None else f'{q:g} cores'})"
            for name, q in self.quotas.items()
        )
        return f"hosts: network namespaces on a private bridge, cgroups rlhl-{self.tag}-*: {caps}"

    def kill(self, name: str) -> None:
        """Kills every process on host `name`, until none is left (at most DRAIN_TIMEOUT s)."""
        self._drain([name])

    def _drain(self, names: Sequence[str]) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while (pids := self._members(names)) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    def _members(self, names: Sequence[str]) -> set[int]:
        """The live processes in the groups of hosts `names` (this one aside). Every process
        started by `wrap` joins them before it enters the namespace."""
        pids: set[int] = set()
        for name in names:
            for controller in (CPU_CGROUP, CPUACCT_CGROUP):
                with contextlib.suppress(OSError):
                    procs = (self._group(controller, name) / "cgroup.procs").read_text()
                    pids.update(int(p) for p in procs.split())
        pids.discard(os.getpid())
        return {pid for pid in pids if _alive(pid)}

    def close(self) -> None:
        """Kills what runs on the hosts, removes the groups, the namespaces and the bridge.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._guard.disarm()
        self._drain(list(self.quotas))
        if hasattr(self, "topology"):
            self.topology.close()  # kills what is left in the namespaces too
        leftovers = []
        for group in self._groups:
            for _ in range(50):  # a killed task leaves its group a moment after it is reaped
                try:
                    group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                leftovers.append(str(group))
        if leftovers:
            print(f"cpuhost: could not remove {', '.join(leftovers)}", file=sys.stderr)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def on(self, name: str) -> OnHost:
        """Host `name` as a place to start servers (benchmarks/processes.py's Placement)."""
        return OnHost(self, name)


@dataclasses.dataclass(frozen=True)
class OnHost:
    """One host of `hosts`, as benchmarks/processes.py's `Far`."""

    hosts: Hosts
    name: str

    @property
    def server_ip(self) -> str:
        return self.hosts.ip(self.name)

    def wrap(self, argv: Sequence[str]) -> list[str]:
        return self.hosts.wrap(self.name, argv)

    def describe(self) -> str:
        return f"host {self.name} ({self.server_ip})"
