"""The worker pool stage: worker processes, their index queues, the result queue, dispatch.

A pool runs one epoch at a time for one Run (server/sharing.py), which decides which task comes
next and puts results back in order. The pool sends each task to the next worker that still has
data, round-robin as torch's _MultiProcessingDataLoaderIter does, and hands back each task's
outcome as it completes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import multiprocessing
import multiprocessing.context
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from remote_loader.server.sampling import Batching
from remote_loader.server.spec import LoaderSpec
from remote_loader.server.worker import (
    EpochStart,
    RemoteError,
    Result,
    Task,
    WorkerConfig,
    worker_loop,
)

log = logging.getLogger(__name__)

# How long a blocked get on the result queue waits before it checks whether the workers are
# alive. Short, because it also bounds how fast a run notices it has been closed.
POLL_INTERVAL = 0.1
# How long shutdown waits for a worker to exit on its own before terminating it.
WORKER_JOIN_TIMEOUT = 5.0

# NOTE [ Pool Protocol ]
#
# Actors: the thread producing a Run (server/sharing.py), which alone calls begin_epoch /
# submit / poll / end_epoch, and `num_workers` worker processes (`worker_loop`). Queues: one
# index queue per worker (server -> worker), one result queue (workers -> server). Neither is
# bounded by size; both are bounded by the protocol: the Run keeps at most `max_outstanding`
# (= prefetch_factor * num_workers) tasks submitted and not yet polled back.
#
#   server (Run thread)                        worker
#   -------------------                        ------
#   begin_epoch: current_epoch.value = key,    on EpochStart(key, base_seed):
#     EpochStart(key, base_seed) to all          seed random/torch/numpy from base_seed + id,
#   submit: Task(key, id, indices) to the        set get_worker_info(), worker_init_fn (once),
#     next worker still active                   restart the dataset iterator
#   poll (timeout POLL_INTERVAL):              on Task(key, id, indices, released):
#     on Empty: workers alive? timeout?          mark `released` slots free
#     stale epoch: release its slot              skip if key is not current_epoch.value
#     exhausted: that worker is inactive         fetch + collate + encode into a free shm slot
#     else: Outcome(id, Delivery)                put Result(id, slot | error | exhausted)
#   Delivery.release() (any thread, once the   on None, or the server gone: exit
#     bytes are sent): slot handed back with     (checked every MP_STATUS_CHECK_INTERVAL)
#     the worker's next Task
#   end_epoch: current_epoch.value = -1
#
# Shared memory: each worker allocates its own slots (torch shared tensors, passed to the
# server once, as file descriptors, with the Result that first uses them). A slot is read by the
# server between that Result and its release; a worker reuses only released slots. The
# segments have no names in /dev/shm (torch's file_descriptor strategy unlinks them at once),
# so nothing is left behind whichever process dies.
#
# NOTE [ Pool Shutdown ]
#
# `shutdown()` is the one cleanup path, called when a Run ends (non-persistent pools), when
# its loader is closed (persistent pools) and when the server stops:
#   1. current_epoch.value = -1, so workers skip whatever is still queued for them;
#   2. put None on every index queue (workers exit after their current task);
#   3. join each worker for WORKER_JOIN_TIMEOUT, then terminate, then kill, what remains;
#   4. close the queues without waiting for their feeder threads (cancel_join_thread), since a
#      dead reader would make that wait forever.
# A worker that finds the server gone exits by itself (see _server_alive in server/worker.py).
# Deliveries still held by consumers stay readable: their memoryviews keep the mapped segments.


class WorkerDiedError(RuntimeError):
    """A worker process exited while the pool was running an epoch."""


def _nothing() -> None:
    pass


@dataclasses.dataclass
class Delivery:
    """One batch made for a Run: its encoded blob, or the error raised making it.

    `blob` stays valid until `release()` is called; the consumer calls it once it has copied
    the bytes out.
    """

    blob: memoryview | None = None
    header_nbytes: int = 0
    error: RemoteError | None = None
    release: Callable[[], None] = _nothing


@dataclasses.dataclass
class Outcome:
    """A submitted task came back: its Delivery, or None when the worker had run dry."""

    task_id: int
    delivery: Delivery | None


class WorkerPool:
    """`num_workers` worker processes for one loader spec; runs one epoch at a time.

    See NOTE [ Pool Protocol ]. Only the thread producing a Run calls the epoch methods;
    `Delivery.release` may be called from any thread.
    """

    def __init__(
        self,
        spec: LoaderSpec,
        batching: Batching,
        ctx: multiprocessing.context.BaseContext,
    ) -> None:
        if spec.num_workers < 1:
            raise ValueError("a WorkerPool needs num_workers >= 1; num_workers=0 loads in-process")
        self.spec = spec
        self.batching = batching
        self.num_workers = spec.num_workers
        self.prefetch = spec.prefetch_factor if spec.prefetch_factor is not None else 2
        self.max_outstanding = max(1, self.prefetch * self.num_workers)
        self._ctx = ctx
        self._workers: list[multiprocessing.process.BaseProcess] = []
        self._index_queues: list[Any] = []
        self._result_queue: Any = None
        self._current_epoch: Any = None
        self._epoch_keys = itertools.count()
        # (worker, slot) -> the slot's bytes, mapped from the worker's shared tensor.
        self._slots: dict[tuple[int, int], memoryview] = {}
        # Slots the server is done with, per worker, to hand back with that worker's next Task.
        self._released: list[list[int]] = []
        self._lock = threading.Lock()  # guards _released: releases come from the stream thread
        self._closed = False
        # Set by the Run when a worker died or a task timed out: the pool must not run another
        # epoch.
        self.broken = False
        # The current epoch (begin_epoch): its key, which workers still have data, and tasks
        # submitted and not yet polled back.
        self._key = -1
        self._active: list[bool] = []
        self._worker_cycle: itertools.cycle[int] = itertools.cycle(range(self.num_workers))
        self.outstanding = 0
        self._progress_at = 0.0

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self._workers if w.pid is not None]

    def start(self) -> None:
        """Starts the worker processes (they build the dataset themselves)."""
        self._result_queue = self._ctx.Queue()
        self._current_epoch = self._ctx.Value("q", -1, lock=False)
        for worker_id in range(self.num_workers):
            index_queue = self._ctx.Queue()
            # Index queues only carry small messages; do not let a dead worker make the server
            # wait on the feeder thread at exit.
            index_queue.cancel_join_thread()
            cfg = WorkerConfig(
                spec=self.spec,
                batching=self.batching,
                worker_id=worker_id,
                num_workers=self.num_workers,
                index_queue=index_queue,
                result_queue=self._result_queue,
                current_epoch=self._current_epoch,
                server_pid=os.getpid(),
            )
            proc = self._ctx.Process(  # type: ignore[attr-defined]
                target=worker_loop,
                args=(cfg,),
                name=f"remote-loader-worker-{worker_id}",
                daemon=True,
            )
            proc.start()
            self._workers.append(proc)
            self._index_queues.append(index_queue)
            self._released.append([])

    def _release(self, worker_id: int, slot: int) -> None:
        with self._lock:
            self._released[worker_id].append(slot)

    def _take_released(self, worker_id: int) -> tuple[int, ...]:
        with self._lock:
            ids = tuple(self._released[worker_id])
            self._released[worker_id].clear()
        return ids

    def _accept_buffers(self, result: Result) -> None:
        for slot in result.dropped:
            self._slots.pop((result.worker_id, slot), None)
        if result.new_buffer is not None:
            self._slots[(result.worker_id, result.slot)] = result.new_buffer.numpy().data

    def _check_alive(self) -> None:
        dead = [w for w in self._workers if not w.is_alive()]
        if dead:
            pids = ", ".join(f"{w.pid} (exit code {w.exitcode})" for w in dead)
            raise WorkerDiedError(f"DataLoader worker (pid(s) {pids}) exited unexpectedly")

    # --- one epoch (called by the Run's thread only) -------------------------------------

    def begin_epoch(self, base_seed: int) -> None:
        """Reseeds the workers and restarts their dataset iterators for a new epoch."""
        if self._closed:
            raise RuntimeError("this worker pool has been shut down")
        self._key = next(self._epoch_keys)
        self._current_epoch.value = self._key
        for q in self._index_queues:
            q.put(EpochStart(epoch_key=self._key, base_seed=base_seed))
        self._active = [True] * self.num_workers
        self._worker_cycle = itertools.cycle(range(self.num_workers))
        self.outstanding = 0

    def submit(self, task_id: int, indices: Any, seed: int | None = None) -> bool:
        """Sends a task (with its per-batch seed, if any) to the next active worker; False when
        every worker has run dry."""
        for _ in range(self.num_workers):
            worker_id = next(self._worker_cycle)
            if self._active[worker_id]:
                break
        else:
            return False
        if self.outstanding == 0:
            self._progress_at = time.monotonic()  # the timeout counts from here
        self._index_queues[worker_id].put(
            Task(self._key, task_id, indices, self._take_released(worker_id), seed)
        )
        self.outstanding += 1
        return True

    def poll(self, timeout: float = POLL_INTERVAL) -> Outcome | None:
        """The next task to complete, or None after `timeout` seconds without one.

        Each wait is followed by a liveness check (WorkerDiedError) and, when the spec sets
        `timeout`, a check that some task completed within it (TimeoutError), as torch's
        _try_get_data does.
        """
        if self.outstanding == 0:
            return None
        deadline = time.monotonic() + timeout
        while True:
            try:
                result: Result = self._result_queue.get(
                    timeout=max(0.0, min(POLL_INTERVAL, deadline - time.monotonic()))
                )
            except queue.Empty:
                self._check_alive()
                now = time.monotonic()
                if self.spec.timeout > 0 and now - self._progress_at >= self.spec.timeout:
                    raise TimeoutError(
                        f"DataLoader timed out after {self.spec.timeout} seconds"
                    ) from None
                if now >= deadline:
                    return None
                continue
            self._accept_buffers(result)
            if result.epoch_key != self._key:
                if result.slot >= 0:  # a batch of an abandoned epoch: the slot is free again
                    self._release(result.worker_id, result.slot)
                continue
            self.outstanding -= 1
            self._progress_at = time.monotonic()
            return self._outcome(result)

    def _outcome(self, result: Result) -> Outcome:
        if result.exhausted:
            # As torch does on _IterableDatasetStopIteration: no more tasks for this worker.
            self._active[result.worker_id] = False
            return Outcome(result.task_id, None)
        if result.error is not None:
            return Outcome(result.task_id, Delivery(error=result.error))
        blob = self._slots[(result.worker_id, result.slot)][: result.total_nbytes]
        return Outcome(
            result.task_id,
            Delivery(
                blob=blob,
                header_nbytes=result.header_nbytes,
                release=functools.partial(self._release, result.worker_id, result.slot),
            ),
        )

    def end_epoch(self) -> None:
        """Abandons what is still queued: workers skip it, and a result still in flight is
        recognised as stale by the next epoch's poll."""
        self._current_epoch.value = -1
        self.outstanding = 0

    def shutdown(self) -> None:
        """Stops the workers. See NOTE [ Pool Shutdown ]."""
        if self._closed:
            return
        self._closed = True
        if self._current_epoch is not None:
            self._current_epoch.value = -1
        for q in self._index_queues:
            with contextlib.suppress(OSError, ValueError):  # already closed
                q.put(None)
        for w in self._workers:
            w.join(timeout=WORKER_JOIN_TIMEOUT)
            if w.is_alive():
                log.warning(
                    "worker pid %s did not exit in %.0f s; terminating it",
                    w.pid,
                    WORKER_JOIN_TIMEOUT,
                )
                w.terminate()
                w.join(timeout=1.0)
                if w.is_alive():
                    w.kill()
                    w.join(timeout=1.0)
        self._slots.clear()
        for q in [*self._index_queues, self._result_queue]:
            if q is not None:
                q.cancel_join_thread()
                q.close()
