"""The sharing stage: one production of an epoch, handed out to the consumers that share it.

A consumer is one stream: a trainer's `RemoteLoader` iterating an epoch. Consumers that name the
same job, epoch, seed, sharing mode and world size share a Run: one thread that feeds the
loader's worker pool and puts the results in order, once for all of them.

- partition: rank r of w gets its own lane, the tasks of its share (server/sampling.py). The
  lanes take turns at the pool, so a fast rank cannot starve a slow one, and each lane buffers
  at most a window of batches, so a slow rank cannot stall a fast one either.
- broadcast: one lane; every consumer reads every batch, each at its own cursor. A batch is
  retired once every consumer has sent it, and the lane holds at most `broadcast_window`
  batches, so the fastest consumer is at most that far ahead of the slowest.
- dynamic: one lane; each batch goes to whichever consumer asks first.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

from remote_loader.protos import wire
from remote_loader.server.errors import (
    ClosingError,
    DetachedError,
    LoaderBrokenError,
    SharingError,
)
from remote_loader.server.metrics import ConsumerRow, LoaderMetrics
from remote_loader.server.pool import (
    POLL_INTERVAL,
    Delivery,
    Outcome,
    WorkerDiedError,
    WorkerInitError,
)
from remote_loader.server.reorder import Reorderer
from remote_loader.server.sampling import EpochPlan, batch_seed
from remote_loader.server.spec import SHARING_MODES, LoaderSpec
from remote_loader.server.worker import RemoteError

log = logging.getLogger(__name__)

DEFAULT_JOB = "default"
# Ranks in one job. DistributedSampler pads every rank's share to world_size * ceil(n /
# world_size) indices: a request naming 2**32 - 1 ranks would build billions of them.
MAX_WORLD_SIZE = 1 << 20
# The most a stream's handler waits for the Run it ended to give its engine back (a
# non-persistent pool joins its workers, NOTE [ Pool Shutdown ]); the Run finishes on its own.
RUN_JOIN_TIMEOUT = 60.0
# A partition or dynamic lane keeps at most this many batches made and not yet sent, unless
# the pool keeps more in flight (prefetch_factor * num_workers), which then is the bound.
MIN_LANE_WINDOW = 2

# NOTE [ Sharing ]
#
# Locks: `Runs._lock` (the registry) is taken before any `Run.cond`, never after. Everything
# about one Run (its lanes, entries and consumers) is guarded by its `cond`; the Run's thread
# is the only one that talks to the engine (worker pool or in-process loader), and it calls
# `engine.poll` without holding `cond`.
#
# Lifetime: a Run is created by the first consumer that finds no Run to join and ends when its
# last consumer detaches (end of its stream, a client that went away, or a stalled broadcast
# consumer detached after `detach_timeout`). Ending it joins its thread, which gives the engine
# back (see NOTE [ Pool Shutdown ] in server/pool.py) before the last consumer's end frame is
# sent, so the next epoch of the same trainer finds the persistent pool free. The join is the
# stream handler's (Consumer.close, at most RUN_JOIN_TIMEOUT), never gRPC's cancellation
# callback's: that one only queues the consumer (Consumer.let_go) for the loader's reaper
# thread, which detaches it without waiting. The callback runs on the thread that serves every
# other call: a join there stalled health checks for seconds, and so did waiting for
# `Runs._lock` while another stream planned its epoch under it. The queue holds at most one
# entry per stream (a consumer is let go once), so the server's stream limit bounds it.
#
# Who joins what: a partition rank joins the newest Run of its key whose lane for that rank
# nobody has claimed yet, its lane beginning at the consumer's start; a broadcast consumer joins
# the newest Run that still holds the batch at its start (nothing before it retired) and, with
# world_size > 1, whose consumers do not already include its rank; a dynamic consumer joins the
# newest Run that still has batches to give. Otherwise a new Run starts, at that start: a
# consumer always receives the rest of its epoch from its start (or, dynamic, what is left of
# one), and two Runs of the same key only mean some batches were made twice.


class LeaseAbandoned(Exception):
    """The Run that waited for an engine closed meanwhile: it needs none any more."""


@dataclasses.dataclass(frozen=True)
class Membership:
    """How one consumer takes part: sharing mode, job, rank and world size."""

    sharing: str = "partition"
    job: str = DEFAULT_JOB
    rank: int = 0
    world_size: int = 1

    def check(self, spec: LoaderSpec, is_iterable: bool) -> None:
        """Raises SharingError, saying what is allowed, for a membership the loader refuses."""
        if self.sharing not in SHARING_MODES:
            raise SharingError(
                f"unknown sharing mode {self.sharing!r}; the modes are {', '.join(SHARING_MODES)}"
            )
        if self.sharing not in spec.sharing:
            raise SharingError(
                f"loader {spec.name!r} does not allow sharing={self.sharing!r}; it allows "
                f"{', '.join(spec.sharing)} (the server's `sharing` option)"
            )
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise SharingError(
                f"world_size must be between 1 and {MAX_WORLD_SIZE}, got {self.world_size}"
            )
        if not 0 <= self.rank < self.world_size:
            raise SharingError(
                f"rank {self.rank} is out of range for world_size {self.world_size}: "
                f"it must be in [0, {self.world_size - 1}]"
            )
        if self.sharing == "partition" and self.world_size > 1 and is_iterable:
            raise SharingError(
                f"loader {spec.name!r} serves an IterableDataset, which the server cannot split "
                "between ranks; use sharing='dynamic' (or 'broadcast'), or world_size=1 with a "
                "dataset that shards itself"
            )


class Engine(Protocol):
    """What a Run drives: the loader's worker pool, or in-process loading (num_workers=0)."""

    max_outstanding: int
    broken: bool

    @property
    def outstanding(self) -> int: ...

    def begin_epoch(self, base_seed: int) -> None: ...
    def submit(self, task_id: int, indices: Any, seed: int | None = None) -> bool: ...
    def poll(self, timeout: float = ...) -> Outcome | None: ...
    def end_epoch(self) -> None: ...


