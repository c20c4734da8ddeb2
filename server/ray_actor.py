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

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.utils.data._utils.worker as torch_worker

from remote_loader.protos.compression import Compressor, compressor_for
from remote_loader.server.collating import use_collate_buffers
from remote_loader.server.sampling import Batching
from remote_loader.server.spec import LoaderSpec, resolve
from remote_loader.server.worker import (
    Fetcher,
    RemoteError,
    build_dataset,
    make_batch,
    seed_rngs,
)

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
        # NOTE [ Collating in process memory ] in server/worker.py: a batch leaves as a blob.
        use_collate_buffers()
        self.spec = spec
        self.batching = batching
        self.worker_id = worker_id
        self.num_workers = num_workers
        self.max_batch_bytes = max_batch_bytes
        self.where = f"in DataLoader worker {worker_id} (Ray actor, pid {os.getpid()})"
        self.init_error: RemoteError | None = None
        self.dataset: Any = None
        self.collate_fn: Callable[[Any], Any] | None = None
        self.fetcher: Fetcher | None = None
        self.initialized = False
        self.epoch_key = -1
        self.epochs = 0  # begun by this actor
        self.compressor: Compressor | None = None
        self.build()

    def build(self) -> None:
        """The dataset from its factory and the collate_fn, as a new worker process has them."""
        try:
            self.dataset = build_dataset(self.spec)
            self.collate_fn = self.batching.collate_fn(self.spec)
        except Exception as exc:
            self.init_error = RemoteError.capture(self.where, exc)

    def node(self) -> str:
        """The id of the node this actor runs on (for Describe and the metrics)."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def begin_epoch(
        self, epoch_key: int, base_seed: int, compression: str = "", fresh: bool = False
    ) -> None:
        """Reseeds and restarts iteration, as a worker process does on EpochStart; `fresh`:
        with a new dataset and worker_init_fn run again, as torch's new worker processes of
        an epoch without persistent_workers (NOTE [ Ray pool reuse ] in server/ray_pool.py)."""
        self.epoch_key = epoch_key
        self.compressor = compressor_for(compression, self.compressor)
        if fresh and self.epochs > 0:
            self.initialized, self.init_error = False, None
            self.build()
        self.epochs += 1
        if self.init_error is not None:
            return
        seed = seed_rngs(base_seed, self.worker_id)
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=self.worker_id, num_workers=self.num_workers, seed=seed, dataset=self.dataset
        )
        try:
            if not self.initialized and self.spec.worker_init_fn:
                resolve(self.spec.worker_init_fn, "worker_init_fn")(self.worker_id)
            self.initialized = True
            assert self.collate_fn is not None
            self.fetcher = Fetcher(self.dataset, self.batching, self.collate_fn)
        except Exception as exc:
            self.init_error = RemoteError.capture(self.where, exc)

    def make(self, epoch_key: int, indices: Any, seed: int | None) -> tuple[Any, ...]:
        """One task (see the return values above)."""
        if self.init_error is not None:
            return (FATAL, self.init_error)
        if epoch_key != self.epoch_key:
            raise RuntimeError(f"task of epoch {epoch_key} sent to a worker in {self.epoch_key}")
        assert self.fetcher is not None
        started = time.monotonic()
        made = make_batch(
            self.fetcher, indices, seed, self.max_batch_bytes, self.where, self.compressor
        )
        if made.error is not None:
            return (ERROR, made.error, started, time.monotonic())
        if made.encoded is None:
            return (EXHAUSTED,)
        encoded = made.encoded
        blob = np.empty(encoded.total_nbytes, dtype=np.uint8)
        encoded.write_blob(torch.from_numpy(blob))
        return (BATCH, len(encoded.header), blob, started, time.monotonic())
