"""One hosted loader: its spec, a dataset built in the server process, and how it runs an epoch.

The server-side dataset instance answers len() and kind, validates the options against torch at
start-up and does the loading when num_workers = 0; workers build their own instances.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.context
import threading
from collections.abc import Iterator
from typing import Any

from remote_loader.protos import codec
from remote_loader.server.pool import Delivery, WorkerPool
from remote_loader.server.sampling import Batching, EpochPlan, build_dataloader, plan_epoch
from remote_loader.server.spec import LoaderSpec
from remote_loader.server.worker import Fetcher, RemoteError, build_dataset, seed_rngs

log = logging.getLogger(__name__)


class LoaderHost:
    """A named loader on the server.

    Building one builds the dataset and a torch DataLoader with the spec's options, so a bad
    factory or an option torch rejects fails here, at start-up, with the original exception.
    """

    def __init__(self, spec: LoaderSpec, ctx: multiprocessing.context.BaseContext) -> None:
        self.spec = spec
        self.dataset = build_dataset(spec)
        self._loader = build_dataloader(spec, self.dataset)
        self.batching = Batching.of(self._loader)
        self._ctx = ctx
        self._lock = threading.Lock()
        self._persistent: WorkerPool | None = None
        self._persistent_busy = False
        self._closed = False

    def __len__(self) -> int:
        """Batches per epoch, as torch's `len(DataLoader)` (TypeError for an unsized dataset)."""
        return len(self._loader)

    @property
    def dataset_kind(self) -> str:
        return "iterable" if self.batching.is_iterable else "map"

    def start(self) -> None:
        """Starts the persistent workers, if the spec asks for them (before the gRPC server)."""
        if self.spec.persistent_workers and self.spec.num_workers > 0:
            with self._lock:
                self._persistent = self._new_pool()

    def _new_pool(self) -> WorkerPool:
        pool = WorkerPool(self.spec, self.batching, self._ctx)
        pool.start()
        return pool

    @contextlib.contextmanager
    def _lease_pool(self) -> Iterator[WorkerPool]:
        """The persistent pool when it is free, else a pool for this epoch only.

        A persistent pool serves one epoch at a time (its workers' RNGs are per epoch); a second
        concurrent stream of the same loader gets workers of its own.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"loader {self.spec.name!r} is closed")
            pool = None
            if self._persistent is not None and not self._persistent_busy:
                pool, self._persistent_busy = self._persistent, True
        if pool is not None:
            try:
                yield pool
            finally:
                with self._lock:
                    self._persistent_busy = False
                    broken = pool.broken
                    if broken:
                        self._persistent = None
                if broken:  # a worker died: replace the pool rather than run on with a hole
                    pool.shutdown()
                    if not self._closed:
                        log.warning("loader %r: restarting its persistent workers", self.spec.name)
                        replacement = self._new_pool()
                        with self._lock:
                            self._persistent = replacement
            return
        pool = self._new_pool()
        try:
            yield pool
        finally:
            pool.shutdown()  # See NOTE [ Pool Shutdown ] in server/pool.py

    @contextlib.contextmanager
    def epoch(
        self, seed: int, epoch: int, cancelled: threading.Event
    ) -> Iterator[Iterator[Delivery]]:
        """The batches of one epoch, produced while the context is open."""
        plan = plan_epoch(self.spec, self.dataset, seed, epoch)
        if self.spec.num_workers == 0:
            yield self._run_in_process(plan, cancelled)
            return
        with self._lease_pool() as pool:
            deliveries = pool.run_epoch(plan, cancelled)
            try:
                yield deliveries
            finally:
                deliveries.close()  # hands its slots back and abandons its queued tasks

    def _run_in_process(self, plan: EpochPlan, cancelled: threading.Event) -> Iterator[Delivery]:
        # num_workers = 0: the stream's thread loads. torch does not seed the main process; here
        # it is seeded as worker 0 would be, so the epoch is still a function of (seed, epoch).
        # The RNGs are process-global: concurrent streams of such loaders share them.
        seed_rngs(plan.base_seed, 0)
        fetcher = Fetcher(self.dataset, self.batching, self.batching.collate_fn(self.spec))
        for position, indices in enumerate(plan.tasks):
            if cancelled.is_set():
                return
            try:
                batch: Any = fetcher.fetch(indices)
                encoded = codec.encode(batch)
            except StopIteration:
                return
            except Exception as exc:
                yield Delivery(position, error=RemoteError.capture("in the server process", exc))
            else:
                blob = memoryview(encoded.to_bytes())
                yield Delivery(position, blob=blob, header_nbytes=len(encoded.header))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._persistent = self._persistent, None
        if pool is not None:
            pool.shutdown()  # See NOTE [ Pool Shutdown ] in server/pool.py
