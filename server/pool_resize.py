"""num_workers = "auto" for the local pool: adding and removing worker processes as the tuner
decides (NOTE [ Worker autotuning ] in server/autotune.py).

A mixin of WorkerPool (server/pool.py), kept apart because it is a concept of its own: the
pool's Run-thread methods call `_tune` from `poll`; it works on the pool's per-worker lists.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import multiprocessing.connection
from typing import Any

from remote_loader.server.autotune import Tuned, WorkerTuner, new_tuner
from remote_loader.server.metrics import LoaderMetrics
from remote_loader.server.slots import SlotTable
from remote_loader.server.spec import LoaderSpec
from remote_loader.server.supervision import TaskLedger
from remote_loader.server.worker import EpochStart

log = logging.getLogger(__name__)


class ResizablePool(Tuned):
    """The part of WorkerPool that changes its size (only ever the last worker goes)."""

    spec: LoaderSpec
    num_workers: int
    prefetch: int
    max_outstanding: int
    _metrics: LoaderMetrics
    _ledger: TaskLedger
    _slots: SlotTable
    _workers: list[multiprocessing.process.BaseProcess]
    _index_queues: list[Any]
    _incarnations: list[int]
    _making: list[Any]
    _results: list[multiprocessing.connection.Connection | None]
    _active: list[bool]
    _worker_cycle: itertools.cycle[int]
    _retired: list[multiprocessing.process.BaseProcess]
    _current_epoch: Any
    _key: int
    _base_seed: int
    _compression: str

    def _new_tuner(self, spec: LoaderSpec) -> WorkerTuner | None:
        """The pool's tuner with num_workers or prefetch_factor = "auto", else None."""
        return new_tuner(spec, self.prefetch)

    def _spawn(
        self, worker_id: int
    ) -> tuple[
        multiprocessing.process.BaseProcess, Any, int, Any, multiprocessing.connection.Connection
    ]:
        raise NotImplementedError

    def _add_worker(self) -> None:
        self.num_workers += 1  # the new worker's get_worker_info() says so
        proc, index_queue, incarnation, making, results = self._spawn(self.num_workers - 1)
        self._workers.append(proc)
        self._index_queues.append(index_queue)
        self._incarnations.append(incarnation)
        self._making.append(making)
        self._results.append(results)
        self._resized()
        if self._key >= 0 and self._current_epoch.value == self._key:
            index_queue.put(EpochStart(self._key, self._base_seed, self._compression))

    def _remove_last(self) -> None:
        self._index_queues.pop().put(None)
        self._retired.append(self._workers.pop())
        self._slots.forget(self._incarnations.pop())
        self._making.pop()
        results = self._results.pop()
        if results is not None:
            results.close()
        self.num_workers -= 1
        self._resized()

    def _resized(self) -> None:
        n = self.num_workers
        self.max_outstanding = max(1, self.prefetch * n)
        self._ledger.resize(n)
        self._active = [True] * n
        self._worker_cycle = itertools.cycle(range(n))
