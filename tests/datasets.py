"""Datasets, samplers and collate functions the tests name by import path ("tests.datasets:X").

Worker processes import this module by that path, so everything here is module-level.
"""

from __future__ import annotations

import contextlib
import os
import random
import resource
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

INIT_CALLS = 0  # per process: how often worker_init_fn ran there


def count_init(worker_id: int) -> None:
    global INIT_CALLS
    INIT_CALLS += 1


def _worker_id() -> int:
    info = get_worker_info()
    return -1 if info is None else info.id


class Squares(Dataset[dict[str, Any]]):
    """Deterministic samples: index, its square, a small image-like tensor."""

    def __init__(self, n: int = 50) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"index": i, "square": torch.tensor(i * i), "x": torch.full((2, 3), float(i))}


class RandomAug(Dataset[tuple[Any, ...]]):
    """Samples drawn from all three RNGs a DataLoader seeds, plus the worker that made them."""

    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        return i, torch.rand(3), random.random(), np.random.rand(2), _worker_id()


class WorkerProbe(Dataset[tuple[int, int, int, int]]):
    """Which worker process made a sample, and how often worker_init_fn ran there."""

    def __init__(self, n: int = 12) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int, int, int]:
        return i, _worker_id(), INIT_CALLS, os.getpid()


class Sharded(IterableDataset[int]):
    """An IterableDataset split between workers by get_worker_info(), unevenly: worker 0 gets
    the extra items, so workers run dry at different times."""

    def __init__(self, n: int = 23) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        if info is None:
            return iter(range(self.n))
        return iter(range(info.id, self.n, info.num_workers))


class Unsized(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(10))


class Failing(Dataset[int]):
    """Raises at index `bad`."""

    def __init__(self, n: int = 20, bad: int = 7) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            raise ValueError(f"sample {i} is corrupt")
        return i


class Reversed(Sampler[int]):
    """A custom sampler: the dataset backwards."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.dataset) - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.dataset)


class GrowingBatches(Sampler[list[int]]):
    """A custom batch_sampler: batches of 1, 2, 3, ... indices, in a generator-shuffled order."""

    def __init__(self, dataset: Any, generator: torch.Generator | None = None) -> None:
        self.dataset = dataset
        self.generator = generator

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(len(self.dataset), generator=self.generator).tolist()
        size = 1
        while order:
            yield order[:size]
            order = order[size:]
            size += 1

    def __len__(self) -> int:
        count, left, size = 0, len(self.dataset), 1
        while left > 0:
            left -= size
            size += 1
            count += 1
        return count


def mixed_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A collate_fn returning a dict of mixed types."""
    return {
        "x": torch.stack([s["x"] for s in samples]),
        "indices": [s["index"] for s in samples],
        "names": [f"sample-{s['index']}" for s in samples],
        "raw": bytes(s["index"] % 256 for s in samples),
        "array": np.array([s["index"] for s in samples], dtype=np.int16),
        "mask": torch.tensor([s["index"] % 2 == 0 for s in samples]),
        "half": torch.stack([s["x"] for s in samples]).to(torch.bfloat16),
        "nothing": None,
        "pair": (len(samples), 0.5),
    }


class Slow(Dataset[int]):
    """Sleeps before every sample; with `log`, first appends the reading process's pid to it."""

    def __init__(self, n: int = 4, seconds: float = 1.0, log: str | None = None) -> None:
        self.n, self.seconds, self.log = n, seconds, log

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if self.log is not None:
            fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, f"{os.getpid()}\n".encode())
            finally:
                os.close(fd)
        time.sleep(self.seconds)
        return i


class SlowPlan(Sampler[int]):
    """A sampler that takes `seconds` to make (the server makes one per epoch, planning it) and
    appends a line to `log` as each make begins."""

    def __init__(self, dataset: Any, log: str, seconds: float) -> None:
        with open(log, "a") as f:
            f.write("plan\n")
        time.sleep(seconds)
        self.n = len(dataset)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


class Counted(Dataset[dict[str, Any]]):
    """Squares that append each index they read to `log`, so a test can count the reads made in
    any process (one small O_APPEND write per read is atomic)."""

    def __init__(self, log: str, n: int = 48) -> None:
        self.log, self.n = log, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{i}\n".encode())
        finally:
            os.close(fd)
        return {"index": i, "x": torch.full((2,), float(i))}


def read_counts(log: str) -> dict[int, int]:
    """How often Counted read each index."""
    counts: dict[int, int] = {}
    if os.path.exists(log):
        with open(log) as f:
            for line in f:
                counts[int(line)] = counts.get(int(line), 0) + 1
    return counts


