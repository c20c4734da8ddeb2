"""Is the GPU waiting? A trainer's stall over its last seconds and the stage holding it (NOTE
[ Stall stages ] in protos/stall.py), on real servers and trainers: a pipeline made to stall on
its workers, one that keeps up, the same figures on /metrics and from the Status RPC, the
reports' bounds, and an older server.

The unit tests (no server, no process, no Ray): tests/unit/test_stall.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from remote_loader.client.report import StallReporter
from remote_loader.client.stall import StallWindow
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import stall
from remote_loader.server.api.server import Server
from remote_loader.server.api.settings import ServerSettings
from remote_loader.server.config.spec import LoaderSpec
from tests.helpers import scrape, value, wait_for
from tests.stalls import Trainer, consumers_of, fast_spec, report, stalled_spec, status

CONSUMER = {"job": "default", "sharing": "partition", "rank": "0"}


# --- real servers and trainers --------------------------------------------------------------


@pytest.fixture(scope="module")
def served() -> Iterator[Server]:
    settings = ServerSettings(address="127.0.0.1:0", metrics_address="127.0.0.1:0")
    with Server(settings, [stalled_spec(), fast_spec()]) as server:
        yield server


@pytest.mark.timeout(90)
def test_a_trainer_waiting_on_one_slow_worker_stalls_on_the_workers(served: Server) -> None:
    with Trainer(served.address, "stalled") as trainer:
        wait_for(lambda: trainer.batches >= 40, 30, "40 batches")
        stats = trainer.loader.stats()
        assert stats.window_wait_fraction > 0.5, stats
        assert stats.wait_stage == "workers", stats
        # The server's view: the trainer's report on /metrics, and in the Status snapshot.
        assert served.metrics_port is not None
        wait_for(
            lambda: any(c.reported for c in consumers_of(status(served.address), "stalled")),
            10,
            "a report",
        )
        samples = scrape(served.metrics_port)
        stalled = value(samples, "remote_loader_consumer_stall", loader="stalled", **CONSUMER)
        assert stalled is not None and stalled > 0.5
        by_stage = {
            stage: value(
                samples,
                "remote_loader_consumer_stall_by_stage",
                loader="stalled",
                stage=stage,
                **CONSUMER,
            )
            or 0.0
            for stage in stall.STAGES
        }
        assert max(by_stage, key=by_stage.__getitem__) == "workers", by_stage
        ready = value(samples, "remote_loader_consumer_ready_batches", loader="stalled", **CONSUMER)
        assert ready is not None and ready <= 1  # nothing waits ahead of a stalled trainer
        busy = value(samples, "remote_loader_worker_busy_seconds_total", loader="stalled")
        assert busy is not None and busy > 1.0
        (seen,) = consumers_of(status(served.address), "stalled")
        assert seen.reported and seen.attached and seen.stage == "workers"
        assert seen.wait_fraction > 0.5 and 5 < seen.batches_per_second <= 25
        assert len(seen.wait_history) >= 1
        (loader,) = [lo for lo in status(served.address).loaders if lo.name == "stalled"]
        assert loader.workers == 1 and loader.busy > 0.5 and loader.make_seconds >= 0.04


@pytest.mark.timeout(90)
def test_a_trainer_whose_workers_keep_up_hardly_stalls(served: Server) -> None:
    with Trainer(served.address, "fast", step=0.02) as trainer:
        # Its first batch waits for the epoch to start (a fraction of a second on a busy
        # machine): the figure is below 0.05 once that wait has left the window.
        wait_for(
            lambda: trainer.batches >= 100 and trainer.loader.stats().window_wait_fraction < 0.05,
            stall.WINDOW_SECONDS + 15,
            "the stall to settle below 0.05",
        )
        assert served.metrics_port is not None
        port = served.metrics_port

        def reported() -> float | None:
            samples = scrape(port)
            return value(samples, "remote_loader_consumer_stall", loader="fast", **CONSUMER)

        wait_for(lambda: (reported() or 1.0) < 0.05, 5, "the report on /metrics")
        (seen,) = consumers_of(status(served.address), "fast")
        assert seen.wait_fraction < 0.05 and seen.ready >= 1


@pytest.mark.timeout(60)
def test_a_trainer_reports_at_most_once_a_second_and_each_report_is_checked(
    served: Server,
) -> None:
    with Trainer(served.address, "stalled") as trainer:
        started = time.monotonic()
        wait_for(lambda: trainer.loader._reporter.sent >= 3, 15, "3 reports")
        assert trainer.loader._reporter.sent <= time.monotonic() - started + 1
    request = pb.StallReport(
        loader="stalled", consumer=pb.Consumer(job="hand", world_size=1), reporter=99
    )
    report(served.address, request)
    with pytest.raises(grpc.RpcError) as refused:
        report(served.address, request)  # the same reporter, within MIN_REPORT_GAP
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    request.reporter, request.stage = 100, "lunch"
    with pytest.raises(grpc.RpcError) as invalid:
        report(served.address, request)
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    request.stage, request.consumer.rank = "", 5  # rank 5 of a world of 1
    with pytest.raises(grpc.RpcError) as invalid:
        report(served.address, request)
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.timeout(60)
def test_trainers_past_the_consumer_series_cap_share_the_other_series() -> None:
    spec = LoaderSpec(name="inline", dataset="tests.datasets:Squares", batch_size=2)
    settings = ServerSettings(
        address="127.0.0.1:0", metrics_address="127.0.0.1:0", metrics_max_consumers=1
    )
    with Server(settings, [spec]) as server:
        with Trainer(server.address, "inline", step=0.01, job="first"):
            wait_for(
                lambda: any(c.reported for c in consumers_of(status(server.address), "inline")),
                10,
                "a report",
            )
            for reporter, job in ((7, "second"), (8, "third")):
                report(
                    server.address,
                    pb.StallReport(
                        loader="inline",
                        consumer=pb.Consumer(job=job, world_size=1),
                        reporter=reporter,
                        wait_fraction=0.25 * (reporter - 6),
                        stage="copy",
                    ),
                )
            assert server.metrics_port is not None
            samples = scrape(server.metrics_port)
        stalls = {
            dict(labels)["job"]: value
            for (name, labels), value in samples.items()
            if name == "remote_loader_consumer_stall"
        }
        assert set(stalls) == {"first", "other"} and stalls["other"] == pytest.approx(0.5)


@pytest.mark.timeout(30)
def test_the_reporter_stops_at_a_server_that_predates_the_report_call() -> None:
    from concurrent import futures

    older = grpc.server(futures.ThreadPoolExecutor(max_workers=2))  # serves no Report method
    port = older.add_insecure_port("127.0.0.1:0")
    older.start()
    try:
        window = StallWindow()
        window.blocked(time.monotonic())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reporter = StallReporter(channel, window, interval=0.1)
            reporter.follow("any", pb.Consumer(), 0)
            wait_for(lambda: reporter.unsupported, 10, "UNIMPLEMENTED")
            reporter.close()
            assert reporter.sent == 0
    finally:
        older.stop(0)


@pytest.mark.timeout(30)
def test_the_reporter_thread_ends_once_the_loop_stops_reading_and_comes_back_with_it() -> None:
    window = StallWindow(window=0.2)
    with grpc.insecure_channel("127.0.0.1:1") as channel:  # never called: nothing is read
        reporter = StallReporter(channel, window, interval=0.05)
        reporter.follow("any", pb.Consumer(), 0)
        thread = reporter._thread
        assert thread is not None
        thread.join(5)  # idle a window after follow(): it ends, holding nothing alive
        assert not thread.is_alive() and reporter._thread is None
        reporter.follow("any", pb.Consumer(), 1)  # the next stream starts another
        assert reporter._thread is not None and reporter._thread.is_alive()
        reporter.close()
        assert reporter.sent == 0 and not reporter._thread.is_alive()
