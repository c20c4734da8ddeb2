"""A second "host" on this machine for the benchmarks: a network namespace joined by a veth pair.

    with Link.create(rate="1gbit") as link:          # root, iproute2 (`ip`, and `tc` for rate)
        server = subprocess.Popen(link.wrap([sys.executable, "-m", "my.server", link.server_ip]))
        ...                                           # this process dials link.server_ip

Layout. The namespace holds one end of a veth pair, `server_ip` on a /30 inside 10.213.0.0/16,
and its own `lo` (up: a server's fork server and workers talk to it on loopback). The other end
stays in the root namespace with `client_ip`. The client stays in the root namespace because
that is the simplest robust choice: the benchmark process is itself the client (the local
DataLoader, every RemoteLoader, the raw receivers), so only the servers, started as separate
processes anyway, need wrapping, and nothing has to re-run this script inside a namespace. Only
the /30 between the two ends is routed; neither side gets a default route or NAT through the
other, so nothing here touches the machine's real interfaces.

Not the same host. `wrap(argv)` runs a command as

    ip netns exec NS unshare -m sh -c 'mount -t tmpfs -o size=2g tmpfs /dev/shm && exec "$@"' \
        sh ARGV...

a mount namespace of its own (unshare's default propagation is private, so the mount does not
leak out) with an empty tmpfs on /dev/shm: the server and its workers still have shared memory
among themselves, but cannot read the nonce a client leaves in the root /dev/shm, so a
RemoteLoader's `transport="auto"` falls back to the TCP data connection exactly as it does
across machines. Files, users and PIDs stay shared (so /proc still shows the server's tree to
the benchmark's CPU and RSS accounting). `ip netns exec`, `unshare` and `sh` each exec the next,
so the Popen's pid is the wrapped program's own and signals reach it directly.

Rate. `rate` ("10gbit", "1gbit", "500mbit": tc's decimal bit units) puts a token bucket filter
(`tc qdisc ... tbf`) on the egress of both veth ends, so each direction is shaped like one link
of that rate. Without it the veth pair moves data as fast as the CPUs copy it (like loopback).

Names and cleanup. Each `create()` draws a random tag for the namespace ("rlbench-TAG") and the
two veth ends ("rlbTAGc" in the root namespace, "rlbTAGs" in the namespace), and a /30 that no
address or route of the root namespace overlaps. `close()` (the `with` block's end) kills
whatever still runs in the namespace (only this run's processes can be there: the namespace is
new and its name random), deletes it (which destroys its veth end, and so the pair) and deletes
the root end if it outlived that. It runs once, and is also registered with atexit and run on
SIGTERM / SIGINT (which are turned into SystemExit / KeyboardInterrupt while a link is open, so
that `finally` blocks run too). Not root, or no `ip` (or `tc`, `unshare`, `mount` where needed):
NetnsError with what is missing, before anything is created.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType, TracebackType
from typing import Any

# The /30s are drawn from this block: private (RFC 1918) and unlikely to be in use, and any
# clash is checked against the root namespace's addresses and routes anyway.
BLOCK = ipaddress.IPv4Network("10.213.0.0/16")
# The private /dev/shm of a wrapped command: as big as a default Docker container's is small
# (64 MiB) is not enough for worker slots of 9.6 MB batches; 2 GiB is what the server's
# max_batch_bytes default assumes a container may have. tmpfs takes pages only when written.
SHM_SIZE = "2g"
# tc's rate units, decimal as tc reads them (tc's "bps" means bytes/s: not accepted here, to
# leave no doubt).
RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
# A bucket must hold the biggest packet the interface hands the qdisc: veth passes TSO/GSO
# segments of up to 64 KiB whole, and tbf would have to split a bigger one (at a CPU cost the
# real link does not have). Two of them, so that one waiting does not stall the next.
MIN_BURST = 2 * 64 * 1024
# ... and at least this long at full rate: tbf refills from a timer, and a bucket smaller than
# what the link carries between two timer wake-ups (hrtimers here: well under a millisecond
# late) cannot reach its rate. At 10 Gbit/s that is 1.25 MB, at 1 Gbit/s 125 kB (so MIN_BURST).
BURST_SECONDS = 1e-3
# The queue behind the bucket, in bytes: one socket buffer of protos/tcp.py (4 MiB), so that a
# sender's burst waits instead of being dropped; TCP small queues keep a single flow's share of
# it near 1 MB anyway. A real switch drops sooner, but drops on an uncontended single flow would
# only add TCP recovery noise to a figure meant to show the rate.
QUEUE_LIMIT = 4 * 1024 * 1024
# Seconds any one `ip` / `tc` command may take.
COMMAND_TIMEOUT = 30.0


class NetnsError(RuntimeError):
    """The namespace cannot be made here: not root, a missing tool, or a command that failed."""


def parse_rate(text: str) -> int:
    """Bits per second of a tc rate such as "10gbit" or "500mbit"; ValueError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*", text.lower())
    if match is None or match.group(2) not in RATE_UNITS:
        raise ValueError(
            f"a link rate is a number and one of {', '.join(RATE_UNITS)} (as tc reads them), "
            f"e.g. 10gbit; got {text!r}"
        )
    bits = float(match.group(1)) * RATE_UNITS[match.group(2)]
    if bits < 8000:
        raise ValueError(f"a link rate must be at least 8kbit; got {text!r}")
    return int(bits)


