"""The faults `benchmarks/ray_hosts.py --faults` makes to the worker nodes of
benchmarks/ray_cluster.py mid-epoch (every process of a node's namespace killed, or silence
between node2 and the trainer: tc), and what it reads off the nodes and the server meanwhile:
where replacement actors run, the slots the actors keep, the size of the server's pool."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from benchmarks.ray_cluster import BRIDGE, NETWORK, ip, run
from benchmarks.ray_server import METRICS_PORT

# --faults: what is done to node2 after batch FAULT_AT of the measured epoch.
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


def pids(host: str) -> list[int]:
    """The processes of `host`'s network namespace, as this (the root) PID namespace numbers
    them."""
    listed = subprocess.run(
        ["ip", "netns", "pids", f"rlh-{host}"], capture_output=True, text=True
    ).stdout
    return [int(pid) for pid in listed.split()]


def kill(host: str) -> None:
    """The host dies: every process of its namespace at once (SIGKILL), so that Ray learns it
    only from its health checks, seconds later."""
    for pid in pids(host):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def actors(host: str) -> int:
    """Ray actors of the pool on `host`: processes Ray has titled after the actor's class
    (server/engine/ray/actor.py's RayWorker; an idle worker process is "ray::IDLE")."""
    count = 0
    for pid in pids(host):
        with contextlib.suppress(OSError):  # ended meanwhile
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::RayWorker"):
                count += 1
    return count


class KillOncePlaced(threading.Thread):
    """Kills `host` as soon as `wanted` more pool actors run there than `before` (the
    replacements of a lost node's actors placed there: killed while they start), or at
    monotonic time `deadline` whatever runs there. `placed`: how many more did; `at`: when it
    was killed."""

    def __init__(self, host: str, before: int, wanted: int, deadline: float) -> None:
        super().__init__(name=f"kill-{host}", daemon=True)
        self.host, self.before, self.wanted, self.deadline = host, before, wanted, deadline
        self.placed = 0
        self.at = 0.0

    def run(self) -> None:
        while time.monotonic() < self.deadline:
            self.placed = actors(self.host) - self.before
            if self.placed >= self.wanted:
                break
            time.sleep(0.1)  # each look runs `ip netns pids`: light on the epoch it watches
        self.at = time.monotonic()
        kill(self.host)


# A mapping of a slot of an actor's (server/worker/collating.py's WorkerSlots: torch shared
# memory, its file unlinked once mapped): "START-END rw-s OFFSET DEV INODE /dev/shm/torch_...".
SLOT_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) rw-s \S+ (\S+) (\d+) +/dev/shm/torch_")


def slot_bytes(hosts: Sequence[str]) -> tuple[int, int]:
    """Bytes of shared-memory slots mapped by the processes of `hosts` now, and the largest
    slot's: what the actors there keep (a batch named on its node stays in its slot until
    fetched), as the server's `kept_bytes` counts them (server/engine/ray/direct.py), read from
    outside since the server is another process."""
    seen: dict[tuple[str, str], int] = {}  # per shared-memory file: mapped by one process
    for host in hosts:
        for pid in pids(host):
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                    found = SLOT_MAPPING.match(line)
                    if found:
                        start, end, dev, inode = found.groups()
                        size = int(end, 16) - int(start, 16)
                        seen[(dev, inode)] = max(seen.get((dev, inode), 0), size)
    return sum(seen.values()), max(seen.values(), default=0)


def pool_workers() -> int:
    """The server's pool size as its /metrics shows it (`remote_loader_pool_workers`, the
    loader "bench"): the workers it has, short ones not counted."""
    url = f"http://{ip('coord')}:{METRICS_PORT}/metrics"
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    for line in text.splitlines():
        if line.startswith("remote_loader_pool_workers{") and 'loader="bench"' in line:
            return int(float(line.rsplit(" ", 1)[-1]))
    raise RuntimeError(f"no remote_loader_pool_workers for loader bench at {url}")