class Entry:
    """A batch (or the error at its place) made by a Run, waiting to be sent."""

    def __init__(self, position: int, delivery: Delivery) -> None:
        self.position = position
        self.delivery = delivery
        self.made_at = time.monotonic()
        # The encoded batch's size (0 for an error), kept: the blob goes once released.
        self.nbytes = len(delivery.blob) if delivery.blob is not None else 0
        self._released = False
        self._frames: list[bytes] | None = None
        self._blob: bytes | None = None
        self._lock = threading.Lock()

    @property
    def error(self) -> RemoteError | None:
        return self.delivery.error

    def frames(self, batch: int, chunk_size: int) -> list[bytes]:
        """The batch as Frames numbered `batch`, built once and kept for every consumer.

        Used by broadcast, where every consumer sends the same entry as the same batch number:
        the copy out of shared memory happens once, and the worker's slot goes back at once.
        """
        with self._lock:
            if self._frames is None:
                blob = self._blob if self._blob is not None else self.delivery.blob
                assert blob is not None
                self._frames = list(
                    wire.batch_frames(
                        batch, memoryview(blob), self.delivery.header_nbytes, chunk_size
                    )
                )
                self._release_locked()
            return self._frames

    def blob(self) -> memoryview:
        """The encoded batch, copied out of the worker's slot once and kept for every consumer.

        Used by broadcast consumers on shared memory (which copy it into their own rings): the
        worker's slot goes back at once, as with `frames()`.
        """
        with self._lock:
            if self._blob is None:
                if not self._released:
                    assert self.delivery.blob is not None
                    self._blob = bytes(self.delivery.blob)
                    self._release_locked()
                else:  # frames() came first and gave the slot back: the bytes are in them
                    assert self._frames is not None
                    self._blob = b"".join(wire.parse_frame(f)[1] for f in self._frames)
            return memoryview(self._blob)

    def release(self) -> None:
        """Hands the worker's slot back; idempotent."""
        with self._lock:
            self._release_locked()

    def _release_locked(self) -> None:
        if not self._released:
            self._released = True
            self.delivery.release()