def tbf_args(rate: str) -> list[str]:
    """`tbf` qdisc arguments for `rate`: burst and queue limit chosen above (MIN_BURST ...)."""
    bits = parse_rate(rate)
    burst = max(MIN_BURST, int(bits / 8 * BURST_SECONDS))
    return ["tbf", "rate", str(bits), "burst", str(burst), "limit", str(QUEUE_LIMIT + burst)]


def check_prerequisites(*, rate: str | None) -> None:
    """NetnsError naming what is missing to make a link (with `rate`: shaped)."""
    if os.geteuid() != 0:
        raise NetnsError(
            "root is needed to create a network namespace, a veth pair and a tmpfs mount (run "
            "the benchmark as root, e.g. with sudo)"
        )
    tools = ["ip", "unshare", "mount", "sh"] + (["tc"] if rate is not None else [])
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise NetnsError(
            f"{', '.join(missing)} not found on PATH (iproute2 for ip and tc, "
            "util-linux for unshare and mount)"
        )
    if rate is not None:
        parse_rate(rate)  # ValueError before anything is made


def _run(argv: Sequence[str]) -> str:
    """Runs an `ip` / `tc` command; its stdout, or NetnsError with its stderr."""
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(argv)}: {exc}") from exc
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _taken_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks of the root namespace's addresses and routes (default route aside)."""
    taken = []
    for entry in json.loads(_run(["ip", "-j", "-4", "addr", "show"]) or "[]"):
        for info in entry.get("addr_info", []):
            taken.append(ipaddress.IPv4Network(f"{info['local']}/{info['prefixlen']}", False))
    for route in json.loads(_run(["ip", "-j", "-4", "route", "show"]) or "[]"):
        if route.get("dst") not in (None, "default"):
            taken.append(ipaddress.IPv4Network(route["dst"], strict=False))
    return taken


def _free_subnet() -> ipaddress.IPv4Network:
    """A random /30 of BLOCK that overlaps nothing the root namespace has."""
    taken = _taken_networks()
    subnets = 1 << (30 - BLOCK.prefixlen)
    for _ in range(256):
        index = secrets.randbelow(subnets)
        subnet = ipaddress.IPv4Network((int(BLOCK.network_address) + 4 * index, 30))
        if not any(subnet.overlaps(net) for net in taken):
            return subnet
    raise NetnsError(f"no free /30 in {BLOCK} after 256 draws")


def _exists(argv: Sequence[str]) -> bool:
    return subprocess.run(list(argv), capture_output=True, check=False).returncode == 0


def private_shm(namespace: str, argv: Sequence[str]) -> list[str]:
    """`argv` run inside network namespace `namespace` and a mount namespace of its own with an
    empty tmpfs on /dev/shm (module doc, "Not the same host")."""
    script = f'mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm && exec "$@"'
    inside = ["ip", "netns", "exec", namespace, "unshare", "-m"]
    return [*inside, "sh", "-c", script, "sh", *argv]


class CloseOnSignal:
    """Runs `close` at exit, and turns SIGTERM / SIGINT into SystemExit / KeyboardInterrupt
    meanwhile, so that `finally` blocks (and `with` blocks, which call `close`) run too; a
    second signal during cleanup takes the default way out. `disarm()` (from `close`) restores
    the handlers it replaced."""

    def __init__(self, close: Callable[[], None]) -> None:
        self._close = close
        self._handlers: dict[int, Any] = {}

    @classmethod
    def arm(cls, close: Callable[[], None]) -> CloseOnSignal:
        guard = cls(close)
        atexit.register(close)
        if threading.current_thread() is threading.main_thread():
            # Signal handlers can only be set there; atexit still covers a normal exit.
            for sig in (signal.SIGTERM, signal.SIGINT):
                guard._handlers[sig] = signal.signal(sig, guard._on_signal)
        return guard

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._restore()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def _restore(self) -> None:
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        self._handlers.clear()

    def disarm(self) -> None:
        self._restore()
        atexit.unregister(self._close)


