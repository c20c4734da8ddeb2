"""A loader spec resolved into its parts: what each stage of the server reads, with the types
the values have once the spec is built.

A LoaderSpec (server/config/spec.py) is flat, as its TOML table, its flags and torch's DataLoader
keywords are, and some of its fields hold what was asked rather than what holds: None for "as
detach_timeout" or "torch's default", "auto" for a count the server chooses. `LoaderSpec.parts`
is the same spec after construction resolved all that, one part per stage: the dataset (built
by server/worker/dataset.py, named to Ray's actors), the batching (sampling's epoch plans, the
Run's seeding, the policies' and pool's order), the pool (server/engine/ and its backends),
sharing (server/sharing/) and the timeouts. The stages read the parts; read as given are only
torch's own DataLoader options (server/config/sampling.py builds a DataLoader from them, with
torch's checks; batch_size, drop_last, samplers, collate_fn are read there and from the
DataLoader it builds) and what Describe and `check-config` report of the spec as it was
written (its seed, batch_size, dataset).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from remote_loader.server.config.types import PoolBackend, Seeding, Sharing


@dataclasses.dataclass(frozen=True)
class DatasetPart:
    factory: str  # "module:callable"
    kwargs: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class BatchingPart:
    shuffle: bool  # torch's shuffle=None is False
    in_order: bool
    seeding: Seeding


@dataclasses.dataclass(frozen=True)
class PoolPart:
    backend: PoolBackend
    num_workers: int  # at start (with autotune: 1)
    prefetch_factor: int  # tasks in flight per worker (torch's 2 when not given)
    persistent_workers: bool
    worker_init_fn: str | None
    autotune: bool  # num_workers = "auto"
    autotune_prefetch: bool  # prefetch_factor = "auto"
    max_workers: int  # what autotuning may reach (num_workers without it)
    max_pool_bytes: int | None  # None: no bound but max_workers
    ray_num_cpus: float
    ray_runtime_env: Mapping[str, Any]  # {}: none


@dataclasses.dataclass(frozen=True)
class SharingPart:
    modes: tuple[Sharing, ...]  # those clients may ask for
    partition_drop_last: bool
    broadcast_window: int


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Seconds, each resolved (the sharing waits were all `detach` once; unset, they still are)."""

    batch: float  # torch's `timeout`: 0, none
    detach: float
    group: float
    workers: float
    handback: float


@dataclasses.dataclass(frozen=True)
class SpecParts:
    dataset: DatasetPart
    batching: BatchingPart
    pool: PoolPart
    sharing: SharingPart
    timeouts: Timeouts