class _Lane:
    """One sequence of tasks and, in its order, the entries made from them.

    A lane starts at position `start` (a resumed consumer): for a map-style dataset the tasks
    before it are skipped without being run; an IterableDataset cannot skip, so its batches
    before `start` are made and dropped.
    """

    def __init__(self, in_order: bool, window: int) -> None:
        self.in_order = in_order
        self.tasks: Iterator[Any] | None = None  # None: not begun
        self.rank = 0  # partition: the rank whose share this lane makes
        self.window = window
        self.reorder: Reorderer[Delivery | None] = Reorderer(in_order=in_order)
        self.issued = 0  # lane-local task ids handed out
        self.outstanding = 0  # submitted, not yet back
        self.produced = 0  # positions made
        self.drop_before = 0  # positions made only to be dropped (IterableDataset resumed)
        self.tasks_done = True
        self.abandoned = False  # a partition rank left mid-epoch: make nothing more for it

    def begin(self, tasks: Iterator[Any], start: int, iterable: bool) -> None:
        if iterable:
            self.drop_before = start
        else:
            tasks = itertools.islice(tasks, start, None)
            self.issued = self.produced = start
            self.reorder = Reorderer(start, in_order=self.in_order)
        self.tasks = tasks
        self.tasks_done = False

    @property
    def complete(self) -> bool:
        """Nothing more will be made."""
        return self.tasks_done and self.outstanding == 0

    def backlog(self) -> int:
        raise NotImplementedError

    def wants_task(self) -> bool:
        return not self.tasks_done and not self.abandoned and self.backlog() < self.window

    def add(self, delivery: Delivery) -> None:
        raise NotImplementedError

    def drop_all(self) -> None:
        raise NotImplementedError


class _QueueLane(_Lane):
    """partition and dynamic: entries wait in order; each is taken by exactly one consumer."""

    def __init__(self, in_order: bool, window: int) -> None:
        super().__init__(in_order, window)
        self.pending: collections.deque[Entry] = collections.deque()
        self.taken = 0  # entries taken and not yet done with

    def backlog(self) -> int:
        return self.outstanding + len(self.pending) + self.taken

    def add(self, delivery: Delivery) -> None:
        entry = Entry(self.produced, delivery)
        self.produced += 1
        if self.abandoned or entry.position < self.drop_before:
            entry.release()
        else:
            self.pending.append(entry)

    def drop_all(self) -> None:
        while self.pending:
            self.pending.popleft().release()

    @property
    def drained(self) -> bool:
        return self.complete and not self.pending


class _BroadcastLane(_Lane):
    """broadcast: entries stay until every consumer has sent them (and the window needs room)."""

    def __init__(self, in_order: bool, window: int) -> None:
        super().__init__(in_order, window)
        self.entries: collections.deque[Entry] = collections.deque()
        self.base = 0  # position of entries[0]; > start once anything was retired

    def begin(self, tasks: Iterator[Any], start: int, iterable: bool) -> None:
        super().begin(tasks, start, iterable)
        self.base = start

    def backlog(self) -> int:
        return self.outstanding + len(self.entries)

    def add(self, delivery: Delivery) -> None:
        entry = Entry(self.produced, delivery)
        self.produced += 1
        if entry.position < self.drop_before:
            entry.release()
            self.base = self.produced
        else:
            self.entries.append(entry)

    def entry(self, position: int) -> Entry:
        return self.entries[position - self.base]

    def retire_before(self, position: int) -> None:
        while self.entries and self.base < position:
            self.entries.popleft().release()
            self.base += 1

    def drop_all(self) -> None:
        self.retire_before(self.produced)


