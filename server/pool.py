"""The worker pool stage: worker processes, their index queues, their result pipes, dispatch.

A pool runs one epoch at a time for one Run (server/run.py), which decides which task comes
next and puts results back in order. The pool sends each task to the next worker that still has
data, round-robin as torch's _MultiProcessingDataLoaderIter does, and hands back each task's
outcome as it completes.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import os
import time
from typing import Any

from remote_loader.server.engine import POLL_INTERVAL, Delivery, Outcome, WorkerInitError
from remote_loader.server.metrics import LoaderMetrics
from remote_loader.server.pool_supervision import WORKER_JOIN_TIMEOUT, SupervisedPool
from remote_loader.server.sampling import Batching
from remote_loader.server.slots import SlotTable
from remote_loader.server.spec import LoaderSpec
from remote_loader.server.supervision import MAX_TASK_ATTEMPTS, PendingTask, TaskLedger
from remote_loader.server.worker import (
    DEFAULT_MAX_BATCH_BYTES,
    EpochStart,
    Result,
    Task,
    WorkerConfig,
    worker_loop,
)

# MAX_TASK_ATTEMPTS is supervision's (server/supervision.py), importable from here as before.
__all__ = ["MAX_TASK_ATTEMPTS", "WORKER_JOIN_TIMEOUT", "WorkerPool"]

log = logging.getLogger(__name__)

# NOTE [ Pool Protocol ]
#
# Actors: the thread producing a Run (server/run.py), which alone calls begin_epoch /
# submit / poll / end_epoch, and `num_workers` worker processes (`worker_loop`). Channels, one
# pair per worker process: an index queue (server -> worker) and a result pipe (worker ->
# server, written synchronously). Neither is bounded by size; both are bounded by the protocol:
# the Run keeps at most `max_outstanding` (= prefetch_factor * num_workers) tasks submitted and
# not yet polled back.
#
#   server (Run thread)                        worker
#   -------------------                        ------
#   begin_epoch: current_epoch.value = key,    on EpochStart(key, base_seed):
#     EpochStart(key, base_seed) to all          seed random/torch/numpy from base_seed + id,
#   submit: Task(key, id, indices) to the        set get_worker_info(), worker_init_fn (once),
#     next worker still active                   restart the dataset iterator
#   poll (waits on the result pipes):          on Task(key, id, indices, released):
#     workers alive? a task past timeout?        mark `released` slots free
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
# Timing: a Result carries the worker's time.monotonic() when it took the task and when it was
# done (one clock for every process of a Linux host); with the task's submit time and the time
# poll read it, they give the index queue wait, the making and the result pipe wait
# (remote_loader_queue_wait_seconds, remote_loader_batch_make_seconds; server/metrics.py).
#
# NOTE [ Pool Shutdown ]
#
# `shutdown()` is the one cleanup path, called when a Run ends (non-persistent pools), when
# its loader is closed (persistent pools) and when the server stops:
#   1. current_epoch.value = -1, so workers skip whatever is still queued for them;
#   2. put None on every index queue (workers exit after their current task);
#   3. join the workers for WORKER_JOIN_TIMEOUT in all (one deadline, not one per worker: 16
#      workers stuck in a slow __getitem__ would otherwise hold the Run's thread for 80 s), then
#      terminate what remains, then kill it, waiting at most a second for each step;
#   4. close the index queues without waiting for their feeder threads (cancel_join_thread),
#      since a dead reader would make that wait forever, and the result pipes.
# A worker that finds the server gone exits by itself (see _server_alive in server/worker.py),
# within MP_STATUS_CHECK_INTERVAL (5 s) of its last task, so a server killed with SIGKILL leaves
# no worker behind for long; the fork server exits with it. Deliveries still held by consumers
# stay readable: their memoryviews keep the mapped segments.


class WorkerPool(SupervisedPool):
    """`num_workers` worker processes for one loader spec; runs one epoch at a time.

    See NOTE [ Pool Protocol ] and NOTE [ Replacing a Worker Process ] (in
    server/pool_supervision.py). Only the thread producing a Run calls the epoch methods;
    `Delivery.release` may be called from any thread.
    """

    def __init__(
        self,
        spec: LoaderSpec,
        batching: Batching,
        ctx: multiprocessing.context.BaseContext,
        *,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        metrics: LoaderMetrics | None = None,
    ) -> None:
        if spec.num_workers < 1:
            raise ValueError("a WorkerPool needs num_workers >= 1; num_workers=0 loads in-process")
        self.spec = spec
        self.batching = batching
        self.num_workers = spec.num_workers
        self.prefetch = spec.prefetch_factor if spec.prefetch_factor is not None else 2
        self.max_outstanding = max(1, self.prefetch * self.num_workers)
        self.max_batch_bytes = max_batch_bytes
        self._metrics = metrics if metrics is not None else LoaderMetrics(spec.name)
        self._ctx = ctx
        self._workers: list[multiprocessing.process.BaseProcess] = []
        self._index_queues: list[Any] = []
        self._incarnations: list[int] = []  # per worker id: its current process's incarnation
        self._making: list[Any] = []  # per worker id: shared value, the task it is making
        # Per worker id: the reading end of its own result pipe (None once it hit EOF). One pipe
        # per process, written synchronously: a worker that dies mid-write cannot leave a lock
        # held that other workers need (as a shared multiprocessing.Queue's write lock would),
        # and its reader gets EOF, not a hang.
        self._results: list[multiprocessing.connection.Connection | None] = []
        self._next_incarnation = itertools.count()
        self._current_epoch: Any = None
        self._epoch_keys = itertools.count()
        # The worker processes' shared-memory slots, by (incarnation, slot) (server/slots.py).
        self._slots = SlotTable()
        self._closed = False
        # Set by the Run when the pool failed: it must not run another epoch.
        self.broken = False
        # Worker processes replaced after they died (or were stopped for a timeout).
        self.restarts = 0
        # The current epoch (begin_epoch): its key and base seed, which workers still have data,
        # and the tasks submitted and not yet polled back (server/supervision.py).
        self._key = -1
        self._base_seed = 0
        self._compression = ""
        self._active: list[bool] = []
        self._worker_cycle: itertools.cycle[int] = itertools.cycle(range(self.num_workers))
        self._ledger = TaskLedger(self.num_workers, iterable=batching.is_iterable)
        # num_workers = "auto" (NOTE [ Worker autotuning ] in server/autotune.py); workers
        # removed by it, joined at shutdown.
        self._tuner = self._new_tuner(spec)
        self._retired: list[multiprocessing.process.BaseProcess] = []
        # Tasks given up (timed out, or out of attempts) and not yet returned by poll().
        self._failed: collections.deque[Outcome] = collections.deque()

    @property
    def outstanding(self) -> int:
        """Tasks submitted and not yet polled back."""
        return len(self._ledger)

    def describe(self) -> dict[str, int | str]:
        """For Describe and the metrics: processes of this host."""
        return {"backend": "local", "nodes": 1, "workers": self.num_workers}

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self._workers if w.pid is not None]

    def start(self) -> None:
        """Starts the worker processes (they build the dataset themselves)."""
        self._current_epoch = self._ctx.Value("q", -1, lock=False)
        for worker_id in range(self.num_workers):
            proc, index_queue, incarnation, making, results = self._spawn(worker_id)
            self._workers.append(proc)
            self._index_queues.append(index_queue)
            self._incarnations.append(incarnation)
            self._making.append(making)
            self._results.append(results)

    def _spawn(
        self, worker_id: int
    ) -> tuple[
        multiprocessing.process.BaseProcess, Any, int, Any, multiprocessing.connection.Connection
    ]:
        # A fresh index queue per process: the old one may still hold tasks the dead process
        # never read, which are re-issued, not read again.
        index_queue = self._ctx.Queue()
        # Index queues only carry small messages; do not let a dead worker make the server
        # wait on the feeder thread at exit.
        index_queue.cancel_join_thread()
        incarnation = next(self._next_incarnation)
        self._slots.open(incarnation)
        making = self._ctx.Value("q", -1, lock=False)
        results, results_writer = self._ctx.Pipe(duplex=False)
        cfg = WorkerConfig(
            spec=self.spec,
            batching=self.batching,
            worker_id=worker_id,
            num_workers=self.num_workers,
            index_queue=index_queue,
            results=results_writer,
            current_epoch=self._current_epoch,
            server_pid=os.getpid(),
            incarnation=incarnation,
            current_task=making,
            max_batch_bytes=self.max_batch_bytes,
        )
        proc = self._ctx.Process(  # type: ignore[attr-defined]
            target=worker_loop,
            args=(cfg,),
            name=f"remote-loader-worker-{worker_id}",
            daemon=True,
        )
        proc.start()
        # Only the worker may hold the writing end: its death then reads as EOF here.
        results_writer.close()
        return proc, index_queue, incarnation, making, results

    # --- one epoch (called by the Run's thread only) -------------------------------------

    def begin_epoch(self, base_seed: int, compression: str = "") -> None:
        """Reseeds the workers and restarts their dataset iterators for a new epoch, whose
        batches they compress with `compression` ("": none; NOTE [ Compression ])."""
        if self._closed:
            raise RuntimeError("this worker pool has been shut down")
        self._key = next(self._epoch_keys)
        self._base_seed = base_seed
        self._compression = compression
        self._current_epoch.value = self._key
        for q in self._index_queues:
            q.put(self._epoch_start())
        # A worker being drained by autotuning is kept: the new epoch may use it again.
        self._resized()
        self._ledger.begin_epoch()
        self._failed.clear()

    def submit(self, task_id: int, indices: Any, seed: int | None = None) -> bool:
        """Sends a task (with its per-batch seed, if any) to the next active worker; False when
        every worker has run dry."""
        worker_id = self._next_worker()
        if worker_id is None:
            return False
        self._send(self._ledger.add(task_id, indices, seed, worker_id))
        return True

    def _next_worker(self) -> int | None:
        for _ in range(self.num_workers):
            worker_id = next(self._worker_cycle)
            if self._active[worker_id]:
                return worker_id
        return None

    def _epoch_start(self) -> EpochStart:
        return EpochStart(self._key, self._base_seed, self._compression)

    def _send(self, pending: PendingTask) -> None:
        w = pending.worker_id
        self._index_queues[w].put(
            Task(
                self._key,
                pending.task_id,
                pending.indices,
                self._slots.take_released(self._incarnations[w]),
                pending.seed,
            )
        )

    def poll(self, timeout: float = POLL_INTERVAL) -> Outcome | None:
        """The next task to complete, or None after `timeout` seconds without one.

        Each wait is followed by a liveness check, which replaces dead workers and re-issues
        their tasks, and, when the spec sets `timeout`, a check that some task completed within
        it. See NOTE [ Worker Failures ] in server/supervision.py.
        """
        if self._failed:
            return self._failed.popleft()
        if self._tuner is not None:
            self._tune(self._tuner)
        if not self._ledger:
            return None
        deadline = time.monotonic() + timeout
        while True:
            failed = self._check_workers()
            if failed is not None:
                return failed
            readers = [r for r in self._results if r is not None]
            wait = max(0.0, min(POLL_INTERVAL, deadline - time.monotonic()))
            ready = multiprocessing.connection.wait(readers, timeout=wait) if readers else []
            if not ready:
                if not readers:
                    time.sleep(wait)
                if time.monotonic() >= deadline:
                    return None
                continue
            for reader in ready:
                assert isinstance(reader, multiprocessing.connection.Connection)
                result = self._receive(reader)
                if result is None:
                    continue
                self._slots.accept(result)
                outcome = self._outcome(result)
                if outcome is not None:
                    return outcome

    def _receive(self, reader: multiprocessing.connection.Connection) -> Result | None:
        try:
            result: Result = reader.recv()
        except (EOFError, OSError):
            # Its worker is gone (perhaps mid-write): stop reading it; the liveness check
            # replaces the worker and re-issues its tasks.
            self._results[self._results.index(reader)] = None
            return None
        except Exception:
            # A result that cannot be unpickled: its worker died while handing over a new
            # slot's file descriptor. The task is still pending and is re-issued with the
            # worker's other tasks once its death is seen.
            log.warning("dropped a result that could not be read", exc_info=True)
            return None
        return result

    def _outcome(self, result: Result) -> Outcome | None:
        pending = self._ledger.get(result.task_id)
        if result.epoch_key != self._key or pending is None:
            # A batch of an abandoned epoch, or a second answer for a task that was re-issued
            # after its worker died: the first answer counted, this slot is free again.
            if result.slot >= 0:
                self._slots.release(result.incarnation, result.slot)
            return None
        if result.fatal:
            assert result.error is not None
            raise WorkerInitError(result.error)
        now = self._ledger.complete(result.task_id, result.worker_id)
        stamps = (pending.submitted_at, result.started_at, result.finished_at, now)
        if self._tuner is not None:
            self._tuner.made(result.finished_at - result.started_at, result.total_nbytes)
        if result.exhausted:
            # As torch does on _IterableDatasetStopIteration: no more tasks for this worker.
            self._active[result.worker_id] = False
            return Outcome(result.task_id, None)
        if result.error is not None:
            self._metrics.worker_timing(*stamps)
            return Outcome(result.task_id, Delivery(error=result.error))
        slot = self._slots.view(result.incarnation, result.slot)
        if slot is None:
            # From a process already replaced, reusing a slot forgotten with it: the task was
            # re-issued, and its new answer counts.
            self._ledger.restore(pending)
            return None
        self._metrics.worker_timing(*stamps)
        return Outcome(
            result.task_id,
            Delivery(
                blob=slot.blob(result.offset, result.total_nbytes),
                header_nbytes=result.header_nbytes,
                slot=slot.ref(result.offset, result.generation),
                release=functools.partial(self._slots.release, result.incarnation, result.slot),
            ),
        )

    def end_epoch(self) -> None:
        """Abandons what is still queued: workers skip it, and a result still in flight is
        recognised as stale by the next epoch's poll."""
        self._current_epoch.value = -1
        self._ledger.end_epoch()
        self._failed.clear()

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
        self._workers += self._retired  # removed by autotuning: long gone, or going
        self._retired = []
        _join_all(self._workers, WORKER_JOIN_TIMEOUT)
        late = [w for w in self._workers if w.is_alive()]
        if late:
            log.warning(
                "worker pid(s) %s did not exit in %.0f s; terminating them",
                ", ".join(str(w.pid) for w in late),
                WORKER_JOIN_TIMEOUT,
            )
            for w in late:
                w.terminate()
            _join_all(late, 1.0)
            for w in late:
                if w.is_alive():
                    w.kill()
            _join_all(late, 1.0)
        self._slots.clear()
        for q in self._index_queues:
            q.cancel_join_thread()
            q.close()
        for reader in self._results:
            if reader is not None:
                reader.close()


def _join_all(processes: list[multiprocessing.process.BaseProcess], seconds: float) -> None:
    """Joins `processes` until all have exited or `seconds` have passed, in all."""
    deadline = time.monotonic() + seconds
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
