"""Messages between the server and its workers (processes or Ray actors): what goes down an
index queue (EpochStart, Task), what comes back (Result), a batch too large to hold. See NOTE
[ Pool Protocol ] in server/engine/pool.py.

Imported by the worker process and by every stage that reads its results; imports only the
errors leaf of the server, so the worker stays free of gRPC.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from remote_loader.protos import slots as slot_protocol
from remote_loader.server.errors import CapturedError


class BatchTooLargeError(ValueError):
    """An encoded batch is bigger than the server's max_batch_bytes."""


# The largest encoded batch a loader may make (max_batch_bytes). A batch is held whole in a
# worker's shared-memory slot (prefetch_factor * num_workers of them may be in flight, in a
# /dev/shm that containers size: docker-compose.yml gives 2 GiB), then whole in the trainer's
# pinned memory. One of several GiB is nearly always a mistake (a batch_size meant for samples,
# a collate_fn that gathers the dataset) that would otherwise end as a worker killed by SIGBUS
# or the OOM killer; 2 GiB is well above real batches (256 float32 images of 3x512x512 are
# 805 MB). A batch over it is an error at its position (check_batch_size).
DEFAULT_MAX_BATCH_BYTES = 2 << 30


def check_batch_size(nbytes: int, limit: int) -> None:
    """Raises BatchTooLargeError, saying what to change, for a batch over `limit` bytes."""
    if nbytes > limit:
        raise BatchTooLargeError(
            f"the encoded batch is {nbytes} bytes ({nbytes / 2**20:.1f} MiB), more than the "
            f"server's max_batch_bytes of {limit} bytes ({limit / 2**20:.1f} MiB); make smaller "
            "batches (batch_size, or less data per sample), or raise the limit: max_batch_bytes "
            "in the config's [server] table, REMOTE_LOADER_MAX_BATCH_BYTES or serve "
            "--max-batch-bytes"
        )


# --- messages on the queues (see NOTE [ Pool Protocol ] in server/engine/pool.py) -----------------


@dataclasses.dataclass(frozen=True)
class EpochStart:
    """Reseed and restart iteration for a new epoch; tasks of older epochs are dropped."""

    epoch_key: int
    base_seed: int
    # "lz4" / "zstd": compress the epoch's leaves that shrink (NOTE [ Compression ] in
    # protos/compression.py); "": none.
    compression: str = ""
    # The loader's epoch, as the stream asked for it (not epoch_key, the pool's count), for the
    # dataset's set_epoch; and an IterDataPipe's shared seed (None: not one). NOTE [ Epoch
    # hooks ] in server/worker/dataset.py.
    epoch: int = 0
    shared_seed: int | None = None


@dataclasses.dataclass(frozen=True)
class Task:
    epoch_key: int
    task_id: int
    indices: Any
    # Slots of this worker that the server has finished reading and hands back for reuse.
    released: tuple[int, ...] = ()
    # seeding = "per_batch": random/torch/numpy are seeded with this before the batch is made.
    seed: int | None = None


@dataclasses.dataclass(frozen=True)
class Result:
    """One task's outcome: an encoded batch in slot `slot`, an error, or the end of the data."""

    worker_id: int
    epoch_key: int
    task_id: int
    slot: int = -1
    offset: int = slot_protocol.SLOT_HEADER  # where the blob starts in the slot
    header_nbytes: int = 0
    total_nbytes: int = 0
    # A slot the server has not seen yet (or that replaced a smaller one): a shared tensor.
    new_buffer: torch.Tensor | None = None
    # Slots the worker has let go (too small); the server forgets them.
    dropped: tuple[int, ...] = ()
    error: CapturedError | None = None
    # An IterableDataset ran dry in this worker (torch's _IterableDatasetStopIteration).
    exhausted: bool = False
    # Which process of worker `worker_id` this is (a replaced worker gets a new one): slots are
    # the process's own, so they are named by (incarnation, slot).
    incarnation: int = 0
    # The worker cannot load anything (the dataset factory or worker_init_fn raised there).
    fatal: bool = False
    # The slot's generation holding this batch (NOTE [ Zero-copy slots ] in protos/slots.py).
    generation: int = 0
    # A KEEP lane's actor keeps the batch in its slot, for trainers to fetch from its data
    # server at this address (NOTE [ Node data connection ] in protos/node.py) ...
    node: tuple[str, int] | None = None
    # ... and the server's pool adds, in its own process, the batch's handle (a NodeBatch).
    node_batch: Any = None
    # time.monotonic() when the worker took the task and when it had the result (for metrics):
    # CLOCK_MONOTONIC is one clock for all processes of a Linux host, so the server compares
    # them with its own stamps.
    started_at: float = 0.0
    finished_at: float = 0.0
