"""The worker seam of the pool core (server/engine/pool.py): where a pool's workers run and how
messages reach them. The core owns everything else (tasks, slots, dispatch, supervision rules,
autotuning); a backend only starts, stops, talks to and watches its workers.

- ProcessBackend (server/engine/local.py): worker processes of this server, one index queue and
  one result pipe each (NOTE [ Pool Protocol ] in server/engine/pool.py).
- RayBackend (server/engine/ray/backend.py): Ray actors on a cluster, owned by a bridge process
  (NOTE [ Ray bridge ] in server/engine/ray/bridge.py).

Besides results, `receive` yields what a backend learns about its workers' capacity: a
replacement that cannot start yet (Short) and one that has started (WorkerReady); see
NOTE [ Capacity lost ] in server/engine/supervisor.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Protocol

from remote_loader.server.batch.messages import EpochStart, Result, Task


@dataclasses.dataclass(frozen=True)
class WorkerReady:
    """Worker `worker_id`'s replacement (or a worker added) has started: the `timeout` of the
    task it holds counts from now, and a worker that was short takes tasks again."""

    worker_id: int


@dataclasses.dataclass(frozen=True)
class Short:
    """Worker `worker_id`'s replacement cannot start for now (`message`: what it lacks, e.g. a
    free CPU in the cluster); the pool runs without it until its WorkerReady comes."""

    worker_id: int
    message: str


Event = Result | WorkerReady | Short


class WorkerBackend(Protocol):
    """Workers 0..workers-1 of one pool. Called from the Run's thread only, as the core is."""

    @property
    def workers(self) -> int:
        """How many workers it has (spawned and not retired)."""
        ...

    @property
    def pids(self) -> list[int]:
        """The processes running the workers (for tests and logs)."""
        ...

    @property
    def kept_between_epochs(self) -> bool:
        """Whether a pool without persistent_workers is kept for the next epoch rather than
        started anew, its workers beginning each epoch as new ones would (a dataset built
        again, worker_init_fn run again): where a new pool costs seconds (NOTE [ Ray pool
        reuse ] in server/engine/ray/backend.py)."""
        ...

    def describe(self) -> dict[str, int | str]:
        """ "backend" (its `pool` name) and "nodes" (hosts the workers run on), for Describe and
        the metrics."""
        ...

    def start(self) -> None:
        """Sets up what all workers share, before the first spawn."""
        ...

    def spawn(self, worker_id: int, num_workers: int) -> int:
        """Starts worker `worker_id` of `num_workers` (a new one when `worker_id` == workers,
        else the replacement of one discarded); returns its incarnation, which names its
        shared-memory slots (server/engine/slots.py)."""
        ...

    def send(self, worker_id: int, message: EpochStart | Task) -> None: ...

    def set_epoch(self, key: int) -> None:
        """The epoch the workers make tasks of (-1: none): they skip other epochs' tasks."""
        ...

    def receive(self, timeout: float) -> Iterator[Event]:
        """Waits up to `timeout` seconds for results, then yields those that arrived (a
        worker's unreadable or cut-off result is dropped: its death is seen by `alive`), and
        Short and WorkerReady as they happen. Raises WorkerDiedError when the backend itself is gone
        (the pool cannot go on)."""
        ...

    def alive(self, worker_id: int) -> bool: ...

    def ready(self, worker_id: int) -> bool:
        """False while a spawned worker has not started yet (its WorkerReady is to come): the
        `timeout` of its tasks does not count meanwhile."""
        ...

    def making(self, worker_id: int) -> int:
        """The task the worker says it is making (-1: none)."""
        ...

    def who(self, worker_id: int) -> str:
        """Names the worker in logs and errors, e.g. "worker 2 (pid 123)"."""
        ...

    def death(self, worker_id: int) -> str:
        """Why a worker that is not alive died, for logs and errors."""
        ...

    def kill(self, worker_id: int) -> None:
        """Stops a stuck worker now (the next liveness check replaces it)."""
        ...

    def discard(self, worker_id: int) -> None:
        """Drops a dead worker's channels: nothing more of it is read, nothing sent to it
        is read by its replacement."""
        ...

    def retire_last(self) -> None:
        """Lets the last worker go (autotuning): it exits after its current task, and is
        joined at `stop`."""
        ...

    def stop(self) -> None:
        """Stops every worker and frees the channels (NOTE [ Pool Shutdown ] in
        server/engine/pool.py)."""
        ...