class Blobs(Dataset[dict[str, Any]]):
    """Samples of `nbytes` bytes each: big enough that gRPC flow control holds a slow reader."""

    def __init__(self, n: int = 40, nbytes: int = 1 << 20) -> None:
        self.n, self.nbytes = n, nbytes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"index": i, "data": torch.full((self.nbytes,), i % 256, dtype=torch.uint8)}


class Crashing(Dataset[int]):
    """Index `bad` crashes the process that reads it with a segfault, every time."""

    def __init__(self, n: int = 20, bad: int = 7) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            import ctypes

            ctypes.string_at(0)  # reads address 0: SIGSEGV
        return i


class Sleepy(Dataset[int]):
    """Index `bad` sleeps `seconds` (past any sensible timeout); the others are quick."""

    def __init__(self, n: int = 10, bad: int = 4, seconds: float = 60.0) -> None:
        self.n, self.bad, self.seconds = n, bad, seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            time.sleep(self.seconds)
        return i


def failing_init(worker_id: int) -> None:
    raise RuntimeError(f"worker_init_fn fails on purpose in worker {worker_id}")


class Sizes(Dataset[torch.Tensor]):
    """Sample i is `sizes[i]` bytes, all equal to i % 256: batches of chosen sizes."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.sizes[i],), i % 256, dtype=torch.uint8)


def sharing_collate(samples: list[Any]) -> dict[str, Any]:
    """default_collate, plus whether its tensor landed in shared memory (see
    server/worker/loop.py)."""
    batch = torch.utils.data.default_collate(samples)
    return {"batch": batch, "shared": batch.is_shared()}


class Drawn(Dataset[Any]):
    """Batches described in a JSON file the test rewrites between epochs (the conformance suite).

    The file holds a list with one entry per sample: {"sizes": [bytes of each tensor leaf],
    "dtype": a torch dtype name, "nest": 0-2}. Used with batch_size=None, sample i is batch i,
    so a test chooses every batch's byte size and structure. Reading the file on every access
    lets one server (and persistent workers) serve any number of drawn sequences.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def _batches(self) -> list[dict[str, Any]]:
        import json

        with open(self.path) as f:
            batches: list[dict[str, Any]] = json.load(f)
        return batches

    def __len__(self) -> int:
        return len(self._batches())

    def __getitem__(self, i: int) -> Any:
        spec = self._batches()[i]
        dtype = getattr(torch, spec["dtype"])
        itemsize = torch.empty((), dtype=dtype).element_size()
        leaves = [
            torch.arange(n // itemsize, dtype=torch.int64).add_(i * 7 + k).to(dtype)
            for k, n in enumerate(spec["sizes"])
        ]
        if spec["nest"] == 0:
            return leaves[0] if len(leaves) == 1 else leaves
        if spec["nest"] == 1:
            return {"index": i, "leaves": tuple(leaves)}
        return {"index": i, "deep": [{"first": leaves[0]}, (leaves[1:], f"sample {i}")]}


class Skewed(Dataset[int]):
    """Every `every`-th sample sleeps `slow` seconds, the others `fast`: with round-robin
    dispatch, the tasks queued behind a slow one wait while the other workers idle."""

    def __init__(self, n: int = 200, every: int = 4, slow: float = 0.08, fast: float = 0.002):
        self.n, self.every, self.slow, self.fast = n, every, slow, fast

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        time.sleep(self.slow if i % self.every == 0 else self.fast)
        return i


_KEPT: list[Any] = []  # per worker process: every batch keeping_collate made there


def keeping_collate(samples: list[Any]) -> dict[str, Any]:
    """default_collate, keeping every batch it made (a collate_fn that caches its output), and
    returning beside the batch the first byte of each sample of every batch it kept in this
    worker, read now: they are what they were unless something reused their memory."""
    batch = torch.utils.data.default_collate(samples)
    _KEPT.append(batch)
    return {"batch": batch, "kept": torch.stack([kept["data"][:, 0] for kept in _KEPT])}


# Gated's planning of GATED_EPOCH waits for PLAN_GATE (set by the test) and says it has begun
# by setting PLAN_ENTERED: a server in the test's process plans that epoch as slowly as the test
# likes, with no timing. Other epochs pass at once.
GATED_EPOCH = 5
PLAN_GATE = threading.Event()
PLAN_ENTERED = threading.Event()


class Gated(Sampler[int]):
    """The dataset in order; iterating it for GATED_EPOCH (set_epoch) waits for PLAN_GATE."""

    def __init__(self, dataset: Any) -> None:
        self.n = len(dataset)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.epoch == GATED_EPOCH:
            PLAN_ENTERED.set()
            if not PLAN_GATE.wait(timeout=120):
                raise RuntimeError("PLAN_GATE was never opened")
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


class Faults(Dataset[int]):
    """Each sample allocates, fills and frees a 1 MiB tensor 8 times and is the minor page faults
    that took in the process that made it (NOTE [ Worker allocator ] in
    server/worker/allocator.py)."""

    def __init__(self, n: int = 8) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(8):
            torch.empty(1 << 20, dtype=torch.uint8).fill_(1)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


class Threads(Dataset[torch.Tensor]):
    """Each sample is [torch's intra-op thread count, pid] of the process that made it."""

    def __init__(self, n: int = 6) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([torch.get_num_threads(), os.getpid()])


class Logged(Dataset[torch.Tensor]):
    """Item i: `nbytes` bytes of value i % 256; first appends the reading process's pid to
    `log` (a batch big enough to fill a data connection's buffers while its trainer waits)."""

    def __init__(self, n: int, nbytes: int, log: str) -> None:
        self.n, self.nbytes, self.log = n, nbytes, log

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{os.getpid()}\n".encode())
        finally:
            os.close(fd)
        return torch.full((self.nbytes,), i % 256, dtype=torch.uint8)


class Pair(NamedTuple):
    number: int
    x: torch.Tensor


class Pairs(Dataset[Pair]):
    """Samples as a namedtuple: default_collate keeps its type, and so must the client."""

    def __init__(self, n: int = 10) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Pair:
        return Pair(i, torch.full((3,), float(i)))


class FailingOwn(Dataset[int]):
    """Raises its own exception class at index `bad`: nested, so its qualname
    ("FailingOwn.Corrupt") is not its name, and a trainer can only find it by both."""

    class Corrupt(ValueError):
        """The dataset's own error: torch's DataLoader re-raises it as this type."""

    def __init__(self, n: int = 8, bad: int = 3) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            raise FailingOwn.Corrupt(f"sample {i} is corrupt")
        return i


def failing_init_at_length(worker_id: int) -> None:
    """worker_init_fn whose error says a great deal (20 KB), far past gRPC's 8 KiB of metadata."""
    raise RuntimeError(f"worker {worker_id} cannot start: " + "the reason is long. " * 1000)


class DrawnWhenBuilt(Dataset[dict[str, Any]]):
    """Draws, unseeded, a random permutation when it is built (as a random split or a shuffle
    seed is drawn) and records the epoch set_epoch gave it. Sample i: its index, the drawn
    `order[i]`, that epoch and the worker that made it. `lock`: unpicklable (NOTE [ One
    dataset per loader ] in server/worker/dataset.py)."""

    def __init__(self, n: int = 24, lock: bool = False) -> None:
        self.order = np.random.default_rng().permutation(n)
        self.epoch = -1  # set_epoch never called
        self.lock = threading.Lock() if lock else None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "index": i,
            "drawn": int(self.order[i]),
            "epoch": self.epoch,
            "worker": _worker_id(),
        }


