"""One training process of benchmarks/headline.py: a loop whose step is a fixed wait (an
accelerator's step takes no host CPU), fed by a local `DataLoader` or by `RemoteLoader`.

    python -m benchmarks.headline_trainer '{"mode": "local", "rank": 0, ...}'   # a TrainerSpec

Its protocol with the parent, on stdin and stdout, one line each: WARMUP_STEPS steps, then
"ready"; for each "go START STOP" (monotonic seconds, the same clock in every process of the
machine) it steps until a step ends after STOP and answers with one JSON line for the steps
that fell in [START, STOP] (`window`); EOF ends it. Between windows it pauses (blocked on stdin).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

# Steps a trainer takes before it says it is ready (its workers started, its first stream open).
WARMUP_STEPS = 5


@dataclasses.dataclass(frozen=True)
class TrainerSpec:
    """What one trainer process runs (its command line's JSON)."""

    mode: str  # "local" or "remote"
    rank: int
    world_size: int
    step_s: float
    batch_size: int
    crop: int
    root: str  # the JPEG folder (local)
    workers: int  # the local DataLoader's num_workers
    address: str  # the server (remote)
    job: str  # the remote job: one per measurement, so each starts at epoch 0
    threads: int  # torch's intra-op threads: its host's whole cores, at least 1


def batches(spec: TrainerSpec) -> tuple[Iterator[Any], Any]:
    """Batches of the loader `spec` names, epoch after epoch, and the loader (to close). Both
    read the same share: rank `rank` of `world_size`, shuffled with seed 0, each epoch anew."""
    if spec.mode == "remote":
        from remote_loader.client import RemoteLoader

        remote = RemoteLoader(
            spec.address, rank=spec.rank, world_size=spec.world_size, sharing="partition",
            job=spec.job, device="cpu",
        )  # fmt: skip
        return itertools.chain.from_iterable(remote for _ in itertools.count()), remote
    from torch.utils.data import DataLoader, DistributedSampler

    from benchmarks.jpegs import JpegFolder

    dataset = JpegFolder(spec.root, size=spec.crop)
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=spec.world_size, rank=spec.rank, shuffle=True, seed=0
    )
    local = DataLoader(
        dataset, batch_size=spec.batch_size, sampler=sampler, num_workers=spec.workers,
        persistent_workers=spec.workers > 0,
    )  # fmt: skip

    def epochs() -> Iterator[Any]:
        for epoch in itertools.count():
            sampler.set_epoch(epoch)
            yield from local

    return epochs(), local


def commands() -> Iterable[str]:
    """Lines of stdin, read from fd 0 itself: sys.stdin's buffer has a lock that a DataLoader
    worker forked while a read holds it would deadlock on."""
    pending = b""
    while True:
        while b"\n" not in pending:
            chunk = os.read(0, 4096)
            if not chunk:
                return
            pending += chunk
        line, pending = pending.split(b"\n", 1)
        yield line.decode()


def window(loader: Iterator[Any], step_s: float, start: float, stop: float) -> dict[str, Any]:
    """Steps until one ends after `stop`; what fell in [start, stop]: steps completed, seconds
    waited in next() (the part of each wait inside the window) and the longest such wait."""
    counted = 0
    wait = longest = 0.0
    while True:
        begin = time.monotonic()
        next(loader)
        got = time.monotonic()
        time.sleep(step_s)  # the accelerator's step: no host CPU
        end = time.monotonic()
        if end <= start:
            continue
        waited = max(0.0, min(got, stop) - max(begin, start))
        wait += waited
        longest = max(longest, waited)
        if end > stop:
            return {"steps": counted, "seconds": stop - start, "wait": wait, "longest": longest}
        counted += 1


def main(spec: TrainerSpec) -> int:
    import torch

    torch.set_num_threads(spec.threads)  # as in a container with a CPU quota
    loader, owner = batches(spec)
    try:
        for _ in range(WARMUP_STEPS):
            next(loader)
            time.sleep(spec.step_s)
        print("ready", flush=True)
        for line in commands():
            words = line.split()
            if len(words) != 3 or words[0] != "go":
                raise ValueError(f"expected 'go START STOP', got {line!r}")
            report = window(loader, spec.step_s, float(words[1]), float(words[2]))
            report["transport"] = getattr(owner, "last_transport", None)
            print(json.dumps(report), flush=True)
        return 0
    finally:
        close = getattr(owner, "close", None)
        if close is not None:
            close()


if __name__ == "__main__":
    sys.exit(main(TrainerSpec(**json.loads(sys.argv[1]))))
