"""The worker stage: a process that turns tasks (indices) into encoded batches in shared memory.

Also holds what a Ray actor (server/engine/ray/actor.py) shares with it, a worker's state across
epochs and making one task's batch; the messages it reads and writes are
server/batch/messages.py's. Seeding and fetching like torch are
server/worker/fetcher.py's; the dataset a worker starts from, server/worker/dataset.py's.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.data._utils.worker as torch_worker

from remote_loader.protos import codec
from remote_loader.protos.compression import Compressor, compressor_for
from remote_loader.server.batch.messages import EpochStart, Result, Task, check_batch_size
from remote_loader.server.config.sampling import Batching
from remote_loader.server.config.spec import LoaderSpec, resolve
from remote_loader.server.errors import CapturedError
from remote_loader.server.worker.allocator import settle_allocator
from remote_loader.server.worker.collating import (
    Arena,
    WorkerSlots,
    stacking_into,
    use_collate_buffers,
)
from remote_loader.server.worker.dataset import SharedDataset, begin_dataset_epoch
from remote_loader.server.worker.fetcher import Fetcher, seed_rngs

# How often a blocked worker checks that the server still exists (torch uses the same 5 s).
MP_STATUS_CHECK_INTERVAL = 5.0


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """Everything one worker process needs; the process entry point takes only this."""

    spec: LoaderSpec
    batching: Batching
    worker_id: int
    num_workers: int
    index_queue: Any
    # This process's own result pipe (the writing end of a one-way Pipe).
    results: Any
    # The current epoch's key, shared with the server, so a worker skips tasks of an epoch the
    # server has abandoned (a client that went away) instead of loading them.
    current_epoch: Any
    server_pid: int
    incarnation: int
    # The task this worker is making (-1: none), written before each task: if the process dies,
    # the server knows which batch it died on (a Result may die unsent with it).
    current_task: Any
    # An encoded batch bigger than this is an error at its position (the server setting
    # max_batch_bytes; see check_batch_size).
    max_batch_bytes: int
    # The loader's dataset, pickled once (NOTE [ One dataset per loader ]).
    dataset: SharedDataset


# --- what a worker keeps across epochs ---------------------------------------------------


class WorkerState:
    """What one worker keeps across epochs, a worker process (`worker_loop`) or a Ray actor
    (server/engine/ray/actor.py) alike: its copy of the loader's one dataset (NOTE [ One dataset per
    loader ] in server/worker/dataset.py) and its collate_fn, whether worker_init_fn has run, and
    the current epoch's fetcher and compressor. `init_error` is set once the dataset (read from
    its pickle, or built by the factory), the collate_fn, an epoch hook or worker_init_fn
    raised: every task is then answered with it (fatal), nothing more is tried.
    """

    def __init__(
        self,
        spec: LoaderSpec,
        batching: Batching,
        worker_id: int,
        num_workers: int,
        where: str,
        dataset: SharedDataset,
    ) -> None:
        self.spec = spec
        self.batching = batching
        self.worker_id = worker_id
        self.num_workers = num_workers
        self.where = where  # names the worker in its errors
        self.init_error: CapturedError | None = None
        self.dataset: Any = None
        self.collate_fn: Callable[[Any], Any] | None = None
        self.fetcher: Fetcher | None = None
        self.compressor: Compressor | None = None
        self.initialized = False  # worker_init_fn has run (it runs once per worker)
        try:
            self.dataset = dataset.load(spec)
            self.collate_fn = batching.collate_fn(spec)
        except Exception as exc:
            self.init_error = CapturedError.capture(where, exc)

    def begin_epoch(self, start: EpochStart) -> None:
        """The worker's epoch start, as torch's _worker_loop does it: seed random, torch and
        numpy from base_seed + worker_id, set get_worker_info() (an IterableDataset shards
        itself by it), the epoch hooks (NOTE [ Epoch hooks ] in server/worker/dataset.py), run
        worker_init_fn once, restart the dataset iterator; the epoch's batches are compressed
        as `start` says."""
        if self.init_error is not None:
            return
        seed = seed_rngs(start.base_seed, self.worker_id)
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=self.worker_id, num_workers=self.num_workers, seed=seed, dataset=self.dataset
        )
        try:
            self.dataset = begin_dataset_epoch(
                self.dataset, start.epoch, self.worker_id, self.num_workers, start.shared_seed
            )
            init_fn = self.spec.parts.pool.worker_init_fn
            if not self.initialized and init_fn:
                resolve(init_fn, "worker_init_fn")(self.worker_id)
            self.initialized = True
            assert self.collate_fn is not None
            self.fetcher = Fetcher(self.dataset, self.batching, self.collate_fn)
            self.compressor = compressor_for(start.compression, self.compressor)
        except Exception as exc:
            self.init_error = CapturedError.capture(self.where, exc)


# --- the worker process -------------------------------------------------------------------


def _server_alive(server_pid: int, parent_pid: int) -> bool:
    # Our parent is the fork server, which exits with the server; a changed parent pid means it is
    # gone. The server's own pid is checked too, in case the fork server outlives it, and a
    # zombie counts as gone (a killed server not yet reaped by its parent).
    if os.getppid() != parent_pid:
        return False
    try:
        os.kill(server_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{server_pid}/stat", "rb") as f:
            # The state follows the command name, which is in parentheses and may hold spaces.
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def worker_loop(cfg: WorkerConfig) -> None:
    """Entry point of a worker process. See NOTE [ Pool Protocol ] in server/engine/pool.py.

    Reads EpochStart / Task / None from its index queue, writes one Result per Task to the result
    queue, and exits on None or when the server is gone.
    """
    # Ctrl-C belongs to the server, which shuts the pool down in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)  # as torch's workers do: parallelism comes from the processes
    settle_allocator()  # NOTE [ Worker allocator ] in server/worker/allocator.py
    use_collate_buffers()  # NOTE [ Collating in process memory ] in server/worker/collating.py
    parent_pid = os.getppid()
    state = WorkerState(
        cfg.spec,
        cfg.batching,
        cfg.worker_id,
        cfg.num_workers,
        f"in DataLoader worker process {cfg.worker_id}",
        cfg.dataset,
    )
    slots = WorkerSlots()
    epoch_key = -1
    while True:
        try:
            msg = cfg.index_queue.get(timeout=MP_STATUS_CHECK_INTERVAL)
        except queue.Empty:
            if not _server_alive(cfg.server_pid, parent_pid):
                return
            continue
        if msg is None:
            return
        if isinstance(msg, EpochStart):
            epoch_key = msg.epoch_key
            state.begin_epoch(msg)
            continue
        slots.release(msg.released)
        if msg.epoch_key != epoch_key or msg.epoch_key != cfg.current_epoch.value:
            continue  # an abandoned epoch: the server no longer waits for this result
        cfg.current_task.value = msg.task_id
        result = _run_task(cfg, msg, state, slots)
        cfg.current_task.value = -1
        try:
            cfg.results.send(result)
        except (BrokenPipeError, OSError):
            return  # the server is gone (or replaced this worker): nobody reads results
        del result
        del msg


@dataclasses.dataclass
class Made:
    """One task's outcome: the encoded batch, or the error at its place; neither when the
    worker's IterableDataset has run dry."""

    encoded: codec.Encoded | None = None
    error: CapturedError | None = None


