"""The loader's one dataset: built once in the server, pickled once, and the start of every worker's
copy; and what each epoch tells a copy before its first sample (set_epoch, an IterDataPipe's
seed and shard). See NOTE [ One dataset per loader ] and NOTE [ Epoch hooks ].
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterDataPipe, MapDataPipe
from torch.utils.data.graph_settings import apply_random_seed, apply_sharding

from remote_loader.server.config.spec import LoaderSpec, resolve

log = logging.getLogger(__name__)

# A dataset whose pickle is larger than this gets a warning: each worker holds a copy.
LARGE_PICKLE = 256 << 20

# NOTE [ One dataset per loader ]
#
# torch builds a DataLoader's dataset once, in the main process, and every worker starts from
# that object: a fork of it ("fork"), or one pickled copy of it ("spawn", "forkserver"). So
# whatever the dataset drew at random when it was built (a shuffle buffer's seed, a random
# split, an augmentation's parameters) is the same in every worker, and an IterableDataset
# that shards itself by get_worker_info() hands each sample to exactly one worker.
#
# Here the same: the factory is called once per loader, in the server (LoaderHost, at
# start-up), and the object it returns is pickled once (`share`: plain pickle, highest
# protocol, after the server has built its DataLoader over it, so the settings DataLoader
# applies to an IterDataPipe are in it; not torch's ForkingPickler, whose tensors travel as
# file descriptors that one reader takes, where these bytes are read by every worker of every
# epoch). The bytes lie in a shared-memory tensor that each
# worker process is handed (a file descriptor, not a copy through a pipe) and each Ray actor
# gets through the object store (one ray.put by the bridge); every worker, a fresh one of
# each epoch without persistent_workers and a replacement for a dead one alike, unpickles
# them (`SharedDataset.load`). The collate_fn, sampler and worker_init_fn are still named by
# import path and resolved where they run.
#
# So a dataset factory
#   - is called once, in the server process, with the spec's keyword arguments; it may draw
#     random numbers, read files, download: workers never call it (unless the next point);
#   - must return an object that pickles (and unpickles) to share that state. One that does
#     not (an open file handle, a lock, a lambda) is built by each worker calling the factory
#     itself, as before: the server logs one warning at start-up naming the pickling error
#     (and hands it to trainers, a UserWarning at their `iter()` as torch's own are), and
#     what the factory draws at random then differs between workers (an unseeded shuffle
#     buffer loses and repeats samples across workers);
#   - should not hand its object state that only the server process may use: the workers'
#     copies are unpickled in other processes, perhaps on other hosts (Ray).
# Tensors in the dataset are copied into each worker (plain pickle), where torch's "spawn"
# would share them: as before, when each worker built its own, each holds its own copy. A
# memory map (np.memmap) pickles as its data, where workers that built their own mapped the
# file: a dataset over a large one should open it on first use in the worker. A pickle over
# LARGE_PICKLE gets a warning saying so.


def build_dataset(spec: LoaderSpec) -> Any:
    """Calls the spec's dataset factory (once per loader: NOTE [ One dataset per loader ])."""
    part = spec.parts.dataset
    factory = resolve(part.factory, "dataset")
    return factory(**part.kwargs)


@dataclasses.dataclass(frozen=True)
class SharedDataset:
    """The loader's dataset as its workers get it: `data`, its pickle (a uint8 tensor in shared
    memory for worker processes, an array out of Ray's object store for actors), or None when
    it cannot be pickled and each worker builds its own (NOTE [ One dataset per loader ])."""

    data: Any = None
    # Why it could not be shared, for the trainers (LoaderInfo.warnings): None when it was.
    warning: str | None = None

    def array(self) -> Any:
        """The pickle as a numpy array (None without one), for ray.put."""
        if isinstance(self.data, torch.Tensor):
            return self.data.numpy()
        return self.data

    def load(self, spec: LoaderSpec) -> Any:
        """This worker's copy of the loader's dataset."""
        if self.data is None:
            return build_dataset(spec)
        return pickle.loads(memoryview(self.array()))


