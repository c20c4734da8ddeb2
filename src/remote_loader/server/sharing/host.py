"""One hosted loader: its spec, a dataset built in the server process, and its Runs.

The server-side dataset instance answers len() and kind, validates the options against torch at
start-up and does the loading when num_workers = 0; it is pickled once, and every worker starts
from that pickle (NOTE [ One dataset per loader ] in server/worker/dataset.py).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.context
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import IterableDataset

from remote_loader.server.config.sampling import (
    Batching,
    EpochPlan,
    LoaderWarning,
    dataloader_with_warnings,
    epoch_length,
    plan_epoch,
)
from remote_loader.server.config.spec import ConfigError, LoaderSpec
from remote_loader.server.engine.choice import Pool, make_pool, require_backend
from remote_loader.server.engine.inline import InlineEngine
from remote_loader.server.engine.kept import KeptPools
from remote_loader.server.engine.options import PoolOptions
from remote_loader.server.engine.seam import POLL_INTERVAL, Engine
from remote_loader.server.errors import Closing
from remote_loader.server.sharing.consumer import Consumer
from remote_loader.server.sharing.elastic import (
    Reshard,
    ReshardError,
    resharded_length,
    resharded_plan,
)
from remote_loader.server.sharing.membership import Membership
from remote_loader.server.sharing.policies import admit, policy_for
from remote_loader.server.sharing.run import BorrowAbandoned
from remote_loader.server.sharing.runs import Runs
from remote_loader.server.telemetry.metrics import LoaderMetrics
from remote_loader.server.telemetry.series import DEFAULT_MAX_CONSUMERS
from remote_loader.server.worker.dataset import SharedDataset, build_dataset, share

log = logging.getLogger(__name__)


def check_length(spec: LoaderSpec, dataset: Any) -> None:
    """Raises ConfigError when a map-style `dataset` cannot give the length an epoch needs.

    A map-style epoch is sampled from len(dataset) (torch's default samplers; most custom ones
    too), so a `__len__` that raises would fail every stream at batch 0, and len(loader) would
    look like an IterableDataset's. Without `__len__` at all, only a named sampler or
    batch_sampler can sample it. An IterableDataset's `__len__` is optional, and TypeError from
    it means "unsized" (torchdata's IterDataPipe), so it is left to torch.
    """
    if isinstance(dataset, IterableDataset):
        return
    kind = f"map-style dataset {type(dataset).__qualname__}"
    if not hasattr(type(dataset), "__len__"):
        if spec.sampler is None and spec.batch_sampler is None:
            raise ConfigError(
                f"loader {spec.name!r}: its {kind} has no __len__, and torch's default "
                "sampler needs it to sample an epoch: define __len__, or name a sampler or "
                "batch_sampler that does not need it"
            )
        return
    try:
        len(dataset)
    except Exception as exc:
        raise ConfigError(
            f"loader {spec.name!r}: its {kind} has __len__, but len(dataset) raised "
            f"{type(exc).__name__}: {exc}; an epoch of a map-style dataset is sampled from its "
            "length, so no stream could start: fix __len__"
        ) from exc


class LoaderHost:
    """A named loader on the server.

    Building one builds the dataset and a torch DataLoader with the spec's options, so a bad
    factory or an option torch rejects fails here, at start-up, with the original exception.
    """

    def __init__(
        self,
        spec: LoaderSpec,
        ctx: multiprocessing.context.BaseContext,
        *,
        pool_options: PoolOptions | None = None,
        metrics_max_consumers: int = DEFAULT_MAX_CONSUMERS,
        kept: KeptPools | None = None,
    ) -> None:
        self.spec = spec
        # The server's settings its pools are made with (the same for every loader).
        self.pool_options = pool_options if pool_options is not None else PoolOptions()
        # What this loader served and where its batches waited; a server's MetricsServer
        # shows it (server/telemetry/metrics.py).
        self.metrics = LoaderMetrics(spec.name, metrics_max_consumers)
        self.metrics.configured(spec.parts.pool.num_workers, spec.parts.pool.prefetch_factor)
        require_backend(spec)  # before the dataset: Ray missing is the cheaper thing to find
        self.dataset = build_dataset(spec)
        check_length(spec, self.dataset)  # before torch's RandomSampler calls len() itself
        # torch's warnings for this loader (more workers than CPUs, ...): logged once here,
        # handed to trainers by Describe (LoaderInfo.warnings).
        self._loader, self.warnings = dataloader_with_warnings(spec, self.dataset)
        for warning in self.warnings:
            log.warning("loader %r: %s: %s", spec.name, warning.category, warning.message)
        self.batching = Batching.of(self._loader)
        if spec.parts.pool.autotune and self.batching.is_iterable:
            raise ConfigError(
                f'loader {spec.name!r}: num_workers = "auto" needs a map-style dataset: an '
                "IterableDataset shards itself by the worker count, which autotuning changes"
            )
        # Once, after the DataLoader has set what it sets on an IterDataPipe: what every
        # worker starts from (NOTE [ One dataset per loader ]). num_workers = 0 loads this one.
        pool = spec.parts.pool
        workers = pool.num_workers > 0 or pool.autotune
        self.shared = share(spec, self.dataset) if workers else SharedDataset()
        if self.shared.warning is not None:
            self.warnings += (LoaderWarning("UserWarning", self.shared.warning),)
        self._ctx = ctx
        self._cond = threading.Condition()
        # The last pool started (for Describe): its backend, nodes and workers.
        self.pool_info: dict[str, int | str] = {}
        self._persistent: Pool | None = None
        self._persistent_job: str | None = None  # the job whose Run holds it, None when free
        # Pools without persistent_workers kept for a next Run (server/engine/kept.py): the
        # server's, shared by its loaders.
        self._kept = kept if kept is not None else KeptPools()
        self._closed = False
        self.runs = Runs(
            spec,
            self._plan,
            self._borrow,
            iterable=self.batching.is_iterable,
            metrics=self.metrics,
        )
        self.metrics.watch_consumers(self.runs.consumer_lags)

    def _plan(self, seed: int, epoch: int, world_size: int, reshard: Reshard | None) -> EpochPlan:
        if reshard is None:
            return plan_epoch(self.spec, self.dataset, seed, epoch, world_size)
        return resharded_plan(self.spec, self.dataset, seed, epoch, reshard, world_size)

    def __len__(self) -> int:
        """Batches per epoch, as torch's `len(DataLoader)` (TypeError for an unsized dataset)."""
        return len(self._loader)

    @property
    def persistent_pool(self) -> Pool | None:
        """The pool this loader keeps between epochs (persistent_workers), None until the first
        epoch starts it or when it keeps none. Read-only: for Describe's readers and tests, which
        watch its workers (`restarts`, `pids`); the host alone lends it to a Run."""
        return self._persistent

    @property
    def dataset_kind(self) -> str:
        return "iterable" if self.batching.is_iterable else "map"

    def length(
        self,
        membership: Membership,
        reshard: Reshard | None = None,
        seed: int = 0,
        epoch: int = 0,
    ) -> int:
        """Batches `membership`'s consumer receives per epoch (of `epoch`, when a job of another
        world size began it: `reshard`); TypeError when unknown, ReshardError when refused."""
        policy = policy_for(membership.sharing)
        if not policy.fixed_length:
            raise TypeError(f"with {policy.name} sharing it depends on the other consumers")
        world_size = policy.plan_world_size(membership)
        if reshard is not None:
            if self.batching.is_iterable:
                raise ReshardError(
                    f"loader {self.spec.name!r} serves an IterableDataset, whose order is not "
                    "the server's to deal out again: it cannot resume on another world size"
                )
            return resharded_length(
                reshard,
                world_size,
                self.spec.parts.sharing.partition_drop_last,
                epoch,
                lambda w: epoch_length(self._loader, self.spec, w),
            )
        return epoch_length(self._loader, self.spec, world_size)

    def check(self, membership: Membership) -> None:
        """Raises SharingRefused when this loader refuses `membership`."""
        admit(membership, self.spec, self.batching.is_iterable)

    def attach(
        self,
        membership: Membership,
        seed: int,
        epoch: int,
        start: int = 0,
        reshard: Reshard | None = None,
        compression: str = "",
    ) -> Consumer:
        """A consumer of this epoch from position `start` (NOTE [ Sharing ], server/sharing/runs.py;
        `reshard`: NOTE [ Elastic resume ], server/sharing/elastic.py; `compression`: NOTE
        [ Compression ], protos/compression.py)."""
        with self._cond:
            if self._closed:
                raise Closing(f"loader {self.spec.name!r} is shutting down")
        return self.runs.attach(membership, seed, epoch, start, reshard, compression)

    def start(self) -> None:
        """Starts the persistent workers, if the spec asks for them (before the gRPC server)."""
        pool = self.spec.parts.pool
        if pool.persistent_workers and pool.num_workers > 0:
            with self._cond:
                self._persistent = self._new_pool()

    def _new_pool(self) -> Pool:
        pool = make_pool(
            self.spec,
            self.batching,
            self._ctx,
            self.pool_options,
            metrics=self.metrics,
            dataset=self.shared,
        )
        if pool.kept_between_epochs:
            self._kept.make_room(self.spec.name)  # others' idle pools hold cluster CPUs
        pool.start()
        self.pool_info = info = pool.describe()
        self.metrics.pool_started(str(info["backend"]), int(info["nodes"]), int(info["workers"]))
        return pool

    @contextlib.contextmanager
    def _borrow(self, job: str, give_up: Callable[[], bool]) -> Iterator[Engine]:
        """The engine for one Run: in-process loading, the persistent pool, or a pool of its own.

        A persistent pool runs one epoch at a time (its workers' RNGs are per epoch). While a Run
        of the same job holds it, a new Run waits for it, up to workers_timeout: that is the next
        epoch of the same trainers, whose slowest rank is finishing the last one. A Run of
        another job gets workers of its own at once.
        """
        if self.spec.parts.pool.num_workers == 0:
            yield InlineEngine(
                self.spec,
                self.dataset,
                self.batching,
                max_batch_bytes=self.pool_options.max_batch_bytes,
                metrics=self.metrics,
            )
            return
        pool = self._take_persistent(job, give_up)
        if pool is None:
            pool = self._kept.take(self.spec.name) or self._new_pool()
            try:
                yield pool
            finally:
                # Kept for the next Run (NOTE [ Ray pool reuse ] in server/engine/ray/backend.py),
                # or shut down (NOTE [ Pool Shutdown ] in server/engine/pool.py).
                if pool.kept_between_epochs and not self._closed:
                    self._kept.keep(self.spec.name, pool)
                else:
                    pool.shutdown()
            return
        try:
            yield pool
        finally:
            self._give_back(pool)

    def _take_persistent(self, job: str, give_up: Callable[[], bool]) -> Pool | None:
        wait = self.spec.parts.timeouts.workers
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError(f"loader {self.spec.name!r} is closed")
                if self._persistent is None:
                    return None
                if self._persistent_job is None:
                    self._persistent_job = job
                    return self._persistent
                remaining = deadline - time.monotonic()
                if self._persistent_job != job or remaining <= 0:
                    return None
                if give_up():
                    raise BorrowAbandoned(job)
                self._cond.wait(min(remaining, POLL_INTERVAL))

    def _give_back(self, pool: Pool) -> None:
        with self._cond:
            self._persistent_job = None
            broken = pool.broken
            if broken:
                self._persistent = None
            self._cond.notify_all()
        if not broken:
            return
        pool.shutdown()  # a worker died: replace the pool rather than run on with a hole
        if self._closed:
            return
        log.warning("loader %r: restarting its persistent workers", self.spec.name)
        replacement = self._new_pool()
        with self._cond:
            if self._closed:
                replacement.shutdown()
                return
            self._persistent = replacement
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.runs.close()
        with self._cond:
            pool, self._persistent = self._persistent, None
        if pool is not None:
            pool.shutdown()  # See NOTE [ Pool Shutdown ] in server/engine/pool.py
        self._kept.close(self.spec.name)