class EpochBatches(Sampler[list[int]]):
    """A batch_sampler with set_epoch: batches of 4 of the dataset, starting `epoch` batches in."""

    def __init__(self, dataset: Any) -> None:
        self.batches = [list(range(i, min(i + 4, len(dataset)))) for i in range(0, len(dataset), 4)]
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        k = self.epoch % len(self.batches)
        return iter(self.batches[k:] + self.batches[:k])

    def __len__(self) -> int:
        return len(self.batches)


def datapipe(n: int = 10, shuffle: bool = False) -> Any:
    """torch's IterDataPipe of range(n), sharded between workers by a sharding_filter (after a
    shuffle, when asked)."""
    from torch.utils.data.datapipes.iter import IterableWrapper

    pipe = IterableWrapper(range(n))
    return (pipe.shuffle() if shuffle else pipe).sharding_filter()


class Straggler(Dataset[int]):
    """Index `slow` is a straggler: it waits until `others` other samples were made, in any
    worker (each writes a line to `log`), at most `patience` s, then `settle` s for their
    batches to be sent; so it finishes after them however loaded the machine is, where a
    fixed sleep would race the other worker's start."""

    def __init__(
        self,
        log: str,
        n: int = 10,
        slow: int = 0,
        others: int = 8,
        patience: float = 5.0,
        settle: float = 0.5,
    ) -> None:
        self.log, self.n, self.slow, self.others = log, n, slow, others
        self.patience, self.settle = patience, settle

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i != self.slow:
            with open(self.log, "a") as f:
                f.write(f"{i}\n")
            return i
        deadline = time.monotonic() + self.patience
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError), open(self.log) as f:
                if len(f.readlines()) >= self.others:
                    break
            time.sleep(0.01)
        time.sleep(self.settle)
        return i
