"""A loader worker as a Ray actor: worker `w` of `num_workers`, on whichever node Ray placed it.

It does what a worker process does (server/worker.py), with the same pieces: it builds the
dataset from its factory itself (nothing is pickled but the spec), seeds random, torch and numpy
as torch seeds worker `w`, runs `worker_init_fn` once and sets `get_worker_info()`, so an
IterableDataset shards itself as under a local DataLoader. Ray runs an actor's calls one at a
time in the order one caller made them (the pool's bridge is the only caller), so a worker's
tasks are made in the order they were sent, as from a worker's index queue.

Batches leave as numpy arrays: Ray stores them in its object store without pickling their data
(zero-copy for a reader on the same node), not as Python objects.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import numpy as np
import torch

from remote_loader.server.allocator import settle_allocator
from remote_loader.server.collating import use_collate_buffers
from remote_loader.server.sampling import Batching
from remote_loader.server.spec import LoaderSpec
from remote_loader.server.worker import WorkerState, make_batch

# What `make` returns (a tuple, so Ray serialises the array out of band):
#   ("batch", header_nbytes, blob, started_at, finished_at)
#   ("error", RemoteError, started_at, finished_at)
#   ("exhausted",)              the worker's IterableDataset ran dry
#   ("fatal", RemoteError)      the dataset factory or worker_init_fn raised: nothing can load
BATCH, ERROR, EXHAUSTED, FATAL = "batch", "error", "exhausted", "fatal"


class RayWorker:
    """Worker `worker_id` of `num_workers` (made a Ray actor class by server/ray_bridge.py)."""

    def __init__(
        self,
        spec: LoaderSpec,
        batching: Batching,
        worker_id: int,
        num_workers: int,
        max_batch_bytes: int,
    ) -> None:
        torch.set_num_threads(1)  # as torch's workers do: parallelism comes from the workers
        settle_allocator()  # NOTE [ Worker allocator ] in server/allocator.py
        # NOTE [ Collating in process memory ] in server/collating.py: a batch leaves as a blob.
        use_collate_buffers()
        self.max_batch_bytes = max_batch_bytes
        self.epoch_key = -1
        where = f"in DataLoader worker {worker_id} (Ray actor, pid {os.getpid()})"
        # The same dataset, seeding and worker_init_fn as a worker process (server/worker.py).
        self._new_state = functools.partial(
            WorkerState, spec, batching, worker_id, num_workers, where
        )
        self.state = self._new_state()
        self.epochs = 0  # begun by this actor

    def node(self) -> str:
        """The id of the node this actor runs on (for Describe and the metrics)."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def begin_epoch(
        self, epoch_key: int, base_seed: int, compression: str = "", fresh: bool = False
    ) -> None:
        """Reseeds and restarts iteration, as a worker process does on EpochStart; `fresh`:
        with a new dataset and worker_init_fn run again, as torch's new worker processes of
        an epoch without persistent_workers (NOTE [ Ray pool reuse ] in server/pool_ray.py)."""
        self.epoch_key = epoch_key
        if fresh and self.epochs > 0:
            self.state = self._new_state()  # a new dataset; worker_init_fn runs again
        self.epochs += 1
        self.state.begin_epoch(base_seed, compression)

    def make(self, epoch_key: int, indices: Any, seed: int | None) -> tuple[Any, ...]:
        """One task (see the return values above)."""
        state = self.state
        if state.init_error is not None:
            return (FATAL, state.init_error)
        if epoch_key != self.epoch_key:
            raise RuntimeError(f"task of epoch {epoch_key} sent to a worker in {self.epoch_key}")
        assert state.fetcher is not None
        started = time.monotonic()
        made = make_batch(
            state.fetcher, indices, seed, self.max_batch_bytes, state.where, state.compressor
        )
        if made.error is not None:
            return (ERROR, made.error, started, time.monotonic())
        if made.encoded is None:
            return (EXHAUSTED,)
        encoded = made.encoded
        blob = np.empty(encoded.total_nbytes, dtype=np.uint8)
        encoded.write_blob(torch.from_numpy(blob))
        return (BATCH, len(encoded.header), blob, started, time.monotonic())
