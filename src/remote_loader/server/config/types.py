"""The modes a loader's spec takes, as Literal aliases (a typo in code is a type error before it
is a ConfigError), with their values as tuples for the spec's checks and the flags' choices."""

from __future__ import annotations

from typing import Literal, get_args

from remote_loader.protos.modes import SHARING_MODES, Sharing

# How random/torch/numpy are seeded in workers: "worker" as torch does (once per worker and
# epoch), "per_batch" before every batch from (seed, epoch, batch index).
Seeding = Literal["worker", "per_batch"]
SEEDING_MODES: tuple[Seeding, ...] = get_args(Seeding)

# Where a loader's workers run (server/engine/choice.py): "local", processes of this server;
# "ray", actors on a Ray cluster (the `ray` extra).
PoolBackend = Literal["local", "ray"]
POOL_BACKENDS: tuple[PoolBackend, ...] = get_args(PoolBackend)

__all__ = ["POOL_BACKENDS", "SEEDING_MODES", "SHARING_MODES", "PoolBackend", "Seeding", "Sharing"]
