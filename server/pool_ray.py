"""The Ray pool's WorkerBackend (server/pool_backend.py): a loader's workers as Ray actors.

Driven by the pool core (server/pool.py) like the local pool's worker processes, through one
bridge process (NOTE [ Ray bridge ] in server/ray_bridge.py), which owns the actors: dispatch,
the task ledger, supervision, the shortfall of a lost node (NOTE [ Capacity lost ] in
server/pool_supervision.py) and autotuning are the core's. This module only turns the core's
calls into the bridge's commands and the bridge's messages into Results, Ready and Short.

NOTE [ Ray data path ]

A batch is encoded by its actor into a numpy array, which Ray puts in the object store of the
actor's node; the bridge (on the server's host) reads it, over the network when the actor is
elsewhere, and copies it into a shared-memory slot the server streams from. So every byte of
every batch crosses the server host's link once inbound and once outbound to the trainers:
at scale the coordinator's NIC, not the workers, bounds throughput (bytes per batch through the
coordinator = the encoded batch, `remote_loader_batch_bytes`). The next step is for trainers to
fetch a batch from the node that made it: the server would send only (node address, object
id, size) in the Frame, as it sends ring offsets for shared memory today, and a small data
server beside each Ray worker node (or Ray's own object transfer, with the trainer as a Ray
client) would serve the bytes; ordering, exactly-once and resume stay the coordinator's, since
they are decided by positions, never by the bytes.

NOTE [ Ray pool reuse ]

Not done yet, and why: keeping a non-persistent loader's pool (bridge and actors) between
epochs holds its actors' CPUs of the cluster while no epoch runs, and other loaders' pools
then cannot be placed (measured: tests/test_ray.py's loaders on a 2-CPU cluster). The way is
to keep the bridge and its connection but release the actors after a Run and place new ones
(capacity checked) at the next; Begin(fresh=True) already gives an actor torch's per-epoch
worker state (dataset rebuilt, worker_init_fn again) for when a pool is kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
from collections.abc import Iterator
from typing import Any

from remote_loader.server.engine import WorkerDiedError, WorkerInitError
from remote_loader.server.pool_backend import Event, Ready, Short
from remote_loader.server.ray_bridge import (
    ACTOR_START_TIMEOUT,
    BridgeConfig,
    Kill,
    Lost,
    Placed,
    Retire,
    Send,
    Shortfall,
    Spawn,
    Started,
    StartFailed,
    bridge_main,
)
from remote_loader.server.sampling import Batching
from remote_loader.server.spec import LoaderSpec
from remote_loader.server.worker import EpochStart, RemoteError, Result, Task

log = logging.getLogger(__name__)

# How long start() waits for the bridge to connect and place its actors: ray.init to an address
# nobody answers retries without end, and the actors' placement waits for free CPUs.
START_TIMEOUT = ACTOR_START_TIMEOUT + 30.0
# How long stop waits for the bridge (and, with it, the actors it owns) to go.
BRIDGE_JOIN_TIMEOUT = 10.0


@dataclasses.dataclass
class _Actor:
    """What the server knows of one worker's actor: its incarnation, whether it has started
    (Placed) and, once the bridge reported it Lost, why it died and what it was making."""

    incarnation: int
    ready: bool
    alive: bool = True
    making: int = -1
    death: str = ""

    def died(self, reason: str, making: int) -> None:
        self.alive, self.death, self.making = False, reason, making


class RayBackend:
    """Workers as Ray actors, one per worker id, replaced by a new actor (a new incarnation)
    when one dies. See NOTE [ Ray bridge ] and NOTE [ Ray data path ]."""

    def __init__(
        self,
        spec: LoaderSpec,
        batching: Batching,
        ctx: multiprocessing.context.BaseContext,
        *,
        address: str | None,
        max_batch_bytes: int,
    ) -> None:
        self.spec = spec
        self.batching = batching
        self.address = address
        self.max_batch_bytes = max_batch_bytes
        self.nodes = 0  # nodes the actors were placed on at start
        self._ctx = ctx
        self._bridge: multiprocessing.process.BaseProcess | None = None
        self._commands: Any = None
        self._results: multiprocessing.connection.Connection | None = None
        self._next_incarnation = itertools.count()
        self._placed = 0  # actors the bridge placed at start: incarnations 0..placed-1
        # Per worker id: what this side knows of its actor.
        self._actors: list[_Actor] = []

    @property
    def where(self) -> str:
        return f"the Ray cluster at {self.address}" if self.address else "a local Ray instance"

    @property
    def workers(self) -> int:
        return len(self._actors)

    @property
    def pids(self) -> list[int]:
        """The bridge's: the actors' processes are the cluster's."""
        return [] if self._bridge is None or self._bridge.pid is None else [self._bridge.pid]

    def describe(self) -> dict[str, int | str]:
        return {"backend": "ray", "nodes": self.nodes}

    def start(self) -> None:
        """Starts the bridge, which connects and places actors 0..num_workers-1;
        WorkerInitError, naming ray_address, when that fails or takes longer than
        START_TIMEOUT."""
        commands_reader, self._commands = self._ctx.Pipe(duplex=False)
        self._results, results_writer = self._ctx.Pipe(duplex=False)
        cfg = BridgeConfig(
            self.spec,
            self.batching,
            self.max_batch_bytes,
            self.address,
            commands_reader,
            results_writer,
        )
        self._bridge = bridge = self._ctx.Process(  # type: ignore[attr-defined]
            target=bridge_main, args=(cfg,), name=f"remote-loader-ray-{self.spec.name}"
        )
        bridge.start()
        commands_reader.close()
        results_writer.close()
        ready = multiprocessing.connection.wait([self._results, bridge.sentinel], START_TIMEOUT)
        problem = None
        if self._results in ready:
            try:
                message = self._results.recv()
            except (EOFError, OSError):
                message = StartFailed("its Ray driver process exited while connecting")
            if isinstance(message, Started):
                self.nodes, self._placed = message.nodes, message.actors
                log.info(
                    "loader %r: %d Ray actor(s) on %d node(s) of %s",
                    self.spec.name,
                    message.actors,
                    message.nodes,
                    self.where,
                )
                return
            problem = message.message if isinstance(message, StartFailed) else repr(message)
        elif not ready:
            problem = f"no answer within {START_TIMEOUT:g} s"
        else:
            problem = f"its Ray driver process exited (code {bridge.exitcode})"
        self.stop()
        raise WorkerInitError(
            RemoteError(
                where="starting the loader's Ray pool",
                type="RayUnavailable",
                message=(
                    f'loader {self.spec.name!r} (pool = "ray") cannot use {self.where}: '
                    f"{problem}. Check ray_address (REMOTE_LOADER_RAY_ADDRESS, serve "
                    "--ray-address) and that the cluster has ray_num_cpus free per worker"
                ),
                traceback="",
            )
        )

    def spawn(self, worker_id: int, num_workers: int) -> int:
        incarnation = next(self._next_incarnation)
        placed = incarnation < self._placed  # one of the actors the bridge placed at start
        if not placed:
            self._command(Spawn(worker_id, num_workers, incarnation))
        actor = _Actor(incarnation, ready=placed)
        if worker_id == self.workers:
            self._actors.append(actor)
        else:
            self._actors[worker_id] = actor
        return incarnation

    def send(self, worker_id: int, message: EpochStart | Task) -> None:
        self._command(Send(worker_id, message))

    def set_epoch(self, key: int) -> None:
        """Nothing: an actor makes what it was sent, and the core drops a stale epoch's."""

    def receive(self, timeout: float) -> Iterator[Event]:
        assert self._bridge is not None and self._results is not None
        ready = multiprocessing.connection.wait([self._results, self._bridge.sentinel], timeout)
        if self._results not in ready:
            if ready:  # the sentinel: the bridge is gone
                raise self._gone()
            return
        # One message at a time: one the core does not take (it returned an outcome) stays in
        # the pipe for its next poll.
        while self._results.poll():
            try:
                message = self._results.recv()
            except (EOFError, OSError) as exc:
                raise self._gone() from exc
            event = self._event(message)
            if event is not None:
                yield event

    def _event(self, message: object) -> Event | None:
        if isinstance(message, Result):
            current = self._current(message.worker_id, message.incarnation)
            return message if current else None  # else its task was re-issued
        if isinstance(message, Lost):
            if self._current(message.worker_id, message.incarnation):
                self._actors[message.worker_id].died(message.reason, message.making)
            return None
        if isinstance(message, Placed):
            if not self._current(message.worker_id, message.incarnation):
                return None
            self._actors[message.worker_id].ready = True
            return Ready(message.worker_id)
        if isinstance(message, Shortfall):
            if not self._current(message.worker_id, message.incarnation):
                return None
            return Short(message.worker_id, message.message)
        raise AssertionError(f"unexpected message from the Ray bridge: {message!r}")

    def _current(self, worker_id: int, incarnation: int) -> bool:
        return worker_id < self.workers and self._actors[worker_id].incarnation == incarnation

    def alive(self, worker_id: int) -> bool:
        return self._actors[worker_id].alive

    def ready(self, worker_id: int) -> bool:
        return self._actors[worker_id].ready

    def making(self, worker_id: int) -> int:
        return self._actors[worker_id].making

    def who(self, worker_id: int) -> str:
        return f"Ray worker {worker_id}"

    def death(self, worker_id: int) -> str:
        return self._actors[worker_id].death

    def kill(self, worker_id: int) -> None:
        self._command(Kill(worker_id))
        # The task it was stuck on was given up: it dies making nothing of the ledger's.
        self._actors[worker_id].died(f"Ray worker {worker_id} was stopped", making=-1)

    def discard(self, worker_id: int) -> None:
        """Nothing to drop: the bridge drops a replaced actor's results and slots at the Spawn."""

    def retire_last(self) -> None:
        self._command(Retire())
        self._actors.pop()

    def _command(self, message: object) -> None:
        try:
            self._commands.send(message)
        except (BrokenPipeError, OSError) as exc:
            raise self._gone() from exc

    def _gone(self) -> WorkerDiedError:
        code = None if self._bridge is None else self._bridge.exitcode
        return WorkerDiedError(
            f"the loader's Ray driver process exited (code {code}): {self.where} is unreachable "
            "or ended it (check ray_address and `ray status`); the pool is replaced for the "
            "next epoch"
        )

    def stop(self) -> None:
        """Stops the bridge; the actors it owns end with it (Ray ties an actor to its owner)."""
        if self._commands is not None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self._commands.send(None)
        if self._bridge is not None and self._bridge.pid is not None:
            self._bridge.join(BRIDGE_JOIN_TIMEOUT)
            if self._bridge.is_alive():
                self._bridge.kill()
                self._bridge.join(1.0)
        for end in (self._commands, self._results):
            if end is not None:
                end.close()
        self._commands = self._results = None
