"""What the server tells its operator, over real gRPC: metrics stay bounded whatever job names
clients choose, every dataset error is logged once and counted on its streams' end lines, and
the worker gauges exist from start-up.

The unit tests (no server, no process, no Ray): tests/unit/test_observability.py.
"""

from __future__ import annotations

import logging
import threading
import urllib.request
from typing import Any

import grpc
import pytest

from remote_loader.client import DatasetError, RemoteLoader
from remote_loader.client.types import Transport
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import wire
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.telemetry.series import MAX_LABEL_CHARS
from tests.helpers import ServeLoaders, log_fields, scrape, value

SQUARES = LoaderSpec(
    name="sq", dataset="tests.datasets:Squares", dataset_kwargs={"n": 8}, batch_size=4
)


def _metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        text: str = reply.read().decode()
    return text


@pytest.mark.timeout(120)
def test_unique_long_job_names_do_not_grow_the_metrics_without_bound(
    serve_loaders: ServeLoaders,
) -> None:
    served = serve_loaders(SQUARES, metrics_address="127.0.0.1:0", metrics_max_consumers=16)
    port = served.server.metrics_port
    assert port is not None
    before = len(_metrics_text(port))
    # Streams that start at the epoch's end: no batch, but each a consumer of its own job.
    with grpc.insecure_channel(served.address) as channel:
        stream = channel.unary_stream(
            wire.STREAM_METHOD,
            request_serializer=pb.StreamRequest.SerializeToString,
            response_deserializer=pb.Frame.FromString,
        )
        for i in range(200):
            job = f"{i:04d}-" + "j" * 1000
            consumer = pb.Consumer(job=job, rank=0, world_size=1)
            frames = list(stream(pb.StreamRequest(loader="sq", start=2, consumer=consumer)))
            assert frames[-1].end.batches == 2
    text = _metrics_text(port)
    # Without the bound: 200 series of 1 KB labels per counter, about 1.5 MB more.
    assert len(text) - before < 64 << 10, len(text) - before
    samples = scrape(served)
    jobs = {
        dict(labels)["job"]
        for name, labels in samples
        if name == "remote_loader_batches_served_total"
    }
    assert len(jobs) == 17 and "other" in jobs  # the first 16 consumers, then the rest
    assert max(len(job) for job in jobs) == MAX_LABEL_CHARS
    # Distinct long names stay distinct when cut: a hash of the whole name ends each.
    assert len({job for job in jobs if job.startswith("0000-")}) == 1
    other = {"loader": "sq", "job": "other", "sharing": "partition", "rank": "other"}
    assert value(samples, "remote_loader_batches_served_total", **other) == 0
    # The first consumers keep their own series, and a short job name is its own label.
    with RemoteLoader(served.address, "sq", job="short") as loader:
        assert len(list(loader)) == 2
    samples = scrape(served)
    short = {"loader": "sq", "job": "short", "sharing": "partition", "rank": "0"}
    assert value(samples, "remote_loader_batches_served_total", **short) is None  # full: other
    assert value(samples, "remote_loader_batches_served_total", **other) == 2


def test_job_labels_are_cut_with_a_hash_and_short_ones_kept(serve_loaders: ServeLoaders) -> None:
    served = serve_loaders(SQUARES, metrics_address="127.0.0.1:0")
    for job in ("a" * 100 + "1", "a" * 100 + "2", "short job"):
        with RemoteLoader(served.address, "sq", job=job) as loader:
            assert len(list(loader)) == 2
    samples = scrape(served)
    jobs = sorted(
        dict(labels)["job"]
        for name, labels in samples
        if name == "remote_loader_batches_served_total"
    )
    assert jobs[-1] == "short job"
    cut = jobs[:2]
    assert cut[0] != cut[1] and all(len(job) == MAX_LABEL_CHARS for job in cut)
    assert all(job.startswith("a" * 50) for job in cut)


