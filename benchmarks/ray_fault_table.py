"""The table of `benchmarks/ray_hosts.py --faults` (issue 39): epochs on a fresh Ray cluster of 2
worker nodes per run (benchmarks/ray_cluster.py: 4 actors, node fetch on, the server's /metrics
on), each compared batch for batch with torch's DataLoader, with a fault made to the nodes
after batch FAULT_AT (benchmarks/ray_faults.py). Four clusters, six rows:

    none            the epoch without a fault: what "lost" is counted against
    slow trainer    then, on the same cluster, an epoch whose trainer sleeps SLOW_TRAINER s
                    after each batch, so the actors (a free dataset) run ahead of it: "kept",
                    the most MiB of slots the actors held at once (sampled from their
                    mappings) against the bound of NOTE [ Node data connection ] in
                    server/transports/node.py
    node killed     node2 killed (its actors' replacements find no CPUs: the pool goes short)
    node joins      then, on the same cluster once /metrics shows the pool short, node3 joins:
                    epochs run until it shows the pool whole again ("whole": seconds from Ray
                    registering node3), and one more after; every epoch after the fault counts
                    in the row's torch, longest and resumes
    node silent     node2 and the trainer stop hearing each other (tc), node2 and the
                    coordinator still talk
    two nodes lost  node3 joined as a spare before the epoch; node2 killed, its actors'
                    replacements placed on node3, and node3 killed as soon as all of them
                    start there (Ray titles each process after the actor's class), at the
                    latest SECOND_KILL_BY s after node2: before Ray declares node2 dead
                    (13-15 s); a line under the row says when, and how many had started

"pool" is /metrics' `remote_loader_pool_workers` once the epoch ended. A loader error (no
batch within TIMEOUT: a hang) ends its row's epochs; the row says NO and the error follows it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from benchmarks.ray_cluster import Hosts, RayCluster, cluster, ray_env
from benchmarks.ray_faults import (
    FAULT_AT,
    KillOncePlaced,
    actors,
    kill,
    pool_workers,
    silence,
    slot_bytes,
)
from benchmarks.ray_server import expected, same, serve
from remote_loader.client import RemoteLoader
from remote_loader.server.transports.node import NAMED_AHEAD

NODES = 2
WORKERS = 2 * NODES  # one actor per CPU, 2 CPUs a node
PREFETCH = 2  # the loader's prefetch_factor: the spec's default (server/config/spec.py)
# A batch not within this many seconds fails the epoch (LoaderTimeoutError) rather than the
# run hanging: the slowest answer a lost actor's batch waits for is a start's
# SLOW_START_PATIENCE (30 s) after Ray's verdict on a node (13-15 s).
TIMEOUT = 120.0
# The slow trainer's seconds per batch (tests/integration/test_ray_faults.py's).
SLOW_TRAINER = 0.05
# How long the pool may take to go short after node2's death (Ray's verdict on the node, then
# REPLACE_PATIENCE), and to grow back after node3 joins (the test's GROW_BACK).
SHORT_WITHIN = 60.0
WHOLE_WITHIN = 90.0
# node3 killed at the latest this long after node2: Ray must not have declared node2 dead yet.
SECOND_KILL_BY = 8.0
MIB = 1 << 20


@dataclasses.dataclass
class Epoch:
    seconds: float
    exact: bool  # every batch equal to torch's, in order, and the epoch complete
    longest: float  # the longest wait in next(), s
    resumes: int
    node: float  # share of the batch bytes fetched from the nodes
    error: str = ""


def run_epoch(
    loader: RemoteLoader, want: list[Any], fault: Callable[[], None] | None = None, pause: float = 0
) -> Epoch:
    """One epoch: `fault` made after batch FAULT_AT, `pause` s slept after each batch (neither
    counted as a wait)."""
    got: list[Any] = []
    longest, error = 0.0, ""
    start = last = time.perf_counter()
    try:
        for i, batch in enumerate(loader):
            longest = max(longest, time.perf_counter() - last)
            got.append(batch)
            if fault is not None and i == FAULT_AT:
                fault()
            if pause:
                time.sleep(pause)
            last = time.perf_counter()
    except Exception as exc:  # what the trainer would get: the row reports it
        error = f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - start
    stats = loader.stats()
    share = stats.node_bytes / max(1, stats.bytes)
    return Epoch(seconds, not error and same(got, want), longest, stats.reconnects, share, error)


class Sampled(threading.Thread):
    """`read()` every `period` s until stop(): (monotonic time, value) samples; a failed read
    (the server busy answering /metrics) is skipped."""

    def __init__(self, read: Callable[[], Any], period: float) -> None:
        super().__init__(daemon=True)
        self.read, self.period = read, period
        self.samples: list[tuple[float, Any]] = []
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            with contextlib.suppress(OSError, RuntimeError):
                self.samples.append((time.monotonic(), self.read()))
            self._done.wait(self.period)

    def stop(self) -> list[tuple[float, Any]]:
        self._done.set()
        self.join(10)
        return self.samples


def print_row(
    fault: str,
    epochs: list[Epoch],
    baseline: float | None,
    whole: str = "-",
    kept: str = "-",
    timed: bool = True,
) -> None:
    """A row of the table; `timed`: its seconds are one epoch's, against `baseline`."""
    seconds = epochs[0].seconds if timed else None
    errors = [e.error for e in epochs if e.error]
    pool = "?"
    with contextlib.suppress(OSError, RuntimeError):  # the server gone with a failed epoch
        pool = f"{pool_workers()}/{WORKERS}"
    print(
        f"{fault:<14} {'-' if seconds is None else f'{seconds:.1f}':>8} "
        f"{'-' if seconds is None or baseline is None else f'{seconds - baseline:.1f}':>6} "
        f"{'yes' if all(e.exact for e in epochs) else 'NO':>6} "
        f"{max(e.longest for e in epochs):>8.1f} {sum(e.resumes for e in epochs):>7} "
        f"{epochs[-1].node:>6.3f} {pool:>5} {whole:>6} {kept:>9}",
        flush=True,
    )
    for error in errors:
        print(f"    {fault}: {error}", flush=True)


