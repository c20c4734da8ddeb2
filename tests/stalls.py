"""Helpers of the stall tests (tests/integration/test_stall.py, test_top.py, test_page.py,
test_autotune_stall.py) and of docs/screenshots.py: pipelines made to stall or to keep up,
trainers reading them in threads, and the server's figures read back over its Status RPC (its
/metrics: tests/helpers.py's `scrape`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from remote_loader.client import RemoteLoader
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import wire
from remote_loader.server.api.server import Server
from remote_loader.server.api.settings import ServerSettings
from remote_loader.server.config.spec import LoaderSpec
from tests.helpers import wait_for


def stalled_spec(name: str = "stalled", **options: Any) -> LoaderSpec:
    """One worker, 50 ms a sample, a sample a batch: at most 20 batches/s, far below a trainer
    that does nothing else, which then waits on the workers nearly all the time."""
    values: dict[str, Any] = {
        "name": name,
        "dataset": "tests.datasets:Slow",
        "dataset_kwargs": {"n": 100_000, "seconds": 0.05},
        "batch_size": 1,
        "num_workers": 1,
        "persistent_workers": True,
    }
    values.update(options)
    return LoaderSpec(**values)


def fast_spec(name: str = "fast") -> LoaderSpec:
    """Two workers (started with the server) making tiny batches in about a millisecond."""
    return LoaderSpec(
        name=name,
        dataset="tests.datasets:Squares",
        dataset_kwargs={"n": 400_000},
        batch_size=4,
        num_workers=2,
        persistent_workers=True,
    )


class Trainer:
    """A RemoteLoader read in a thread, each step taking `step` s besides next(), epoch after
    epoch, until `stop()`."""

    def __init__(self, address: str, loader: str, step: float = 0.0, **options: Any) -> None:
        self.loader = RemoteLoader(address, loader, **options)
        self.step = step
        self.batches = 0
        self.error: BaseException | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-trainer", daemon=True)

    def start(self) -> Trainer:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                for _ in self.loader:
                    self.batches += 1
                    if self._stopped.is_set():
                        return
                    if self.step:
                        time.sleep(self.step)
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(30)
        self.loader.close()
        assert self.error is None, self.error

    def __enter__(self) -> Trainer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def status(address: str, metadata: tuple[tuple[str, str], ...] = ()) -> pb.ServerStatus:
    """The server's Status snapshot, asked by hand."""
    with grpc.insecure_channel(address) as channel:
        reply: pb.ServerStatus = channel.unary_unary(
            f"/{wire.SERVICE_NAME}/Status",
            request_serializer=pb.StatusRequest.SerializeToString,
            response_deserializer=pb.ServerStatus.FromString,
        )(pb.StatusRequest(), timeout=10, metadata=metadata)
    return reply


def report(address: str, request: pb.StallReport) -> pb.ReportReply:
    """One Report call made by hand (raises grpc.RpcError when refused)."""
    with grpc.insecure_channel(address) as channel:
        reply: pb.ReportReply = channel.unary_unary(
            f"/{wire.SERVICE_NAME}/Report",
            request_serializer=pb.StallReport.SerializeToString,
            response_deserializer=pb.ReportReply.FromString,
        )(request, timeout=10)
    return reply


def consumers_of(snapshot: pb.ServerStatus, loader: str) -> list[pb.ConsumerStatus]:
    return [c for lo in snapshot.loaders if lo.name == loader for c in lo.consumers]


@contextlib.contextmanager
def stalled_job() -> Iterator[Server]:
    """A server (with its metrics port) whose one slow worker two trainers wait on: ranks 0 and
    1 of the job "train", both reporting by the time it is handed over."""
    settings = ServerSettings(address="127.0.0.1:0", metrics_address="127.0.0.1:0")
    with Server(settings, [stalled_spec()]) as server:
        trainers = [
            Trainer(server.address, "stalled", job="train", rank=r, world_size=2).start()
            for r in range(2)
        ]
        try:
            wait_for(
                lambda: (
                    sum(c.reported for c in consumers_of(status(server.address), "stalled")) >= 2
                ),
                30,
                "both trainers' reports",
            )
            yield server
        finally:
            for trainer in trainers:
                trainer.stop()
