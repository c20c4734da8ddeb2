"""A loader spec resolved into its parts: what each stage of the server reads, with the types
the values have once the spec is built.

A LoaderSpec (server/config/spec.py) is flat, as its TOML table, its flags and torch's DataLoader
keywords are, and some of its fields hold what was asked rather than what holds: None for "as
detach_timeout" or "torch's default", "auto" for a count the server chooses. `LoaderSpec.parts`
is the same spec after construction resolved all that, one part per stage: the dataset, the
batching (server/config/sampling.py), the pool (server/engine/pool.py and its backends), sharing
(server/sharing/policies.py, server/sharing/membership.py) and the timeouts. The stages read the
parts; only torch's own DataLoader options (server/config/sampling.py builds a DataLoader from
them, with torch's checks) are read as given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class DatasetPart:
    factory: str  # "module:callable"
    kwargs: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class BatchingPart:
    batch_size: int | None  # None: torch's batch_size=None, each sample its own batch
    shuffle: bool
    drop_last: bool
    in_order: bool
    seed: int
    seeding: str  # spec.SEEDING_MODES


@dataclasses.dataclass(frozen=True)
class PoolPart:
    backend: str  # spec.POOL_BACKENDS
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
    modes: tuple[str, ...]  # those clients may ask for
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