def share(spec: LoaderSpec, dataset: Any) -> SharedDataset:
    """`dataset` pickled once for the loader's workers; when it cannot be (or its pickle cannot
    be read back), a SharedDataset without data, and one warning saying what that costs."""
    try:
        payload = pickle.dumps(dataset, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        return _unshared(spec, dataset, exc)
    data = torch.empty(len(payload), dtype=torch.uint8).share_memory_()
    data.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
    del payload  # at most two copies at once: a dataset's pickle may be large
    shared = SharedDataset(data)
    try:
        shared.load(spec)  # read back once here, rather than failing in every worker
    except Exception as exc:
        return _unshared(spec, dataset, exc)
    size = data.numel()
    log.info("loader %r: its dataset pickled is %d bytes, for its workers", spec.name, size)
    if size > LARGE_PICKLE:
        log.warning(
            "loader %r: its dataset pickles to %.0f MiB, and each worker process holds its own "
            "copy of it (as each would under torch's spawn); keep large data out of the "
            "dataset object (open files or memory maps on first use in the worker) to share "
            "it (NOTE [ One dataset per loader ] in remote_loader.server.worker.dataset)",
            spec.name,
            size / 2**20,
        )
    return shared


def _unshared(spec: LoaderSpec, dataset: Any, exc: Exception) -> SharedDataset:
    warning = (
        f"the dataset of loader {spec.name!r} ({type(dataset).__qualname__}) cannot be "
        f"pickled ({type(exc).__name__}: {exc}), so it cannot be shared with the workers: "
        "each worker builds its own from the factory, and whatever the factory draws at "
        "random when it builds one (a shuffle seed, a split) differs between workers; make "
        "the dataset picklable to share it (NOTE [ One dataset per loader ] in "
        "remote_loader.server.worker.dataset)"
    )
    log.warning("%s", warning)
    return SharedDataset(warning=warning)


# NOTE [ Epoch hooks ]
#
# What a training framework does to the dataset before each epoch, locally, is done to every
# worker's copy before the epoch's first sample (`begin_dataset_epoch`, from WorkerState in
# server/worker/loop.py, and from InlineEngine for num_workers = 0), every epoch, persistent
# workers included:
#   - `dataset.set_epoch(epoch)` when the dataset has it (Hugging Face IterableDataset,
#     WebDataset, torchdata), with the loader's epoch: the one the stream asked for (the
#     client's set_epoch), not the pool's count of the epochs it ran. Users call it on their
#     copy before iterating a DataLoader; a sampler's and batch_sampler's set_epoch are called
#     in the server, which samples (server/config/sampling.py's plan_epoch);
#   - for an IterDataPipe (torch.utils.data.datapipes), what torch's DataLoader does: its
#     random pipes seeded from the epoch's shared seed (`apply_random_seed`, the seed drawn
#     from the epoch's generator before the workers' base seed, as torch draws it), and its
#     sharding_filter told this worker's share (`apply_sharding(num_workers, worker_id)`,
#     torch's _sharding_worker_init_fn; one worker of one with num_workers = 0). The server
#     serves one rank's worth: partitioning an IterableDataset between ranks is refused.


def begin_dataset_epoch(
    dataset: Any, epoch: int, worker_id: int, num_workers: int, shared_seed: int | None
) -> Any:
    """The epoch hooks of one worker's copy (NOTE [ Epoch hooks ]); returns the dataset to
    iterate (the same object)."""
    set_epoch = getattr(dataset, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
    if isinstance(dataset, IterDataPipe) and shared_seed is not None:
        dataset = apply_random_seed(dataset, torch.Generator().manual_seed(shared_seed))
    if isinstance(dataset, IterDataPipe | MapDataPipe):
        dataset = apply_sharding(dataset, num_workers, worker_id)
    return dataset
