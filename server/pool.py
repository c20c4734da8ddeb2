"""The worker pool stage: worker processes, their index queues, their result pipes, dispatch.

A pool runs one epoch at a time for one Run (server/run.py), which decides which task comes
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
import multiprocessing.connection
import multiprocessing.context
import os
import threading
import time
from typing import Any

from remote_loader.server.engine import (
    POLL_INTERVAL,
    Delivery,
    Outcome,
    WorkerDiedError,
    WorkerInitError,
)
from remote_loader.server.metrics import LoaderMetrics
from remote_loader.server.sampling import Batching
from remote_loader.server.spec import LoaderSpec
from remote_loader.server.worker import (
    DEFAULT_MAX_BATCH_BYTES,
    EpochStart,
    RemoteError,
    Result,
    Task,
    WorkerConfig,
    worker_loop,
)

log = logging.getLogger(__name__)

# How long shutdown waits, in all, for the workers to exit on their own before terminating them.
WORKER_JOIN_TIMEOUT = 5.0
# How many times a batch is tried when its worker dies while making it (a sample that crashes
# its worker every time is then delivered as an error at its position).
MAX_TASK_ATTEMPTS = 3

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
#
# NOTE [ Worker Failures ]
#
# Detection: every poll checks each worker with is_alive() (waitpid) at least every
# POLL_INTERVAL (0.1 s) while a Run waits for results, so a worker killed by SIGKILL, a segfault
# or os._exit is seen within 0.1 s. `_replace` then:
#   1. counts a restart, forgets the dead process's slots (entries being sent keep their views)
#      and its releases, closes its index queue (tasks it never read are re-issued, not read);
#   2. starts a new process for the same worker id (from the fork server: never a fork of the
#      gRPC process, grpc/grpc#16001), with a new queue, an incarnation of its own (slot names
#      never collide with the dead one's) and the current EpochStart (same base seed);
#   3. re-issues the dead worker's pending tasks, in order, to the new process. The one it was
#      making (a shared value the worker sets before each task: its Result may have died half
#      written to its result pipe) is charged an attempt, and after MAX_TASK_ATTEMPTS (3) it is
#      given up and delivered as an error at its position (a poison sample), the epoch going on.
# A late result of the dead process for a re-issued task is dropped: the first answer counts.
# Limits: an IterableDataset's position dies with its worker, so its epoch ends with an error;
# workers dying more than 2 * num_workers + 2 times in a row without a batch finished mean the
# loader cannot work (WorkerDiedError: the Run fails, the pool is replaced).
# Timeout: a worker that has been on one task for `timeout` seconds (counted from when it was
# free for it) is killed and replaced (as above), and that task is delivered as a TimeoutError
# at its position: an error within timeout + 0.1 s plus the restart, never a hang.
# Fatal: a worker whose dataset factory or worker_init_fn raised answers every task with a fatal
# Result; the Run ends all its streams with FAILED_PRECONDITION and the original traceback.


@dataclasses.dataclass
class _Pending:
    """A task submitted and not yet back: where it is, and how often its worker died on it."""

    task_id: int
    indices: Any
    seed: int | None
    worker_id: int
    submitted_at: float
    attempts: int = 1


class WorkerPool:
    """`num_workers` worker processes for one loader spec; runs one epoch at a time.

    See NOTE [ Pool Protocol ] and NOTE [ Worker Failures ]. Only the thread producing a Run
    calls the epoch methods; `Delivery.release` may be called from any thread.
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
        # (incarnation, slot) -> the slot's bytes, mapped from that worker process's tensor.
        self._slots: dict[tuple[int, int], memoryview] = {}
        # Slots the server is done with, per incarnation, handed back with its next Task.
        self._released: dict[int, list[int]] = {}
        self._lock = threading.Lock()  # guards _released: releases come from stream threads
        self._closed = False
        # Set by the Run when the pool failed: it must not run another epoch.
        self.broken = False
        # Worker processes replaced after they died (or were stopped for a timeout).
        self.restarts = 0
        # The current epoch (begin_epoch): its key and base seed, which workers still have data,
        # and the tasks submitted and not yet polled back, in submission order per worker.
        self._key = -1
        self._base_seed = 0
        self._active: list[bool] = []
        self._worker_cycle: itertools.cycle[int] = itertools.cycle(range(self.num_workers))
        self._pending: dict[int, _Pending] = {}
        self._deaths_without_progress = 0
        # Per worker: when it last finished a task (or was started), so the task it is on now
        # counts from then, not from when it was queued behind others.
        self._free_since: list[float] = []

    @property
    def outstanding(self) -> int:
        """Tasks submitted and not yet polled back."""
        return len(self._pending)

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
        with self._lock:
            self._released[incarnation] = []
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

    def _release(self, incarnation: int, slot: int) -> None:
        with self._lock:
            released = self._released.get(incarnation)
            if released is not None:  # else that process is gone, and its slots with it
                released.append(slot)

    def _take_released(self, worker_id: int) -> tuple[int, ...]:
        with self._lock:
            released = self._released[self._incarnations[worker_id]]
            ids = tuple(released)
            released.clear()
        return ids

    def _accept_buffers(self, result: Result) -> None:
        for slot in result.dropped:
            self._slots.pop((result.incarnation, slot), None)
        if result.new_buffer is not None:
            self._slots[(result.incarnation, result.slot)] = result.new_buffer.numpy().data

    # --- one epoch (called by the Run's thread only) -------------------------------------

    def begin_epoch(self, base_seed: int) -> None:
        """Reseeds the workers and restarts their dataset iterators for a new epoch."""
        if self._closed:
            raise RuntimeError("this worker pool has been shut down")
        self._key = next(self._epoch_keys)
        self._base_seed = base_seed
        self._current_epoch.value = self._key
        for q in self._index_queues:
            q.put(EpochStart(epoch_key=self._key, base_seed=base_seed))
        self._active = [True] * self.num_workers
        self._worker_cycle = itertools.cycle(range(self.num_workers))
        self._pending.clear()
        self._deaths_without_progress = 0
        self._free_since = [time.monotonic()] * self.num_workers

    def submit(self, task_id: int, indices: Any, seed: int | None = None) -> bool:
        """Sends a task (with its per-batch seed, if any) to the next active worker; False when
        every worker has run dry."""
        worker_id = self._next_worker()
        if worker_id is None:
            return False
        pending = _Pending(task_id, indices, seed, worker_id, time.monotonic())
        self._pending[task_id] = pending
        self._send(pending)
        return True

    def _next_worker(self) -> int | None:
        for _ in range(self.num_workers):
            worker_id = next(self._worker_cycle)
            if self._active[worker_id]:
                return worker_id
        return None

    def _send(self, pending: _Pending) -> None:
        w = pending.worker_id
        self._index_queues[w].put(
            Task(self._key, pending.task_id, pending.indices, self._take_released(w), pending.seed)
        )

    def poll(self, timeout: float = POLL_INTERVAL) -> Outcome | None:
        """The next task to complete, or None after `timeout` seconds without one.

        Each wait is followed by a liveness check, which replaces dead workers and re-issues
        their tasks, and, when the spec sets `timeout`, a check that some task completed within
        it. See NOTE [ Worker Failures ].
        """
        if not self._pending:
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
                self._accept_buffers(result)
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
        pending = self._pending.get(result.task_id)
        if result.epoch_key != self._key or pending is None:
            # A batch of an abandoned epoch, or a second answer for a task that was re-issued
            # after its worker died: the first answer counted, this slot is free again.
            if result.slot >= 0:
                self._release(result.incarnation, result.slot)
            return None
        if result.fatal:
            assert result.error is not None
            raise WorkerInitError(result.error)
        del self._pending[result.task_id]
        now = self._free_since[result.worker_id] = time.monotonic()
        self._deaths_without_progress = 0
        stamps = (pending.submitted_at, result.started_at, result.finished_at, now)
        if result.exhausted:
            # As torch does on _IterableDatasetStopIteration: no more tasks for this worker.
            self._active[result.worker_id] = False
            return Outcome(result.task_id, None)
        if result.error is not None:
            self._metrics.worker_timing(*stamps)
            return Outcome(result.task_id, Delivery(error=result.error))
        slot = self._slots.get((result.incarnation, result.slot))
        if slot is None:
            # From a process already replaced, reusing a slot forgotten with it: the task was
            # re-issued, and its new answer counts.
            self._pending[result.task_id] = pending
            return None
        self._metrics.worker_timing(*stamps)
        blob = slot[: result.total_nbytes]
        return Outcome(
            result.task_id,
            Delivery(
                blob=blob,
                header_nbytes=result.header_nbytes,
                release=functools.partial(self._release, result.incarnation, result.slot),
            ),
        )

    def _check_workers(self) -> Outcome | None:
        """Replaces dead workers and re-issues their tasks; stops a worker stuck past `timeout`.

        Returns an error Outcome for a task that has used up its attempts or timed out.
        """
        failed: Outcome | None = None
        if self.spec.timeout > 0 and self._pending:
            now = time.monotonic()
            for current in self._current_tasks().values():
                started = max(current.submitted_at, self._free_since[current.worker_id])
                if now - started >= self.spec.timeout:
                    failed = self._stop_stuck(current)
                    break
        for worker_id, proc in enumerate(self._workers):
            if proc.is_alive():
                continue
            outcome = self._replace(worker_id, proc)
            failed = failed or outcome
        return failed

    def _current_tasks(self) -> dict[int, _Pending]:
        """Per busy worker, the task it is making now (as it says, else its oldest pending)."""
        current: dict[int, _Pending] = {}
        for p in self._pending.values():
            if p.worker_id not in current or p.submitted_at < current[p.worker_id].submitted_at:
                current[p.worker_id] = p
        for worker_id in list(current):
            making = self._pending.get(self._making[worker_id].value)
            if making is not None and making.worker_id == worker_id:
                current[worker_id] = making
        return current

    def _stop_stuck(self, stuck: _Pending) -> Outcome:
        proc = self._workers[stuck.worker_id]
        log.warning(
            "loader %r: no batch within timeout=%g s; stopping worker %d (pid %s), which has "
            "batch task %d",
            self.spec.name,
            self.spec.timeout,
            stuck.worker_id,
            proc.pid,
            stuck.task_id,
        )
        del self._pending[stuck.task_id]
        proc.kill()
        proc.join(timeout=WORKER_JOIN_TIMEOUT)
        error = TimeoutError(
            f"DataLoader timed out after {self.spec.timeout} seconds: worker "
            f"{stuck.worker_id} (pid {proc.pid}) was stopped and replaced"
        )
        where = f"in DataLoader worker process {stuck.worker_id}"
        return Outcome(stuck.task_id, Delivery(error=RemoteError.capture(where, error)))

    def _replace(self, worker_id: int, dead: multiprocessing.process.BaseProcess) -> Outcome | None:
        """See NOTE [ Worker Failures ]."""
        self.restarts += 1
        self._metrics.restarts.inc()
        self._deaths_without_progress += 1
        mine = sorted(
            (p for p in self._pending.values() if p.worker_id == worker_id),
            key=lambda p: p.submitted_at,
        )
        # The task it was making when it died, as it wrote down before starting it (none if it
        # died between tasks: then nothing is charged).
        dying_on = self._making[worker_id].value
        reason = f"DataLoader worker {worker_id} (pid {dead.pid}) exited unexpectedly with " + (
            f"exit code {dead.exitcode}"
            if dead.exitcode is None or dead.exitcode >= 0
            else f"signal {-dead.exitcode}"
        )
        log.warning(
            "loader %r: %s; restarting it and re-issuing its %d task(s)",
            self.spec.name,
            reason,
            len(mine),
        )
        dead_incarnation = self._incarnations[worker_id]
        with self._lock:
            self._released.pop(dead_incarnation, None)
        # Entries still being sent keep their own views of the dead process's slots.
        for key in [k for k in self._slots if k[0] == dead_incarnation]:
            del self._slots[key]
        old_queue = self._index_queues[worker_id]
        old_queue.close()
        old_results = self._results[worker_id]
        if old_results is not None:
            old_results.close()
        proc, index_queue, incarnation, making, results = self._spawn(worker_id)
        self._workers[worker_id] = proc
        self._index_queues[worker_id] = index_queue
        self._incarnations[worker_id] = incarnation
        self._making[worker_id] = making
        self._results[worker_id] = results
        if self._key >= 0 and self._current_epoch.value == self._key:
            index_queue.put(EpochStart(epoch_key=self._key, base_seed=self._base_seed))
        if self.batching.is_iterable and mine:
            # An IterableDataset's position lives in the process that died: re-issuing its
            # tasks to a fresh iterator would repeat samples. The epoch ends with an error.
            raise WorkerDiedError(f"{reason}; an IterableDataset cannot resume its position")
        if self._deaths_without_progress > 2 * self.num_workers + 2:
            raise WorkerDiedError(
                f"{reason}; workers died {self._deaths_without_progress} times in a row "
                "without finishing a batch"
            )
        failed: Outcome | None = None
        for pending in mine:
            if pending.task_id == dying_on:  # it may be what killed the process
                pending.attempts += 1
            if pending.attempts > MAX_TASK_ATTEMPTS:
                del self._pending[pending.task_id]
                error = WorkerDiedError(
                    f"{reason} while making this batch, {MAX_TASK_ATTEMPTS} times: it is "
                    "given up (a sample that crashes its worker?)"
                )
                where = f"in DataLoader worker process {worker_id}"
                failed = Outcome(pending.task_id, Delivery(error=RemoteError.capture(where, error)))
                continue
            pending.submitted_at = time.monotonic()
            self._send(pending)
        self._free_since[worker_id] = time.monotonic()
        return failed

    def end_epoch(self) -> None:
        """Abandons what is still queued: workers skip it, and a result still in flight is
        recognised as stale by the next epoch's poll."""
        self._current_epoch.value = -1
        self._pending.clear()

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
