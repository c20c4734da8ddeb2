"""The Run: one production of an epoch, on its own thread, for the Consumers that read it
(server/sharing/consumer.py).

The Run's thread is the only one that talks to the engine (worker pool or in-process loader);
consumers (stream handlers) take entries from its lanes under its `cond`. See NOTE [ Sharing ]
in server/sharing/runs.py for who joins which Run and when it ends.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from remote_loader.server.batch.delivery import Delivery
from remote_loader.server.config.sampling import EpochPlan, batch_seed
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.engine.seam import POLL_INTERVAL, Engine, WorkerDiedError, WorkerInitError
from remote_loader.server.errors import CapturedError
from remote_loader.server.sharing.consumer import Consumer
from remote_loader.server.sharing.elastic import Reshard
from remote_loader.server.sharing.lanes import MIN_LANE_WINDOW, Lane
from remote_loader.server.sharing.membership import Membership
from remote_loader.server.sharing.policies import policy_for
from remote_loader.server.sharing.policy import Policy, Seat
from remote_loader.server.telemetry.logfmt import logfmt
from remote_loader.server.telemetry.metrics import LoaderMetrics
from remote_loader.server.telemetry.series import ConsumerRow

log = logging.getLogger(__name__)

# NOTE [ Run states ]
#
# A Run moves one way through these states; `cond` guards every field named here.
#
#   waiting   its thread waits in `borrow` for an engine (a persistent pool busy with the job's
#             previous epoch). Consumers attach and wait in next().
#   producing the thread holds the engine: each step submits what the lanes want (they take
#             turns) and waits, without `cond`, for one outcome, which it puts back in order.
#   made      every task is back (`policy.complete()`): the thread has given the engine back and
#             ended; entries wait for their consumers.
#   failed    the engine broke: `fatal` (the workers cannot start: every next() raises) or one
#             error entry at each open lane's next position. The thread ends as in `made`.
#   closing   the last consumer detached, or the server is shutting down (`close(reason)`
#             sets `closed_by_server`). No consumer attaches, nothing more is submitted, the
#             thread leaves at its next step and gives the engine back (end_epoch).
#   closed    `wait_closed()` joined the thread; every entry left is dropped.
#
# Invariants:
# - Only the Run's thread calls the engine, and never while holding `cond` in `poll` (a
#   consumer must be able to take an entry while the engine waits).
# - `closing` never goes back to False; after it, `try_attach` returns None.
# - Every task submitted is in `_tasks` until its outcome comes back, and its lane's
#   `outstanding` counts it: sum(lane.outstanding) == len(_tasks). `_fail` clears both
#   together.
# - Every Delivery is released exactly once: when a consumer is done with it (queue lanes), when
#   every consumer has passed it (broadcast `retire_before`), when it is made for nobody (an
#   abandoned lane, a position before an IterableDataset's resume point) or when the Run closes
#   (`drop_all`). A worker's shared-memory slot is never held by a Run nobody reads.
# - A lane holds at most `window` batches in flight, made and not yet sent (`Lane.wants_task`),
#   so memory per Run is bounded by the windows of its lanes.
# - A consumer receives positions in order and each once: its lane's positions from its start
#   (partition, broadcast), or whatever is left of the shared lane (dynamic).


class BorrowAbandoned(Exception):
    """The Run that waited for an engine closed meanwhile: it needs none any more."""


@dataclasses.dataclass(frozen=True)
class RunKey:
    sharing: str
    job: str
    seed: int
    epoch: int
    world_size: int
    # An epoch finished by another world size than the one that began it
    # (server/sharing/elastic.py): its shares differ from an ordinary epoch's, so it is a Run of
    # its own.
    reshard: Reshard | None = None
    # What the workers compress the batches with ("": nothing; NOTE [ Compression ]): made
    # differently, so a Run of its own too.
    compression: str = ""


class Run:
    """One epoch of one loader, produced once for the consumers that share it (NOTE [ Run
    states ])."""

    def __init__(
        self,
        key: RunKey,
        spec: LoaderSpec,
        plan: EpochPlan,
        borrow: Callable[[Callable[[], bool]], AbstractContextManager[Engine]],
        *,
        iterable: bool,
        on_close: Callable[[Run, Consumer, bool], None],
        start: int = 0,
        metrics: LoaderMetrics | None = None,
    ) -> None:
        self.key = key
        self.spec = spec
        self.metrics = metrics if metrics is not None else LoaderMetrics(spec.name)
        self.plan = plan
        self._borrow = borrow
        # The registry's (Runs._detach): each Consumer's close and let_go, with this Run.
        self._on_close = on_close
        self.cond = threading.Condition()
        self.consumers: list[Consumer] = []
        self.closing = False
        self.closed_by_server = False
        self.fatal: CapturedError | None = None  # no batch can be made: every stream fails
        self._task_ids = itertools.count()
        # task id -> (lane, lane-local id, when it was submitted)
        self._tasks: dict[int, tuple[Lane, int, float]] = {}
        self._turn = 0  # the lane whose turn it is to submit next
        self._window = MIN_LANE_WINDOW  # a queue lane's, from the engine's max_outstanding
        # The lanes and who reads what; a queue lane's window is set again once the engine
        # (and its max_outstanding) is known.
        self.policy: Policy[Any] = policy_for(key.sharing)(
            key,
            spec,
            plan,
            iterable=iterable,
            start=start,
            window=MIN_LANE_WINDOW,
            detach=self._dismiss,
        )
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
            seat = self.policy.join(membership, start)
            if seat is None:
                return None
            consumer = Consumer(self, membership, seat, self._close_consumer)
            self.consumers.append(consumer)
            self.cond.notify_all()
            return consumer

    def _close_consumer(self, consumer: Consumer, join: bool) -> None:
        """`consumer` closes (Consumer.close, Consumer.let_go): the registry lets it go."""
        self._on_close(self, consumer, join)

    def detach(self, consumer: Consumer) -> bool:
        """Lets go of `consumer`; True when it was the last one and the Run is now closing."""
        with self.cond:
            if not consumer.mark_closed():
                return False
            if consumer in self.consumers:
                self.consumers.remove(consumer)
            self.policy.let_go(consumer.seat)
            if not self.consumers:
                self.closing = True
            self.cond.notify_all()
            return self.closing

    def close(self, reason: str) -> None:
        """Ends the Run for the server's reason (shutdown): every consumer's stream fails with
        `reason` (Closing), and the thread leaves at its next step (`wait_closed`)."""
        with self.cond:
            self.closing = self.closed_by_server = True
            consumers = list(self.consumers)
            for consumer in consumers:
                consumer.dismiss(reason)
            self.cond.notify_all()
        for consumer in consumers:
            self.detach(consumer)

    def lags(self) -> list[ConsumerRow]:
        """Each consumer served, how many batches it is behind and has ready (for metrics)."""
        with self.cond:
            return [
                ConsumerRow(
                    c.membership.job,
                    c.membership.sharing,
                    c.membership.rank,
                    self.policy.lag(c.seat),
                    self.policy.ready(c.seat),
                    self.key.epoch,
                    c.membership.world_size,
                )
                for c in self.consumers
            ]

    def _dismiss(self, seat: Seat, why: str) -> None:
        """The policy let go of the consumer in `seat` (with `cond` held): it is served no more,
        and its stream ends with `why` (Detached)."""
        for consumer in self.consumers:
            if consumer.seat is seat:
                consumer.dismiss(why)
                self.consumers.remove(consumer)
                return

    def wait_closed(self, timeout: float | None = None) -> bool:
        """Waits until the Run's thread has given its engine back, then drops what is left;
        False if the thread is still running after `timeout`."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        with self.cond:
            if self.closing:
                for lane in self.policy.lanes:
                    lane.drop_all()
        return not self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    # --- production (the Run's thread) ------------------------------------------------------

    def _produce(self) -> None:
        engine: Engine | None = None
        try:
            # Borrowing may wait for the job's persistent workers; it gives up once this Run
            # closes, so the last consumer's detach (on gRPC's callback thread) is not held.
            with self._borrow(lambda: self.closing) as engine:
                with self.cond:
                    self._window = max(MIN_LANE_WINDOW, engine.max_outstanding)
                    self.policy.set_window(self._window)
                try:
                    # Inside: a Ray pool whose bridge is gone fails here already.
                    engine.begin_epoch(
                        self.plan.base_seed,
                        self.key.compression,
                        epoch=self.plan.epoch,
                        shared_seed=self.plan.shared_seed,
                    )
                    while self._step(engine):
                        pass
                except (WorkerDiedError, WorkerInitError):
                    engine.broken = True  # the pool is replaced, not reused with a hole
                    raise
                finally:
                    engine.end_epoch()
        except BorrowAbandoned:
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
            self._fail(CapturedError.capture(where, exc))
        finally:
            with self.cond:
                if self.closing:
                    for lane in self.policy.lanes:
                        lane.drop_all()
                self.cond.notify_all()

    def _step(self, engine: Engine) -> bool:
        """One round: submit what the lanes want, then wait for one outcome. False: stop."""
        with self.cond:
            if self.closing:
                return False
            window = max(MIN_LANE_WINDOW, engine.max_outstanding)
            if window != self._window:  # the pool was resized (num_workers = "auto")
                self._window = window
                self.policy.set_window(window)
            self._submit(engine)
            if engine.outstanding == 0:
                if self.policy.complete():
                    self.cond.notify_all()
                    return False  # everything is made; the entries stay until sent
                self.cond.wait(POLL_INTERVAL)
                return True
        outcome = engine.poll(POLL_INTERVAL)
        failed: list[tuple[Lane, int, CapturedError]] = []
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
                        failed.extend(self._add(lane, delivery))
                        self.metrics.batch_ready(
                            delivery.submitted_at, delivery.received_at, time.monotonic()
                        )
                self.cond.notify_all()
        self._log_errors(failed)
        return True

    def _add(self, lane: Lane, delivery: Delivery) -> list[tuple[Lane, int, CapturedError]]:
        """With `cond` held: `delivery` takes `lane`'s next position; returns the error made
        there, if it is one, for `_log_errors` (after `cond` is let go)."""
        position = lane.produced
        lane.add(delivery)
        return [] if delivery.error is None else [(lane, position, delivery.error)]

    def _log_errors(self, failed: list[tuple[Lane, int, CapturedError]]) -> None:
        """Logs each error made at a batch's position: here, where it is made once, not in each
        stream that sends it (a broadcast error goes to every consumer)."""
        for lane, position, error in failed:
            lines = error.traceback.strip().splitlines() or [f"{error.type}: {error.message}"]
            rank = {"rank": lane.rank} if self.key.sharing == "partition" else {}
            log.warning(
                "dataset error %s",
                logfmt(
                    loader=self.spec.name,
                    job=self.key.job,
                    epoch=self.key.epoch,
                    sharing=self.key.sharing,
                    **rank,
                    batch=position,
                    where=error.where,
                    error=lines[-1],
                ),
            )

    def _submit(self, engine: Engine) -> None:
        """Submits tasks while the engine has room, the lanes taking turns (fairness)."""
        lanes = self.policy.lanes
        n = len(lanes)
        # has_room: in_order = false sends only to a worker with room (NOTE [ Dispatch ]); no
        # task is drawn until one has.
        while engine.outstanding < engine.max_outstanding and engine.has_room():
            for i in range(n):
                lane = lanes[(self._turn + i) % n]
                self.policy.make_room(lane)
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
            if self.spec.parts.batching.seeding == "per_batch":
                seed = batch_seed(self.key.seed, self.key.epoch, self.policy.batch_index(lane))
            if not engine.submit(task_id, indices, seed):
                lane.tasks_done = True  # every worker's IterableDataset has run dry
                continue
            self._tasks[task_id] = (lane, lane.issued, time.monotonic())
            lane.issued += 1
            lane.outstanding += 1

    def _fail(self, error: CapturedError) -> None:
        """The engine failed: each lane in use ends with the error at its next position."""
        failed = []
        with self.cond:
            for lane in self.policy.lanes:
                lane.tasks_done = True
                lane.outstanding = 0
                if lane.tasks is not None and not lane.abandoned and not self.closing:
                    failed.extend(self._add(lane, Delivery(error=error)))
            self._tasks.clear()
            self.cond.notify_all()
        self._log_errors(failed)
