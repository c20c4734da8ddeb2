"""num_workers = "auto" on a real pool (NOTE [ Worker autotuning ] in server/engine/autotune.py):
it grows while its workers cannot keep up and shrinks while its consumer is slow, its batches
the same as a fixed pool's.

The unit tests (no server, no process, no Ray): tests/unit/test_autotune.py.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from remote_loader.client import RemoteLoader
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.engine import autotune
from remote_loader.server.engine.pool import WorkerPool
from tests.helpers import ServeLoaders, loader_metric, wait_until


def auto_spec(name: str, **options: Any) -> LoaderSpec:
    return LoaderSpec(
        name=name,
        dataset="tests.datasets:Slow",  # sleeps: busy workers, idle CPU
        dataset_kwargs={"n": 400, "seconds": 0.02},
        batch_size=2,
        shuffle=True,
        seeding="per_batch",
        persistent_workers=True,
        **options,
    )


def pool_of(served: Any, name: str) -> WorkerPool:
    pool = served.hosts[name].persistent_pool
    assert isinstance(pool, WorkerPool)
    return pool


@pytest.mark.timeout(120)
def test_the_pool_grows_while_production_lags_and_shrinks_while_the_consumer_does(
    serve_loaders: ServeLoaders, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The host-idle rule has its own unit test above; the machine's other load must not decide.
    monkeypatch.setattr(autotune, "MIN_IDLE_CORES", 0.0)
    served = serve_loaders(
        auto_spec("auto", num_workers=1, autotune=True, max_workers=3),  # = num_workers="auto"
        auto_spec("fixed", num_workers=2),
    )
    pool = pool_of(served, "auto")
    assert pool.num_workers == 1
    with RemoteLoader(served.address, "fixed") as loader:
        expected = [b.tolist() for b in loader]
    with RemoteLoader(served.address, "auto") as loader:
        got = [b.tolist() for b in loader]  # reading as fast as it can
        grown = pool.num_workers
        assert got == expected  # the same batches, whatever the count did meanwhile
        assert grown == 3, "the workers could not keep up: the pool should have grown"
        slow = []
        loader.set_epoch(0)  # the same epoch again, read slowly
        for batch in loader:  # now a consumer slower than one worker
            slow.append(batch.tolist())
            time.sleep(0.05)
            if pool.num_workers == 1 and len(slow) > 20:
                break
        assert wait_until(lambda: pool.num_workers == 1, 1), pool.num_workers
        assert slow == expected[: len(slow)]
    host = served.hosts["auto"]
    changes = "remote_loader_autotune_changes_total"
    assert (
        loader_metric(host, changes, loader="auto", setting="num_workers", reason="production") >= 2
    )
    assert (
        loader_metric(host, changes, loader="auto", setting="num_workers", reason="consumers") >= 2
    )


@pytest.mark.timeout(120)
def test_prefetch_auto_deepens_the_queue_when_a_slow_task_idles_the_others(
    serve_loaders: ServeLoaders,
) -> None:
    options: dict[str, Any] = {
        "dataset": "tests.datasets:Skewed",  # every 7th slow: on either worker in turn
        "dataset_kwargs": {"n": 300, "every": 7, "slow": 0.2},
        "batch_size": 1,
        "num_workers": 2,
        "persistent_workers": True,
    }
    served = serve_loaders(
        LoaderSpec(name="deep", prefetch_factor="auto", **options),  # type: ignore[arg-type]
        LoaderSpec(name="fixed", **options),
    )
    pool = pool_of(served, "deep")
    with RemoteLoader(served.address, "fixed") as loader:
        expected = [int(b) for b in loader]
    with RemoteLoader(served.address, "deep") as loader:
        assert [int(b) for b in loader] == expected  # prefetch never changes the batches
    assert pool.prefetch > 2, "workers idled at the cap: the queue per worker should deepen"
    labels = {"loader": "deep", "setting": "prefetch_factor", "reason": "production"}
    assert (
        loader_metric(served.hosts["deep"], "remote_loader_autotune_changes_total", **labels) >= 1
    )
