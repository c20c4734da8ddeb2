"""How the Ray bridge answers every actor start a Spawn asks for: patience with a start that is
only slow, a Shortfall for one that cannot start for want of CPUs, and the count of the starts
Ray failed in a row.

NOTE [ Every start ends ]

Ray may fail an actor's creation however it was placed: on a node that died before Ray
declared it dead (Ray offers a dead node's CPUs until its health checks fail: 5 checks 3 s
apart by default, 12.8-14.7 s measured, and the creation fails with ActorDiedError then), on
one that dies while it starts, killed while it waited for CPUs, or its constructor raising.
Every start a Spawn asks for ends in one answer to the server:

    ActorStarted  it started (its `node` call returned): the server sends it its held tasks;
    Lost          Ray failed it (making -1: it made nothing, so no task is charged an attempt);
                  the server replaces it with another start and re-issues its tasks. With no
                  CPUs free for that one, it is Short at once (checked when it is spawned, not
                  REPLACE_PATIENCE later). MAX_FAILED_STARTS (3) of one worker's in a row fail
                  the epoch with the last reason (WorkerDiedError; the next epoch starts a new
                  pool) rather than start actors for ever;
    Shortfall     neither within REPLACE_PATIENCE while the CPUs it asks are not free, or
                  within SLOW_START_PATIENCE at all: the pool goes on without it; the start
                  goes on, and ends later in ActorStarted (the pool grows back) or Lost
                  (another start, and so on).

Bound: every start is answered within SLOW_START_PATIENCE (30 s), and a start Ray fails as soon
as Ray says so (a replacement placed on a killed node: 13-15 s without a batch in
tests/integration/test_ray_faults.py, Ray's verdict on the node). It used to be dropped
("shows in its first task"), but the server holds a starting actor's tasks until ActorStarted
(RayBackend's `pending`), so none reached Ray to show it: the epoch hung, or a worker whose
tasks had moved stayed short for good.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from remote_loader.server.engine.ray.connect import capacity
from remote_loader.server.engine.ray.messages import Shortfall

# How long a spawned actor may take to start before the bridge tells the server it is short of
# it (Shortfall), so that its tasks go to the actors that remain.
REPLACE_PATIENCE = 5.0
# ... unless the cluster has the CPUs it asks free: then it is only slow to start (a loaded
# node takes seconds to start a worker process), and the bridge waits up to this long in all,
# since moving its tasks would have them made twice (the calls stay queued on the actor). Past
# it, CPUs free but on no single node (fragmented) or not usable by it count as missing.
SLOW_START_PATIENCE = 30.0
# How many starts of one worker Ray may fail in a row (NOTE [ Every start ends ]) before the
# pool is taken as unable to run here (a runtime_env or an actor that cannot be built on any
# node): the epoch then fails with why, rather than starting actors for ever.
MAX_FAILED_STARTS = 3


class ActorStarts:
    """The bridge's spawned actors whose start has not ended, and per worker the starts Ray
    failed in a row (NOTE [ Every start ends ]). `look_again(worker_id, incarnation)` is called
    on a timer's thread when a start's patience runs out; the bridge's main loop then asks
    `overdue`."""

    def __init__(self, ray: Any, cpus: float, look_again: Callable[[int, int], None]) -> None:
        self.ray = ray
        self.cpus = cpus  # what each actor asks (ray_num_cpus)
        self.look_again = look_again
        # Spawned actors not yet started, (worker id, incarnation): when each was spawned.
        # Written by the command thread (spawned) and the main loop (ended).
        self.starting: dict[tuple[int, int], float] = {}
        # Per worker id, how many of its starts in a row Ray failed (its replacement is looked
        # at once: `watch`).
        self.failed: dict[int, int] = {}

    def spawned(self, worker_id: int, incarnation: int) -> None:
        self.starting[(worker_id, incarnation)] = time.monotonic()

    def watch(self, worker_id: int, incarnation: int) -> None:
        """Looks at a spawned actor after REPLACE_PATIENCE; the replacement of an actor Ray
        failed to start at once: without the CPUs it asks free it is short now, not
        REPLACE_PATIENCE later (NOTE [ Every start ends ])."""
        self.be_patient(worker_id, incarnation, 0.0 if self.failed.get(worker_id) else None)

    def be_patient(self, worker_id: int, incarnation: int, wait: float | None = None) -> None:
        """Looks again at a starting actor after `wait` (None: REPLACE_PATIENCE; the bridge's
        main loop: `overdue`)."""
        patience = threading.Timer(
            REPLACE_PATIENCE if wait is None else wait,
            lambda: self.look_again(worker_id, incarnation),
        )
        patience.daemon = True
        patience.start()

    def overdue(self, worker_id: int, incarnation: int) -> Shortfall | None:
        """A starting actor's patience ran out: a Shortfall, unless it has started or only
        seems slow (the CPUs it asks are free: NOTE on SLOW_START_PATIENCE)."""
        spawned = self.starting.get((worker_id, incarnation))
        if spawned is None:
            return None  # started meanwhile
        free, total = capacity(self.ray)
        cpus = self.cpus
        waited = time.monotonic() - spawned
        if free + 1e-6 >= cpus and waited < SLOW_START_PATIENCE:
            self.be_patient(worker_id, incarnation)
            return None
        late = (
            f"has not started within {waited:.0f} s"
            if waited >= 1.0
            else "cannot start now (Ray failed to start the last one)"
        )
        return Shortfall(
            worker_id,
            incarnation,
            f"Ray worker {worker_id}'s actor {late} (it asks ray_num_cpus={cpus:g} CPUs; "
            f"{free:g} free of {total:g} in the cluster)",
        )

    def ended(self, worker_id: int, incarnation: int) -> None:
        """The actor's start ended, either way: it is not looked at again."""
        self.starting.pop((worker_id, incarnation), None)

    def succeeded(self, worker_id: int) -> None:
        self.failed.pop(worker_id, None)

    def failed_once(self, worker_id: int) -> None:
        self.failed[worker_id] = self.failed.get(worker_id, 0) + 1

    def failed_in_a_row(self, worker_id: int) -> int:
        """How many of `worker_id`'s starts in a row Ray failed, this one included."""
        return self.failed.get(worker_id, 1)
