"""In-process loading for num_workers = 0: the engine (server/engine/seam.py) that makes each batch
on the Run's own thread, in the server process, with the same pieces a worker uses
(server/worker/fetcher.py, server/worker/loop.py's make_batch, the epoch hooks of
server/worker/dataset.py) and no worker processes.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from remote_loader.protos.compression import Compressor, compressor_for
from remote_loader.server.batch.delivery import Delivery, Outcome
from remote_loader.server.batch.messages import DEFAULT_MAX_BATCH_BYTES
from remote_loader.server.config.sampling import Batching
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.telemetry.metrics import LoaderMetrics
from remote_loader.server.worker.dataset import begin_dataset_epoch
from remote_loader.server.worker.fetcher import Fetcher, seed_rngs
from remote_loader.server.worker.loop import make_batch

# Where an inline (num_workers=0) batch failed, in its error.
INLINE = "in the server process"


class InlineEngine:
    """num_workers = 0: the Run's own thread loads, one batch at a time, in the server process.

    torch does not seed the main process; here it is seeded as worker 0 would be, so the epoch is
    still a function of (seed, epoch). The RNGs are process-global: concurrent Runs of such
    loaders share them.
    """

    max_outstanding = 1
    broken = False
    outstanding = 0

    def __init__(
        self,
        spec: LoaderSpec,
        dataset: Any,
        batching: Batching,
        *,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        metrics: LoaderMetrics | None = None,
    ) -> None:
        self._spec = spec
        self._dataset = dataset
        self._batching = batching
        self._max_batch_bytes = max_batch_bytes
        self._metrics = metrics if metrics is not None else LoaderMetrics(spec.name)
        self._queue: collections.deque[tuple[int, Any, int | None]] = collections.deque()
        self._fetcher: Fetcher | None = None
        self._compressor: Compressor | None = None
        self.outstanding = 0

    def begin_epoch(
        self, base_seed: int, compression: str = "", *, epoch: int, shared_seed: int | None = None
    ) -> None:
        seed_rngs(base_seed, 0)
        # As torch's main process does with num_workers = 0: the one copy, one worker of one
        # (NOTE [ Epoch hooks ] in server/worker/dataset.py).
        self._dataset = begin_dataset_epoch(self._dataset, epoch, 0, 1, shared_seed)
        self._compressor = compressor_for(compression, self._compressor)
        collate_fn = self._batching.collate_fn(self._spec)
        self._fetcher = Fetcher(self._dataset, self._batching, collate_fn)
        self._queue.clear()
        self.outstanding = 0

    def has_room(self) -> bool:
        return True  # no workers to share tasks between: max_outstanding alone bounds them

    def submit(self, task_id: int, indices: Any, seed: int | None = None) -> bool:
        assert self._fetcher is not None
        if self._fetcher.ended:
            return False
        self._queue.append((task_id, indices, seed))
        self.outstanding += 1
        return True

    def poll(self, timeout: float = 0.0) -> Outcome | None:
        if not self._queue:
            return None
        assert self._fetcher is not None
        task_id, indices, seed = self._queue.popleft()
        self.outstanding -= 1
        started = time.monotonic()
        made = make_batch(
            self._fetcher, indices, seed, self._max_batch_bytes, INLINE, self._compressor
        )
        if made.error is None and made.encoded is None:
            return Outcome(task_id, None)  # the IterableDataset ran dry
        self._metrics.made(time.monotonic() - started)
        if made.error is not None:
            return Outcome(task_id, Delivery(error=made.error))
        encoded = made.encoded
        assert encoded is not None
        return Outcome(
            task_id,
            Delivery(blob=memoryview(encoded.to_bytes()), header_nbytes=len(encoded.header)),
        )

    def end_epoch(self) -> None:
        self._queue.clear()
        self.outstanding = 0
