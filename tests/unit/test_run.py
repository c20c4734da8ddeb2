"""The Run and its registry against a fake engine: the sharing modes' contracts (order, exactly
once, fairness, the broadcast window, detaching, failures), in-process and fast. The same
contracts end to end, through worker processes and gRPC, are in test_sharing.py."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from remote_loader.server.batch.delivery import Delivery, Outcome
from remote_loader.server.batch.lease import SlotLease
from remote_loader.server.config.sampling import EpochPlan, share
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.engine.seam import Engine
from remote_loader.server.errors import Closing, Detached
from remote_loader.server.sharing.consumer import Consumer
from remote_loader.server.sharing.lanes import MIN_LANE_WINDOW
from remote_loader.server.sharing.membership import Membership
from remote_loader.server.sharing.runs import Runs
from tests.helpers import wait_until

NEVER = threading.Event()  # a stream that is never cancelled
CEILING = 30.0  # a bound for waits that take milliseconds (a busy machine takes longer)


class FakeEngine:
    """Makes each task's batch at once (its indices, as JSON bytes), and completes them newest
    first when `lifo`, so the Run must put them back in order. Counts what it was asked for."""

    def __init__(self, max_outstanding: int = 4, lifo: bool = False) -> None:
        self.max_outstanding = max_outstanding
        self.broken = False
        self.lifo = lifo
        self.submitted: list[Any] = []  # the indices of each task, in submission order
        self.released: list[Any] = []
        self.fail_after: int | None = None  # poll raises once this many tasks were made
        self.on_submit: Callable[[Any], None] = lambda indices: None
        self._pending: list[tuple[int, Any]] = []
        self._made = 0
        self._lock = threading.Lock()

    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._pending)

    def begin_epoch(
        self, base_seed: int, compression: str = "", *, epoch: int, shared_seed: int | None = None
    ) -> None:
        pass

    def end_epoch(self) -> None:
        pass

    def has_room(self) -> bool:
        return True

    def submit(self, task_id: int, indices: Any, seed: int | None = None) -> bool:
        with self._lock:
            self._pending.append((task_id, indices))
            self.submitted.append(indices)
        self.on_submit(indices)
        return True

    def poll(self, timeout: float = 0.1) -> Outcome | None:
        with self._lock:
            if not self._pending:
                return None
            if self.fail_after is not None and self._made >= self.fail_after:
                raise RuntimeError("the fake engine broke")
            task_id, indices = self._pending.pop(-1 if self.lifo else 0)
            self._made += 1
        blob = memoryview(json.dumps(indices).encode())
        lease = SlotLease(lambda: self.released.append(indices))
        return Outcome(task_id, Delivery(blob=blob, lease=lease))


def tasks(n: int) -> list[list[int]]:
    """An epoch of `n` one-index batches."""
    return [[i] for i in range(n)]


def registry(engine: FakeEngine, epoch: list[list[int]], **options: Any) -> Runs:
    """The Runs of a loader whose epochs are `epoch` (split by rank as DistributedSampler
    splits it), each produced by `engine`."""
    spec = LoaderSpec(name="fake", dataset="tests.datasets:Squares", **options)

    def plan(seed: int, number: int, world_size: int, reshard: object) -> EpochPlan:
        return EpochPlan(
            seed, number, 0, world_size, lambda r: iter(share(epoch, r, world_size, False))
        )

    def borrow(job: str, give_up: Callable[[], bool]) -> contextlib.AbstractContextManager[Engine]:
        return contextlib.nullcontext(engine)

    runs = Runs(spec, plan, borrow, iterable=False)
    _OPEN.append(runs)  # closed after the test, which also stops its reaper thread
    return runs


_OPEN: list[Runs] = []


def read(consumer: Consumer, hold: float = 0.0) -> list[Any]:
    """Every batch `consumer` gets, in order, as its indices; sleeps `hold` s per batch."""
    got = []
    while (entry := consumer.next(NEVER)) is not None:
        assert entry.error is None, entry.error
        assert entry.delivery.blob is not None
        got.append(json.loads(bytes(entry.delivery.blob)))
        time.sleep(hold)
        consumer.done(entry)
    consumer.close()
    return got


def in_threads(*jobs: Callable[[], Any]) -> list[Any]:
    """Runs each job in a thread of its own; their results, or raises the first error."""
    results: list[Any] = [None] * len(jobs)

    def run(k: int) -> None:
        try:
            results[k] = jobs[k]()
        except BaseException as exc:
            results[k] = exc

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CEILING)
        assert not t.is_alive(), "a consumer is stuck"
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


@pytest.mark.parametrize("lifo", [False, True])
def test_partition_ranks_get_their_shares_in_order_and_every_slot_goes_back(lifo: bool) -> None:
    engine = FakeEngine(lifo=lifo)
    runs = registry(engine, tasks(11))
    ranks = [runs.attach(Membership("partition", "job", r, 2), seed=0, epoch=0) for r in (0, 1)]
    assert ranks[0].run is ranks[1].run  # one production for the job
    got = in_threads(*(lambda c=c: read(c) for c in ranks))
    assert got == [share(tasks(11), r, 2, False) for r in (0, 1)]
    assert sorted(map(str, engine.released)) == sorted(map(str, engine.submitted))
    assert len(engine.submitted) == 12  # 11 and one repeated to even the shares, made once
    assert not runs.active()


def test_no_partition_lane_runs_more_than_its_window_ahead_of_its_reader() -> None:
    engine = FakeEngine(max_outstanding=1)
    runs = registry(engine, tasks(20))
    ranks = [runs.attach(Membership("partition", "job", r, 2), seed=0, epoch=0) for r in (0, 1)]
    # Rank 0 has 0, 2, 4, ...; rank 1 has 1, 3, 5, .... Whenever a task is submitted, its
    # rank's batches made and not yet done with are at most the lane's window (plus the task
    # in flight): a rank whose reader is slow (or not started yet: one thread may start well
    # after the other on a busy machine) holds back only itself, never the other.
    done = [0, 0]
    ahead = [0, 0]

    def submitted(indices: Any) -> None:
        rank = indices[0] % 2
        made = sum(1 for [i] in engine.submitted if i % 2 == rank)
        ahead[rank] = max(ahead[rank], made - done[rank])

    engine.on_submit = submitted

    def reader(consumer: Consumer, rank: int) -> None:
        while (entry := consumer.next(NEVER)) is not None:
            consumer.done(entry)
            done[rank] += 1
        consumer.close()

    in_threads(*(lambda c=c, r=r: reader(c, r) for r, c in enumerate(ranks)))
    # +1: the reader counts an entry just after the Run sees it done.
    assert max(ahead) <= MIN_LANE_WINDOW + engine.max_outstanding + 1, (ahead, engine.submitted)
    assert sorted(engine.submitted) == tasks(20)
    assert done == [10, 10]


def test_broadcast_consumers_each_read_every_batch() -> None:
    engine = FakeEngine(lifo=True)
    runs = registry(engine, tasks(9), broadcast_window=2)
    group = [runs.attach(Membership("broadcast", "job", r, 3), seed=0, epoch=0) for r in range(3)]
    assert len({c.run for c in group}) == 1
    got = in_threads(*(lambda c=c, k=k: read(c, hold=0.001 * k) for k, c in enumerate(group)))
    assert got == [tasks(9)] * 3
    assert engine.submitted == tasks(9)  # made once for the three
    assert sorted(map(str, engine.released)) == sorted(map(str, engine.submitted))


def test_a_broadcast_consumer_that_reads_nothing_is_detached_after_detach_timeout() -> None:
    engine = FakeEngine(max_outstanding=1)
    runs = registry(engine, tasks(30), broadcast_window=2, detach_timeout=0.3)
    reader, stalled = (runs.attach(Membership("broadcast", "job", r, 2), 0, 0) for r in (0, 1))
    first = stalled.next(NEVER)  # takes batch 0, then sends nothing
    assert first is not None
    assert read(reader) == tasks(30)  # held at most detach_timeout, then the rest
    with pytest.raises(Detached, match=r"sent no batch for 0\.3 s \(detach_timeout\)"):
        stalled.next(NEVER)
    stalled.close()


def test_the_broadcast_window_bounds_how_far_production_runs_ahead() -> None:
    engine = FakeEngine(max_outstanding=1)
    window = 3
    runs = registry(engine, tasks(30), broadcast_window=window, detach_timeout=CEILING)
    fast, slow = (runs.attach(Membership("broadcast", "job", r, 2), 0, 0) for r in (0, 1))
    # Whenever a task is submitted or the fast consumer gets a batch, neither is more than the
    # window ahead of what the slow one has sent (tasks in flight count in the window). +1: the
    # slow reader counts a batch just after the Run sees it done.
    sent_by_slow = 0
    ahead: list[int] = []
    engine.on_submit = lambda indices: ahead.append(len(engine.submitted) - sent_by_slow)
    progress = threading.Condition()
    consumed: list[Any] = []

    def read_fast() -> None:
        while (entry := fast.next(NEVER)) is not None:
            assert entry.delivery.blob is not None
            with progress:
                consumed.append(json.loads(bytes(entry.delivery.blob)))
                ahead.append(len(consumed) - sent_by_slow)
                progress.notify_all()
            fast.done(entry)
        fast.close()

    reading = threading.Thread(target=read_fast)
    reading.start()
    with progress:  # the fast consumer reads what the window lets it, while the slow one waits
        assert progress.wait_for(lambda: len(consumed) >= window, CEILING)
    got = []
    while (entry := slow.next(NEVER)) is not None:
        assert entry.delivery.blob is not None
        got.append(json.loads(bytes(entry.delivery.blob)))
        slow.done(entry)
        sent_by_slow += 1
    slow.close()
    reading.join(CEILING)
    assert got == consumed == tasks(30)
    assert max(ahead) <= window + 1, ahead


def test_dynamic_consumers_share_the_batches_exactly_once() -> None:
    engine = FakeEngine(lifo=True)
    runs = registry(engine, tasks(40), sharing=["dynamic"])
    pair = [runs.attach(Membership("dynamic", "job"), 0, 0) for _ in range(2)]
    got = in_threads(*(lambda c=c: read(c, hold=0.001) for c in pair))
    assert sorted(i for share_ in got for [i] in share_) == list(range(40))
    for share_ in got:  # each consumer's batches come in the epoch's order
        assert share_ == sorted(share_)


def test_a_failing_engine_ends_each_stream_with_the_error_at_its_position() -> None:
    engine = FakeEngine(max_outstanding=1)
    engine.fail_after = 3
    runs = registry(engine, tasks(10))
    consumer = runs.attach(Membership("partition", "job"), 0, 0)
    made = []
    while (entry := consumer.next(NEVER)) is not None:
        if entry.error is not None:
            e = entry.error
            assert (e.type, e.message, e.where) == (
                "RuntimeError",
                "the fake engine broke",
                "in the server process",
            )
            consumer.done(entry)
            break
        assert entry.delivery.blob is not None
        made.append(json.loads(bytes(entry.delivery.blob)))
        consumer.done(entry)
    else:
        pytest.fail("the stream ended without the engine's error")
    assert made == tasks(3)
    consumer.close()


def test_a_cancelled_consumer_is_let_go_without_waiting() -> None:
    engine = FakeEngine()
    runs = registry(engine, tasks(1000))
    consumer = runs.attach(Membership("partition", "job"), 0, 0)
    entry = consumer.next(NEVER)
    assert entry is not None
    asked = time.monotonic()
    consumer.let_go()  # gRPC's cancellation callback: queues it, returns at once
    assert time.monotonic() - asked < 1.0
    # The reaper detaches it; the Run ends with its last consumer.
    assert wait_until(lambda: not runs.active(), CEILING)
    runs.close()


def test_closing_a_run_fails_each_stream_with_the_reason_and_gives_the_engine_back() -> None:
    engine = FakeEngine()
    runs = registry(engine, tasks(1000))
    ranks = [runs.attach(Membership("partition", "job", r, 2), 0, 0) for r in (0, 1)]
    [run] = runs.active()
    held = ranks[0].next(NEVER)  # taken, not sent: the Run settles it
    assert held is not None
    run.close("the server is going away")
    assert run.wait_closed(CEILING)  # its thread gave the engine back
    for consumer in ranks:
        with pytest.raises(Closing, match="the server is going away"):
            consumer.next(NEVER)
        consumer.close()
    assert run.try_attach(Membership("partition", "job", 0, 2)) is None  # closed for good
    assert sorted(map(str, engine.released)) == sorted(map(str, engine.submitted))


def test_resumed_consumers_start_at_their_position() -> None:
    engine = FakeEngine()
    runs = registry(engine, tasks(12))
    consumer = runs.attach(Membership("partition", "job"), seed=0, epoch=0, start=7)
    assert read(consumer) == tasks(12)[7:]
    assert engine.submitted == tasks(12)[7:]  # the skipped ones were never made


@pytest.fixture(autouse=True)
def _no_thread_left() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    while _OPEN:
        _OPEN.pop().close()

    def left() -> list[threading.Thread]:
        return [
            t
            for t in set(threading.enumerate()) - before
            if t.name.startswith(("rl-run", "rl-reaper"))
        ]

    if not wait_until(lambda: not left(), CEILING):
        pytest.fail(f"Run or reaper threads left running: {left()}")


def test_a_broadcast_group_waits_group_timeout_for_its_ranks_not_detach_timeout() -> None:
    # Rank 1 of 2 never comes: after group_timeout the Run stops holding batches for it, while
    # detach_timeout (a stalled consumer's allowance) stays long.
    engine = FakeEngine(max_outstanding=1)
    runs = registry(engine, tasks(30), broadcast_window=2, group_timeout=0.2, detach_timeout=600)
    alone = runs.attach(Membership("broadcast", "job", 0, 2), 0, 0)
    started = time.monotonic()
    assert read(alone) == tasks(30)
    assert time.monotonic() - started < CEILING / 3  # waited 0.2 s, not 600


def test_the_sharing_waits_default_to_detach_timeout() -> None:
    spec = LoaderSpec(name="a", dataset="m:f", detach_timeout=7.0, handback_timeout=2.0)
    assert (spec.group_timeout, spec.workers_timeout, spec.handback_timeout) == (7.0, 7.0, 2.0)
    with pytest.raises(ValueError, match="workers_timeout must be a positive number of seconds"):
        LoaderSpec(name="a", dataset="m:f", workers_timeout=0)