FAILING = LoaderSpec(
    name="failing",
    dataset="tests.datasets:Failing",
    dataset_kwargs={"n": 20, "bad": 7},
    batch_size=2,
    num_workers=1,
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["auto", "grpc"])  # auto: slot Frames over shared memory
def test_a_dataset_error_is_logged_once_and_counted_on_each_stream_end_line(
    serve_loaders: ServeLoaders, caplog: pytest.LogCaptureFixture, transport: Transport
) -> None:
    caplog.set_level(logging.INFO, logger="remote_loader.server")
    served = serve_loaders(FAILING)
    got: dict[int, list[Any]] = {}

    def consume(rank: int) -> None:
        # Two broadcast consumers of one job: the batch that fails is made once, sent twice.
        with RemoteLoader(
            served.address,
            "failing",
            sharing="broadcast",
            rank=rank,
            world_size=2,
            transport=transport,
        ) as loader:
            seen: list[Any] = []
            it = iter(loader)
            while True:
                try:
                    seen.append(next(it).tolist())
                except DatasetError as exc:
                    seen.append(exc.position)
                except StopIteration:
                    break
            got[rank] = seen

    threads = [threading.Thread(target=consume, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(50)
    expected: list[Any] = [[2 * i, 2 * i + 1] for i in range(10)]
    expected[3] = 3  # samples 6 and 7: the error at batch 3
    assert got == {0: expected, 1: expected}
    assert served.server.service.wait_streams(30)
    records = [r for r in caplog.records if r.getMessage().startswith("dataset error ")]
    assert len(records) == 1, [r.getMessage() for r in records]  # once, not per consumer
    assert records[0].levelno == logging.WARNING
    error = log_fields(records[0].getMessage())
    assert (error["loader"], error["epoch"], error["batch"]) == ("failing", "0", "3")
    assert error["error"] == "ValueError: sample 7 is corrupt"
    assert error["sharing"] == "broadcast" and "worker" in error["where"]
    ends = [
        log_fields(r.getMessage())
        for r in caplog.records
        if r.getMessage().startswith("stream end ")
    ]
    assert [(end["outcome"], end["errors"]) for end in ends] == [("completed", "1")] * 2


def test_a_stream_without_errors_says_errors_0(
    serve_loaders: ServeLoaders, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="remote_loader.server")
    served = serve_loaders(SQUARES)
    with RemoteLoader(served.address, "sq") as loader:
        assert len(list(loader)) == 2
    assert served.server.service.wait_streams(30)
    (end,) = [
        log_fields(r.getMessage())
        for r in caplog.records
        if r.getMessage().startswith("stream end ")
    ]
    assert end["errors"] == "0"
    assert not [r for r in caplog.records if r.getMessage().startswith("dataset error ")]


@pytest.mark.timeout(60)
def test_the_worker_gauges_exist_from_start_up_for_every_loader(
    serve_loaders: ServeLoaders,
) -> None:
    squares: dict[str, Any] = {"dataset": "tests.datasets:Squares", "batch_size": 4}
    served = serve_loaders(
        LoaderSpec(name="inline", **squares),
        LoaderSpec(name="pooled", num_workers=2, prefetch_factor=3, **squares),
        LoaderSpec(name="persistent", num_workers=2, persistent_workers=True, **squares),
        LoaderSpec(name="auto", num_workers="auto", seeding="per_batch", **squares),  # type: ignore[arg-type]
        metrics_address="127.0.0.1:0",
    )
    samples = scrape(served)  # no stream yet: nothing was autotuned
    workers = {
        name: value(samples, "remote_loader_workers", loader=name)
        for name in ("inline", "pooled", "persistent", "auto")
    }
    assert workers == {"inline": 0, "pooled": 2, "persistent": 2, "auto": 1}
    prefetch = {
        name: value(samples, "remote_loader_prefetch_factor", loader=name)
        for name in ("inline", "pooled", "persistent", "auto")
    }
    assert prefetch == {"inline": None, "pooled": 3, "persistent": 2, "auto": 2}
