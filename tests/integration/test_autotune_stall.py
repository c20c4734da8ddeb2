"""num_workers = "auto" reads the trainers' stall (NOTE [ Worker autotuning ]): a worker is added
while a trainer waits on the workers and the host has CPU to spare, and none while the trainers
report that they do not wait, however busy the workers; without reports, the busy rule.

The unit tests (no server, no process, no Ray): tests/unit/test_autotune_stall.py.
"""

from __future__ import annotations

import logging

import pytest

from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.engine import autotune
from remote_loader.server.engine.pool import WorkerPool
from tests.helpers import ServeLoaders, wait_for
from tests.stalls import Trainer


@pytest.mark.timeout(120)
def test_a_real_pool_grows_while_its_trainer_reports_waiting_on_it(
    serve_loaders: ServeLoaders,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The host-idle rule has its own unit test; the machine's other load must not decide.
    monkeypatch.setattr(autotune, "MIN_IDLE_CORES", 0.0)
    spec = LoaderSpec(
        name="auto",
        dataset="tests.datasets:Slow",  # sleeps: workers busy, CPU idle
        dataset_kwargs={"n": 100_000, "seconds": 0.02},
        batch_size=2,
        seeding="per_batch",
        persistent_workers=True,
        num_workers="auto",  # type: ignore[arg-type]
        max_workers=4,
    )
    served = serve_loaders(spec)
    host = served.hosts["auto"]
    pool = host.persistent_pool
    assert isinstance(pool, WorkerPool) and pool.num_workers == 1
    logs = caplog.at_level(logging.INFO, logger="remote_loader.server.engine.autotune")
    with logs, Trainer(served.address, "auto") as trainer:  # it reads as fast as it can
        # Until the trainer's first report arrives the tuner goes by how busy the workers
        # are, which may add a worker first: what the report decides is the raise after it.
        wait_for(lambda: host.metrics.stalls.workers_stall() is not None, 60, "a stall report")
        seen = len(caplog.records)

        def raised() -> list[str]:
            messages = (r.getMessage() for r in caplog.records[seen:])
            return [m for m in messages if "raising num_workers" in m]

        wait_for(lambda: bool(raised()), 60, "a worker added after the report")
        assert trainer.loader.stats().wait_stage == "workers"
    assert "stalled on the workers" in raised()[0], raised()
    assert pool.num_workers >= 2
