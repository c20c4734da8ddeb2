"""The Ray pool's WorkerBackend (server/engine/backend.py): a loader's workers as Ray actors.

Driven by the pool core (server/engine/pool.py) like the local pool's worker processes, through
one bridge process (NOTE [ Ray bridge ] in server/engine/ray/bridge.py, run by
server/engine/ray/bridge_process.py), which owns the actors: dispatch, the task ledger,
supervision, the shortfall of a lost node (NOTE [ Capacity lost ] in server/engine/supervisor.py)
and autotuning are the core's. This module only turns the core's calls into the bridge's commands
(or a direct lane's messages) and the bridge's messages into Results, WorkerReady and Short; what
goes down a direct lane and comes up it, and the nodes that keep batches, are
server/engine/ray/direct.py's.

NOTE [ Ray data path ]

Every actor first tries to attach a direct lane to the server (NOTE [ Ray direct lane ] in
server/engine/ray/lane.py), so that its tasks and results bypass Ray's calls and object store:

- on the server's own host (same pid namespace), a SLOTS lane: the actor fills shared-memory
  slots of its own, which the server maps once and streams from (or a same-host trainer reads
  in place), exactly as a worker process's. That took the Ray pool from 0.14-0.18x to 0.96-1.08x
  the local pool on 2.4 and 9.6 MB image batches on one host (benchmarks/RESULTS.md);
- elsewhere (another host reaching the server's TCP listener, a container, another pid
  namespace), unless told not to (`ray_node_fetch = false`, or under TLS), a KEEP lane: the
  actor keeps each batch in a slot of its own and serves it from a data server on its node; the
  server names the batch there in the Frame (node, slot, generation, sizes), as it names slot
  positions for shared memory, and the trainer fetches the bytes from the node (NOTE [ Node data
  connection ] in protos/node.py). The server keeps what it decides by positions (sampling,
  order, sharing, exactly-once, resume); a batch's slot is the actor's again once its trainer
  has fetched it. A trainer that cannot reach the node gets that node's batches through the
  server, per batch, which then fetches them itself; an actor lost with batches no trainer has
  fetched has them made again by another (NOTE [ Node lost ] in server/batch/node_directory.py);
- elsewhere otherwise (`ray_node_fetch = false`, and always under TLS: the node connections are
  not encrypted), a COPY lane: each batch follows its Result on the lane and is received
  straight into a slot of the server's (one kernel copy on each side). Measured with a node in a
  PID namespace of its own on the same host: 0.72x and 0.53x the local pool on 2.4 and 9.6 MB
  batches, where Ray's object store gave 0.16x and 0.19x.

An actor that reaches neither listener (a firewall), or every actor of a server with
`ray_direct = false`, encodes each batch into a numpy array, which Ray puts in its node's object
store; the bridge reads it, over the network when the actor is elsewhere, and copies it into
one of its own slots.

Through the server (COPY lanes, the object store, a trainer that cannot reach a node), every
byte of a batch made on another host crosses the server host's link once inbound and once
outbound to the trainers: at scale its NIC, not the workers, bounds throughput. Fetched from
the nodes, only the Frames do (tens of bytes a batch). remote_loader_remote_batch_bytes counts
both paths' bytes, and `RemoteLoader.stats().node_bytes` a trainer's share fetched from nodes;
benchmarks/ray_hosts.py measures the server's interface.

NOTE [ Ray pool reuse ]

A Ray pool costs seconds to start (the bridge's process and its connection to the cluster,
actors placed and their datasets built: about 2 s a pool on the test machine), and a loader
without persistent_workers would pay that every epoch. So such a pool is kept after its Run
for the loader's next one (server/sharing/host.py, KEEP_IDLE_POOL: 30 s, one per loader), and its
actors begin each epoch as torch's new worker processes would: the bridge's Begin and a lane's
EpochStart carry `fresh`, and an actor takes a new copy of the loader's dataset (its pickle
again: NOTE [ One dataset per loader ] in server/worker/dataset.py) and runs worker_init_fn again
(server/engine/ray/actor.py), seeded for the epoch. Kept longer, an idle pool would hold its actors'
CPUs of the cluster while no epoch runs, and other loaders' pools could not be placed; past
KEEP_IDLE_POOL it is shut down, and the next epoch starts a new one.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
from collections.abc import Callable, Iterator

from remote_loader.server.batch.messages import EpochStart, Result, Task
from remote_loader.server.config.sampling import Batching
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.engine.backend import Event, Short, WorkerReady
from remote_loader.server.engine.options import PoolOptions
from remote_loader.server.engine.ray.bridge_process import BridgeProcess
from remote_loader.server.engine.ray.direct import Attached, DirectLanes, LaneClosed
from remote_loader.server.engine.ray.messages import (
    ActorStarted,
    BridgeConfig,
    Kill,
    Lost,
    Retire,
    Send,
    Shortfall,
    Spawn,
)
from remote_loader.server.engine.ray.starts import MAX_FAILED_STARTS
from remote_loader.server.engine.seam import WorkerDiedError, WorkerInitError
from remote_loader.server.worker.dataset import SharedDataset

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Actor:
    """What the server knows of one worker's actor: its incarnation, whether it has started
    (ActorStarted) and, once it died, why and what it was making. It may have a direct lane (`end`,
    server/engine/ray/direct.py); until it has started, the messages for it wait in `pending`
    (whether they go down a lane or to the bridge is known only then)."""

    incarnation: int
    ready: bool
    alive: bool = True
    making: int = -1
    death: str = ""
    end: Attached | None = None
    pending: list[EpochStart | Task] = dataclasses.field(default_factory=list)

    def died(self, reason: str, making: int) -> None:
        self.alive, self.death, self.making = False, reason, making
        if self.end is not None:
            self.end.close()
            self.end = None
        self.pending.clear()


class RayBackend:
    """Workers as Ray actors, one per worker id, replaced by a new actor (a new incarnation)
    when one dies. See NOTE [ Ray bridge ] and NOTE [ Ray data path ]."""

    def __init__(
        self,
        spec: LoaderSpec,
        batching: Batching,
        ctx: multiprocessing.context.BaseContext,
        options: PoolOptions,
        *,
        dataset: SharedDataset,
        record: Callable[[str, int], None] = lambda path, nbytes: None,
    ) -> None:
        self.spec = spec
        self.batching = batching
        self.address = options.ray_address
        self.max_batch_bytes = options.max_batch_bytes
        # What each actor starts from (NOTE [ One dataset per loader ]): the bridge puts it in
        # Ray's object store once.
        self.dataset = dataset
        self.nodes = 0  # nodes the actors were placed on at start
        self._ctx = ctx
        self._bridge: BridgeProcess | None = None
        self._next_incarnation = itertools.count()
        self._placed = 0  # actors the bridge placed at start: incarnations 0..placed-1
        # Direct lanes (the server's ray_direct setting); actors of other hosts keep their
        # batches for trainers to fetch (KEEP lanes, NOTE [ Node data connection ] in
        # protos/node.py) unless ray_node_fetch is off.
        self._direct = options.ray_direct
        self._node_fetch = options.ray_node_fetch
        self._record = record  # bytes of batches made elsewhere, by path ("server", "node")
        self._lanes: DirectLanes | None = None
        self._attached: tuple[bool, ...] = ()  # of the actors placed at start
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
        pid = None if self._bridge is None else self._bridge.pid
        return [] if pid is None else [pid]

    @property
    def kept_between_epochs(self) -> bool:
        return True  # NOTE [ Ray pool reuse ]

    def describe(self) -> dict[str, int | str]:
        # `direct`: the actors whose batches come on a lane (NOTE [ Ray direct lane ]).
        return {
            "backend": "ray",
            "nodes": self.nodes,
            "direct": self.direct,
            "copied": self.copied,
            "kept": self.kept,
            # NOTE [ Node lost ] in server/batch/node_directory.py: batches made again after their
            # actor was.
            "remade": 0 if self._lanes is None else self._lanes.remade,
            # The KEEP lanes' actors' slots, now and at most (NOTE [ Node data connection ]).
            "kept_bytes": 0 if self._lanes is None else self._lanes.kept_bytes(),
            "kept_peak": 0 if self._lanes is None else self._lanes.kept_peak,
        }

    @property
    def direct(self) -> int:
        """Actors whose batches come on a direct lane (NOTE [ Ray direct lane ])."""
        return sum(a.end is not None for a in self._actors)

    @property
    def kept(self) -> int:
        """... of them, those that keep their batches for trainers to fetch (KEEP)."""
        return sum(a.end is not None and a.end.lane.keep for a in self._actors)

    @property
    def copied(self) -> int:
        """... of them, those whose batches come on it as bytes (COPY)."""
        return sum(a.end is not None and a.end.copies is not None for a in self._actors)

    def start(self) -> None:
        """Starts the bridge, which connects and places actors 0..num_workers-1;
        WorkerInitError, naming ray_address, when that fails or takes longer than
        START_TIMEOUT (server/engine/ray/bridge_process.py)."""
        if self._direct:
            self._lanes = DirectLanes(self.address, self._node_fetch, self._record, self._live)
        lane = None if self._lanes is None else self._lanes.address
        self._bridge = BridgeProcess(self._ctx, self.spec.name, self.where)
        try:
            started = self._bridge.start(
                lambda commands, results: BridgeConfig(
                    self.spec,
                    self.batching,
                    self.max_batch_bytes,
                    self.dataset,
                    self.address,
                    lane,
                    commands,
                    results,
                )
            )
        except WorkerInitError:
            self.stop()
            raise
        self.nodes, self._attached = started.nodes, started.attached
        self._placed = len(started.attached)
        log.info(
            "loader %r: %d Ray actor(s) on %d node(s) of %s, %d on a direct lane",
            self.spec.name,
            self._placed,
            started.nodes,
            self.where,
            sum(started.attached),
        )

    def spawn(self, worker_id: int, num_workers: int) -> int:
        incarnation = next(self._next_incarnation)
        placed = incarnation < self._placed  # one of the actors the bridge placed at start
        if not placed:
            self._command(Spawn(worker_id, num_workers, incarnation))
        actor = _Actor(incarnation, ready=placed)
        if placed and self._attached[incarnation]:
            actor.end = self._take_lane(incarnation)
        if worker_id == self.workers:
            self._actors.append(actor)
        else:
            self._actors[worker_id] = actor
        return incarnation

    def _take_lane(self, incarnation: int) -> Attached | None:
        return None if self._lanes is None else self._lanes.take(incarnation)

    def _live(self) -> list[Attached]:
        """The lanes of the actors alive now (the directory's thread: a batch lost with its
        node is made again down one of them)."""
        return [a.end for a in list(self._actors) if a.alive and a.end is not None]

    def send(self, worker_id: int, message: EpochStart | Task) -> None:
        actor = self._actors[worker_id]
        if not actor.alive:
            return  # its replacement is sent its tasks again
        if not actor.ready and self._lanes is not None:
            actor.pending.append(message)  # lane or bridge: known once it has started
            return
        if actor.end is None or self._lanes is None:
            self._command(Send(worker_id, message))
            return
        try:
            self._lanes.send(actor.end, message)
        except LaneClosed:
            self._lane_closed(worker_id)

    def set_epoch(self, key: int) -> None:
        """Nothing: an actor makes what it was sent, and the core drops a stale epoch's."""

    def receive(self, timeout: float) -> Iterator[Event]:
        assert self._bridge is not None
        ends = {a.end.lane.conn: w for w, a in enumerate(self._actors) if a.end is not None}
        ready = multiprocessing.connection.wait([*self._bridge.waitables(), *ends], timeout)
        self._bridge.exited(ready)
        for conn, worker_id in ends.items():
            if conn in ready:
                yield from self._from_lane(worker_id)
        for message in self._bridge.messages(ready):
            event = self._event(message)
            if event is not None:
                yield event

    def _from_lane(self, worker_id: int) -> Iterator[Event]:
        """The Results waiting on an actor's lane; its death when the lane has closed."""
        end = self._actors[worker_id].end
        assert end is not None and self._lanes is not None
        try:
            yield from self._lanes.results(end)
        except LaneClosed as closed:
            if closed.stalled:
                # Stalled mid-batch (a stopped process, a partitioned node): it is stopped, so
                # that it does not hold its CPUs beside its replacement.
                self._command(Kill(worker_id))
            if self._actors[worker_id].end is end:
                self._lane_closed(worker_id, closed.why)

    def _lane_closed(self, worker_id: int, why: str = "") -> None:
        """An actor's lane closed (or stalled: `why`): it died, making the first task sent to
        it and not answered."""
        actor = self._actors[worker_id]
        making = -1 if actor.end is None else actor.end.making
        why = why or (
            "its lane to the server closed (its process ended: killed, out of memory, or "
            "exited in the dataset)"
        )
        actor.died(f"DataLoader worker {worker_id} (a Ray actor) died: {why}", making)

    def _event(self, message: object) -> Event | None:
        if isinstance(message, Result):
            current = self._current(message.worker_id, message.incarnation)
            return message if current else None  # else its task was re-issued
        if isinstance(message, Lost):
            if not self._current(message.worker_id, message.incarnation):
                return None
            if message.failed_starts >= MAX_FAILED_STARTS:
                raise WorkerDiedError(
                    f"{message.reason}; Ray failed to start Ray worker {message.worker_id}'s "
                    f"actor {message.failed_starts} times in a row, so the loader's pool cannot "
                    f"run on {self.where} (`ray status`, the nodes' logs); the next epoch starts "
                    "a new pool"
                )
            self._actors[message.worker_id].died(message.reason, message.making)
            return None
        if isinstance(message, ActorStarted):
            if not self._current(message.worker_id, message.incarnation):
                return None
            actor = self._actors[message.worker_id]
            actor.ready = True
            if message.attached:
                actor.end = self._take_lane(message.incarnation)
            pending, actor.pending = actor.pending, []
            for held in pending:
                self.send(message.worker_id, held)
            return WorkerReady(message.worker_id)
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
        self._command(Kill(worker_id))  # Ray kills it: a lane closes then
        # The task it was stuck on was given up: it dies making nothing of the ledger's.
        self._actors[worker_id].died(f"Ray worker {worker_id} was stopped", making=-1)

    def discard(self, worker_id: int) -> None:
        """Nothing to drop: the bridge drops a replaced actor's results and slots at the Spawn."""

    def retire_last(self) -> None:
        self._command(Retire())
        actor = self._actors.pop()
        if actor.end is not None:
            actor.end.close()

    def _command(self, message: object) -> None:
        assert self._bridge is not None
        self._bridge.command(message)

    def stop(self) -> None:
        """Stops the bridge; the actors it owns end with it (Ray ties an actor to its owner)."""
        if self._bridge is not None:
            self._bridge.stop()
        for actor in self._actors:
            if actor.end is not None:
                actor.end.close()
                actor.end = None
        if self._lanes is not None:
            self._lanes.close()
            self._lanes = None
