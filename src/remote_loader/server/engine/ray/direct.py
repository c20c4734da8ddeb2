"""The server's end of the Ray pool's direct lanes: what goes down an attached actor's lane and
what comes up it (NOTE [ Ray direct lane ] in server/engine/ray/lane.py, NOTE [ Ray data path ] in
server/engine/ray/backend.py).

RayBackend (server/engine/ray/backend.py) owns the actors and the bridge; this module owns the
lanes' listener, the directory of the nodes that keep batches (server/batch/node_directory.py) and
the one lock the lanes are written under. Per lane it turns a Result into what the pool core takes:
a new slot of a same-host actor mapped here (SLOTS), a batch received into a slot of the server's
(COPY), or a batch left on its node with room for it here (KEEP). A lane that closes or stalls is
raised as LaneClosed, for the backend to count the actor dead.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch

from remote_loader.protos import node as node_protocol
from remote_loader.protos import slots as slot_protocol
from remote_loader.server.batch.messages import EpochStart, Result, Task
from remote_loader.server.batch.node_batch import NodeBatch
from remote_loader.server.batch.node_directory import NodeDirectory
from remote_loader.server.engine.ray.lane import (
    DirectLane,
    LaneAddress,
    Lanes,
    ProcFd,
    SlotSize,
    open_slot,
    recv_bytes_into,
    recv_message,
)
from remote_loader.server.engine.ray.node import Remake
from remote_loader.server.worker.collating import WorkerSlots


def lane_host(address: str | None) -> str | None:
    """This host's address as the cluster at `address` reaches it (the local end of a route to
    its head), for actors of other hosts to attach their lanes to; None for a local instance
    or "auto" (actors of this host only reach the Unix listener)."""
    if address is None or address == "auto":
        return None
    host, _, port = address.rpartition(":")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, int(port)))  # a UDP connect sends nothing: it picks a route
            local: str = probe.getsockname()[0]
            return local
    except (OSError, ValueError):
        return None


class LaneClosed(Exception):
    """An actor's lane closed (its process ended) or stalled mid-batch (`stalled`: a stopped
    process or a lost node, which the backend has Ray stop)."""

    def __init__(self, why: str = "", stalled: bool = False) -> None:
        super().__init__(why)
        self.why = why
        self.stalled = stalled


@dataclasses.dataclass
class Attached:
    """One actor's lane, seen from the server."""

    lane: DirectLane
    # A COPY lane's batches: slots this process receives them into (server/worker/collating.py).
    copies: WorkerSlots | None = None
    # Its tasks sent and not yet answered, in the order sent, with what each asks (epoch key,
    # indices, seed): the first is the one it was making when it died, and a KEEP lane's batch
    # may be made again (NOTE [ Node lost ] in server/batch/node_directory.py).
    unanswered: dict[int, tuple[int, Any, int | None]] = dataclasses.field(default_factory=dict)
    # A KEEP lane's: its data server's address, from its first Result, and the sizes of the
    # slots the actor keeps batches in there, by slot (its memory held for trainers).
    node: tuple[str, int] | None = None
    kept: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def making(self) -> int:
        return next(iter(self.unanswered), -1)

    def close(self) -> None:
        self.lane.conn.close()


