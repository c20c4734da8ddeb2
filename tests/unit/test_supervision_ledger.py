"""The supervision rules every pool backend shares, as bookkeeping alone (no processes): see
NOTE [ Worker Failures ] in server/engine/ledger.py. tests/integration/test_supervision.py kills
real workers.
"""

from __future__ import annotations

import pytest

from remote_loader.server.engine.ledger import MAX_TASK_ATTEMPTS, TaskLedger
from remote_loader.server.engine.seam import WorkerDiedError

REASON = "DataLoader worker 1 (pid 42) exited unexpectedly with signal 11"


class Clock:
    """A time.monotonic() that moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def ledger(num_workers: int = 2, *, iterable: bool = False) -> tuple[TaskLedger, Clock]:
    clock = Clock()
    books = TaskLedger(num_workers, iterable=iterable, clock=clock)
    books.begin_epoch()
    return books, clock


def nothing(worker_id: int) -> int:
    return -1


def test_a_dead_workers_tasks_are_reissued_in_submission_order_and_only_its_own() -> None:
    books, clock = ledger()
    # Task ids out of order, and worker 1's tasks out of submission order in the ledger (a
    # task put back after an unreadable answer goes to its end): the order is submission's.
    for task_id, worker_id in [(7, 1), (2, 0), (3, 1), (5, 1)]:
        books.add(task_id, [task_id], None, worker_id)
        clock.now += 1
    pending = books.get(7)
    assert pending is not None
    books.complete(7, 1)
    books.restore(pending)
    clock.now += 1
    reissue = books.worker_died(1, dying_on=-1, reason=REASON)
    assert [p.task_id for p in reissue.tasks] == [7, 3, 5]
    assert [p.indices for p in reissue.tasks] == [[7], [3], [5]]
    assert reissue.given_up is None
    # Re-issued now: a timeout counts from the new submission.
    assert all(p.submitted_at == clock.now for p in reissue.tasks)
    assert len(books) == 4 and books.held_by(0)[0].task_id == 2


def test_only_the_task_being_made_is_charged_an_attempt() -> None:
    books, _ = ledger()
    for task_id in range(3):
        books.add(task_id, [task_id], None, 1)
    books.worker_died(1, dying_on=1, reason=REASON)
    books.worker_died(1, dying_on=-1, reason=REASON)  # between tasks: nothing is charged
    attempts = {p.task_id: p.attempts for p in books.held_by(1)}
    assert attempts == {0: 1, 1: 2, 2: 1}


def test_a_task_its_worker_dies_on_max_attempts_times_is_given_up_at_its_position() -> None:
    books, _ = ledger()
    books.add(4, [4], None, 1)
    books.add(5, [5], None, 1)
    for _ in range(MAX_TASK_ATTEMPTS - 1):
        reissue = books.worker_died(1, dying_on=4, reason=REASON)
        assert reissue.given_up is None and [p.task_id for p in reissue.tasks] == [4, 5]
    reissue = books.worker_died(1, dying_on=4, reason=REASON)
    # Given up, and the epoch goes on: the worker's other task is re-issued.
    assert [p.task_id for p in reissue.tasks] == [5]
    assert books.get(4) is None and len(books) == 1
    outcome = reissue.given_up
    assert outcome is not None and outcome.task_id == 4
    assert outcome.delivery is not None and outcome.delivery.error is not None
    error = outcome.delivery.error
    assert error.type == "WorkerDiedError"
    assert error.where == "in DataLoader worker process 1"
    assert error.message == (
        f"{REASON} while making this batch, {MAX_TASK_ATTEMPTS} times: it is given up "
        "(a sample that crashes its worker?)"
    )


def test_workers_dying_without_progress_break_the_loader_and_progress_resets_the_count() -> None:
    num_workers = 2
    books, _ = ledger(num_workers)
    allowed = 2 * num_workers + 2
    for _ in range(allowed):
        books.worker_died(0, dying_on=-1, reason=REASON)
    books.add(0, [0], None, 1)
    books.complete(0, 1)  # a batch finished: the deaths before it no longer count
    for _ in range(allowed):
        books.worker_died(0, dying_on=-1, reason=REASON)
    with pytest.raises(WorkerDiedError, match=f"died {allowed + 1} times in a row"):
        books.worker_died(0, dying_on=-1, reason=REASON)
    books.begin_epoch()  # a new epoch starts counting again
    books.worker_died(0, dying_on=-1, reason=REASON)


def test_an_iterable_datasets_worker_dying_with_tasks_ends_the_epoch() -> None:
    books, _ = ledger(iterable=True)
    books.add(0, [0], None, 0)
    books.worker_died(1, dying_on=-1, reason=REASON)  # it held nothing: no position lost
    with pytest.raises(WorkerDiedError, match="an IterableDataset cannot resume its position"):
        books.worker_died(0, dying_on=0, reason=REASON)


def test_a_task_is_overdue_timeout_seconds_after_its_worker_was_free_for_it() -> None:
    books, clock = ledger()
    books.add(0, [0], None, 0)
    books.add(1, [1], None, 0)  # queued behind task 0
    clock.now += 0.9
    assert books.overdue(1.0, nothing) is None
    clock.now += 0.1
    stuck = books.overdue(1.0, nothing)
    assert stuck is not None and stuck.task_id == 0  # its oldest: the one it is on
    books.complete(0, 0)  # task 1's time starts now, not when it was queued
    clock.now += 0.9
    assert books.overdue(1.0, nothing) is None
    clock.now += 0.1
    stuck = books.overdue(1.0, nothing)
    assert stuck is not None and stuck.task_id == 1


def test_the_task_a_worker_says_it_is_making_is_the_one_timed_out() -> None:
    books, clock = ledger()
    for task_id in range(3):
        books.add(task_id, [task_id], None, 0)
    books.add(3, [3], None, 1)
    # Worker 0 says it is on task 1 (task 0's answer is on its way); worker 1 names a task of
    # worker 0's, which is not what it is making.
    making = {0: 1, 1: 2}
    assert {w: p.task_id for w, p in books.current_tasks(making.__getitem__).items()} == {
        0: 1,
        1: 3,
    }
    clock.now += 2.0
    stuck = books.overdue(1.0, making.__getitem__)
    assert stuck is not None and stuck.task_id == 1
    outcome = books.timed_out(stuck, 1.0, "worker 0 (pid 42)")
    assert books.get(1) is None and len(books) == 3
    assert outcome.task_id == 1 and outcome.delivery is not None
    error = outcome.delivery.error
    assert error is not None and error.type == "TimeoutError"
    assert error.where == "in DataLoader worker process 0"
    assert error.message == (
        "DataLoader timed out after 1.0 seconds: worker 0 (pid 42) was stopped and replaced"
    )


def test_a_replacement_is_free_for_its_first_task_from_when_it_was_started() -> None:
    books, clock = ledger()
    books.add(0, [0], None, 0)
    clock.now += 5.0
    books.worker_died(0, dying_on=-1, reason=REASON)
    clock.now += 0.5
    assert books.overdue(1.0, nothing) is None
    clock.now += 0.5
    stuck = books.overdue(1.0, nothing)
    assert stuck is not None and stuck.task_id == 0


def test_a_starting_replacements_tasks_count_from_when_it_is_ready() -> None:
    # A Ray actor takes seconds to be placed and started: its tasks are not overdue meanwhile.
    books, clock = ledger()
    books.add(0, [0], None, 0)
    clock.now += 5.0
    assert books.overdue(1.0, nothing, starting={0}) is None
    books.worker_ready(0)
    clock.now += 0.9
    assert books.overdue(1.0, nothing) is None
    clock.now += 0.1
    stuck = books.overdue(1.0, nothing)
    assert stuck is not None and stuck.task_id == 0


def test_end_epoch_forgets_the_tasks() -> None:
    books, clock = ledger()
    books.add(0, [0], None, 0)
    books.end_epoch()
    # A result still in flight for it is stale, and nothing of it can time out.
    assert len(books) == 0 and books.get(0) is None
    clock.now += 10.0
    assert books.overdue(1.0, nothing) is None
    assert books.worker_died(0, dying_on=0, reason=REASON).tasks == []