def make_batch(
    fetcher: Fetcher,
    indices: Any,
    seed: int | None,
    max_batch_bytes: int,
    where: str,
    compressor: Compressor | None = None,
    arena: Arena | None = None,
) -> Made:
    """One task, the same in a worker process and inline (num_workers=0): seed the RNGs (with
    seeding = "per_batch"), fetch and collate (stacking into `arena` what fits: NOTE
    [ Collating into the slot ] in server/worker/collating.py), encode (compressing the leaves that
    shrink when the epoch asks), check the size. The size is checked before anything is
    written to a shared-memory slot: an oversized batch never reaches one."""
    if seed is not None:
        seed_rngs(seed, 0)
    try:
        with stacking_into(arena):
            batch = fetcher.fetch(indices)
    except StopIteration:
        return Made()
    except Exception as exc:
        return Made(error=CapturedError.capture(where, exc))
    try:
        encoded = codec.encode(batch, compressor, arena.placed if arena is not None else None)
        check_batch_size(encoded.total_nbytes, max_batch_bytes)
    except Exception as exc:
        return Made(error=CapturedError.capture(f"encoding a batch {where}", exc))
    return Made(encoded=encoded)


def fill_slot(
    state: WorkerState, slots: WorkerSlots, indices: Any, seed: int | None, max_batch_bytes: int
) -> dict[str, Any]:
    """One task made into one of `slots`, a worker process's or a same-host Ray actor's
    (NOTE [ Ray data path ] in server/engine/ray/backend.py): the Result's fields saying where the
    batch lies, or its error, or that the worker's data ran dry (the caller adds who and when)."""
    if state.init_error is not None:
        return {"error": state.init_error, "fatal": True}
    assert state.fetcher is not None
    # Compressed leaves are made apart from the slot: nothing to stack in place.
    arena = slots.arena() if state.compressor is None else None
    made = make_batch(
        state.fetcher, indices, seed, max_batch_bytes, state.where, state.compressor, arena
    )
    if made.encoded is None:
        if arena is not None:
            slots.give_back(arena.taken)
        if made.error is not None:
            return {"error": made.error}
        return {"exhausted": True}
    encoded = made.encoded
    taken, offset = slots.place(encoded, arena)
    header_nbytes, total_nbytes = len(encoded.header), encoded.total_nbytes
    # The batch's tensors view the slot: none may outlive the task (WorkerSlots.take).
    del made, encoded, arena
    new_buffer, dropped = slots.announce(taken.slot)
    return {
        "slot": taken.slot,
        "offset": offset,
        "header_nbytes": header_nbytes,
        "total_nbytes": total_nbytes,
        "new_buffer": new_buffer,
        "dropped": dropped,
        "generation": taken.generation,
    }


def _run_task(cfg: WorkerConfig, task: Task, state: WorkerState, slots: WorkerSlots) -> Result:
    started = time.monotonic()
    fields = fill_slot(state, slots, task.indices, task.seed, cfg.max_batch_bytes)
    return Result(
        cfg.worker_id,
        task.epoch_key,
        task.task_id,
        incarnation=cfg.incarnation,
        started_at=started,
        finished_at=time.monotonic(),
        **fields,
    )
