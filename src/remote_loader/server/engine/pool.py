"""The pool core: one epoch at a time of a loader's workers, whatever runs them.

A pool runs one epoch at a time for one Run (server/sharing/run.py), which decides which task comes
next and puts results back in order. The core sends each task to a worker chosen as torch's
_MultiProcessingDataLoaderIter chooses (round-robin; with in_order = false, only to a worker
with room: NOTE [ Dispatch ] in server/engine/dispatch.py), keeps at most
prefetch_factor * num_workers of them out, and hands back each task's outcome as it completes.

It owns the task ledger (server/engine/ledger.py), the workers' shared-memory slots
(server/engine/slots.py), dispatch and the bounds, and holds three parts: the Result -> Outcome
step (Outcomes, server/engine/outcomes.py), a Supervisor (server/engine/supervisor.py), which
replaces dead and stuck workers, and, with num_workers or prefetch_factor = "auto", a Resizer
(server/engine/autotune.py). Where the workers run is a WorkerBackend's business
(server/engine/backend.py): worker processes for the local pool (ProcessBackend,
server/engine/local.py), Ray actors for the Ray pool (RayBackend, server/engine/ray/backend.py).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from remote_loader.server.batch.delivery import Outcome
from remote_loader.server.batch.messages import EpochStart, Task
from remote_loader.server.config.sampling import Batching
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.engine.autotune import Resizer, new_tuner
from remote_loader.server.engine.backend import Short, WorkerBackend, WorkerReady
from remote_loader.server.engine.dispatch import dispatch_for
from remote_loader.server.engine.ledger import PendingTask, TaskLedger
from remote_loader.server.engine.outcomes import Outcomes
from remote_loader.server.engine.seam import POLL_INTERVAL, in_flight_bound
from remote_loader.server.engine.slots import SlotTable
from remote_loader.server.engine.supervisor import Supervisor
from remote_loader.server.telemetry.metrics import LoaderMetrics

__all__ = ["WorkerPool"]

# NOTE [ Pool Protocol ]
#
# Actors: the thread producing a Run (server/sharing/run.py), which alone calls begin_epoch /
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
#     worker dispatch picks (NOTE [ Dispatch ])  restart the dataset iterator
#   poll (waits on the result pipes):          on Task(key, id, indices, released):
#     workers alive? a task past timeout?        mark `released` slots free
#     stale epoch: release its slot              skip if key is not current_epoch.value
#     exhausted: that worker is inactive         fetch + collate + encode into a free shm slot
#     else: Outcome(id, Delivery)                put Result(id, slot | error | exhausted)
#   the Delivery's SlotLease over (any thread, on None, or the server gone: exit
#     NOTE [ Slot lease ]): slot handed back     (checked every MP_STATUS_CHECK_INTERVAL)
#     with the worker's next Task
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
# (remote_loader_queue_wait_seconds, remote_loader_batch_make_seconds; server/telemetry/metrics.py).
#
# The Ray backend (server/engine/ray/backend.py) keeps this protocol, with its bridge process in the
# middle (NOTE [ Ray bridge ] in server/engine/ray/bridge.py): EpochStart and Task go to an actor as
# calls, each Result comes back naming a slot of the bridge's shared memory for that actor's
# incarnation, stamped on this host's clock, and a dead actor is reported (Lost) rather than
# polled.
#
# NOTE [ Pool Shutdown ]
#
# `shutdown()` is the one cleanup path, called when a Run ends (non-persistent pools), when
# its loader is closed (persistent pools) and when the server stops. The core does step 1, the
# process backend (ProcessBackend.stop, server/engine/local.py) the rest:
#   1. current_epoch.value = -1, so workers skip whatever is still queued for them;
#   2. put None on every index queue (workers exit after their current task);
#   3. join the workers for WORKER_JOIN_TIMEOUT in all (one deadline, not one per worker: 16
#      workers stuck in a slow __getitem__ would otherwise hold the Run's thread for 80 s), then
#      terminate what remains, then kill it, waiting at most a second for each step;
#   4. close the index queues without waiting for their feeder threads (cancel_join_thread),
#      since a dead reader would make that wait forever, and the result pipes.
# A worker that finds the server gone exits by itself (see _server_alive in server/worker/loop.py),
# within MP_STATUS_CHECK_INTERVAL (5 s) of its last task, so a server killed with SIGKILL leaves
# no worker behind for long; the fork server exits with it. Deliveries still held by consumers
# stay readable: their memoryviews keep the mapped segments.


class WorkerPool:
    """`num_workers` workers of one loader spec, run by `backend`; one epoch at a time.

    See NOTE [ Pool Protocol ] and NOTE [ Replacing a Worker ] (server/engine/supervisor.py).
    Only the thread producing a Run calls the epoch methods; a Delivery's lease may end on any
    thread.
    """

    def __init__(
        self,
        spec: LoaderSpec,
        batching: Batching,
        backend: WorkerBackend,
        *,
        metrics: LoaderMetrics | None = None,
    ) -> None:
        options = spec.parts.pool
        if options.num_workers < 1:
            raise ValueError("a WorkerPool needs num_workers >= 1; num_workers=0 loads in-process")
        self.spec = spec
        self.batching = batching
        self.num_workers = options.num_workers
        self.prefetch = options.prefetch_factor
        self.max_outstanding = in_flight_bound(self.prefetch, self.num_workers)
        self._metrics = metrics if metrics is not None else LoaderMetrics(spec.name)
        self._backend = backend
        self._incarnations: list[int] = []  # per worker id: its current incarnation
        self._epoch_keys = itertools.count()
        # The workers' shared-memory slots, by (incarnation, slot) (server/engine/slots.py).
        self._slots = SlotTable()
        self._closed = False
        # Set by the Run when the pool failed: it must not run another epoch.
        self.broken = False
        # The current epoch (begin_epoch): its key and what its workers begin it with, whether
        # it still runs, which workers still take tasks, and the tasks submitted and not yet
        # polled back.
        self._key = -1
        self._start = EpochStart(-1, 0)
        self._in_epoch = False
        self._active: list[bool] = []
        # Which worker takes the next task (NOTE [ Dispatch ]): in turn, or in turn among those
        # with room (in_order = false).
        self._dispatch = dispatch_for(spec.parts.batching.in_order, self.num_workers)
        self._ledger = TaskLedger(self.num_workers, iterable=batching.is_iterable)
        self._supervisor = Supervisor(
            spec,
            backend,
            self._ledger,
            self._metrics,
            respawn=self._respawn,
            send=self._send,
            reassign=self._reassign,
            capacity_changed=self._capacity_changed,
        )
        # num_workers or prefetch_factor = "auto" (NOTE [ Worker autotuning ]).
        tuner = new_tuner(spec, self.prefetch)
        self._resizer = None if tuner is None else Resizer(tuner, spec.name, self._metrics)
        self._outcomes = Outcomes(
            self._ledger,
            self._slots,
            self._metrics,
            made=None if self._resizer is None else self._resizer.made,
            ran_dry=self._ran_dry,
        )

    @property
    def outstanding(self) -> int:
        """Tasks submitted and not yet polled back."""
        return len(self._ledger)

    @property
    def restarts(self) -> int:
        """Workers replaced after they died (or were stopped for a timeout)."""
        return self._supervisor.restarts

    @property
    def pids(self) -> list[int]:
        return self._backend.pids

    @property
    def kept_between_epochs(self) -> bool:
        """The backend keeps pools between epochs, and this one is whole."""
        return self._backend.kept_between_epochs and not self.broken and not self._closed

    @property
    def working(self) -> int:
        """Workers that take tasks: all but those whose replacement cannot start (NOTE
        [ Capacity lost ] in server/engine/supervisor.py), and at least one."""
        return max(1, self.num_workers - len(self._supervisor.short))

    def describe(self) -> dict[str, int | str]:
        """For Describe and the metrics: the backend, its nodes and the workers."""
        return {**self._backend.describe(), "workers": self.num_workers}

    def start(self) -> None:
        """Starts the workers (they build the dataset themselves)."""
        self._backend.start()
        for worker_id in range(self.num_workers):
            self._spawn(worker_id)

    def _spawn(self, worker_id: int) -> int:
        incarnation = self._backend.spawn(worker_id, self.num_workers)
        self._slots.open(incarnation)
        if worker_id == len(self._incarnations):
            self._incarnations.append(incarnation)
        else:
            self._incarnations[worker_id] = incarnation
        return incarnation

    def _respawn(self, worker_id: int) -> None:
        """The Supervisor's: a replacement for a dead worker (NOTE [ Replacing a Worker ])."""
        self._slots.forget(self._incarnations[worker_id])
        self._backend.discard(worker_id)
        self._spawn(worker_id)
        if self._in_epoch:
            self._backend.send(worker_id, self._epoch_start())

    # --- one epoch (called by the Run's thread only) -------------------------------------

    def begin_epoch(
        self, base_seed: int, compression: str = "", *, epoch: int, shared_seed: int | None = None
    ) -> None:
        """Reseeds the workers and restarts their dataset iterators for the loader's epoch
        `epoch` (NOTE [ Epoch hooks ] in server/worker/dataset.py), whose batches they compress
        with `compression` ("": none; NOTE [ Compression ])."""
        if self._closed:
            raise RuntimeError("this worker pool has been shut down")
        self._key = next(self._epoch_keys)
        self._start = EpochStart(self._key, base_seed, compression, epoch, shared_seed)
        self._in_epoch = True
        self._backend.set_epoch(self._key)
        for worker_id in range(self.num_workers):
            self._backend.send(worker_id, self._epoch_start())
        # A worker being drained by autotuning is kept: the new epoch may use it again.
        self._resized()
        self._ledger.begin_epoch()
        self._supervisor.clear()

    def has_room(self) -> bool:
        """Whether a task submitted now is sent at once: False while every worker that takes
        tasks holds its share (in_order = false, NOTE [ Dispatch ]), until a result frees one."""
        return self._dispatch.has_room(self._takes, self._held, self.max_outstanding)

    def submit(self, task_id: int, indices: Any, seed: int | None = None) -> bool:
        """Sends a task (with its per-batch seed, if any) to the worker dispatch picks; False
        when every worker has run dry. Only while `has_room()`."""
        if not self.has_room():
            # A task taken from the sampler now would wait with no worker: the Run asks first.
            raise RuntimeError("submit() while no worker has room: ask has_room() first")
        worker_id = self._dispatch.pick(self._takes, self._held, self.max_outstanding)
        if worker_id is None:
            return False
        self._send(self._ledger.add(task_id, indices, seed, worker_id))
        return True

    def _takes(self, worker_id: int) -> bool:
        """Whether `worker_id` is given tasks: its data has not run dry, autotuning is not
        draining it, and it is not short (NOTE [ Capacity lost ])."""
        return self._active[worker_id] and worker_id not in self._supervisor.short

    def _held(self, worker_id: int) -> int:
        return len(self._ledger.held_by(worker_id))

    def _reassign(self, worker_id: int) -> int:
        """The Supervisor's, for a worker gone short: its tasks go to the others, in order and
        in turn whatever they hold (they are out already: NOTE [ Dispatch ]), while another
        worker takes tasks; how many moved."""
        held = self._ledger.held_by(worker_id)
        for moved, pending in enumerate(held):
            other = self._dispatch.in_turn(self._takes)
            if other is None:
                return moved
            self._send(self._ledger.move(pending, other))
        return len(held)

    def _capacity_changed(self) -> None:
        """The Supervisor's: the workers that take tasks changed, so do the bound and gauge."""
        self.max_outstanding = in_flight_bound(self.prefetch, self.working)
        info = self._backend.describe()
        self._metrics.pool_started(str(info["backend"]), int(info["nodes"]), self.working)

    def _epoch_start(self) -> EpochStart:
        return self._start

    def _send(self, pending: PendingTask) -> None:
        w = pending.worker_id
        released = self._slots.take_released(self._incarnations[w])
        task = Task(self._key, pending.task_id, pending.indices, released, pending.seed)
        self._backend.send(w, task)

    def poll(self, timeout: float = POLL_INTERVAL) -> Outcome | None:
        """The next task to complete, or None after `timeout` seconds without one.

        Each wait is followed by a liveness check, which replaces dead workers and re-issues
        their tasks, and, when the spec sets `timeout`, a check that some task completed within
        it. See NOTE [ Worker Failures ] in server/engine/ledger.py.
        """
        failed = self._supervisor.next_failure()
        if failed is not None:
            return failed
        if self._resizer is not None:
            self._resizer.tune(self)
        if not self._ledger:
            return None
        deadline = time.monotonic() + timeout
        while True:
            failed = self._supervisor.check()
            if failed is not None:
                return failed
            wait = max(0.0, min(POLL_INTERVAL, deadline - time.monotonic()))
            for event in self._backend.receive(wait):
                if isinstance(event, WorkerReady):
                    self._supervisor.ready(event)
                    continue
                if isinstance(event, Short):
                    self._supervisor.short_of(event)
                    continue
                self._slots.accept(event)
                outcome = self._outcomes.of(event, self._key)
                if outcome is not None:
                    return outcome
            if time.monotonic() >= deadline:
                return None

    def _ran_dry(self, worker_id: int) -> None:
        self._active[worker_id] = False

    def end_epoch(self) -> None:
        """Abandons what is still queued: workers skip it, and a result still in flight is
        recognised as stale by the next epoch's poll."""
        self._in_epoch = False
        self._backend.set_epoch(-1)
        self._ledger.end_epoch()
        self._supervisor.clear()

    # --- the size (the Resizer's, server/engine/autotune.py: only ever the last worker goes) ------

    @property
    def active(self) -> list[bool]:
        """Per worker: whether it is given tasks (False: drained, or its data ran dry)."""
        return self._active

    def holds(self, worker_id: int) -> bool:
        return bool(self._ledger.held_by(worker_id))

    def add_worker(self) -> None:
        self.num_workers += 1  # the new worker's get_worker_info() says so
        worker_id = self.num_workers - 1
        self._spawn(worker_id)
        self._resized()
        if self._in_epoch:
            self._backend.send(worker_id, self._epoch_start())

    def remove_last(self) -> None:
        self._backend.retire_last()
        self._slots.forget(self._incarnations.pop())
        self.num_workers -= 1
        self._supervisor.forget(self.num_workers)
        self._resized()

    def _resized(self) -> None:
        n = self.num_workers
        self.max_outstanding = in_flight_bound(self.prefetch, self.working)
        self._ledger.resize(n)
        self._active = [True] * n
        self._dispatch.resize(n)

    def shutdown(self) -> None:
        """Stops the workers. See NOTE [ Pool Shutdown ]."""
        if self._closed:
            return
        self._closed = True
        self._in_epoch = False
        self._backend.set_epoch(-1)
        self._backend.stop()
        self._slots.clear()
