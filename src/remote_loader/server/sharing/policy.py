"""The sharing policy seam: what a Run asks of the policy that divides its batches among its
consumers, and the Seat each consumer holds in it (NOTE [ Sharing ] in server/sharing/runs.py).

A policy owns a Run's lanes and decides, under the Run's `cond`, who may join, what a consumer
takes next, when its epoch is over and what happens to what it held when it goes. What it keeps
per consumer is its own: `join` gives each consumer a Seat, which the Run hands back with every
call about that consumer. The Run (server/sharing/run.py) drives production and knows no policy by
name: the modes' policies (server/sharing/policies.py) fill this seam, and a fourth mode would be
a class there and an entry in POLICIES, as tf.data service adds a sharding policy with a task
runner.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import ClassVar, Generic, Protocol, TypeVar

from remote_loader.server.config.sampling import EpochPlan
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.sharing.lanes import Entry, Lane, QueueLane
from remote_loader.server.sharing.membership import Membership


class Key(Protocol):
    """What a policy reads of its Run's key (server/sharing/run.py's RunKey)."""

    @property
    def job(self) -> str: ...

    @property
    def epoch(self) -> int: ...

    @property
    def world_size(self) -> int: ...


class Seat:
    """One consumer's place in its Run's policy: the lane it reads. Made by `Policy.join` and
    handed back with every call about that consumer; a policy's subclass adds what only that
    policy keeps per consumer."""

    def __init__(self, membership: Membership, lane: Lane) -> None:
        self.membership = membership
        self.lane = lane


S = TypeVar("S", bound=Seat)


class Policy(abc.ABC, Generic[S]):
    """One Run's sharing policy. Every method but the class-level ones runs under the Run's
    `cond`; `lanes` is what the Run's thread submits tasks for, taking turns.

    `detach(seat, why)`: the policy let go of a consumer that is still there (a stalled
    broadcast consumer): the Run stops serving it, and its stream ends with `why`."""

    name: ClassVar[str]
    # Several consumers send the same entry (as the same batch number): transports keep the
    # forms they build of it (server/transports/base.py) rather than build one per consumer.
    shares_entries: ClassVar[bool] = False
    # Each consumer's share of an epoch has a length known in advance (len(loader) works).
    fixed_length: ClassVar[bool] = True

    def __init__(
        self,
        key: Key,
        spec: LoaderSpec,
        plan: EpochPlan,
        *,
        iterable: bool,
        start: int,
        window: int,
        detach: Callable[[Seat, str], None],
    ) -> None:
        self.key = key
        self.spec = spec
        self._lane_tasks = plan.lane  # rank -> that rank's tasks
        self._indices = plan.indices  # rank -> its tasks' indices in the epoch, when not k*w+r
        self._iterable = iterable
        self._window = window
        self._detach = detach
        self.lanes: list[Lane] = []

    # --- which Run, which plan (no Run yet) ---------------------------------------------------

    @staticmethod
    def run_world_size(membership: Membership) -> int:
        """The world size in the key of the Runs `membership` may join."""
        return membership.world_size

    @staticmethod
    def plan_world_size(membership: Membership) -> int:
        """Into how many shares the epoch's plan is split (a lane per share)."""
        return 1

    @classmethod
    def refusal(cls, membership: Membership, spec: LoaderSpec, iterable: bool) -> str | None:
        """Why this policy cannot serve `membership` on such a loader; None if it can."""
        return None

    # --- consumers ----------------------------------------------------------------------------

    @abc.abstractmethod
    def join(self, membership: Membership, start: int) -> S | None:
        """The seat of a consumer starting at `start`, or None if it cannot join this Run (it
        then gets a Run of its own)."""

    def asking(self, seat: S) -> None:
        """The consumer asks for its next entry (Consumer.next): a wait for it begins."""
        return None

    @abc.abstractmethod
    def take(self, seat: S) -> Entry | None:
        """The consumer's next entry if one is ready; None to wait or end (see `finished`)."""

    @abc.abstractmethod
    def finished(self, seat: S) -> bool:
        """Nothing ready and nothing more will be for this consumer: its epoch is over."""

    @abc.abstractmethod
    def done(self, seat: S, entry: Entry) -> None:
        """The consumer has sent `entry` (or given up sending it)."""

    @abc.abstractmethod
    def let_go(self, seat: S) -> None:
        """The consumer left: settle what it held (its Run has already dropped it)."""

    @abc.abstractmethod
    def lag(self, seat: S) -> int:
        """How many batches the consumer is behind, for metrics."""

    @abc.abstractmethod
    def ready(self, seat: S) -> int:
        """How many batches are made and waiting for the consumer to take them, for metrics."""

    # --- production (the Run's thread) --------------------------------------------------------

    def set_window(self, window: int) -> None:
        """The engine is known: a queue lane's window is what the engine keeps in flight."""
        self._window = window
        for lane in self.lanes:
            lane.window = window

    def complete(self) -> bool:
        """Everything this Run will make has been made."""
        return all(lane.complete for lane in self.lanes)

    def make_room(self, lane: Lane) -> None:
        """Called before `lane` is asked whether it wants a task: a policy whose entries wait
        for several consumers frees what they have all sent (queue lanes free as they go)."""
        return None

    def batch_index(self, lane: Lane) -> int:
        """The index in the epoch of `lane`'s next task (seeding = "per_batch")."""
        return lane.issued

    def _queue_lane(self, rank: int, start: int) -> QueueLane:
        lane = QueueLane(self.spec.parts.batching.in_order, self._window)
        lane.rank = rank
        lane.begin(self._lane_tasks(rank), start, self._iterable)
        return lane
