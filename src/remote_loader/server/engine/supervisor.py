"""The pool core's Supervisor: it notices dead and stuck workers and has them replaced
(NOTE [ Replacing a Worker ]), applying NOTE [ Worker Failures ] (server/engine/ledger.py), whose
TaskLedger keeps the books.

A part the core (server/engine/pool.py) holds, not a base class: `poll` calls `check` on the Run's
thread, and hands it the backend's Short and WorkerReady events; the Supervisor asks the
WorkerBackend (server/engine/backend.py) whether workers live, and the core, through callbacks,
to start a replacement, to send a task again, to move a worker's tasks to the others and to
recompute its bound when the workers that can take tasks change (NOTE [ Capacity lost ]).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from remote_loader.server.batch.delivery import Outcome
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.engine.backend import Short, WorkerBackend, WorkerReady
from remote_loader.server.engine.ledger import PendingTask, TaskLedger
from remote_loader.server.engine.seam import WorkerDiedError
from remote_loader.server.telemetry.metrics import LoaderMetrics

log = logging.getLogger(__name__)

# NOTE [ Replacing a Worker ]
#
# How the pool core applies NOTE [ Worker Failures ] (server/engine/ledger.py) to its workers.
# Every poll checks each worker with the backend's `alive` (for a worker process: is_alive(),
# waitpid), so a worker killed by SIGKILL, a segfault or os._exit is seen within POLL_INTERVAL;
# a worker stuck past `timeout` is stopped (`kill`: SIGKILL for a process). `_replace` then:
#   1. counts a restart; the core forgets the dead worker's slots (entries being sent keep their
#      views) and its releases, and the backend drops its channels (`discard`: for a process,
#      its index queue, so tasks it never read are re-issued, not read, and its result pipe, so
#      a re-issued task's answer is the new process's);
#   2. the core starts a new worker for the same worker id (`spawn`: for a process, from the
#      fork server, never a fork of the gRPC process, grpc/grpc#16001), with new channels, an
#      incarnation of its own (slot names never collide with the dead one's) and the current
#      EpochStart (same base seed);
#   3. hands the ledger the task the worker was making (`making`: a shared value a process sets
#      before each task, since its Result may have died half written to its result pipe) and
#      sends what the ledger re-issues, in order, to the new worker.
# A replacement that takes time to start (a Ray actor waits for a CPU somewhere in the cluster)
# is not `ready` until its backend says so: the `timeout` of its tasks counts from then.
#
# NOTE [ Capacity lost ]
#
# A replacement may not start for a long time: a Ray node lost when no other node has a free
# CPU leaves its actors' replacements waiting for one. Waiting with them stalls the epoch while
# the other workers sit idle (tf.data service and Ray Data go on with the workers they have).
# So when the backend says a worker is Short, the pool runs without it:
#   - a map-style dataset's tasks are anyone's: what the worker holds goes to the other workers
#     at once, in submission order, and it gets no new tasks; the in-flight bound becomes
#     prefetch_factor * the workers left, and remote_loader_pool_workers shows them; a warning
#     names the shortfall;
#   - an IterableDataset shards itself by worker: without the worker its share is lost, so the
#     epoch ends with WorkerDiedError (the pool is replaced and says what it lacks);
#   - when its WorkerReady comes (CPUs returned: a node joined), it takes tasks again and
#     the bound and gauge grow back, with a warning ("started again: N of M workers"). A short
#     worker keeps trying: a start the backend gives up (Ray failed it: NOTE [ Every start
#     ends ] in server/engine/ray/starts.py) is a death like any other, and its replacement waits
#     for CPUs in turn (Short at once when none are free), so the pool grows back once any
#     of its starts lands, within seconds of a node joining (11.4 s in
#     tests/integration/test_ray_faults.py, Ray's verdict on the lost node included). Events
#     are read while an epoch polls the backend: between epochs, at the next one.
# If no worker is left to take them, the tasks wait for the replacement, as before.
# A backend says Short only when the worker truly cannot start for now (the Ray bridge: its CPUs
# are not free in the cluster, or it has not started in SLOW_START_PATIENCE): tasks moved away
# stay queued on the starting actor too, and are made again when it starts (the first answer
# counts; a sample that kills its worker costs one death more).


class Supervisor:
    """Checks a pool's workers on every poll and replaces the dead and the stuck.

    `respawn(worker_id)` starts a replacement (the core's: slots, backend, EpochStart);
    `send(pending)` sends a re-issued task. Outcomes of tasks given up (timed out, or out of
    attempts) wait here until the core's poll returns them, one per poll.
    """

    def __init__(
        self,
        spec: LoaderSpec,
        backend: WorkerBackend,
        ledger: TaskLedger,
        metrics: LoaderMetrics,
        *,
        respawn: Callable[[int], None],
        send: Callable[[PendingTask], None],
        reassign: Callable[[int], int],
        capacity_changed: Callable[[], None],
    ) -> None:
        self._spec = spec
        self._backend = backend
        self._ledger = ledger
        self._metrics = metrics
        self._respawn = respawn
        self._send = send
        self._reassign = reassign
        self._capacity_changed = capacity_changed
        # Workers whose replacement cannot start (Short), until their WorkerReady: no tasks.
        self.short: set[int] = set()
        # Workers replaced after they died (or were stopped for a timeout).
        self.restarts = 0
        # Tasks given up and not yet returned by the core's poll.
        self._failed: collections.deque[Outcome] = collections.deque()

    def next_failure(self) -> Outcome | None:
        """A task given up that the core's poll has not returned yet."""
        return self._failed.popleft() if self._failed else None

    def clear(self) -> None:
        """A new epoch, or the end of one: its failures no longer matter."""
        self._failed.clear()

    def check(self) -> Outcome | None:
        """Replaces dead workers and re-issues their tasks; stops a worker stuck past `timeout`.

        Returns an error Outcome for a task that has used up its attempts or timed out.
        """
        if self._spec.parts.timeouts.batch > 0:
            starting = {w for w in range(self._backend.workers) if not self._backend.ready(w)}
            stuck = self._ledger.overdue(
                self._spec.parts.timeouts.batch, self._backend.making, starting
            )
            if stuck is not None:
                self._failed.append(self._stop_stuck(stuck))
        for worker_id in range(self._backend.workers):
            if self._backend.alive(worker_id):
                continue
            outcome = self._replace(worker_id)
            if outcome is not None:
                self._failed.append(outcome)
        # Several can fail in one check (a timeout and a death, two deaths): each is left the
        # ledger, so each must reach the Run, one per poll.
        return self.next_failure()

    def _stop_stuck(self, stuck: PendingTask) -> Outcome:
        who = self._backend.who(stuck.worker_id)
        log.warning(
            "loader %r: no batch within timeout=%g s; stopping %s, which has batch task %d",
            self._spec.name,
            self._spec.parts.timeouts.batch,
            who,
            stuck.task_id,
        )
        failed = self._ledger.timed_out(stuck, self._spec.parts.timeouts.batch, who)
        self._backend.kill(stuck.worker_id)
        return failed

    def _replace(self, worker_id: int) -> Outcome | None:
        """See NOTE [ Replacing a Worker ]."""
        self.restarts += 1
        self._metrics.restarts.inc()
        # The task it was making when it died, as it wrote down before starting it (read before
        # its replacement gets a value of its own).
        dying_on = self._backend.making(worker_id)
        reason = self._backend.death(worker_id)
        log.warning(
            "loader %r: %s; restarting it and re-issuing its %d task(s)",
            self._spec.name,
            reason,
            len(self._ledger.held_by(worker_id)),
        )
        self._respawn(worker_id)
        reissue = self._ledger.worker_died(worker_id, dying_on, reason)
        for pending in reissue.tasks:
            self._send(pending)
        return reissue.given_up

    def forget(self, worker_id: int) -> None:
        """The worker is gone for good (autotuning removed it): it is no longer short."""
        self.short.discard(worker_id)

    def ready(self, event: WorkerReady) -> None:
        """A replacement started: its tasks' `timeout` counts from now; a short worker is back."""
        self._ledger.worker_ready(event.worker_id)
        if event.worker_id not in self.short:
            return
        self.short.discard(event.worker_id)
        self._capacity_changed()
        log.warning(
            "loader %r: %s started again: %d of %d workers",
            self._spec.name,
            self._backend.who(event.worker_id),
            self._backend.workers - len(self.short),
            self._backend.workers,
        )

    def short_of(self, event: Short) -> None:
        """See NOTE [ Capacity lost ]."""
        if self._ledger.iterable:
            raise WorkerDiedError(
                f"{event.message}; an IterableDataset shards itself by worker, so its epoch "
                "cannot go on without it"
            )
        held = len(self._ledger.held_by(event.worker_id))
        self.short.add(event.worker_id)  # before moving: it takes none of its own tasks back
        moved = self._reassign(event.worker_id)
        if moved < held:  # no worker left to take them: they wait for the replacement
            self.short.discard(event.worker_id)
            return
        self._capacity_changed()
        log.warning(
            "loader %r: %s; %d of %d workers, %d task(s) moved",
            self._spec.name,
            event.message,
            self._backend.workers - len(self.short),
            self._backend.workers,
            moved,
        )
