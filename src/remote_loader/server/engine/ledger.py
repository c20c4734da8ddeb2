"""Supervision of a pool's workers, the part every pool backend shares: which tasks each worker
holds, how often a worker died making each, what is re-issued after a death and what given up.

The pool core (server/engine/pool.py, through its Supervisor, whatever backend runs the workers)
notices dead and stuck workers and replaces them; the TaskLedger here decides what that means
for the epoch's tasks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Container
from typing import Any

from remote_loader.server.batch.delivery import Delivery, Outcome
from remote_loader.server.engine.seam import WorkerDiedError
from remote_loader.server.errors import CapturedError

# How many times a batch is tried when its worker dies while making it (a sample that crashes
# its worker every time is then delivered as an error at its position).
MAX_TASK_ATTEMPTS = 3

# NOTE [ Worker Failures ]
#
# The rules every pool backend applies; the backend notices and replaces workers (for worker
# processes: NOTE [ Replacing a Worker ] in server/engine/supervisor.py), the TaskLedger
# keeps the books the rules need.
#
# Detection (backend): every poll checks that each worker is alive at least every POLL_INTERVAL
# (0.1 s) while a Run waits for results, so a worker that died (SIGKILL, a segfault, os._exit)
# is seen within 0.1 s. Its replacement gets the same worker id and the current epoch with the
# same base seed; what the dead worker was sent and never read is not read by the new one.
# Re-issue (ledger, `TaskLedger.worker_died`):
#   1. the dead worker's pending tasks go to its replacement again, in the order they were
#      submitted, so the earliest position, the one the Run's reordering waits on, comes first;
#   2. the one it was making when it died (as the worker wrote down before starting it: its
#      answer may have died with it, half sent) is charged an attempt, since it may be what
#      killed the worker; one that died between tasks charges nothing. After MAX_TASK_ATTEMPTS
#      (3) the task is given up and delivered as a WorkerDiedError at its position (a poison
#      sample), the epoch going on.
# A late answer of the dead worker for a re-issued task is dropped: the first answer counts.
# Limits: an IterableDataset's position dies with its worker, so its epoch ends with an error
# when the worker held tasks; workers dying more than 2 * num_workers + 2 times in a row without
# a batch finished mean the loader cannot work (WorkerDiedError: the Run fails, the pool is
# replaced).
# Timeout: a worker that has been on one task for `timeout` seconds (counted from when it was
# free for it, not from when the task was queued behind others) is stopped and replaced (as
# above), and that task is delivered as a TimeoutError at its position: an error within
# timeout + 0.1 s plus the restart, never a hang.
# Fatal: a worker whose dataset factory or worker_init_fn raised answers every task with a fatal
# Result; the Run ends all its streams with FAILED_PRECONDITION and the original traceback.


@dataclasses.dataclass
class PendingTask:
    """A task submitted and not yet back: where it is, and how often its worker died on it."""

    task_id: int
    indices: Any
    seed: int | None
    worker_id: int
    submitted_at: float
    attempts: int = 1


@dataclasses.dataclass
class Reissue:
    """What a worker's death leaves to do: the tasks to send to its replacement, in this order,
    and the task given up (at most one: only the task being made is charged), as an error."""

    tasks: list[PendingTask]
    given_up: Outcome | None


class TaskLedger:
    """The tasks of one epoch submitted to `num_workers` workers and not yet back, and what a
    worker's death or a stuck worker does to them. See NOTE [ Worker Failures ].

    Pure bookkeeping: it sends nothing and stops nothing. `clock` stamps submissions (the same
    time.monotonic() the workers stamp their Results with).
    """

    def __init__(
        self,
        num_workers: int,
        *,
        iterable: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_workers = num_workers
        self.iterable = iterable
        self._clock = clock
        self._pending: dict[int, PendingTask] = {}
        # Reset by every task that comes back: a loader whose workers only ever die is broken.
        self._deaths_without_progress = 0
        # Per worker: when it last finished a task (or was started), so the task it is on now
        # counts from then, not from when it was queued behind others.
        self._free_since: list[float] = [clock()] * num_workers

    def __len__(self) -> int:
        return len(self._pending)

    def resize(self, num_workers: int) -> None:
        """The pool grew or shrank (num_workers = "auto"); a worker that leaves holds nothing."""
        self._free_since = (self._free_since + [self._clock()] * num_workers)[:num_workers]
        self.num_workers = num_workers

    def begin_epoch(self) -> None:
        self._pending.clear()
        self._deaths_without_progress = 0
        self._free_since = [self._clock()] * self.num_workers

    def end_epoch(self) -> None:
        """Forgets the epoch's tasks: a result still in flight for one is stale."""
        self._pending.clear()

    def add(self, task_id: int, indices: Any, seed: int | None, worker_id: int) -> PendingTask:
        pending = PendingTask(task_id, indices, seed, worker_id, self._clock())
        self._pending[task_id] = pending
        return pending

    def get(self, task_id: int) -> PendingTask | None:
        return self._pending.get(task_id)

    def complete(self, task_id: int, worker_id: int) -> float:
        """`worker_id` answered task `task_id`: it is free again. Returns when (clock())."""
        del self._pending[task_id]
        now = self._free_since[worker_id] = self._clock()
        self._deaths_without_progress = 0
        return now

    def restore(self, pending: PendingTask) -> None:
        """Puts back a task whose answer turned out unreadable: a later answer counts."""
        self._pending[pending.task_id] = pending

    def move(self, pending: PendingTask, worker_id: int) -> PendingTask:
        """Hands `pending` to another worker (its own cannot start: NOTE [ Capacity lost ] in
        server/engine/supervisor.py), submitted now."""
        pending.worker_id = worker_id
        pending.submitted_at = self._clock()
        return pending

    def held_by(self, worker_id: int) -> list[PendingTask]:
        """The tasks sent to `worker_id` and not yet back, in the order they were submitted."""
        return sorted(
            (p for p in self._pending.values() if p.worker_id == worker_id),
            key=lambda p: p.submitted_at,
        )

    def current_tasks(self, making: Callable[[int], int]) -> dict[int, PendingTask]:
        """Per busy worker, the task it is making now: the one `making(worker_id)` names if it
        is still that worker's, else its oldest pending."""
        current: dict[int, PendingTask] = {}
        for p in self._pending.values():
            if p.worker_id not in current or p.submitted_at < current[p.worker_id].submitted_at:
                current[p.worker_id] = p
        for worker_id in list(current):
            said = self._pending.get(making(worker_id))
            if said is not None and said.worker_id == worker_id:
                current[worker_id] = said
        return current

    def overdue(
        self, timeout: float, making: Callable[[int], int], starting: Container[int] = ()
    ) -> PendingTask | None:
        """A task some worker has been making for `timeout` seconds or more, if any. Workers
        in `starting` (replacements not yet ready) are not counted: their clock starts with
        `worker_ready`."""
        if not self._pending:
            return None
        now = self._clock()
        for current in self.current_tasks(making).values():
            if current.worker_id in starting:
                continue
            started = max(current.submitted_at, self._free_since[current.worker_id])
            if now - started >= timeout:
                return current
        return None

    def worker_ready(self, worker_id: int) -> None:
        """A replacement is ready: the task it is on counts from now."""
        self._free_since[worker_id] = self._clock()

    def timed_out(self, stuck: PendingTask, timeout: float, who: str) -> Outcome:
        """Gives `stuck` up as a TimeoutError at its position; `who` names its worker (the
        backend stops and replaces it)."""
        del self._pending[stuck.task_id]
        error = TimeoutError(
            f"DataLoader timed out after {timeout} seconds: {who} was stopped and replaced"
        )
        return _error_outcome(stuck, error)

    def worker_died(self, worker_id: int, dying_on: int, reason: str) -> Reissue:
        """`worker_id` died (`reason`, for the errors) while making task `dying_on` (-1: between
        tasks) and has been replaced. See NOTE [ Worker Failures ].

        Raises WorkerDiedError when the epoch cannot go on (an IterableDataset's position is
        lost, or workers keep dying without finishing anything).
        """
        self._deaths_without_progress += 1
        mine = self.held_by(worker_id)
        if self.iterable and mine:
            # An IterableDataset's position lives in the worker that died: re-issuing its
            # tasks to a fresh iterator would repeat samples.
            raise WorkerDiedError(f"{reason}; an IterableDataset cannot resume its position")
        if self._deaths_without_progress > 2 * self.num_workers + 2:
            raise WorkerDiedError(
                f"{reason}; workers died {self._deaths_without_progress} times in a row "
                "without finishing a batch"
            )
        reissue = Reissue(tasks=[], given_up=None)
        for pending in mine:
            if pending.task_id == dying_on:  # it may be what killed the worker
                pending.attempts += 1
            if pending.attempts > MAX_TASK_ATTEMPTS:
                del self._pending[pending.task_id]
                error = WorkerDiedError(
                    f"{reason} while making this batch, {MAX_TASK_ATTEMPTS} times: it is "
                    "given up (a sample that crashes its worker?)"
                )
                reissue.given_up = _error_outcome(pending, error)
                continue
            pending.submitted_at = self._clock()
            reissue.tasks.append(pending)
        self._free_since[worker_id] = self._clock()
        return reissue


def _error_outcome(pending: PendingTask, error: Exception) -> Outcome:
    where = f"in DataLoader worker process {pending.worker_id}"
    return Outcome(pending.task_id, Delivery(error=CapturedError.capture(where, error)))
