"""Network namespaces on one bridge, for benchmarks/campaign.py and benchmarks/cpuhost.py: a small
"cluster" of hosts.

Each node gets a namespace ("cmpTAG-NODE") with its own `lo` and a veth whose other end is
enslaved to one bridge ("cmpTAGbr") in the root namespace, all on a /29 of benchmarks/netns.py's
block that nothing in the root namespace overlaps (the root namespace itself gets no address:
nothing here can reach or be reached from the machine's real interfaces). Commands run inside
with a private /dev/shm, as netns.Link.wrap does, so no shared memory crosses between "hosts".
close() kills whatever runs in the namespaces and removes them, the veths and the bridge; it is
registered with atexit. netns.py's helpers do the `ip` calls and the prerequisite checks.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence

from benchmarks.netns import (
    BLOCK,
    NetnsError,
    _exists,
    _run,
    _taken_networks,
    check_prerequisites,
    private_shm,
)
from benchmarks.processes import subprocess_env


class Topology:
    """A bridge, a namespace per node and their veths (module doc); close() removes them."""

    def __init__(self, names: Sequence[str], *, nft: bool = True) -> None:
        """`nft`: the nodes' firewalls will be set (`nft()`), so nftables must be there."""
        check_prerequisites(rate=None)
        if nft and shutil.which("nft") is None:
            raise NetnsError("nft not found on PATH (apt-get install nftables)")
        if not 1 <= len(names) <= 6:
            raise ValueError(f"a /29 holds 1 to 6 nodes, got {len(names)}")
        self.tag = secrets.token_hex(3)
        self.bridge = f"cmp{self.tag}br"
        self.names = list(names)
        self.ns = {n: f"cmp{self.tag}-{n}" for n in self.names}
        self.veth = {
            n: (f"cmp{self.tag}h{i}", f"cmp{self.tag}n{i}") for i, n in enumerate(self.names)
        }
        subnet = self._subnet()
        hosts = [str(h) for h in subnet.hosts()]
        self.ip = dict(zip(self.names, hosts, strict=False))
        self.procs: list[subprocess.Popen[str]] = []
        self._closed = False
        atexit.register(self.close)
        try:
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "link", "set", self.bridge, "up"])
            for n in self.names:
                host, inner = self.veth[n]
                _run(["ip", "netns", "add", self.ns[n]])
                _run(["ip", "link", "add", host, "type", "veth", "peer", "name", inner])
                _run(["ip", "link", "set", inner, "netns", self.ns[n]])
                _run(["ip", "link", "set", host, "master", self.bridge, "up"])
                _run(["ip", "-n", self.ns[n], "addr", "add", f"{self.ip[n]}/29", "dev", inner])
                _run(["ip", "-n", self.ns[n], "link", "set", "lo", "up"])
                _run(["ip", "-n", self.ns[n], "link", "set", inner, "up"])
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _subnet() -> ipaddress.IPv4Network:
        taken = _taken_networks()
        for _ in range(256):
            base = int(BLOCK.network_address) + 8 * secrets.randbelow(BLOCK.num_addresses // 8)
            subnet = ipaddress.IPv4Network((base, 29))
            if not any(subnet.overlaps(net) for net in taken):
                return subnet
        raise NetnsError(f"no free /29 in {BLOCK} after 256 draws")

    def wrap(self, node: str, argv: Sequence[str]) -> list[str]:
        """`argv` inside `node`'s namespace with a private /dev/shm (as netns.Link.wrap)."""
        return private_shm(self.ns[node], argv)

    def start(self, node: str, argv: Sequence[str]) -> subprocess.Popen[str]:
        """A process in `node`'s namespace, its own process group, stdout piped."""
        proc = subprocess.Popen(
            self.wrap(node, argv), stdout=subprocess.PIPE, text=True, env=subprocess_env(),
            start_new_session=True,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def nft(self, node: str, *rules: str) -> None:
        for rule in rules:
            _run(["ip", "netns", "exec", self.ns[node], "nft", *rule.split()])

    def link(self, node: str, up: bool) -> None:
        _run(["ip", "-n", self.ns[node], "link", "set", self.veth[node][1], "up" if up else "down"])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for proc in self.procs:
            kill_group(proc)
        for n in self.names:
            if _exists(["ip", "netns", "pids", self.ns[n]]):
                pids = subprocess.run(
                    ["ip", "netns", "pids", self.ns[n]], capture_output=True, text=True
                ).stdout.split()
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
                subprocess.run(["ip", "netns", "del", self.ns[n]], capture_output=True)
            if _exists(["ip", "link", "show", self.veth[n][0]]):
                subprocess.run(["ip", "link", "del", self.veth[n][0]], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        left = [ns for ns in self.ns.values() if _exists(["ip", "netns", "pids", ns])]
        left += [self.bridge] if _exists(["ip", "link", "show", self.bridge]) else []
        if left:
            print(f"campaign: could not remove {', '.join(left)}", file=sys.stderr)


def kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=30)