@contextlib.contextmanager
def running(
    hosts: Hosts, args: argparse.Namespace, tmp: str, label: str
) -> Iterator[tuple[RayCluster, RemoteLoader]]:
    """A fresh cluster of NODES worker nodes, the server, and a trainer's loader on them after
    a warm-up epoch (the actors' first slots, the connections)."""
    env = ray_env(tempfile.mkdtemp(prefix=f"{label}-", dir=tmp))  # the cluster's sessions
    with (
        cluster(hosts, NODES, env, args.node_cpus) as ray,
        tempfile.TemporaryFile("w+") as log,
    ):
        server, address = serve(hosts, args, ray.address, NODES, env, log, metrics=True)
        try:
            with RemoteLoader(
                address, "bench", transport="auto", device="cpu", timeout=TIMEOUT
            ) as loader:
                list(loader)
                yield ray, loader
        finally:
            silence(False)
            server.send_signal(signal.SIGTERM)
            server.communicate(timeout=60)


def no_fault(hosts: Hosts, args: argparse.Namespace, tmp: str, want: list[Any]) -> float:
    """Rows none and slow trainer; the baseline's seconds."""
    with running(hosts, args, tmp, "none") as (_, loader):
        baseline = run_epoch(loader, want)
        print_row("none", [baseline], baseline.seconds)
        slots = Sampled(lambda: slot_bytes([f"node{k}" for k in range(1, NODES + 1)]), 0.05)
        slots.start()
        slow = run_epoch(loader, want, pause=SLOW_TRAINER)
        samples = [value for _, value in slots.stop()]
        kept = max((total for total, _ in samples), default=0)
        slot = max((largest for _, largest in samples), default=0)
        # The bound, in slots, as tests/integration/test_ray_faults.py counts it from the rule:
        # the tasks in flight, the batches made and not yet sent, NAMED_AHEAD per stream at
        # each actor's data server, and per actor a slot released since its last task.
        in_flight = PREFETCH * WORKERS
        bound = (in_flight + max(2, in_flight) + NAMED_AHEAD * WORKERS + WORKERS) * slot
        kept_text = f"{kept / MIB:.0f}/{bound / MIB:.0f}"
        print_row("slow trainer", [slow], None, kept=kept_text, timed=False)
    return baseline.seconds