class DirectLanes:
    """The lanes' listener (`address` goes to the bridge, which gives it to each actor), the
    node directory when actors elsewhere keep their batches (`node_fetch`), and the lanes' I/O.

    `live()` lists the lanes of the actors alive now: a batch lost with its node is made again
    down one of them. `record(path, nbytes)` counts the bytes of batches made elsewhere."""

    def __init__(
        self,
        address: str | None,
        node_fetch: bool,
        record: Callable[[str, int], None],
        live: Callable[[], Iterable[Attached]],
    ) -> None:
        self._lanes = Lanes(lane_host(address), keep=node_fetch)
        self._record = record
        self._live = live
        self._directory: NodeDirectory | None = None
        if node_fetch:
            key = node_protocol.node_key(self._lanes.address.secret)
            self._directory = NodeDirectory(key, record, self._remake)
        # The most bytes of slots the KEEP lanes' actors held at once (tests, describe()):
        # bounded by NOTE [ Node data connection ]'s rule, NAMED_AHEAD per stream and node.
        self.kept_peak = 0
        # Lanes are written by the pool's thread and, for a batch made again, by the
        # directory's (NOTE [ Node lost ] in server/batch/node_directory.py).
        self._sending = threading.Lock()

    @property
    def address(self) -> LaneAddress:
        return self._lanes.address

    @property
    def remade(self) -> int:
        """Batches made again after their actor was lost (NOTE [ Node lost ])."""
        return 0 if self._directory is None else self._directory.remade

    def take(self, incarnation: int) -> Attached | None:
        """The lane of actor `incarnation`, which said it attached (None: its hello never
        came, and it answers through the bridge)."""
        lane = self._lanes.take(incarnation)
        if lane is None:
            return None
        return Attached(lane, WorkerSlots(read_here=True) if lane.copy else None)

    def send(self, end: Attached, message: EpochStart | Task) -> None:
        """Sends `message` down `end`'s lane; LaneClosed if it has closed."""
        if isinstance(message, Task):
            end.unanswered[message.task_id] = (message.epoch_key, message.indices, message.seed)
            if end.copies is not None:  # the slots are this process's, not the actor's
                end.copies.release(message.released)
                message = dataclasses.replace(message, released=())
        try:
            with self._sending:
                end.lane.conn.send(message)
        except OSError as exc:
            raise LaneClosed() from exc

    def results(self, end: Attached) -> Iterator[Result]:
        """The Results waiting on `end`'s lane, each ready for the pool core; LaneClosed when
        the lane has closed or stalled mid-batch."""
        conn = end.lane.conn
        while not conn.closed and conn.poll():
            try:
                result = recv_message(conn)  # never waits on a stalled actor for good
                ref = result.new_buffer
                if isinstance(ref, ProcFd):  # a new slot of the actor's: mapped here once
                    result = dataclasses.replace(result, new_buffer=open_slot(ref))
                elif end.copies is not None and result.total_nbytes:
                    result = _copied(end.copies, conn, result)
                    self._record("server", result.total_nbytes)
                elif result.node is not None:
                    result = self._kept_on_node(end, result)
            except TimeoutError as exc:
                raise LaneClosed(f"{exc} (a stopped process or a lost node?)", True) from exc
            except (EOFError, OSError) as exc:
                raise LaneClosed() from exc
            end.unanswered.pop(result.task_id, None)
            yield result

    def _kept_on_node(self, end: Attached, result: Result) -> Result:
        """A KEEP lane's Result: its batch stays in the actor's slot; the pool gets room for it
        here (a buffer as large as each new slot) and its handle (NOTE [ Node data
        connection ] in protos/node.py)."""
        assert self._directory is not None and result.node is not None
        for slot in result.dropped:
            end.kept.pop(slot, None)
        if isinstance(result.new_buffer, SlotSize):
            # Shared from the start: the pool's slot table shares it (server/engine/slots.py), which
            # would move a private tensor's memory from under the views taken before.
            end.kept[result.slot] = size = result.new_buffer.size
            room = torch.empty(size, dtype=torch.uint8).share_memory_()
            result = dataclasses.replace(result, new_buffer=room)
            self.kept_peak = max(self.kept_peak, self.kept_bytes())
        host, port = result.node
        end.node = (host, port)
        if result.total_nbytes:
            kept = self._directory.kept(
                (host, port),
                result.slot,
                result.generation,
                result.offset,
                result.total_nbytes,
                result.header_nbytes,
                end.unanswered.get(result.task_id),
            )
            result = dataclasses.replace(result, node_batch=kept)
        return result

    def kept_bytes(self) -> int:
        """Bytes of the slots the live actors on KEEP lanes hold (their batches for trainers)."""
        return sum(sum(end.kept.values()) for end in list(self._live()))

    def _remake(self, batch: NodeBatch, remake_id: int) -> tuple[str, int] | None:
        """Sends `batch` to be made again by a live actor on a KEEP lane elsewhere than where it
        was lost (the directory's thread); that actor's node, or None when none can now."""
        if batch.task is None:
            return None
        epoch_key, indices, seed = batch.task
        for end in list(self._live()):
            if not end.lane.keep or end.node is None or end.node == batch.address:
                continue
            try:
                with self._sending:
                    end.lane.conn.send(Remake(remake_id, epoch_key, indices, seed))
            except OSError:
                continue  # closed meanwhile: the pool's thread finds it
            return end.node
        return None

    def close(self) -> None:
        self._lanes.close()
        if self._directory is not None:
            self._directory.close()


def _copied(slots: WorkerSlots, conn: Connection, result: Result) -> Result:
    """A COPY lane's batch, which follows its Result: received straight into a slot."""
    taken = slots.take(result.total_nbytes)
    try:
        blob = taken.blob(result.total_nbytes).numpy().data
        got = recv_bytes_into(conn, blob)
    except BaseException:
        slots.give_back(taken)
        raise
    if got != result.total_nbytes:
        slots.give_back(taken)
        raise OSError(f"a {got}-byte batch where its Result said {result.total_nbytes}")
    slots.written(taken)
    new_buffer, dropped = slots.announce(taken.slot)
    return dataclasses.replace(
        result,
        slot=taken.slot,
        offset=slot_protocol.SLOT_HEADER,
        new_buffer=new_buffer,
        dropped=dropped,
        generation=taken.generation,
    )
