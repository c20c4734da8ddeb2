"""The faults `benchmarks/ray_hosts.py --faults` makes to node2 (benchmarks/ray_cluster.py)
mid-epoch: every process of its namespace killed, or silence between it and the trainer (tc)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence

from benchmarks.ray_cluster import BRIDGE, NETWORK, ip, run

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
