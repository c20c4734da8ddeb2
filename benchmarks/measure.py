"""What benchmarks/compare.py measures, and how: one timed epoch of a loader (wall seconds, time
to the first batch, tensor bytes), the CPU it cost this process and the loader's processes, the
peak RSS of both (sampled in a thread), and the per-batch work of the training loop (`touch`, or
`train_step` with --train-step), and what one workload came to (`Workload`, which
benchmarks/report.py shows).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from benchmarks.processes import process_rss
from remote_loader.client import RemoteLoader

GB = 1e9
# Seconds between two RSS samples, and between two listings of the processes a side's loader
# runs in (a full /proc scan; its workers are persistent, so the list hardly ever changes).
RSS_INTERVAL = 0.025
RSS_RELIST = 0.5
# Timed repetitions of the train step alone (after one untimed).
STEP_REPEATS = 20


class PeakRss:
    """Within `with`: samples RSS every RSS_INTERVAL s in a thread and keeps the maxima.

    `client` is this process's peak, `server` the peak of the RSS summed over `server_pids()`
    (listed again every RSS_RELIST s), both in bytes; `cpu` is the sampling thread's own CPU
    seconds, for the caller to leave out of this process's.
    """

    def __init__(self, server_pids: Callable[[], list[int]]) -> None:
        self._server_pids = server_pids
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self.client = 0
        self.server = 0
        self.cpu = 0.0

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        start = time.thread_time()
        me = os.getpid()
        pids: list[int] = []
        listed = float("-inf")
        while True:
            now = time.monotonic()
            if now - listed >= RSS_RELIST:
                pids, listed = self._server_pids(), now
            self.client = max(self.client, process_rss(me))
            self.server = max(self.server, sum(process_rss(pid) for pid in pids))
            if self._stop.is_set():
                break  # that was the last sample, taken after the epoch's end
            self._stop.wait(RSS_INTERVAL)
        self.cpu = time.thread_time() - start


def tensor_bytes(batch: Any) -> int:
    """Bytes held by the tensors in a batch (tuples, lists and dicts are walked)."""
    if isinstance(batch, torch.Tensor):
        return batch.nbytes
    if isinstance(batch, list | tuple):
        return sum(tensor_bytes(x) for x in batch)
    if isinstance(batch, dict):
        return sum(tensor_bytes(x) for x in batch.values())
    return 0


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    items = batch.values() if isinstance(batch, dict) else batch
    if isinstance(items, Iterable) and not isinstance(items, str | bytes):
        for x in items:
            found = _first_tensor(x)
            if found is not None:
                return found
    return None


def touch(batch: Any) -> None:
    """Reads one sample of the batch, so that it is really there, at almost no cost."""
    t = _first_tensor(batch)
    if t is not None:
        t[0].sum().item()


def train_step(batch: Any) -> None:
    """`--train-step`: a trainer's CPU work on the batch's first tensor (the images): widen to
    float, scale in place, reduce. Every byte is read, and four times as many written."""
    t = _first_tensor(batch)
    if t is not None:
        t.float().div_(255).sum().item()


def step_alone(batch: Any, step: Callable[[Any], None]) -> tuple[float, float]:
    """Wall and CPU seconds (this process) of one `step(batch)`, medians of STEP_REPEATS."""
    step(batch)  # untimed: the allocator and the thread pool warm up
    walls, cpus = [], []
    for _ in range(STEP_REPEATS):
        wall, cpu = time.perf_counter(), time.process_time()
        step(batch)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


@dataclasses.dataclass(frozen=True)
class Epoch:
    """One timed epoch: wall seconds, seconds to the first batch, batches and tensor bytes."""

    seconds: float
    first_batch: float
    batches: int
    nbytes: int

    @property
    def batches_per_s(self) -> float:
        return self.batches / self.seconds

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / GB / self.seconds


def run_epoch(loader: Iterable[Any], step: Callable[[Any], None] = touch) -> Epoch:
    """Iterates one epoch of `loader`, calling `step` on each batch."""
    start = time.perf_counter()
    first = float("nan")
    batches = nbytes = 0
    for batch in loader:
        if batches == 0:
            first = time.perf_counter() - start
        step(batch)
        nbytes += tensor_bytes(batch)
        batches += 1
    return Epoch(time.perf_counter() - start, first, batches, nbytes)


@dataclasses.dataclass
class Side:
    """The timed epochs of one loader, the CPU seconds they cost and the peak RSS they saw."""

    epochs: list[Epoch] = dataclasses.field(default_factory=list)
    main_cpu: float = 0.0  # this process (time.process_time), summed over the timed epochs
    loader_cpu: float = 0.0  # local workers, or the server process tree, summed likewise
    main_rss: int = 0  # this process, bytes: the peak over the timed epochs
    loader_rss: int = 0  # local workers, or the server process tree, summed: the peak likewise
    # RemoteLoader.stats().transport after each timed epoch (remote sides only), each once.
    transports: list[str] = dataclasses.field(default_factory=list)

    def median(self, value: Callable[[Epoch], float]) -> float:
        return statistics.median(value(e) for e in self.epochs)

    @property
    def batches(self) -> int:
        return sum(e.batches for e in self.epochs)

    @property
    def cores_busy(self) -> float:
        """Client and server CPU seconds per wall second, over the timed epochs."""
        return (self.main_cpu + self.loader_cpu) / sum(e.seconds for e in self.epochs)

    def timed_epoch(
        self,
        loader: Iterable[Any],
        loader_cpu: Callable[[], float],
        loader_pids: Callable[[], list[int]],
        step: Callable[[Any], None],
    ) -> None:
        """Runs one timed epoch of `loader` and adds its numbers to this side."""
        cpu, loader_before = time.process_time(), loader_cpu()
        with PeakRss(loader_pids) as rss:
            self.epochs.append(run_epoch(loader, step))
        self.main_cpu += time.process_time() - cpu - rss.cpu
        self.loader_cpu += loader_cpu() - loader_before
        self.main_rss = max(self.main_rss, rss.client)
        self.loader_rss = max(self.loader_rss, rss.server)
        if isinstance(loader, RemoteLoader):
            transport = str(loader.stats().transport)
            if transport not in self.transports:
                self.transports.append(transport)


@dataclasses.dataclass
class Workload:
    """What `compare` measured for one workload."""

    sides: dict[str, Side]
    # Tensor bytes of one batch (the mean over the local side's timed epochs): the ceilings'.
    batch_bytes: int
    # --train-step: wall and CPU seconds of the step alone on one batch; else None.
    step: tuple[float, float] | None
    # Across hosts: the transports the server logged for its streams, counted.
    logged: collections.Counter[str]