class Consumer:
    """One stream's handle on its Run: `next()` an entry, send it, `done()` with it."""

    def __init__(self, run: Run, membership: Membership, lane: _Lane, start: int) -> None:
        self.run = run
        self.membership = membership
        self.lane = lane
        self.cursor = start  # broadcast: the lane position this consumer reads next
        self.moved_at = time.monotonic()
        self.closed = False
        self.detached: str | None = None  # why the Run let go of this consumer
        self._holding: list[Entry] = []
        self.metrics = run.metrics.stream(membership.job, membership.sharing, membership.rank)
        self._taken_at = 0.0  # when next() last returned an entry (send time, for metrics)
        # Runs._detach(consumer, join): `join` waits (bounded) for a Run this ends to end.
        self._on_close: Callable[[Consumer, bool], None] = lambda consumer, join: None

    def next(self, cancelled: threading.Event) -> Entry | None:
        """The next entry to send, or None at the end of this consumer's epoch (or once
        `cancelled` is set). Raises DetachedError if the Run let go of this consumer."""
        run = self.run
        peers_since: float | None = None  # dynamic: since when only peers' batches were left
        asked = time.monotonic()
        with run.cond:
            while True:
                if run.fatal is not None:
                    e = run.fatal
                    raise LoaderBrokenError(
                        f"loader {run.spec.name!r} cannot make batches: {e.type} {e.where}: "
                        f"{e.message}\nOriginal {e.traceback.rstrip()}"
                    )
                if self.detached is not None:
                    raise (ClosingError if run.closed_by_server else DetachedError)(self.detached)
                if self.closed or cancelled.is_set():
                    return None
                lane = self.lane
                if isinstance(lane, _BroadcastLane):
                    if self.cursor < lane.produced:
                        return self._took(lane.entry(self.cursor), asked)
                    if lane.complete:
                        return None
                else:
                    assert isinstance(lane, _QueueLane)
                    if lane.pending:
                        entry = lane.pending.popleft()
                        lane.taken += 1
                        self._holding.append(entry)
                        return self._took(entry, asked)
                    # dynamic: not while another consumer still holds batches, which come back
                    # here if it goes away before it has sent them; a peer that holds one
                    # longer than detach_timeout does not keep this stream open.
                    if lane.complete:
                        now = time.monotonic()
                        if peers_since is None:
                            peers_since = now
                        if lane.taken == 0 or now - peers_since >= run.spec.detach_timeout:
                            return None
                run.cond.wait(POLL_INTERVAL)

    def _took(self, entry: Entry, asked: float) -> Entry:
        self._taken_at = time.monotonic()
        self.metrics.took(self._taken_at - asked, self._taken_at - entry.made_at)
        return entry

    def done(self, entry: Entry) -> None:
        """This consumer has sent `entry` (or given up sending it)."""
        run = self.run
        self.metrics.sending(time.monotonic() - self._taken_at)
        with run.cond:
            self.moved_at = time.monotonic()
            if isinstance(self.lane, _BroadcastLane):
                if entry.position == self.cursor:
                    self.cursor += 1
            elif entry in self._holding:
                self._holding.remove(entry)
                assert isinstance(self.lane, _QueueLane)
                self.lane.taken -= 1
                entry.release()
            run.cond.notify_all()

    def sent(self, entry: Entry) -> None:
        """`entry` reached the client (for metrics: batches, bytes or errors served)."""
        self.metrics.sent(entry.nbytes, entry.error is not None)

    def close(self) -> None:
        """Detaches from the Run (idempotent); the last consumer out ends it, and this waits,
        at most RUN_JOIN_TIMEOUT, for the Run's thread to give its engine back."""
        self._on_close(self, True)

    def let_go(self) -> None:
        """Queues this consumer for its loader's reaper, which detaches it: for gRPC's
        cancellation callback, which runs on the thread that serves every call and so must
        not wait, not even for a lock. The stream's own `close()` in its handler does the
        waiting."""
        self._on_close(self, False)


@dataclasses.dataclass(frozen=True)
class RunKey:
    sharing: str
    job: str
    seed: int
    epoch: int
    world_size: int