def node_killed(
    hosts: Hosts, args: argparse.Namespace, tmp: str, want: list[Any], baseline: float
) -> None:
    """Rows node killed and node joins."""
    with running(hosts, args, tmp, "killed") as (ray, loader):
        killed = run_epoch(loader, want, lambda: kill("node2"))
        print_row("node killed", [killed], baseline)
        if killed.error:
            return
        after: list[Epoch] = []
        deadline = time.monotonic() + SHORT_WITHIN
        # A short pool is told to the server while an epoch polls its bridge.
        while pool_workers() == WORKERS and time.monotonic() < deadline and not after_error(after):
            after.append(run_epoch(loader, want))
        if pool_workers() == WORKERS or after_error(after):
            print_row("node joins", after or [killed], None, whole="-", timed=False)
            if not after_error(after):
                print(f"    the pool was not short {SHORT_WITHIN:g} s after the fault: no join")
            return
        joined = ray.join("node3")
        gauge = Sampled(pool_workers, 0.1)
        gauge.start()
        while (
            not any(n == WORKERS for _, n in gauge.samples)
            and time.monotonic() - joined < WHOLE_WITHIN
            and not after_error(after)
        ):
            after.append(run_epoch(loader, want))
        whole_at = next((t for t, n in gauge.stop() if n == WORKERS), None)
        if not after_error(after):
            after.append(run_epoch(loader, want))  # the grown-back pool makes the batches
        whole = "never" if whole_at is None else f"{whole_at - joined:.1f}"
        print_row("node joins", after, None, whole=whole, timed=False)


def after_error(epochs: list[Epoch]) -> bool:
    return any(e.error for e in epochs)


def node_silent(
    hosts: Hosts, args: argparse.Namespace, tmp: str, want: list[Any], baseline: float
) -> None:
    with running(hosts, args, tmp, "silent") as (_, loader):
        print_row("node silent", [run_epoch(loader, want, lambda: silence(True))], baseline)


def two_lost(
    hosts: Hosts, args: argparse.Namespace, tmp: str, want: list[Any], baseline: float
) -> None:
    """Row two nodes lost."""
    with running(hosts, args, tmp, "two-lost") as (ray, loader):
        ray.join("node3")  # after the actors were placed: its 2 CPUs are free
        run_epoch(loader, want)  # not measured: node3's start settles
        second: list[KillOncePlaced] = []
        first = 0.0

        def fault() -> None:
            nonlocal first
            before, on_node2 = actors("node3"), actors("node2")
            kill("node2")
            first = time.monotonic()
            second.append(KillOncePlaced("node3", before, on_node2, first + SECOND_KILL_BY))
            second[0].start()

        lost = run_epoch(loader, want, fault)
        ended = time.monotonic()
        for watcher in second:
            watcher.join(SECOND_KILL_BY + 10)
        print_row("two nodes lost", [lost], baseline)
    if not second:
        return  # the epoch ended before the fault (its error is printed)
    third = second[0]
    print(
        f"    node3 killed {third.at - first:.1f} s after node2, {third.placed} of node2's "
        f"actors' replacements started there; the epoch ended {ended - third.at:+.1f} s from "
        "then",
        flush=True,
    )


def faults(hosts: Hosts, args: argparse.Namespace, tmp: str) -> None:
    print(
        f"{'fault':<14} {'seconds':>8} {'lost':>6} {'torch':>6} {'longest':>8} {'resumes':>7} "
        f"{'node':>6} {'pool':>5} {'whole':>6} {'kept MiB':>9}   (lost: seconds against the "
        "epoch without a fault; longest: the longest wait for a batch, s; node: share of batch "
        "bytes fetched from the nodes; pool: workers after the epoch; whole: s from a node "
        "joining to the pool whole; kept: the actors' slots at most / the bound)"
    )
    # The server's torch warns each epoch of 4 workers on this 2-core machine (the client
    # repeats it, as a local DataLoader would warn): here the workers are on other "hosts".
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    want = expected(args)
    baseline = no_fault(hosts, args, tmp, want)
    node_killed(hosts, args, tmp, want, baseline)
    node_silent(hosts, args, tmp, want, baseline)
    two_lost(hosts, args, tmp, want, baseline)
