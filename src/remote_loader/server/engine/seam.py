"""The engine seam: what a Run drives to make its batches (server/sharing/run.py), and what
comes back.

Two engines fill it: the worker pool (server/engine/pool.py) and in-process loading for
num_workers = 0 (InlineEngine, server/engine/inline.py).
"""

from __future__ import annotations

from typing import Any, Protocol

from remote_loader.server.batch.delivery import Outcome
from remote_loader.server.errors import CapturedError

# How long one engine poll blocks (the pool: on its result pipes) before it checks whether the
# workers are alive. Short, because it also bounds how fast a run notices it has been closed.
POLL_INTERVAL = 0.1


def in_flight_bound(prefetch: int, workers: int) -> int:
    """An engine's `max_outstanding`: at most prefetch_factor tasks per worker taking tasks, as
    torch's DataLoader keeps out (at least one, so an epoch always moves)."""
    return max(1, prefetch * workers)


class Engine(Protocol):
    """What a Run drives: the loader's worker pool, or in-process loading (num_workers=0)."""

    max_outstanding: int
    broken: bool

    @property
    def outstanding(self) -> int: ...

    def begin_epoch(
        self, base_seed: int, compression: str = "", *, epoch: int, shared_seed: int | None = None
    ) -> None:
        """Starts the loader's epoch `epoch` (as the stream asked: the dataset's set_epoch gets
        it), seeded from `base_seed` (an IterDataPipe's random pipes from `shared_seed`: NOTE
        [ Epoch hooks ] in server/worker/dataset.py), whose batches are compressed with
        `compression` ("": none; NOTE [ Compression ] in protos/compression.py)."""
        ...

    def has_room(self) -> bool:
        """Whether a task submitted now is sent at once; False while every worker holds its
        share (in_order = false, NOTE [ Dispatch ] in server/engine/dispatch.py): the Run then waits
        for a result before it draws the next task."""
        ...

    def submit(self, task_id: int, indices: Any, seed: int | None = None) -> bool:
        """Sends a task; False when every worker has run dry (an IterableDataset's end)."""
        ...

    def poll(self, timeout: float = ...) -> Outcome | None: ...
    def end_epoch(self) -> None: ...


class WorkerDiedError(RuntimeError):
    """Workers kept dying without finishing a batch, or a worker of an IterableDataset died."""


class WorkerInitError(RuntimeError):
    """A worker cannot load anything: the dataset factory or worker_init_fn raised there."""

    def __init__(self, error: CapturedError) -> None:
        super().__init__(f"{error.type}: {error.message}")
        self.error = error
