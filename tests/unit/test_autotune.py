"""num_workers = "auto": the tuner's decisions on their own, with a fake clock and host (NOTE
[ Worker autotuning ] in server/engine/autotune.py): one more worker while they are busy on a
host with idle CPU, none past its caps, prefetch before workers, one fewer while they idle.

The tests that start a server, a process or Ray: tests/integration/test_autotune.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from remote_loader.server.config.spec import ConfigError, LoaderSpec
from remote_loader.server.engine import autotune
from remote_loader.server.engine.autotune import Decision, WorkerTuner
from remote_loader.server.telemetry.metrics import LoaderMetrics


class Host:
    def __init__(self) -> None:
        self.now = 0.0
        self.idle: float | None = 1.0

    def clock(self) -> float:
        return self.now

    def idle_cores(self) -> float | None:
        return self.idle


def tuner(max_workers: int = 4) -> tuple[WorkerTuner, Host]:
    host = Host()
    return WorkerTuner(max_workers, clock=host.clock, idle_cores=host.idle_cores), host


def interval(t: WorkerTuner, host: Host, workers: int, busy: float) -> Decision | None:
    """One interval in which `workers` workers were `busy` (a fraction) of the time."""
    host.now += t.interval
    t.made(busy * workers * t.interval)
    return t.decide(workers)


def test_busy_workers_on_a_host_with_idle_cpu_get_one_more_then_a_pause() -> None:
    t, host = tuner()
    assert t.decide(1) is None  # not an interval yet
    decision = interval(t, host, 1, 0.95)
    assert decision is not None and decision.delta == +1 and decision.reason == "production"
    assert interval(t, host, 2, 0.95) is None  # the interval after a change: measured only
    assert interval(t, host, 2, 0.95) == Decision(
        +1, "production", "workers 95% busy, 1.0 cores idle on the host"
    )


def test_no_worker_is_added_on_a_saturated_host_or_past_max_workers() -> None:
    t, host = tuner(max_workers=2)
    host.idle = 0.2
    assert interval(t, host, 1, 1.0) is None  # busy, but no CPU to give a new worker
    host.idle = 1.5
    assert interval(t, host, 2, 1.0) is None  # at max_workers


def test_no_worker_is_added_past_max_pool_bytes() -> None:
    host = Host()
    t = WorkerTuner(
        4, max_pool_bytes=3000, prefetch=2, clock=host.clock, idle_cores=host.idle_cores
    )
    t.made(0.0, nbytes=1000)  # 2 workers x 2 in flight x 1000 bytes would pass 3000
    assert interval(t, host, 1, 1.0) is None
    t.max_pool_bytes = 4000
    decision = interval(t, host, 1, 1.0)
    assert decision is not None and decision.delta == +1


def polls(t: WorkerTuner, capped: float, n: int = 100) -> None:
    for k in range(n):
        t.polled(k < capped * n)


def test_prefetch_deepens_while_workers_idle_at_the_pools_cap_and_shallows_first() -> None:
    host = Host()
    t = WorkerTuner(
        2, workers=False, prefetch_factor=True, clock=host.clock, idle_cores=host.idle_cores
    )
    polls(t, capped=0.9)  # at the cap most of the time, yet the workers idle a third of it
    decision = interval(t, host, 2, 0.65)
    assert decision == Decision(
        +1, "production", "workers 65% busy while at the cap 90% of the time", "prefetch_factor"
    )
    t.prefetch = 3
    interval(t, host, 2, 0.65)  # pause
    polls(t, capped=0.1)
    assert interval(t, host, 2, 0.65) is None  # not capped: the work, not the queue, is short
    t.tunes_workers = True
    decision = interval(t, host, 2, 0.2)  # consumers are the bottleneck: prefetch goes first
    assert decision is not None and (decision.delta, decision.setting) == (-1, "prefetch_factor")
    t.prefetch = 2
    interval(t, host, 2, 0.2)  # pause
    decision = interval(t, host, 2, 0.2)  # then a worker
    assert decision is not None and (decision.delta, decision.setting) == (-1, "num_workers")


def test_idle_workers_lose_one_down_to_one() -> None:
    t, host = tuner()
    decision = interval(t, host, 3, 0.3)
    assert decision is not None and decision.delta == -1 and decision.reason == "consumers"
    interval(t, host, 2, 0.3)  # pause
    assert interval(t, host, 1, 0.0) is None  # never below one
    assert interval(t, host, 2, 0.7) is None  # between the thresholds: as it is


def test_auto_needs_per_batch_seeding_and_a_local_map_style_pool() -> None:
    base: dict[str, Any] = {"name": "a", "dataset": "tests.datasets:Squares", "num_workers": "auto"}
    with pytest.raises(ConfigError, match='set seeding = "per_batch"'):
        LoaderSpec(**base)
    with pytest.raises(ConfigError, match='max_workers goes with num_workers = "auto"'):
        LoaderSpec(name="a", dataset="tests.datasets:Squares", num_workers=2, max_workers=3)
    with pytest.raises(ConfigError, match="max_pool_bytes must be at least 1 byte"):
        LoaderSpec(**base, seeding="per_batch", max_pool_bytes=0)
    prefetch = LoaderSpec(name="p", dataset="x:y", num_workers=2, prefetch_factor="auto")  # type: ignore[arg-type]
    assert (prefetch.prefetch_factor, prefetch.autotune_prefetch, prefetch.autotune) == (
        2,
        True,
        False,
    )
    spec = LoaderSpec(**base, seeding="per_batch", max_workers=3)
    assert (spec.num_workers, spec.autotune, spec.max_workers) == (1, True, 3)


class Resizing:
    """A pool of nothing but what a Resizer reads and changes (autotune.Tunable)."""

    def __init__(self, workers: int) -> None:
        self.num_workers, self.prefetch = workers, 2
        self.max_outstanding = 2 * workers
        self.outstanding = 0
        self.active = [True] * workers

    def holds(self, worker_id: int) -> bool:
        return False

    def add_worker(self) -> None:
        self.num_workers += 1
        self.active = [True] * self.num_workers

    def remove_last(self) -> None:
        self.num_workers -= 1
        self.active = [True] * self.num_workers


def test_a_drained_worker_removed_in_the_same_round_as_the_next_decision() -> None:
    t, host = tuner()
    pool = Resizing(3)
    pool.active[2] = False  # the last one drained, holding nothing: it goes now...
    host.now += t.interval
    # ...and the consumers are still the bottleneck: the next one drains.
    autotune.Resizer(t, "r", LoaderMetrics("r")).tune(pool)
    assert pool.num_workers == 2 and pool.active == [True, False]
    assert pool.max_outstanding == 2