class Run:
    """One epoch of one loader, produced once for the consumers that share it."""

    def __init__(
        self,
        key: RunKey,
        spec: LoaderSpec,
        plan: EpochPlan,
        lease: Callable[[Callable[[], bool]], AbstractContextManager[Engine]],
        *,
        iterable: bool,
        start: int = 0,
        metrics: LoaderMetrics | None = None,
    ) -> None:
        self.key = key
        self.spec = spec
        self.metrics = metrics if metrics is not None else LoaderMetrics(spec.name)
        self.plan = plan
        self._lease = lease
        self._iterable = iterable
        self.cond = threading.Condition()
        self.consumers: list[Consumer] = []
        self.ranks_joined: set[int] = set()
        self.closing = False
        self.closed_by_server = False
        self.fatal: RemoteError | None = None  # no batch can be made: every stream fails
        self.started_at = time.monotonic()
        self._task_ids = itertools.count()
        # task id -> (lane, lane-local id, when it was submitted)
        self._tasks: dict[int, tuple[_Lane, int, float]] = {}
        self._turn = 0  # the lane whose turn it is to submit next
        # A queue lane's window; set again once the engine (and its max_outstanding) is known.
        self._window = MIN_LANE_WINDOW
        in_order = spec.in_order
        # A partition lane is made when its rank claims it (a job of 2**20 ranks costs what its
        # joined ranks cost); the other modes' lane begins now, at the first consumer's start
        # (dynamic consumers never skip: their positions are their own).
        self.lanes: list[_Lane] = []
        if key.sharing == "broadcast":
            self.lanes.append(_BroadcastLane(in_order, spec.broadcast_window))
            self.lanes[0].begin(plan.lane(0), start, iterable)
        elif key.sharing == "dynamic":
            self.lanes.append(_QueueLane(in_order, self._window))
            self.lanes[0].begin(plan.lane(0), 0, iterable)
        # broadcast with a known group: nothing is retired until all of it has joined (or
        # detach_timeout has passed), so consumers that start a little apart still share.
        self._holding_for_group = key.sharing == "broadcast" and key.world_size > 1
        self._thread = threading.Thread(
            target=self._produce,
            name=f"rl-run-{spec.name}-{key.epoch}-{key.sharing}",
            daemon=True,
        )

    def __repr__(self) -> str:
        k = self.key
        return (
            f"<Run {self.spec.name!r} job={k.job!r} epoch={k.epoch} {k.sharing} "
            f"world_size={k.world_size} consumers={len(self.consumers)}>"
        )

    # --- consumers (called with Runs._lock held) --------------------------------------------

    def try_attach(self, membership: Membership, start: int = 0) -> Consumer | None:
        """A Consumer on this Run from position `start`, or None if it cannot join this Run
        (see NOTE [ Sharing ])."""
        with self.cond:
            if self.closing:
                return None
            mode = self.key.sharing
            lane: _Lane
            if mode == "partition":
                if membership.rank in self.ranks_joined:
                    return None  # that rank's share is already taken: a new Run makes it again
                lane = _QueueLane(self.spec.in_order, self._window)
                lane.rank = membership.rank
                lane.begin(self.plan.lane(membership.rank), start, self._iterable)
                self.lanes.append(lane)
            elif mode == "broadcast":
                lane = self.lanes[0]
                assert isinstance(lane, _BroadcastLane)
                if start < lane.base:
                    return None  # its next batch is gone; this consumer gets a Run of its own
                if self.key.world_size > 1 and any(
                    c.membership.rank == membership.rank for c in self.consumers
                ):
                    return None  # that rank is here already
            else:
                lane = self.lanes[0]
                assert isinstance(lane, _QueueLane)
                if lane.drained:
                    return None
            consumer = Consumer(self, membership, lane, start)
            self.consumers.append(consumer)
            self.ranks_joined.add(membership.rank)
            self.cond.notify_all()
            return consumer

    def detach(self, consumer: Consumer) -> bool:
        """Lets go of `consumer`; True when it was the last one and the Run is now closing."""
        with self.cond:
            if consumer.closed:
                return False
            consumer.closed = True
            if consumer in self.consumers:
                self.consumers.remove(consumer)
            self._let_go(consumer)
            if not self.consumers:
                self.closing = True
            self.cond.notify_all()
            return self.closing

    def _let_go(self, consumer: Consumer) -> None:
        lane = consumer.lane
        if isinstance(lane, _QueueLane):
            held, consumer._holding = consumer._holding, []
            if self.key.sharing == "dynamic":
                # Batches it took but did not finish sending go to the next consumer that asks,
                # first, so none is lost and the order stays as close as it can.
                for entry in reversed(held):
                    lane.pending.appendleft(entry)
                lane.taken -= len(held)
            elif not lane.complete or lane.pending or held:
                # A rank left before the end of its share: make nothing more for it and hand
                # every slot back, including one its stream may still be copying from when this
                # runs on gRPC's cancellation callback: that client is gone, nobody reads it.
                lane.abandoned = True
                lane.drop_all()
                for entry in held:
                    entry.release()
                lane.taken -= len(held)

    def wait_closed(self, timeout: float | None = None) -> bool:
        """Waits until the Run's thread has given its engine back, then drops what is left;
        False if the thread is still running after `timeout`."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        with self.cond:
            if self.closing:
                for lane in self.lanes:
                    lane.drop_all()
        return not self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    # --- production (the Run's thread) ------------------------------------------------------

    def _produce(self) -> None:
        engine: Engine | None = None
        try:
            # The lease may wait for the job's persistent workers; it gives up once this Run
            # closes, so the last consumer's detach (on gRPC's callback thread) is not held.
            with self._lease(lambda: self.closing) as engine:
                with self.cond:
                    self._window = max(MIN_LANE_WINDOW, engine.max_outstanding)
                    for lane in self.lanes:
                        if not isinstance(lane, _BroadcastLane):
                            lane.window = self._window
                engine.begin_epoch(self.plan.base_seed)
                try:
                    while self._step(engine):
                        pass
                except (WorkerDiedError, WorkerInitError):
                    engine.broken = True  # the pool is replaced, not reused with a hole
                    raise
                finally:
                    engine.end_epoch()
        except LeaseAbandoned:
            pass
        except WorkerInitError as exc:
            with self.cond:
                self.fatal = exc.error
                self.cond.notify_all()
        except Exception as exc:
            if isinstance(exc, WorkerDiedError):
                where = "in the server's worker pool"
            else:
                log.exception("%r failed", self)
                where = "in the server process"
            self._fail(RemoteError.capture(where, exc))
        finally:
            with self.cond:
                if self.closing:
                    for lane in self.lanes:
                        lane.drop_all()
                self.cond.notify_all()

    def _step(self, engine: Engine) -> bool:
        """One round: submit what the lanes want, then wait for one outcome. False: stop."""
        with self.cond:
            if self.closing:
                return False
            self._check_group()
            self._submit(engine)
            if engine.outstanding == 0:
                if all(lane.complete for lane in self.lanes) and (
                    self.key.sharing != "partition" or len(self.lanes) == self.key.world_size
                ):
                    self.cond.notify_all()
                    return False  # everything is made; the entries stay until sent
                self.cond.wait(POLL_INTERVAL)
                return True
        outcome = engine.poll(POLL_INTERVAL)
        if outcome is not None:
            with self.cond:
                lane, local_id, submitted_at = self._tasks.pop(outcome.task_id)
                lane.outstanding -= 1
                if outcome.delivery is not None:
                    outcome.delivery.submitted_at = submitted_at
                    outcome.delivery.received_at = time.monotonic()
                lane.reorder.put(local_id, outcome.delivery)
                for delivery in lane.reorder.ready():
                    if delivery is not None:  # None: that worker's IterableDataset ran dry
                        lane.add(delivery)
                        self.metrics.batch_ready(
                            delivery.submitted_at, delivery.received_at, time.monotonic()
                        )
                self.cond.notify_all()
        return True

    def _submit(self, engine: Engine) -> None:
        """Submits tasks while the engine has room, the lanes taking turns (fairness)."""
        n = len(self.lanes)
        while engine.outstanding < engine.max_outstanding:
            for i in range(n):
                lane = self.lanes[(self._turn + i) % n]
                if isinstance(lane, _BroadcastLane) and lane.backlog() >= lane.window:
                    self._retire(lane)
                if lane.wants_task():
                    self._turn = (self._turn + i + 1) % n
                    break
            else:
                return
            assert lane.tasks is not None
            try:
                indices = next(lane.tasks)
            except StopIteration:
                lane.tasks_done = True
                continue
            task_id = next(self._task_ids)
            seed = None
            if self.spec.seeding == "per_batch":
                seed = batch_seed(self.key.seed, self.key.epoch, self._batch_index(lane))
            if not engine.submit(task_id, indices, seed):
                lane.tasks_done = True  # every worker's IterableDataset has run dry
                continue
            self._tasks[task_id] = (lane, lane.issued, time.monotonic())
            lane.issued += 1
            lane.outstanding += 1

    def _batch_index(self, lane: _Lane) -> int:
        """The index in the epoch of the lane's next task: rank r of w's k-th batch is batch
        k * w + r, so every batch of an epoch has its own index whatever the split."""
        if self.key.sharing != "partition":
            return lane.issued
        return lane.issued * self.key.world_size + lane.rank

    def _retire(self, lane: _BroadcastLane) -> None:
        """Retires the batches every consumer has sent, and detaches a consumer that has held
        the others for detach_timeout."""
        if self._holding_for_group or not self.consumers:
            return
        slowest = min(c.cursor for c in self.consumers)
        lane.retire_before(slowest)
        if lane.backlog() < lane.window:
            return
        fastest = max(c.cursor for c in self.consumers)
        if fastest == slowest or not lane.entries:
            return  # nobody is being held back
        now = time.monotonic()
        # A consumer is stalled from when the batch it needs was there to send (or from its
        # last batch, if later): time spent waiting for production is not its fault.
        available_at = lane.entries[0].made_at
        for c in list(self.consumers):
            stalled = now - max(c.moved_at, available_at)
            if c.cursor == slowest and stalled >= self.spec.detach_timeout:
                log.warning(
                    "%r: detaching consumer rank %d: it sent nothing for %.1f s while "
                    "others waited (detach_timeout)",
                    self,
                    c.membership.rank,
                    stalled,
                )
                c.detached = (
                    f"detached from the broadcast of loader {self.spec.name!r}: it sent no "
                    f"batch for {self.spec.detach_timeout:g} s (detach_timeout) while the "
                    f"other consumers waited; it was {fastest - slowest} batches behind"
                )
                self.consumers.remove(c)
        if self.consumers:
            lane.retire_before(min(c.cursor for c in self.consumers))

    def _check_group(self) -> None:
        if self._holding_for_group and (
            len(self.ranks_joined) >= self.key.world_size
            or time.monotonic() - self.started_at >= self.spec.detach_timeout
        ):
            self._holding_for_group = False

    def _fail(self, error: RemoteError) -> None:
        """The engine failed: each lane in use ends with the error at its next position."""
        with self.cond:
            for lane in self.lanes:
                lane.tasks_done = True
                lane.outstanding = 0
                if lane.tasks is not None and not lane.abandoned and not self.closing:
                    lane.add(Delivery(error=error))
            self._tasks.clear()
            self.cond.notify_all()


class Runs:
    """The Runs of one loader, by key: where a consumer attaches."""

    def __init__(
        self,
        spec: LoaderSpec,
        plan: Callable[[int, int, int], EpochPlan],
        lease: Callable[[str, Callable[[], bool]], AbstractContextManager[Engine]],
        *,
        iterable: bool,
        metrics: LoaderMetrics | None = None,
    ) -> None:
        self.spec = spec
        self.metrics = metrics if metrics is not None else LoaderMetrics(spec.name)
        self._iterable = iterable
        self._plan = plan  # (seed, epoch, world_size) -> EpochPlan
        self._lease = lease  # (job, gave up?) -> the engine for one Run
        self._lock = threading.Lock()
        self._runs: dict[RunKey, list[Run]] = {}
        # Consumers gRPC's cancellation callback let go; None stops the reaper (NOTE [ Sharing ]).
        self._let_go: queue.SimpleQueue[Consumer | None] = queue.SimpleQueue()
        self._reaper = threading.Thread(
            target=self._reap, name=f"rl-reaper-{spec.name}", daemon=True
        )
        self._reaper.start()

    def attach(self, membership: Membership, seed: int, epoch: int, start: int = 0) -> Consumer:
        """A consumer from position `start` of the Run it joins (see NOTE [ Sharing ]),
        started if new."""
        world_size = membership.world_size if membership.sharing != "dynamic" else 1
        key = RunKey(membership.sharing, membership.job, seed, epoch, world_size)
        with self._lock:
            for run in reversed(self._runs.get(key, [])):
                consumer = run.try_attach(membership, start)
                if consumer is not None:
                    break
            else:
                plan_world = world_size if membership.sharing == "partition" else 1
                run = Run(
                    key,
                    self.spec,
                    self._plan(seed, epoch, plan_world),
                    lambda give_up: self._lease(membership.job, give_up),
                    iterable=self._iterable,
                    start=start,
                    metrics=self.metrics,
                )
                consumer = run.try_attach(membership, start)
                assert consumer is not None
                self._runs.setdefault(key, []).append(run)
                run.start()
            consumer._on_close = self._detach
        return consumer

    def _detach(self, consumer: Consumer, join: bool) -> None:
        if not join:  # gRPC's cancellation callback: it must not wait for any lock
            self._let_go.put(consumer)
            return
        self._detach_now(consumer, join)

    def _reap(self) -> None:
        while (consumer := self._let_go.get()) is not None:
            try:
                self._detach_now(consumer, join=False)
            except Exception:  # the reaper must outlive any one consumer's cleanup
                log.exception("loader %r: letting go of a cancelled stream failed", self.spec.name)

    def _detach_now(self, consumer: Consumer, join: bool) -> None:
        run = consumer.run
        with self._lock:
            last = run.detach(consumer)
            if last:
                runs = self._runs.get(run.key, [])
                with contextlib.suppress(ValueError):
                    runs.remove(run)
                if not runs:
                    self._runs.pop(run.key, None)
        # The Run may have ended with this consumer's let_go() (a cancel): its close() waits.
        if join and (last or run.closing) and not run.wait_closed(RUN_JOIN_TIMEOUT):
            log.warning(
                "loader %r: a Run still gives its workers back after %g s; not waiting longer",
                self.spec.name,
                RUN_JOIN_TIMEOUT,
            )

    def active(self) -> list[Run]:
        with self._lock:
            return [run for runs in self._runs.values() for run in runs]

    def consumer_lags(self) -> list[ConsumerRow]:
        """Each attached consumer and how many batches it is behind (for metrics): broadcast,
        behind the job's fastest consumer; partition and dynamic, its lane's batches made and
        not yet sent (a dynamic job's consumers share one lane)."""
        rows: list[ConsumerRow] = []
        for run in self.active():
            with run.cond:
                fastest = max((c.cursor for c in run.consumers), default=0)
                for c in run.consumers:
                    lane = c.lane
                    if isinstance(lane, _QueueLane):
                        behind = len(lane.pending) + lane.taken
                    else:
                        behind = fastest - c.cursor
                    m = c.membership
                    rows.append((m.job, m.sharing, m.rank, behind))
        return rows

    def close(self) -> None:
        """Ends every Run (server shutdown): consumers see the end of their stream."""
        with self._lock:
            runs = [run for runs in self._runs.values() for run in runs]
            self._runs.clear()
        for run in runs:
            with run.cond:
                run.closing = run.closed_by_server = True
                for consumer in run.consumers:
                    consumer.detached = f"loader {self.spec.name!r} is shutting down mid-epoch"
                consumers = list(run.consumers)
                run.cond.notify_all()
            for consumer in consumers:
                run.detach(consumer)
        for run in runs:
            run.wait_closed(timeout=10.0)
        self._let_go.put(None)
        self._reaper.join(timeout=10.0)
