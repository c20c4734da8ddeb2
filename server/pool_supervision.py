"""Replacing the local pool's worker processes that died or are stuck (NOTE [ Replacing a Worker
Process ]): how WorkerPool (server/pool.py) applies NOTE [ Worker Failures ]
(server/supervision.py) to processes.

A mixin of WorkerPool, kept apart because it is a concept of its own, as server/pool_resize.py
is: `poll` calls `_check_workers` on the Run's thread; it works on the pool's per-worker lists,
declared in ResizablePool.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing

from remote_loader.server.engine import Outcome
from remote_loader.server.pool_resize import ResizablePool
from remote_loader.server.supervision import PendingTask
from remote_loader.server.worker import EpochStart

log = logging.getLogger(__name__)

# How long shutdown waits, in all, for the workers to exit on their own before terminating them;
# and how long a worker stopped for a timeout is waited for.
WORKER_JOIN_TIMEOUT = 5.0

# NOTE [ Replacing a Worker Process ]
#
# How this pool applies NOTE [ Worker Failures ] (server/supervision.py) to processes. Every
# poll checks each worker with is_alive() (waitpid), so a worker killed by SIGKILL, a segfault
# or os._exit is seen within POLL_INTERVAL; a worker stuck past `timeout` is killed (SIGKILL).
# `_replace` then:
#   1. counts a restart, forgets the dead process's slots (entries being sent keep their views)
#      and its releases, closes its index queue (tasks it never read are re-issued, not read)
#      and its result pipe (nothing more of it is read: a re-issued task's answer is the new
#      process's);
#   2. starts a new process for the same worker id (from the fork server: never a fork of the
#      gRPC process, grpc/grpc#16001), with a new queue, an incarnation of its own (slot names
#      never collide with the dead one's) and the current EpochStart (same base seed);
#   3. hands the ledger the task the process was making (a shared value the worker sets before
#      each task: its Result may have died half written to its result pipe) and sends what the
#      ledger re-issues, in order, to the new process.


class SupervisedPool(ResizablePool):
    """The part of WorkerPool that notices dead and stuck workers and replaces them."""

    restarts: int  # worker processes replaced after they died (or were stopped for a timeout)
    # Tasks given up (timed out, or out of attempts) and not yet returned by poll().
    _failed: collections.deque[Outcome]

    def _epoch_start(self) -> EpochStart:
        raise NotImplementedError

    def _send(self, pending: PendingTask) -> None:
        raise NotImplementedError

    def _check_workers(self) -> Outcome | None:
        """Replaces dead workers and re-issues their tasks; stops a worker stuck past `timeout`.

        Returns an error Outcome for a task that has used up its attempts or timed out.
        """
        if self.spec.timeout > 0:
            stuck = self._ledger.overdue(self.spec.timeout, self._making_now)
            if stuck is not None:
                self._failed.append(self._stop_stuck(stuck))
        for worker_id, proc in enumerate(self._workers):
            if proc.is_alive():
                continue
            outcome = self._replace(worker_id, proc)
            if outcome is not None:
                self._failed.append(outcome)
        # Several can fail in one check (a timeout and a death, two deaths): each is left the
        # ledger, so each must reach the Run, one per poll.
        return self._failed.popleft() if self._failed else None

    def _making_now(self, worker_id: int) -> int:
        """The task worker `worker_id` says it is making (-1: none)."""
        return int(self._making[worker_id].value)

    def _stop_stuck(self, stuck: PendingTask) -> Outcome:
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
        who = f"worker {stuck.worker_id} (pid {proc.pid})"
        failed = self._ledger.timed_out(stuck, self.spec.timeout, who)
        proc.kill()
        proc.join(timeout=WORKER_JOIN_TIMEOUT)
        return failed

    def _replace(self, worker_id: int, dead: multiprocessing.process.BaseProcess) -> Outcome | None:
        """See NOTE [ Replacing a Worker Process ]."""
        self.restarts += 1
        self._metrics.restarts.inc()
        # The task it was making when it died, as it wrote down before starting it (read before
        # its replacement gets a value of its own).
        dying_on = self._making_now(worker_id)
        reason = f"DataLoader worker {worker_id} (pid {dead.pid}) exited unexpectedly with " + (
            f"exit code {dead.exitcode}"
            if dead.exitcode is None or dead.exitcode >= 0
            else f"signal {-dead.exitcode}"
        )
        log.warning(
            "loader %r: %s; restarting it and re-issuing its %d task(s)",
            self.spec.name,
            reason,
            len(self._ledger.held_by(worker_id)),
        )
        self._slots.forget(self._incarnations[worker_id])
        self._index_queues[worker_id].close()
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
            index_queue.put(self._epoch_start())
        reissue = self._ledger.worker_died(worker_id, dying_on, reason)
        for pending in reissue.tasks:
            self._send(pending)
        return reissue.given_up
