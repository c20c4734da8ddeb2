"""A worker's Result as its Run receives it: the pool core's Result -> Outcome step.

A Result of the current epoch becomes the Outcome of its task: its batch read in place in the
worker's slot, leased until its last reader lets go (NOTE [ Slot lease ] in
server/batch/lease.py), or its error, or its worker's data run dry. A stale one (an abandoned
epoch, or a second answer for a task re-issued after its worker died) only frees its slot.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from remote_loader.server.batch.delivery import Delivery, Outcome
from remote_loader.server.batch.lease import SlotLease
from remote_loader.server.batch.messages import Result
from remote_loader.server.engine.ledger import TaskLedger
from remote_loader.server.engine.seam import WorkerInitError
from remote_loader.server.engine.slots import SlotTable
from remote_loader.server.telemetry.metrics import LoaderMetrics


class Outcomes:
    """Turns the Results a pool polls into its tasks' Outcomes (WorkerPool.poll): completes each
    in `ledger`, reads its batch from `slots`, times it in `metrics`. `made(seconds, nbytes)`
    hears how long each batch took (autotuning), `ran_dry(worker_id)` of a worker whose
    iterable dataset is exhausted."""

    def __init__(
        self,
        ledger: TaskLedger,
        slots: SlotTable,
        metrics: LoaderMetrics,
        *,
        made: Callable[[float, int], None] | None,
        ran_dry: Callable[[int], None],
    ) -> None:
        self._ledger = ledger
        self._slots = slots
        self._metrics = metrics
        self._made = made
        self._ran_dry = ran_dry

    def of(self, result: Result, epoch_key: int) -> Outcome | None:
        """The Outcome of `result` in the epoch `epoch_key`; None when it is not one."""
        pending = self._ledger.get(result.task_id)
        if result.epoch_key != epoch_key or pending is None:
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
        if self._made is not None:
            self._made(result.finished_at - result.started_at, result.total_nbytes)
        if result.exhausted:
            # As torch does on _IterableDatasetStopIteration: no more tasks for this worker.
            self._ran_dry(result.worker_id)
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
        blob = slot.blob(result.offset, result.total_nbytes)
        kept = result.node_batch
        if kept is not None:
            kept.room = blob  # where the server fetches it to (or has it made again)
        return Outcome(
            result.task_id,
            Delivery(
                blob=blob,
                header_nbytes=result.header_nbytes,
                # A batch on its node: `blob` is room for it here, not it, until fetched.
                slot=slot.ref(result.offset, result.generation) if kept is None else None,
                node_batch=kept,
                lease=SlotLease(
                    functools.partial(self._slots.release, result.incarnation, result.slot),
                    mapping=blob,
                ),
            ),
        )