@dataclasses.dataclass
class Link:
    """A network namespace `namespace` joined to the root one by a veth pair (module doc)."""

    namespace: str
    host_veth: str  # the end in the root namespace, with client_ip
    ns_veth: str  # the end in the namespace, with server_ip
    client_ip: str
    server_ip: str
    rate: str | None
    _closed: bool = dataclasses.field(default=False, init=False, repr=False)
    _guard: CloseOnSignal | None = dataclasses.field(default=None, init=False, repr=False)

    @classmethod
    def create(cls, rate: str | None = None) -> Link:
        """Makes the namespace, the veth pair, the addresses and (with `rate`) the shapers."""
        check_prerequisites(rate=rate)
        tag = secrets.token_hex(3)  # "rlb" + 6 + "c": within the 15 characters a name may have
        while _exists(["ip", "netns", "pids", f"rlbench-{tag}"]) or _exists(
            ["ip", "link", "show", f"rlb{tag}c"]
        ):
            tag = secrets.token_hex(3)
        subnet = _free_subnet()
        client_ip, server_ip = (str(host) for host in subnet.hosts())
        link = cls(f"rlbench-{tag}", f"rlb{tag}c", f"rlb{tag}s", client_ip, server_ip, rate)
        link._guard = CloseOnSignal.arm(link.close)
        try:
            link._build(subnet.prefixlen)
        except BaseException:
            link.close()
            raise
        return link

    def _build(self, prefixlen: int) -> None:
        ns = ["ip", "netns", "exec", self.namespace]
        _run(["ip", "netns", "add", self.namespace])
        _run(["ip", "link", "add", self.host_veth, "type", "veth", "peer", "name", self.ns_veth])
        _run(["ip", "link", "set", self.ns_veth, "netns", self.namespace])
        _run(["ip", "addr", "add", f"{self.client_ip}/{prefixlen}", "dev", self.host_veth])
        address = f"{self.server_ip}/{prefixlen}"
        _run(["ip", "-n", self.namespace, "addr", "add", address, "dev", self.ns_veth])
        _run(["ip", "-n", self.namespace, "link", "set", "lo", "up"])
        _run(["ip", "-n", self.namespace, "link", "set", self.ns_veth, "up"])
        _run(["ip", "link", "set", self.host_veth, "up"])
        if self.rate is not None:
            shaper = tbf_args(self.rate)
            _run(["tc", "qdisc", "add", "dev", self.host_veth, "root", *shaper])
            _run([*ns, "tc", "qdisc", "add", "dev", self.ns_veth, "root", *shaper])

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the namespace with a private /dev/shm (module doc)."""
        return private_shm(self.namespace, argv)

    def describe(self) -> str:
        shaped = f", shaped to {self.rate} each way (tc tbf)" if self.rate else ", unshaped"
        return (
            f"servers in network namespace {self.namespace} ({self.server_ip}, private "
            f"/dev/shm), client in the root namespace ({self.client_ip}), veth "
            f"{self.host_veth}-{self.ns_veth}{shaped}"
        )

    # --- cleanup ------------------------------------------------------------------------------

    def close(self) -> None:
        """Kills what still runs in the namespace, deletes it and both veth ends. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._guard is not None:
            self._guard.disarm()
        if _exists(["ip", "netns", "pids", self.namespace]):
            # Only this run's processes can be in its fresh, randomly named namespace: servers
            # a crash left behind would otherwise keep it (and its veth end) alive.
            pids = subprocess.run(
                ["ip", "netns", "pids", self.namespace], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True)
        if _exists(["ip", "link", "show", self.host_veth]):
            subprocess.run(["ip", "link", "del", self.host_veth], capture_output=True)
        leftovers = [
            what
            for what, argv in (
                (f"namespace {self.namespace}", ["ip", "netns", "pids", self.namespace]),
                (f"interface {self.host_veth}", ["ip", "link", "show", self.host_veth]),
            )
            if _exists(argv)
        ]
        if leftovers:
            print(f"netns: could not remove {', '.join(leftovers)}", file=sys.stderr)

    def __enter__(self) -> Link:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
