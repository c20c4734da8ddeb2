"""The worker pool stage: worker processes, their index queues, the result queue, dispatch.

One pool runs one epoch at a time. Its tasks go round-robin to the workers that still have data,
at most `prefetch_factor * num_workers` in flight, and its results come back in task order
through server/reorder.py, exactly as in torch's _MultiProcessingDataLoaderIter.
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
from collections.abc import Callable, Generator
from typing import Any

from remote_loader.server.reorder import Reorderer
from remote_loader.server.sampling import Batching, EpochPlan
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

# How long a blocked get on the result queue waits before it checks cancellation and whether
# the workers are alive. Short, because it bounds how fast a cancelled stream lets go.
POLL_INTERVAL = 0.1
# How long shutdown waits for a worker to exit on its own before terminating it.
WORKER_JOIN_TIMEOUT = 5.0

# NOTE [ Pool Protocol ]
#
# Actors: the server thread running an epoch (`WorkerPool.run_epoch`) and `num_workers` worker
# processes (`worker_loop`). Queues: one index queue per worker (server -> worker), one result
# queue (workers -> server). Neither is bounded by size, both are bounded by the protocol: the
# server has at most `prefetch_factor * num_workers` tasks outstanding, where a task stays
# outstanding until its batch has been handed on, not merely received.
#
#   server, per epoch                          worker
#   -----------------                          ------
#   current_epoch.value = key                  on EpochStart(key, base_seed):
#   put EpochStart(key, base_seed) to all        seed random/torch/numpy from base_seed + id,
#   put Task(key, id, indices) round-robin       set get_worker_info(), worker_init_fn (once),
#     to active workers (prefetch window)        restart the dataset iterator
#   get Result (timeout POLL_INTERVAL):        on Task(key, id, indices, released):
#     on Empty: cancelled? workers alive?        mark `released` slots free
#     stale epoch: release its slot              skip if key is not current_epoch.value
#     exhausted: worker inactive, skip id        fetch + collate + encode into a free shm slot
#     else: reorder, hand on in task order       put Result(id, slot | error | exhausted)
#   after handing on a batch: release its      on None, or the server gone: exit
#     slot (piggybacked on the worker's next     (checked every MP_STATUS_CHECK_INTERVAL)
#     Task), put one more Task
#
# Shared memory: each worker allocates its own slots (torch shared tensors, passed to the
# server once, as file descriptors, with the Result that first uses them). A slot is read by the
# server between that Result and its release; a worker reuses only released slots. The
# segments have no names in /dev/shm (torch's file_descriptor strategy unlinks them at once),
# so nothing is left behind whichever process dies.
#
# NOTE [ Pool Shutdown ]
#
# `shutdown()` is the one cleanup path, called when a stream ends (non-persistent pools), when
# its loader is closed (persistent pools) and when the server stops:
#   1. current_epoch.value = -1, so workers skip whatever is still queued for them;
#   2. put None on every index queue (workers exit after their current task);
#   3. join each worker for WORKER_JOIN_TIMEOUT, then terminate, then kill, what remains;
#   4. close the queues without waiting for their feeder threads (cancel_join_thread), since a
#      dead reader would make that wait forever.
# A worker that finds the server gone exits by itself (see _server_alive in server/worker.py).


class WorkerDiedError(RuntimeError):
    """A worker process exited while the pool was running an epoch."""


@dataclasses.dataclass
class Delivery:
    """One batch handed on by an epoch: its encoded blob, or the error raised making it.

    `blob` stays valid until `release()` is called; the consumer calls it once it has copied
    the bytes out.
    """

    position: int
    blob: memoryview | None = None
    header_nbytes: int = 0
    error: RemoteError | None = None
    release: Callable[[], None] = lambda: None


class WorkerPool:
    """`num_workers` worker processes for one loader spec; runs one epoch at a time."""

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
        # Set when a worker died or a task timed out: the pool must not run another epoch.
        self.broken = False

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

    def run_epoch(
        self, plan: EpochPlan, cancelled: threading.Event
    ) -> Generator[Delivery, None, None]:
        """The epoch's batches, in task order (or completion order without in_order).

        Stops early, leaving no work behind, when `cancelled` is set or the caller closes the
        generator. A worker death or a `timeout` ends the epoch with an error Delivery.
        """
        if self._closed:
            raise RuntimeError("this worker pool has been shut down")
        key = next(self._epoch_keys)
        self._current_epoch.value = key
        for q in self._index_queues:
            q.put(EpochStart(epoch_key=key, base_seed=plan.base_seed))
        active = [True] * self.num_workers
        worker_cycle = itertools.cycle(range(self.num_workers))
        outstanding: dict[int, int] = {}  # task id -> worker; len() <= max_outstanding
        reorder: Reorderer[Result] = Reorderer(in_order=self.spec.in_order)
        next_task = 0
        tasks_done = False
        position = 0

        def put_task() -> None:
            nonlocal next_task, tasks_done
            if tasks_done or len(outstanding) >= self.max_outstanding:
                return
            for _ in range(self.num_workers):
                worker_id = next(worker_cycle)
                if active[worker_id]:
                    break
            else:
                tasks_done = True  # every worker ran dry (IterableDataset)
                return
            try:
                indices = next(plan.tasks)
            except StopIteration:
                tasks_done = True
                return
            self._index_queues[worker_id].put(
                Task(key, next_task, indices, self._take_released(worker_id))
            )
            outstanding[next_task] = worker_id
            next_task += 1

        try:
            for _ in range(self.max_outstanding):
                put_task()
            while outstanding:
                result = self._get(cancelled, key)
                if result is None:
                    return  # cancelled
                if result.task_id not in outstanding:
                    raise RuntimeError(f"result for task {result.task_id} that is not outstanding")
                reorder.put(result.task_id, result)
                for ready in reorder.ready():
                    del outstanding[ready.task_id]
                    if ready.exhausted:
                        active[ready.worker_id] = False
                    elif ready.error is not None:
                        yield Delivery(position=position, error=ready.error)
                        position += 1
                    else:
                        slot_key = (ready.worker_id, ready.slot)
                        blob = self._slots[slot_key][: ready.total_nbytes]
                        worker_id, slot = slot_key
                        yield Delivery(
                            position=position,
                            blob=blob,
                            header_nbytes=ready.header_nbytes,
                            release=functools.partial(self._release, worker_id, slot),
                        )
                        position += 1
                    put_task()
        except (WorkerDiedError, TimeoutError) as exc:
            self.broken = True
            where = "in the server's worker pool"
            yield Delivery(position=position, error=RemoteError.capture(where, exc))
        finally:
            # Abandoned or finished: workers skip what is still queued for this epoch, and a
            # result still in flight is recognised as stale by the next epoch (_get).
            self._current_epoch.value = -1

    def _get(self, cancelled: threading.Event, key: int) -> Result | None:
        """The next result of epoch `key`, or None once cancelled.

        Every wait is bounded by POLL_INTERVAL and followed by a cancellation and liveness
        check; `spec.timeout` (when set) bounds the whole wait like torch's `timeout`.
        """
        waited = 0.0
        while True:
            if cancelled.is_set():
                return None
            try:
                result: Result = self._result_queue.get(timeout=POLL_INTERVAL)
            except queue.Empty:
                waited += POLL_INTERVAL
                self._check_alive()
                if self.spec.timeout > 0 and waited >= self.spec.timeout:
                    raise TimeoutError(
                        f"DataLoader timed out after {self.spec.timeout} seconds"
                    ) from None
                continue
            self._accept_buffers(result)
            if result.epoch_key == key:
                return result
            if result.slot >= 0:  # a batch of an abandoned epoch: the slot is free again
                self._release(result.worker_id, result.slot)

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
