"""The sharing stage: one production of an epoch, handed out to the consumers that share it.

A consumer is one stream: a trainer's `RemoteLoader` iterating an epoch. Consumers that name the
same job, epoch, seed, sharing mode and world size share a Run (server/sharing/run.py): one thread
that feeds the loader's engine and puts the results in order, once for all of them. How they divide
its batches is the Run's sharing policy (server/sharing/policies.py):

- partition: rank r of w gets its own lane, the tasks of its share (server/config/sampling.py);
- broadcast: one lane; every consumer reads every batch, each at its own cursor, at most
  `broadcast_window` batches apart;
- dynamic: one lane; each batch goes to whichever consumer asks first.

This module is the registry: which Run a consumer joins, and letting consumers go.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager

from remote_loader.server.config.sampling import EpochPlan
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.engine.seam import Engine
from remote_loader.server.sharing.consumer import Consumer
from remote_loader.server.sharing.elastic import Reshard
from remote_loader.server.sharing.membership import Membership
from remote_loader.server.sharing.policies import policy_for
from remote_loader.server.sharing.run import Run, RunKey
from remote_loader.server.telemetry.metrics import LoaderMetrics
from remote_loader.server.telemetry.series import ConsumerRow

log = logging.getLogger(__name__)

# The most a stream's handler waits for the Run it ended to give its engine back (a
# non-persistent pool joins its workers, NOTE [ Pool Shutdown ]); the Run finishes on its own.
RUN_JOIN_TIMEOUT = 60.0
# NOTE [ Sharing ]
#
# Locks: `Runs._lock` (the registry) is taken before any `Run.cond`, never after. Everything
# about one Run (its lanes, entries and consumers) is guarded by its `cond`; the Run's thread
# is the only one that talks to the engine (worker pool or in-process loader), and it calls
# `engine.poll` without holding `cond`. A new Run's plan is made before `_lock` is taken (an
# elastic resume's can take a while, NOTE [ Resharding cost ]); a consumer that finds a Run
# of its key started meanwhile joins that one, and the plan made for nothing is dropped.
#
# Lifetime: a Run is created by the first consumer that finds no Run to join and ends when its
# last consumer detaches (end of its stream, a client that went away, or a stalled broadcast
# consumer detached after `detach_timeout`). Ending it joins its thread, which gives the engine
# back (see NOTE [ Pool Shutdown ] in server/engine/pool.py) before the last consumer's end frame is
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


class Runs:
    """The Runs of one loader, by key: where a consumer attaches."""

    def __init__(
        self,
        spec: LoaderSpec,
        plan: Callable[[int, int, int, Reshard | None], EpochPlan],
        borrow: Callable[[str, Callable[[], bool]], AbstractContextManager[Engine]],
        *,
        iterable: bool,
        metrics: LoaderMetrics | None = None,
    ) -> None:
        self.spec = spec
        self.metrics = metrics if metrics is not None else LoaderMetrics(spec.name)
        self._iterable = iterable
        self._plan = plan  # (seed, epoch, world_size, reshard) -> EpochPlan
        self._borrow = borrow  # (job, gave up?) -> the engine for one Run
        self._lock = threading.Lock()
        self._runs: dict[RunKey, list[Run]] = {}
        # Consumers gRPC's cancellation callback let go; None stops the reaper (NOTE [ Sharing ]).
        self._let_go: queue.SimpleQueue[tuple[Run, Consumer] | None] = queue.SimpleQueue()
        self._reaper = threading.Thread(
            target=self._reap, name=f"rl-reaper-{spec.name}", daemon=True
        )
        self._reaper.start()

    def attach(
        self,
        membership: Membership,
        seed: int,
        epoch: int,
        start: int = 0,
        reshard: Reshard | None = None,
        compression: str = "",
    ) -> Consumer:
        """A consumer from position `start` of the Run it joins (see NOTE [ Sharing ]),
        started if new. `reshard`: the epoch was begun by a job of another world size
        (partition; NOTE [ Elastic resume ]). `compression`: what the workers compress the
        batches with (NOTE [ Compression ])."""
        policy = policy_for(membership.sharing)
        key = RunKey(
            membership.sharing,
            membership.job,
            seed,
            epoch,
            policy.run_world_size(membership),
            reshard,
            compression,
        )
        with self._lock:
            consumer = self._join(key, membership, start)
        if consumer is None:
            # Planned outside the lock: an elastic resume's plan grows with its ranks (NOTE
            # [ Resharding cost ]) and must not hold up other streams' attaching meanwhile.
            plan = self._plan(seed, epoch, policy.plan_world_size(membership), reshard)
            with self._lock:
                # Another consumer of the key may have started a Run meanwhile: join it.
                consumer = self._join(key, membership, start)
                if consumer is None:
                    run = Run(
                        key,
                        self.spec,
                        plan,
                        lambda give_up: self._borrow(membership.job, give_up),
                        iterable=self._iterable,
                        on_close=self._detach,
                        start=start,
                        metrics=self.metrics,
                    )
                    consumer = run.try_attach(membership, start)
                    assert consumer is not None
                    self._runs.setdefault(key, []).append(run)
                    run.start()
        return consumer

    def _join(self, key: RunKey, membership: Membership, start: int) -> Consumer | None:
        """A consumer of the newest Run of `key` that takes it (NOTE [ Sharing ]); under _lock."""
        for run in reversed(self._runs.get(key, [])):
            consumer = run.try_attach(membership, start)
            if consumer is not None:
                return consumer
        return None

    def _detach(self, run: Run, consumer: Consumer, join: bool) -> None:
        if not join:  # gRPC's cancellation callback: it must not wait for any lock
            self._let_go.put((run, consumer))
            return
        self._detach_now(run, consumer, join)

    def _reap(self) -> None:
        while (let_go := self._let_go.get()) is not None:
            try:
                self._detach_now(*let_go, join=False)
            except Exception:  # the reaper must outlive any one consumer's cleanup
                log.exception("loader %r: letting go of a cancelled stream failed", self.spec.name)

    def _detach_now(self, run: Run, consumer: Consumer, join: bool) -> None:
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
        return [row for run in self.active() for row in run.lags()]

    def close(self) -> None:
        """Ends every Run (server shutdown): consumers see the end of their stream."""
        with self._lock:
            runs = [run for runs in self._runs.values() for run in runs]
            self._runs.clear()
        for run in runs:
            run.close(f"loader {self.spec.name!r} is shutting down mid-epoch")
        for run in runs:
            run.wait_closed(timeout=10.0)
        self._let_go.put(None)
        self._reaper.join(timeout=10.0)
