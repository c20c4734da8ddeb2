"""The local pool's WorkerBackend (server/engine/backend.py): worker processes of this server.

Each worker is a process running `worker_loop` (server/worker/loop.py), started from the fork
server, with its own index queue (server -> worker), its own result pipe (worker -> server) and a
shared value naming the task it is making; see NOTE [ Pool Protocol ] and NOTE [ Pool Shutdown ] in
server/engine/pool.py for what travels on them and how they end.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import os
import time
from collections.abc import Iterator
from typing import Any

from remote_loader.server.batch.messages import EpochStart, Result, Task
from remote_loader.server.config.sampling import Batching
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.engine.backend import Event
from remote_loader.server.worker.dataset import SharedDataset
from remote_loader.server.worker.loop import WorkerConfig, worker_loop

log = logging.getLogger(__name__)

# How long stop() waits, in all, for the workers to exit on their own before terminating them;
# and how long a worker stopped for a timeout is waited for.
WORKER_JOIN_TIMEOUT = 5.0


class ProcessBackend:
    """Worker processes, one per worker id, replaced by a new process (a new incarnation) when
    one dies."""

    def __init__(
        self,
        spec: LoaderSpec,
        batching: Batching,
        ctx: multiprocessing.context.BaseContext,
        *,
        max_batch_bytes: int,
        dataset: SharedDataset,
    ) -> None:
        self.spec = spec
        self.batching = batching
        self.max_batch_bytes = max_batch_bytes
        self.dataset = dataset  # what each worker starts from (NOTE [ One dataset per loader ])
        self._ctx = ctx
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._index_queues: list[Any] = []
        self._making: list[Any] = []  # per worker id: shared value, the task it is making
        # Per worker id: the reading end of its own result pipe (None once it hit EOF). One pipe
        # per process, written synchronously: a worker that dies mid-write cannot leave a lock
        # held that other workers need (as a shared multiprocessing.Queue's write lock would),
        # and its reader gets EOF, not a hang.
        self._results: list[multiprocessing.connection.Connection | None] = []
        self._next_incarnation = itertools.count()
        self._current_epoch: Any = None
        # Workers removed by autotuning: long gone, or going; joined at stop().
        self._retired: list[multiprocessing.process.BaseProcess] = []

    @property
    def workers(self) -> int:
        return len(self._procs)

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self._procs if w.pid is not None]

    @property
    def kept_between_epochs(self) -> bool:
        return False  # forked in milliseconds, new each epoch as torch's are

    def describe(self) -> dict[str, int | str]:
        return {"backend": "local", "nodes": 1}

    def start(self) -> None:
        self._current_epoch = self._ctx.Value("q", -1, lock=False)

    def spawn(self, worker_id: int, num_workers: int) -> int:
        # A fresh index queue per process: the old one may still hold tasks the dead process
        # never read, which are re-issued, not read again.
        index_queue = self._ctx.Queue()
        # Index queues only carry small messages; do not let a dead worker make the server
        # wait on the feeder thread at exit.
        index_queue.cancel_join_thread()
        incarnation = next(self._next_incarnation)
        making = self._ctx.Value("q", -1, lock=False)
        results, results_writer = self._ctx.Pipe(duplex=False)
        cfg = WorkerConfig(
            spec=self.spec,
            batching=self.batching,
            worker_id=worker_id,
            num_workers=num_workers,
            index_queue=index_queue,
            results=results_writer,
            current_epoch=self._current_epoch,
            server_pid=os.getpid(),
            incarnation=incarnation,
            current_task=making,
            max_batch_bytes=self.max_batch_bytes,
            dataset=self.dataset,
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
        if worker_id == len(self._procs):
            self._procs.append(proc)
            self._index_queues.append(index_queue)
            self._making.append(making)
            self._results.append(results)
        else:
            self._procs[worker_id] = proc
            self._index_queues[worker_id] = index_queue
            self._making[worker_id] = making
            self._results[worker_id] = results
        return incarnation

    def send(self, worker_id: int, message: EpochStart | Task) -> None:
        self._index_queues[worker_id].put(message)

    def set_epoch(self, key: int) -> None:
        if self._current_epoch is not None:  # None: stopped before it started
            self._current_epoch.value = key

    def receive(self, timeout: float) -> Iterator[Event]:
        readers = [r for r in self._results if r is not None]
        if not readers:
            time.sleep(timeout)
            return
        for reader in multiprocessing.connection.wait(readers, timeout=timeout):
            assert isinstance(reader, multiprocessing.connection.Connection)
            result = self._read(reader)
            if result is not None:
                yield result

    def _read(self, reader: multiprocessing.connection.Connection) -> Result | None:
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

    def alive(self, worker_id: int) -> bool:
        return self._procs[worker_id].is_alive()

    def ready(self, worker_id: int) -> bool:
        return True  # a process from the fork server starts in milliseconds

    def making(self, worker_id: int) -> int:
        return int(self._making[worker_id].value)

    def who(self, worker_id: int) -> str:
        return f"worker {worker_id} (pid {self._procs[worker_id].pid})"

    def death(self, worker_id: int) -> str:
        dead = self._procs[worker_id]
        return f"DataLoader worker {worker_id} (pid {dead.pid}) exited unexpectedly with " + (
            f"exit code {dead.exitcode}"
            if dead.exitcode is None or dead.exitcode >= 0
            else f"signal {-dead.exitcode}"
        )

    def kill(self, worker_id: int) -> None:
        proc = self._procs[worker_id]
        proc.kill()
        proc.join(timeout=WORKER_JOIN_TIMEOUT)

    def discard(self, worker_id: int) -> None:
        self._index_queues[worker_id].close()
        results = self._results[worker_id]
        if results is not None:
            results.close()

    def retire_last(self) -> None:
        self._index_queues.pop().put(None)
        self._retired.append(self._procs.pop())
        self._making.pop()
        results = self._results.pop()
        if results is not None:
            results.close()

    def stop(self) -> None:
        """Steps 2 to 4 of NOTE [ Pool Shutdown ] (server/engine/pool.py)."""
        for q in self._index_queues:
            with contextlib.suppress(OSError, ValueError):  # already closed
                q.put(None)
        self._procs += self._retired
        self._retired = []
        _join_all(self._procs, WORKER_JOIN_TIMEOUT)
        late = [w for w in self._procs if w.is_alive()]
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
