"""The Run: one production of an epoch, on its own thread, and the Consumers that read it.

The Run's thread is the only one that talks to the engine (worker pool or in-process loader);
consumers (stream handlers) take entries from its lanes under its `cond`. See NOTE [ Sharing ]
in server/sharing.py for who joins which Run and when it ends.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from remote_loader.server.engine import (
    POLL_INTERVAL,
    Delivery,
    Engine,
    WorkerDiedError,
    WorkerInitError,
)
from remote_loader.server.errors import (
    ClosingError,
    DetachedError,
    LoaderBrokenError,
)
from remote_loader.server.lanes import MIN_LANE_WINDOW, BroadcastLane, Entry, Lane, QueueLane
from remote_loader.server.membership import Membership
from remote_loader.server.metrics import LoaderMetrics
from remote_loader.server.sampling import EpochPlan, batch_seed
from remote_loader.server.spec import LoaderSpec
from remote_loader.server.worker import RemoteError

log = logging.getLogger(__name__)


class LeaseAbandoned(Exception):
    """The Run that waited for an engine closed meanwhile: it needs none any more."""


class Consumer:
    """One stream's handle on its Run: `next()` an entry, send it, `done()` with it."""

    def __init__(self, run: Run, membership: Membership, lane: Lane, start: int) -> None:
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
                if isinstance(lane, BroadcastLane):
                    if self.cursor < lane.produced:
                        return self._took(lane.entry(self.cursor), asked)
                    if lane.complete:
                        return None
                else:
                    assert isinstance(lane, QueueLane)
                    if lane.pending:
                        entry = lane.pending.popleft()
                        lane.taken += 1
                        self._holding.append(entry)
                        return self._took(entry, asked)
                    # dynamic: not while another consumer still holds batches, which come back
                    # here if it goes away before it has sent them; a peer that holds one
                    # longer than handback_timeout does not keep this stream open.
                    if lane.complete:
                        now = time.monotonic()
                        if peers_since is None:
                            peers_since = now
                        if lane.taken == 0 or now - peers_since >= _seconds(
                            run.spec.handback_timeout
                        ):
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
            if isinstance(self.lane, BroadcastLane):
                if entry.position == self.cursor:
                    self.cursor += 1
            elif entry in self._holding:
                self._holding.remove(entry)
                assert isinstance(self.lane, QueueLane)
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
        self._tasks: dict[int, tuple[Lane, int, float]] = {}
        self._turn = 0  # the lane whose turn it is to submit next
        # A queue lane's window; set again once the engine (and its max_outstanding) is known.
        self._window = MIN_LANE_WINDOW
        in_order = spec.in_order
        # A partition lane is made when its rank claims it (a job of 2**20 ranks costs what its
        # joined ranks cost); the other modes' lane begins now, at the first consumer's start
        # (dynamic consumers never skip: their positions are their own).
        self.lanes: list[Lane] = []
        if key.sharing == "broadcast":
            self.lanes.append(BroadcastLane(in_order, spec.broadcast_window))
            self.lanes[0].begin(plan.lane(0), start, iterable)
        elif key.sharing == "dynamic":
            self.lanes.append(QueueLane(in_order, self._window))
            self.lanes[0].begin(plan.lane(0), 0, iterable)
        # broadcast with a known group: nothing is retired until all of it has joined (or
        # group_timeout has passed), so consumers that start a little apart still share.
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
            lane: Lane
            if mode == "partition":
                if membership.rank in self.ranks_joined:
                    return None  # that rank's share is already taken: a new Run makes it again
                lane = QueueLane(self.spec.in_order, self._window)
                lane.rank = membership.rank
                lane.begin(self.plan.lane(membership.rank), start, self._iterable)
                self.lanes.append(lane)
            elif mode == "broadcast":
                lane = self.lanes[0]
                assert isinstance(lane, BroadcastLane)
                if start < lane.base:
                    return None  # its next batch is gone; this consumer gets a Run of its own
                if self.key.world_size > 1 and any(
                    c.membership.rank == membership.rank for c in self.consumers
                ):
                    return None  # that rank is here already
            else:
                lane = self.lanes[0]
                assert isinstance(lane, QueueLane)
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
        if isinstance(lane, QueueLane):
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
                        if not isinstance(lane, BroadcastLane):
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
                if isinstance(lane, BroadcastLane) and lane.backlog() >= lane.window:
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

    def _batch_index(self, lane: Lane) -> int:
        """The index in the epoch of the lane's next task: rank r of w's k-th batch is batch
        k * w + r, so every batch of an epoch has its own index whatever the split."""
        if self.key.sharing != "partition":
            return lane.issued
        return lane.issued * self.key.world_size + lane.rank

    def _retire(self, lane: BroadcastLane) -> None:
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
            or time.monotonic() - self.started_at >= _seconds(self.spec.group_timeout)
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


def _seconds(timeout: float | None) -> float:
    """A sharing wait of the spec: set by LoaderSpec (None only before __post_init__)."""
    assert timeout is not None
    return timeout
