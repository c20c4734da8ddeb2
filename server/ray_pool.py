"""The Ray pool backend (`pool = "ray"`): a loader's workers as Ray actors across a cluster.

The server side of it: an Engine (server/engine.py) like the local WorkerPool, driving one
bridge process (NOTE [ Ray bridge ] in server/ray_bridge.py), which owns the actors. Dispatch
is the local pool's: tasks round-robin over the workers that still have data, at most
prefetch_factor * num_workers outstanding, and supervision is the same TaskLedger
(NOTE [ Worker Failures ] in server/supervision.py): an actor that dies (or is on a node that
is removed) is replaced by the bridge, and its tasks are re-issued here, a batch given up after
MAX_TASK_ATTEMPTS as an error at its position.

NOTE [ Ray data path ]

A batch is encoded by its actor into a numpy array, which Ray puts in the object store of the
actor's node; the bridge (on the server's host) reads it, over the network when the actor is
elsewhere, and copies it into a shared-memory slot the server streams from. So every byte of
every batch crosses the server host's link once inbound and once outbound to the trainers:
at scale the coordinator's NIC, not the workers, bounds throughput (bytes per batch through the
coordinator = the encoded batch, `remote_loader_batch_bytes`). The next step is for trainers to
fetch a batch from the node that made it: the server would send only (node address, object
id, size) in the Frame, as it sends ring offsets for shared memory today, and a small data
server beside each Ray worker node (or Ray's own object transfer, with the trainer as a Ray
client) would serve the bytes; ordering, exactly-once and resume stay the coordinator's, since
they are decided by positions, never by the bytes.

NOTE [ Ray pool reuse ]

Not done yet, and why: keeping a non-persistent loader's pool (bridge and actors) between
epochs holds its actors' CPUs of the cluster while no epoch runs, and other loaders' pools
then cannot be placed (measured: tests/test_ray.py's loaders on a 2-CPU cluster). The way is
to keep the bridge and its connection but release the actors after a Run and place new ones
(capacity checked) at the next; Begin(fresh=True) already gives an actor torch's per-epoch
worker state (dataset rebuilt, worker_init_fn again) for when a pool is kept.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import multiprocessing.connection
import time
from typing import Any

from remote_loader.server.autotune import Tuned, new_tuner
from remote_loader.server.engine import (
    POLL_INTERVAL,
    Delivery,
    Outcome,
    WorkerDiedError,
    WorkerInitError,
)
from remote_loader.server.metrics import LoaderMetrics
from remote_loader.server.ray_bridge import (
    ACTOR_START_TIMEOUT,
    Begin,
    BridgeConfig,
    Kill,
    Lost,
    Replaced,
    Resize,
    Send,
    Shortfall,
    Started,
    StartFailed,
    bridge_main,
)
from remote_loader.server.sampling import Batching
from remote_loader.server.slots import SlotTable
from remote_loader.server.spec import LoaderSpec
from remote_loader.server.supervision import PendingTask, TaskLedger
from remote_loader.server.worker import RemoteError, Result, Task

log = logging.getLogger(__name__)

# How long start() waits for the bridge to connect and place its actors: ray.init to an address
# nobody answers retries without end, and the actors' placement waits for free CPUs.
START_TIMEOUT = ACTOR_START_TIMEOUT + 30.0
# How long shutdown waits for the bridge (and, with it, the actors it owns) to go.
BRIDGE_JOIN_TIMEOUT = 10.0


class RayPool(Tuned):
    """A loader's workers as Ray actors. See NOTE [ Ray bridge ] and NOTE [ Ray data path ]."""

    backend = "ray"

    def __init__(
        self,
        spec: LoaderSpec,
        batching: Batching,
        ctx: multiprocessing.context.BaseContext,
        *,
        address: str | None,
        max_batch_bytes: int,
        metrics: LoaderMetrics | None = None,
    ) -> None:
        if spec.num_workers < 1:
            raise ValueError("a RayPool needs num_workers >= 1; num_workers=0 loads in-process")
        self.spec = spec
        self.batching = batching
        self.address = address
        self.num_workers = spec.num_workers
        prefetch = spec.prefetch_factor if spec.prefetch_factor is not None else 2
        self.prefetch = prefetch
        self.max_outstanding = max(1, prefetch * self.num_workers)
        # num_workers = "auto" (NOTE [ Worker autotuning ]): actors added and removed likewise.
        self._tuner = new_tuner(spec, prefetch)
        self.max_batch_bytes = max_batch_bytes
        self.broken = False
        self.restarts = 0
        self.nodes = 0  # nodes the actors were placed on at start
        self._metrics = metrics if metrics is not None else LoaderMetrics(spec.name)
        self._ctx = ctx
        self._bridge: multiprocessing.process.BaseProcess | None = None
        self._commands: Any = None
        self._results: multiprocessing.connection.Connection | None = None
        # The bridge's shared-memory slots (server/slots.py): one process, incarnation 0.
        self._slots = SlotTable()
        self._slots.open(0)
        self._ledger = TaskLedger(self.num_workers, iterable=batching.is_iterable)
        self._key = -1
        self._epoch_keys = iter(range(1 << 62))
        self._active: list[bool] = []
        # Workers replaced whose Replaced has not come yet: `timeout` does not count for them yet.
        self._starting: set[int] = set()
        # Workers whose replacement cannot start (Shortfall), until their Replaced comes: they
        # get no tasks.
        self._short: set[int] = set()
        self._turn = 0
        self._closed = False

    @property
    def where(self) -> str:
        return f"the Ray cluster at {self.address}" if self.address else "a local Ray instance"

    @property
    def outstanding(self) -> int:
        return len(self._ledger)

    def describe(self) -> dict[str, int | str]:
        return {"backend": self.backend, "nodes": self.nodes, "workers": self.num_workers}

    def start(self) -> None:
        """Starts the bridge, which connects and places the actors; WorkerInitError, naming
        ray_address, when that fails or takes longer than START_TIMEOUT."""
        commands_reader, self._commands = self._ctx.Pipe(duplex=False)
        self._results, results_writer = self._ctx.Pipe(duplex=False)
        cfg = BridgeConfig(
            self.spec,
            self.batching,
            self.max_batch_bytes,
            self.address,
            commands_reader,
            results_writer,
        )
        self._bridge = self._ctx.Process(  # type: ignore[attr-defined]
            target=bridge_main, args=(cfg,), name=f"remote-loader-ray-{self.spec.name}"
        )
        self._bridge.start()
        commands_reader.close()
        results_writer.close()
        assert self._bridge is not None and self._results is not None
        ready = multiprocessing.connection.wait(
            [self._results, self._bridge.sentinel], START_TIMEOUT
        )
        problem = None
        if self._results in ready:
            try:
                message = self._results.recv()
            except (EOFError, OSError):
                message = StartFailed("its Ray driver process exited while connecting")
            if isinstance(message, Started):
                self.nodes = message.nodes
                log.info(
                    "loader %r: %d Ray actor(s) on %d node(s) of %s",
                    self.spec.name,
                    message.actors,
                    message.nodes,
                    self.where,
                )
                return
            problem = message.message if isinstance(message, StartFailed) else repr(message)
        elif not ready:
            problem = f"no answer within {START_TIMEOUT:g} s"
        else:
            problem = f"its Ray driver process exited (code {self._bridge.exitcode})"
        self.shutdown()
        raise WorkerInitError(
            RemoteError(
                where="starting the loader's Ray pool",
                type="RayUnavailable",
                message=(
                    f'loader {self.spec.name!r} (pool = "ray") cannot use {self.where}: '
                    f"{problem}. Check ray_address (REMOTE_LOADER_RAY_ADDRESS, serve "
                    "--ray-address) and that the cluster has ray_num_cpus free per worker"
                ),
                traceback="",
            )
        )

    # --- one epoch (the Run's thread) ----------------------------------------------------

    def begin_epoch(self, base_seed: int, compression: str = "") -> None:
        if self._closed:
            raise RuntimeError("this Ray pool has been shut down")
        self._key = next(self._epoch_keys)
        fresh = not self.spec.persistent_workers
        self._command(Begin(self._key, base_seed, compression, fresh))
        self._active = [True] * self.num_workers  # a drained last actor may serve again
        self.max_outstanding = max(1, self.prefetch * self._working())
        self._turn = 0
        self._ledger.begin_epoch()

    def submit(self, task_id: int, indices: Any, seed: int | None = None) -> bool:
        worker_id = self._next_worker()
        if worker_id is None:
            return False  # every worker's IterableDataset has run dry
        self._send(self._ledger.add(task_id, indices, seed, worker_id))
        return True

    def _next_worker(self) -> int | None:
        """Round-robin over the workers that still have data and are not short."""
        for i in range(self.num_workers):
            worker_id = (self._turn + i) % self.num_workers
            if self._active[worker_id] and worker_id not in self._short:
                self._turn = worker_id + 1
                return worker_id
        return None

    def _working(self) -> int:
        return max(1, self.num_workers - len(self._short))

    def _send(self, pending: PendingTask) -> None:
        released = self._slots.take_released(0)
        task = Task(self._key, pending.task_id, pending.indices, released, pending.seed)
        self._command(Send(pending.worker_id, task))

    def _command(self, message: object) -> None:
        try:
            self._commands.send(message)
        except (BrokenPipeError, OSError) as exc:
            raise self._bridge_gone() from exc

    def _bridge_gone(self) -> WorkerDiedError:
        self.broken = True  # a persistent pool is replaced (server/host.py)
        code = None if self._bridge is None else self._bridge.exitcode
        return WorkerDiedError(
            f"the loader's Ray driver process exited (code {code}): {self.where} is unreachable "
            "or ended it (check ray_address and `ray status`); the pool is replaced for the "
            "next epoch"
        )

    def poll(self, timeout: float = POLL_INTERVAL) -> Outcome | None:
        if self._tuner is not None:
            self._tune(self._tuner)
        if not self._ledger:
            return None
        assert self._bridge is not None and self._results is not None
        deadline = time.monotonic() + timeout
        while True:
            if self.spec.timeout > 0:
                stuck = self._ledger.overdue(
                    self.spec.timeout, lambda worker_id: -1, starting=self._starting
                )
                if stuck is not None:
                    return self._stop_stuck(stuck)
            wait = max(0.0, min(POLL_INTERVAL, deadline - time.monotonic()))
            ready = multiprocessing.connection.wait([self._results, self._bridge.sentinel], wait)
            if self._results in ready:
                try:
                    message = self._results.recv()
                except (EOFError, OSError) as exc:
                    raise self._bridge_gone() from exc
                outcome = self._on_message(message)
                if outcome is not None:
                    return outcome
                continue
            if ready:  # the sentinel: the bridge is gone
                raise self._bridge_gone()
            if time.monotonic() >= deadline:
                return None

    def _on_message(self, message: object) -> Outcome | None:
        if isinstance(message, Lost):
            self._starting.add(message.worker_id)
            return self._lost(message)
        if isinstance(message, Replaced):
            self._starting.discard(message.worker_id)
            self._ledger.worker_ready(message.worker_id)
            if message.worker_id in self._short:
                self._short.discard(message.worker_id)
                self._capacity_changed()
                log.warning(
                    "loader %r: Ray worker %d started again: %d of %d workers",
                    self.spec.name,
                    message.worker_id,
                    self._working(),
                    self.num_workers,
                )
            return None
        if isinstance(message, Shortfall):
            self._shortfall(message)
            return None
        assert isinstance(message, Result)
        result = message
        self._slots.accept(result)
        pending = self._ledger.get(result.task_id)
        if result.epoch_key != self._key or pending is None:
            # An abandoned epoch's, or a second answer for a re-issued task: the first counted.
            if result.slot >= 0:
                self._slots.release(0, result.slot)
            return None
        if result.fatal:
            assert result.error is not None
            raise WorkerInitError(result.error)
        now = self._ledger.complete(result.task_id, result.worker_id)
        # Actors' clocks are their nodes': only the time the batch took is comparable here.
        made_in = result.finished_at - result.started_at
        if self._tuner is not None:
            self._tuner.made(made_in, result.total_nbytes)
        stamps = (pending.submitted_at, now - made_in, now, now)
        if result.exhausted:
            self._active[result.worker_id] = False
            return Outcome(result.task_id, None)
        if result.error is not None:
            self._metrics.worker_timing(*stamps)
            return Outcome(result.task_id, Delivery(error=result.error))
        self._metrics.worker_timing(*stamps)
        slot = self._slots.view(0, result.slot)
        assert slot is not None  # the bridge's slots live as long as the pool
        return Outcome(
            result.task_id,
            Delivery(
                blob=slot.blob(result.offset, result.total_nbytes),
                header_nbytes=result.header_nbytes,
                slot=slot.ref(result.offset, result.generation),
                release=functools.partial(self._slots.release, 0, result.slot),
            ),
        )

    def _add_worker(self) -> None:  # Tuned: num_workers / prefetch_factor = "auto"
        self._resize(self.num_workers + 1)

    def _remove_last(self) -> None:
        self._resize(self.num_workers - 1)

    def _resize(self, workers: int) -> None:
        self._command(Resize(workers))
        self.num_workers = workers
        self.max_outstanding = max(1, self.prefetch * workers)
        self._ledger.resize(workers)
        self._active = [True] * workers
        self._starting = {w for w in self._starting if w < workers}
        self._short = {w for w in self._short if w < workers}

    def _lost(self, lost: Lost) -> Outcome | None:
        """An actor died and the bridge replaced it: re-issue what it held (its oldest task is
        the one it was making, charged an attempt)."""
        self.restarts += 1
        self._metrics.restarts.inc()
        held = self._ledger.held_by(lost.worker_id)
        log.warning(
            "loader %r: %s; replaced, re-issuing its %d task(s)",
            self.spec.name,
            lost.reason,
            len(held),
        )
        dying_on = held[0].task_id if held else -1
        reissue = self._ledger.worker_died(lost.worker_id, dying_on, lost.reason)
        for pending in reissue.tasks:
            self._send(pending)
        return reissue.given_up

    def _shortfall(self, short: Shortfall) -> None:
        """NOTE [ Ray capacity lost ]: a replacement that cannot start (no CPU free for it)
        leaves the pool short of a worker. A map-style dataset's tasks are anyone's: what it
        holds goes to the other workers at once, in submission order, and the epoch goes on
        with fewer until its Replaced comes. An IterableDataset shards itself by worker: without the
        worker its share is lost, so its epoch ends with the error."""
        worker_id = short.worker_id
        if self.batching.is_iterable:
            self.broken = True  # a new pool says what it lacks (or has it again)
            raise WorkerDiedError(
                f"{short.message}; an IterableDataset shards itself by worker, so its epoch "
                "cannot go on without it"
            )
        self._short.add(worker_id)
        self._starting.discard(worker_id)
        self._capacity_changed()
        held = self._ledger.held_by(worker_id)
        log.warning(
            "loader %r: %s; %d of %d workers, %d task(s) moved",
            self.spec.name,
            short.message,
            self._working(),
            self.num_workers,
            len(held),
        )
        for pending in held:
            other = self._next_worker()
            if other is None:  # no worker left: they wait for the replacement
                self._short.discard(worker_id)
                return
            pending.worker_id = other
            pending.submitted_at = time.monotonic()
            self._send(pending)

    def _capacity_changed(self) -> None:
        """The workers that can take tasks changed: the in-flight bound and the gauges."""
        self.max_outstanding = max(1, self.prefetch * self._working())
        self._metrics.pool_started(self.backend, self.nodes, self._working())

    def _stop_stuck(self, stuck: PendingTask) -> Outcome:
        log.warning(
            "loader %r: no batch within timeout=%g s; stopping Ray worker %d, which has task %d",
            self.spec.name,
            self.spec.timeout,
            stuck.worker_id,
            stuck.task_id,
        )
        failed = self._ledger.timed_out(stuck, self.spec.timeout, f"Ray worker {stuck.worker_id}")
        self._command(Kill(stuck.worker_id, "timeout"))
        # Its other tasks wait for the replacement (Lost, then Replaced): not its timeout.
        self._starting.add(stuck.worker_id)
        return failed

    def end_epoch(self) -> None:
        """Forgets the epoch's tasks: answers still to come are stale (their slots go back)."""
        self._ledger.end_epoch()

    def shutdown(self) -> None:
        """Stops the bridge; the actors it owns end with it (Ray ties an actor to its owner)."""
        if self._closed:
            return
        self._closed = True
        if self._commands is not None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self._commands.send(None)
        if self._bridge is not None and self._bridge.pid is not None:
            self._bridge.join(BRIDGE_JOIN_TIMEOUT)
            if self._bridge.is_alive():
                self._bridge.kill()
                self._bridge.join(1.0)
        self._slots.clear()
        for end in (self._commands, self._results):
            if end is not None:
                end.close()
