"""The messages between the server (RayBackend, server/engine/ray/backend.py) and its Ray bridge
(server/engine/ray/bridge.py), one pipe each way, and what the bridge process starts from; the
protocol is NOTE [ Ray bridge ] in server/engine/ray/bridge.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from remote_loader.server.batch.messages import EpochStart, Task
from remote_loader.server.config.sampling import Batching
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.engine.ray.lane import LaneAddress
from remote_loader.server.worker.dataset import SharedDataset


@dataclasses.dataclass(frozen=True)
class BridgeConfig:
    spec: LoaderSpec
    batching: Batching
    max_batch_bytes: int
    dataset: SharedDataset  # the loader's, pickled once (NOTE [ One dataset per loader ])
    address: str | None  # None: start a local Ray instance
    lane: LaneAddress | None  # where this host's actors attach (NOTE [ Ray direct lane ])
    commands: Any  # reading end of the server's pipe
    results: Any  # writing end of the bridge's pipe


@dataclasses.dataclass(frozen=True)
class Send:
    worker_id: int
    message: EpochStart | Task


@dataclasses.dataclass(frozen=True)
class Spawn:
    """A new actor for `worker_id` (a replacement, or one more when worker_id is the count)."""

    worker_id: int
    num_workers: int
    incarnation: int


@dataclasses.dataclass(frozen=True)
class Kill:
    """Stop the actor now (stuck past `timeout`); the server spawns its replacement."""

    worker_id: int


@dataclasses.dataclass(frozen=True)
class Retire:
    """num_workers = "auto": the last actor goes (the server gave it no task it still holds)."""


@dataclasses.dataclass(frozen=True)
class Started:
    nodes: int
    attached: tuple[bool, ...]  # per actor (incarnations 0..n-1): it attached a lane


@dataclasses.dataclass(frozen=True)
class StartFailed:
    message: str


@dataclasses.dataclass(frozen=True)
class Lost:
    worker_id: int
    incarnation: int
    reason: str
    making: int  # the task whose call failed with the actor's death (-1: none)
    # Ray failed this worker's starts so many times in a row, this one included (0: it died
    # after it started). At MAX_FAILED_STARTS (server/engine/ray/starts.py) the server gives up
    # on the pool.
    failed_starts: int = 0


@dataclasses.dataclass(frozen=True)
class ActorStarted:
    """A spawned actor has started (placed, its dataset built)."""

    worker_id: int
    incarnation: int
    attached: bool  # it attached a lane (NOTE [ Ray direct lane ] in server/engine/ray/lane.py)


@dataclasses.dataclass(frozen=True)
class Shortfall:
    """A spawned actor has not started within REPLACE_PATIENCE (`message`: the CPUs it asks and
    those free)."""

    worker_id: int
    incarnation: int
    message: str
