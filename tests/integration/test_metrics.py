"""Prometheus metrics scraped over HTTP from real servers, max_batch_bytes, RemoteLoader.stats()."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from remote_loader.client import ConnectionLostError, DatasetError, RemoteLoader
from remote_loader.server.api.server import Server
from remote_loader.server.api.settings import ServerSettings
from remote_loader.server.batch.messages import DEFAULT_MAX_BATCH_BYTES
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.engine.pool import WorkerPool
from tests.helpers import Served, scrape, serve_process, stop_process, value, wait_until

ServeMetered = Callable[..., Served]

HISTOGRAMS = [
    "remote_loader_batch_latency_seconds",
    "remote_loader_batch_make_seconds",
    "remote_loader_stream_wait_seconds",
    "remote_loader_send_seconds",
]


@pytest.fixture
def serve_metered() -> Iterator[ServeMetered]:
    """Starts in-process servers with a metrics endpoint on a free port (and max_batch_bytes)."""
    running: list[Served] = []

    def start(*specs: LoaderSpec, max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES) -> Served:
        settings = ServerSettings(
            address="127.0.0.1:0", metrics_address="127.0.0.1:0", max_batch_bytes=max_batch_bytes
        )
        server = Server(settings, specs)
        server.start()
        running.append(Served(server.address, server.hosts, server))
        return running[-1]

    yield start
    for served in running:
        served.server.stop(0)


def squares(name: str = "sq", n: int = 48, **options: Any) -> LoaderSpec:
    values: dict[str, Any] = {
        "name": name,
        "dataset": "tests.datasets:Squares",
        "dataset_kwargs": {"n": n},
        "batch_size": 4,
        "num_workers": 2,
    }
    values.update(options)
    return LoaderSpec(**values)


@pytest.mark.timeout(60)
def test_a_partitioned_epoch_is_counted_per_consumer(serve_metered: ServeMetered) -> None:
    # 16 batches per rank: more than a stream can run ahead of its training loop (a 4-batch
    # ring, `prefetch` queued, one in the receiver), so both are still attached at the scrape.
    served = serve_metered(squares(n=128))
    loaders = [RemoteLoader(served.address, rank=r, world_size=2, prefetch=2) for r in range(2)]
    try:
        its = [iter(loader) for loader in loaders]
        for it in its:
            next(it)
        attached = scrape(served)
        assert value(attached, "remote_loader_consumers", loader="sq") == 2
        for it in its:
            assert len(list(it)) == 15
        stats = [loader.stats() for loader in loaders]
    finally:
        for loader in loaders:
            loader.close()
    samples = scrape(served)
    for rank, s in enumerate(stats):
        consumer = {"loader": "sq", "job": "default", "sharing": "partition", "rank": str(rank)}
        assert s.batches == 16 and s.bytes > 0
        assert value(samples, "remote_loader_batches_served_total", **consumer) == 16
        assert value(samples, "remote_loader_bytes_served_total", **consumer) == s.bytes
        assert value(samples, "remote_loader_batch_errors_total", **consumer) == 0
    assert value(samples, "remote_loader_consumers", loader="sq") == 0
    assert not [key for key in samples if key[0] == "remote_loader_consumer_lag_batches"]
    for name in HISTOGRAMS:
        assert value(samples, f"{name}_count", loader="sq") == 32, name
    for queue in ("index", "result", "reorder", "lane"):
        count = value(samples, "remote_loader_queue_wait_seconds_count", loader="sq", queue=queue)
        assert count == 32, queue
    latency = value(samples, "remote_loader_batch_latency_seconds_sum", loader="sq")
    assert latency is not None and 0 < latency < 60
    assert value(samples, "remote_loader_worker_restarts_total", loader="sq") == 0


@pytest.mark.timeout(60)
def test_a_killed_worker_counts_one_restart(serve_metered: ServeMetered) -> None:
    spec = LoaderSpec(
        name="slow",
        dataset="tests.datasets:Slow",
        dataset_kwargs={"n": 20, "seconds": 0.02},
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
    )
    served = serve_metered(spec)
    pool = served.hosts["slow"].persistent_pool
    assert isinstance(pool, WorkerPool)
    got: list[int] = []
    with RemoteLoader(served.address) as loader:
        for i, batch in enumerate(loader):
            got.extend(int(v) for v in batch)
            if i == 2:
                os.kill(pool.pids[0], signal.SIGKILL)
    assert got == list(range(20))
    assert wait_until(lambda: pool.restarts == 1, 5)
    samples = scrape(served)
    assert value(samples, "remote_loader_worker_restarts_total", loader="slow") == 1
    consumer = {"loader": "slow", "job": "default", "sharing": "partition", "rank": "0"}
    assert value(samples, "remote_loader_batches_served_total", **consumer) == 10
    # The re-issued batches count once, as the batches they are.
    assert value(samples, "remote_loader_batch_latency_seconds_count", loader="slow") == 10


@pytest.mark.timeout(60)
def test_broadcast_lag_is_the_distance_to_the_fastest_consumer(
    serve_metered: ServeMetered,
) -> None:
    window = 4
    spec = LoaderSpec(
        name="blobs",
        dataset="tests.datasets:Blobs",
        dataset_kwargs={"n": 64, "nbytes": 2 << 20},
        batch_size=1,
        num_workers=2,
        broadcast_window=window,
    )
    served = serve_metered(spec)
    fast, slow = (
        RemoteLoader(served.address, sharing="broadcast", rank=r, world_size=2, prefetch=1)
        for r in range(2)
    )
    read = [0]
    stop = threading.Event()

    def read_fast() -> None:  # as far as the slow consumer and the window let it
        try:
            for _ in fast:
                read[0] += 1
                if stop.is_set():
                    break
        except ConnectionLostError:
            if not stop.is_set():
                raise  # closed by the test only once it is done

    reader = threading.Thread(target=read_fast)
    try:
        slow_it = iter(slow)
        next(slow_it)  # then it reads no more: gRPC flow control holds its stream
        reader.start()

        def lag(rank: int) -> float | None:
            return value(
                scrape(served),
                "remote_loader_consumer_lag_batches",
                loader="blobs",
                job="default",
                sharing="broadcast",
                rank=str(rank),
            )

        # The fast consumer stops at the window's edge, `window` batches ahead of the slow one
        # (and up to the pool's tasks in flight more: results waiting in the reorder buffer do
        # not count against broadcast_window today).
        in_flight = 2 * 2  # prefetch_factor * num_workers
        assert wait_until(lambda: (lag(1) or 0) >= window, 20), (lag(1), read[0])
        # It stays there: a bound over time, so a time (waiting for a state cannot show that
        # something does not happen).
        time.sleep(0.3)
        assert window <= (lag(1) or 0) <= window + in_flight, lag(1)
        assert lag(0) == 0
        assert value(scrape(served), "remote_loader_consumers", loader="blobs") == 2
        stop.set()
        slow.close()  # detaches it: the fast one runs on to the end
        reader.join(timeout=30)
        assert not reader.is_alive()
    finally:
        stop.set()
        fast.close()
        slow.close()
        if reader.is_alive():
            reader.join(timeout=10)
    assert wait_until(
        lambda: value(scrape(served), "remote_loader_consumers", loader="blobs") == 0, 5
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_batch_over_max_batch_bytes_is_an_error_at_its_position(
    serve_metered: ServeMetered, num_workers: int
) -> None:
    limit = 32 << 10
    spec = LoaderSpec(
        name="sizes",
        dataset="tests.datasets:Sizes",
        dataset_kwargs={"sizes": [100, 100, 100, 64 << 10, 100, 100]},
        batch_size=1,
        num_workers=num_workers,
    )
    served = serve_metered(spec, max_batch_bytes=limit)
    with RemoteLoader(served.address) as loader:
        it = iter(loader)
        assert [int(next(it)[0, 0]) for _ in range(3)] == [0, 1, 2]
        with pytest.raises(DatasetError) as info:
            next(it)
        error = info.value
        assert error.position == 3 and error.remote_type == "BatchTooLargeError"
        text = str(error)
        assert f"max_batch_bytes of {limit} bytes" in text
        assert "the encoded batch is 65" in text  # 64 KiB of data plus its header
        assert "REMOTE_LOADER_MAX_BATCH_BYTES" in text and "--max-batch-bytes" in text
        assert [int(b[0, 0]) for b in it] == [4, 5]  # the epoch goes on after it
        stats = loader.stats()
    assert stats.batches == 5
    samples = scrape(served)
    consumer = {"loader": "sizes", "job": "default", "sharing": "partition", "rank": "0"}
    assert value(samples, "remote_loader_batch_errors_total", **consumer) == 1
    assert value(samples, "remote_loader_batches_served_total", **consumer) == 5
    assert value(samples, "remote_loader_bytes_served_total", **consumer) == stats.bytes


@pytest.mark.timeout(60)
def test_stats_wait_fraction_tells_a_slow_loader_from_a_slow_training_loop(
    serve_metered: ServeMetered,
) -> None:
    slow_data = LoaderSpec(
        name="slow",
        dataset="tests.datasets:Slow",
        dataset_kwargs={"n": 8, "seconds": 0.1},
        batch_size=1,
    )
    served = serve_metered(slow_data, squares("fast", n=20, batch_size=1, num_workers=0))
    with RemoteLoader(served.address, "slow") as loader:
        assert loader.stats().batches == 0 and loader.stats().wait_fraction == 0.0
        for _ in loader:
            pass  # a training step that takes no time: the loop waits for every batch
        slow_stats = loader.stats()
    assert slow_stats.batches == 8 and slow_stats.elapsed_seconds >= 0.7
    assert 0.8 < slow_stats.wait_fraction <= 1.0, slow_stats
    with RemoteLoader(served.address, "fast") as loader:
        for _ in loader:
            time.sleep(0.05)  # a slow training step: batches are ready before it asks
        fast_stats = loader.stats()
    assert fast_stats.batches == 20 and fast_stats.elapsed_seconds >= 0.9
    assert 0.0 <= fast_stats.wait_fraction < 0.3, fast_stats
    assert fast_stats.reconnects == 0 and fast_stats.bytes > 0


@pytest.mark.timeout(60)
def test_serve_flags_serve_metrics_until_sigterm() -> None:
    with socket.socket() as probe:  # a port free a moment ago: the flag names a fixed one
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc, address = serve_process(
        "--dataset",
        "tests.datasets:Squares",
        "--batch-size",
        "5",
        "--metrics-address",
        f"127.0.0.1:{port}",
        "--max-batch-bytes",
        "300",  # a batch of 5 Squares samples encodes to more
    )
    try:
        errors: list[DatasetError] = []
        with RemoteLoader(address) as loader:
            it = iter(loader)
            for _ in range(len(loader)):  # every batch is too big: an error each, in order
                with pytest.raises(DatasetError, match="max_batch_bytes of 300 bytes") as info:
                    next(it)
                errors.append(info.value)
            assert next(it, None) is None
        assert [e.position for e in errors] == list(range(10))
        samples = scrape(port)
        consumer = {"loader": "default", "job": "default", "sharing": "partition", "rank": "0"}
        assert value(samples, "remote_loader_batch_errors_total", **consumer) == 10
        assert value(samples, "remote_loader_batches_served_total", **consumer) == 0
        assert value(samples, "remote_loader_consumers", loader="default") == 0
    finally:
        code, err = stop_process(proc)
    assert code == 0, err
    with pytest.raises(OSError):  # stopped with the gRPC server
        scrape(port)
