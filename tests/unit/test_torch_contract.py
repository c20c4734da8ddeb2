"""The server's half of torch's DataLoader contract, the parts that need no worker process: its
own errors named by their builtin class, dispatch only to workers with room, and a context
object kept as its start method's name.

The tests that start a server, a process or Ray: tests/integration/test_torch_contract.py.
"""

from __future__ import annotations

import collections
import multiprocessing
from collections.abc import Iterator
from typing import Any

import pytest

from remote_loader.server.batch.messages import EpochStart, Result, Task
from remote_loader.server.config.sampling import Batching
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.engine.backend import Event, Short
from remote_loader.server.engine.pool import WorkerPool
from remote_loader.server.engine.seam import WorkerDiedError
from remote_loader.server.errors import CapturedError
from tests.helpers import WORKER_0


def test_the_servers_own_errors_are_named_by_their_builtin_class() -> None:
    """A trainer does not import the server: a worker's death (WorkerDiedError) is named as
    the RuntimeError torch raises for one, and keeps its own name as its `type`."""
    error = CapturedError.capture(WORKER_0, WorkerDiedError("worker 0 exited unexpectedly"))
    assert (error.module, error.qualname, error.type) == (
        "builtins",
        "RuntimeError",
        "WorkerDiedError",
    )


class _Backend:
    """Two workers that answer nothing by themselves: the test says what comes back."""

    workers = 2
    pids: list[int] = []
    kept_between_epochs = False

    def __init__(self) -> None:
        self.sent: dict[int, list[int]] = collections.defaultdict(list)  # task ids per worker
        self.events: list[Event] = []

    def describe(self) -> dict[str, int | str]:
        return {"backend": "local", "nodes": 1}

    def start(self) -> None:
        pass

    def spawn(self, worker_id: int, num_workers: int) -> int:
        return worker_id

    def send(self, worker_id: int, message: EpochStart | Task) -> None:
        if isinstance(message, Task):
            self.sent[worker_id].append(message.task_id)

    def set_epoch(self, key: int) -> None:
        pass

    def receive(self, timeout: float) -> Iterator[Event]:
        events, self.events = self.events, []
        yield from events

    def alive(self, worker_id: int) -> bool:
        return True

    def ready(self, worker_id: int) -> bool:
        return True

    def making(self, worker_id: int) -> int:
        return -1

    def who(self, worker_id: int) -> str:
        return f"worker {worker_id}"

    def death(self, worker_id: int) -> str:
        return ""

    def kill(self, worker_id: int) -> None:
        pass

    def discard(self, worker_id: int) -> None:
        pass

    def retire_last(self) -> None:
        pass

    def stop(self) -> None:
        pass


def _answer(worker_id: int, task_id: int) -> Result:
    """Worker `worker_id`'s Result for `task_id` (an error: no shared memory to map)."""
    error = CapturedError(where="", type="", message="", traceback="")
    return Result(worker_id, 0, task_id, error=error, incarnation=worker_id)


def test_dispatch_gives_a_task_only_to_a_worker_with_room_and_moves_a_short_workers_tasks() -> None:
    spec = LoaderSpec(name="d", dataset="tests.datasets:Squares", num_workers=2, in_order=False)
    backend = _Backend()
    pool = WorkerPool(spec, Batching(False, True, False), backend)
    pool.start()
    pool.begin_epoch(0, epoch=0)
    task_ids = iter(range(100))
    while pool.outstanding < pool.max_outstanding and pool.has_room():
        assert pool.submit(next(task_ids), [0])
    assert backend.sent == {0: [0, 2], 1: [1, 3]}  # in turn, prefetch_factor each
    # Worker 1 answers: only it has room, so the next task skips worker 0 (torch's rule).
    backend.events.append(_answer(1, 1))
    assert pool.poll(1.0) is not None
    assert pool.has_room()
    assert pool.submit(next(task_ids), [0])
    assert backend.sent[1] == [1, 3, 4] and not pool.has_room()
    with pytest.raises(RuntimeError, match="has_room"):
        pool.submit(next(task_ids), [0])
    # Worker 0 goes short: its tasks move to worker 1, full as it is (they are out already),
    # and the pool goes on with one worker (NOTE [ Capacity lost ]).
    backend.events.append(Short(0, "no CPU for its replacement"))
    assert pool.poll(0.05) is None
    assert backend.sent[1] == [1, 3, 4, 0, 2]
    assert pool.working == 1 and pool.max_outstanding == 2
    for task_id in (3, 4, 0):
        assert not pool.has_room()
        backend.events.append(_answer(1, task_id))
        assert pool.poll(1.0) is not None
    assert pool.has_room()
    pool.end_epoch()
    pool.shutdown()


def test_a_context_object_is_kept_as_its_start_methods_name() -> None:
    """What torch also accepts from Python; the spec holds plain values (fingerprint, logs)."""
    spawn: Any = multiprocessing.get_context("spawn")  # the field's type says what it keeps
    spec = LoaderSpec(name="a", dataset="m:f", num_workers=1, multiprocessing_context=spawn)
    assert spec.multiprocessing_context == "spawn"
