"""num_workers = "auto" reads the trainers' stall (NOTE [ Worker autotuning ]), the tuner on its
own: a worker is added while a trainer waits on the workers and the host has CPU to spare, and
none while the trainers report that they do not wait, however busy the workers.

The tests that start a server, a process or Ray: tests/integration/test_autotune_stall.py.
"""

from __future__ import annotations

from remote_loader.server.engine.autotune import Decision, WorkerTuner


class Trainers:
    """What the trainers report (None: nobody reports) and the host's idle cores."""

    def __init__(self) -> None:
        self.now = 0.0
        self.stall: float | None = None
        self.idle: float | None = 1.0


def tuner(trainers: Trainers) -> WorkerTuner:
    return WorkerTuner(
        4,
        clock=lambda: trainers.now,
        idle_cores=lambda: trainers.idle,
        stall=lambda: trainers.stall,
    )


def interval(t: WorkerTuner, trainers: Trainers, workers: int, busy: float) -> Decision | None:
    trainers.now += t.interval
    t.made(busy * workers * t.interval)
    return t.decide(workers)


def test_a_trainer_waiting_on_the_workers_gets_one_more_even_if_they_idle_at_times() -> None:
    trainers = Trainers()
    t = tuner(trainers)
    trainers.stall = 0.4
    decision = interval(t, trainers, 2, 0.6)  # under ADD_ABOVE: the busy rule would wait
    assert decision == Decision(
        +1,
        "production",
        "trainers 40% stalled on the workers, workers 60% busy, 1.0 cores idle on the host",
    )


def test_trainers_that_do_not_wait_get_no_worker_however_busy_the_workers() -> None:
    trainers = Trainers()
    t = tuner(trainers)
    trainers.stall = 0.0  # they report, and wait on nothing (or on something else)
    assert interval(t, trainers, 2, 0.97) is None
    assert interval(t, trainers, 2, 0.97) is None
    trainers.stall = None  # nobody reports: the workers' busy time decides, as before
    decision = interval(t, trainers, 2, 0.97)
    assert decision is not None and decision.delta == +1


def test_no_worker_for_waiting_trainers_on_a_host_without_idle_cpu_nor_is_one_removed() -> None:
    trainers = Trainers()
    t = tuner(trainers)
    trainers.stall, trainers.idle = 0.9, 0.1
    assert interval(t, trainers, 2, 0.3) is None  # busy low, yet trainers wait: keep them all
