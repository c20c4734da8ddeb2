"""Operating limits over real gRPC: the stream limit (probes still answered), the request size,
one server per port, and the structured stream log lines."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from remote_loader.client import RemoteLoader, RequestError, ServerBusyError
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import wire
from remote_loader.server.api.server import Server
from remote_loader.server.api.settings import ServerSettings
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.sharing.membership import MAX_WORLD_SIZE
from tests.datasets import read_counts
from tests.helpers import ROOT, SLOW, SQUARES, ServeLoaders, log_fields, log_lines


def _last_frame(address: str, request: pb.StreamRequest, timeout: float = 30) -> pb.Frame:
    """The last Frame of a Stream call that succeeds (its end frame)."""
    with grpc.insecure_channel(address) as channel:
        frames = channel.unary_stream(
            wire.STREAM_METHOD,
            request_serializer=pb.StreamRequest.SerializeToString,
            response_deserializer=pb.Frame.FromString,
        )(request, timeout=timeout)
        last: pb.Frame = list(frames)[-1]
        return last


def _stream_error(address: str, request: pb.StreamRequest) -> tuple[grpc.Call, float]:
    """The error status of a Stream call and how long it took to arrive."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(
            wire.STREAM_METHOD,
            request_serializer=pb.StreamRequest.SerializeToString,
            response_deserializer=pb.Frame.FromString,
        )
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            list(call(request, timeout=30))
        assert isinstance(info.value, grpc.Call)
        return info.value, time.monotonic() - started


def test_one_stream_over_the_limit_is_refused_at_once(serve_loaders: ServeLoaders) -> None:
    served = serve_loaders(SLOW, max_streams=1)
    with RemoteLoader(served.address) as first:
        it = iter(first)
        assert next(it) == 0  # the one stream allowed is running (and stays open)
        error, seconds = _stream_error(served.address, pb.StreamRequest(loader="slow"))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert seconds < 2.0  # refused at once, not queued behind the running stream
        assert "already runs its max_streams=1 streams" in (error.details() or "")
        assert "--max-streams" in (error.details() or "")
        # Probes and Describe are not streams: a full server still answers them.
        with grpc.insecure_channel(served.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # Without retries a RemoteLoader says so at once (tests/integration/test_connect.py: it
        # retries).
        with RemoteLoader(served.address, connect_timeout=2, retries=0) as second:
            assert len(second) == 40
            with pytest.raises(ServerBusyError, match=r"max_streams=1 .*RESOURCE_EXHAUSTED"):
                next(iter(second))
        assert next(it) == 1  # the running stream was not disturbed
    # Once the first stream has ended, its place is free again.
    assert served.server.service.wait_streams(5)
    with RemoteLoader(served.address) as again:
        assert next(iter(again)) == 0


def test_request_size_limit(serve_loaders: ServeLoaders) -> None:
    small = serve_loaders(SQUARES, max_request_bytes=2048)
    with RemoteLoader(small.address, job="j" * 1000) as loader:  # within the limit
        assert len(loader) == 13
    error, _ = _stream_error(
        small.address, pb.StreamRequest(loader="squares", consumer=pb.Consumer(job="j" * 4000))
    )
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in (error.details() or "")
    # The default (64 KiB) takes the 4000-byte request.
    default = serve_loaders(SQUARES)
    with RemoteLoader(default.address, job="j" * 4000) as loader:
        assert len(list(loader)) == 13


def test_a_second_server_on_the_same_port_fails_clearly(serve_loaders: ServeLoaders) -> None:
    served = serve_loaders(SQUARES)
    port = served.server.port
    with pytest.raises(OSError, match=rf"cannot listen on 127\.0\.0\.1:{port}: .*another server"):
        Server(ServerSettings(address=f"127.0.0.1:{port}"), [SQUARES])
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "remote_loader.server.cli.main",
            "serve",
            "--dataset",
            "tests.datasets:Squares",
            "--address",
            f"127.0.0.1:{port}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"remote-loader: error: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "is another server using it?" in result.stderr
    # ... and the first server was not disturbed.
    with RemoteLoader(served.address) as loader:
        assert len(list(loader)) == 13


# --- stream log lines -----------------------------------------------------------------------


def test_stream_log_lines_are_key_value_with_the_peer_and_the_error(
    serve_loaders: ServeLoaders, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="remote_loader.server.api.stream")
    broken = LoaderSpec(
        name="broken",
        dataset="tests.datasets:Squares",
        num_workers=1,
        worker_init_fn="tests.datasets:failing_init",
    )
    served = serve_loaders(SQUARES, broken)
    with RemoteLoader(served.address, "squares", job="my job") as loader:
        assert len(list(loader)) == 13
    with RemoteLoader(served.address, "broken") as loader, pytest.raises(RequestError):
        next(iter(loader))
    with RemoteLoader(served.address, "squares") as loader:
        next(iter(loader))  # then closed: the client cancels the stream

    starts = [log_fields(line) for line in log_lines(caplog, "stream start ", 3)]
    ends = [log_fields(line) for line in log_lines(caplog, "stream end ", 3)]
    assert len(starts) == len(ends) == 3
    ok, failed, cancelled = sorted(ends, key=lambda f: int(f["stream"]))
    assert [s["stream"] for s in starts] == [ok["stream"], failed["stream"], cancelled["stream"]]
    assert starts[0]["peer"].startswith("ipv4:127.0.0.1:") and starts[0]["job"] == "my job"
    assert (ok["loader"], ok["outcome"], ok["batches"]) == ("squares", "completed", "13")
    assert int(ok["bytes"]) > 0 and float(ok["seconds"]) >= 0
    assert (failed["outcome"], failed["status"]) == ("error", "FAILED_PRECONDITION")
    assert "cannot make batches" in failed["error"]
    assert cancelled["outcome"] == "cancelled" and "status" not in cancelled


U64, I64 = 2**64 - 1, 2**63 - 1
EPOCH_RANGE = rf"epoch must be between 0 and {I64} .*, got {U64}$"


@pytest.mark.parametrize(
    ("request_fields", "sharing", "message"),
    [
        ({"seed": I64, "epoch": U64}, "partition", EPOCH_RANGE),
        ({"seed": -(2**63), "epoch": 0}, "partition", None),  # the least seed torch takes
        ({"seed": I64, "epoch": I64}, "partition", None),  # the greatest sum: 2**64 - 2
        ({"seed": 1, "epoch": U64}, "broadcast", EPOCH_RANGE),
        # In range as a sum, but a sampler's own seed + epoch would not be: refused alike.
        ({"seed": -(2**63), "epoch": U64}, "dynamic", EPOCH_RANGE),
        ({"start": U64}, "partition", r"start must be between 0 and 24 \(this consumer"),
        ({"start": U64}, "broadcast", r"start must be between 0 and 48 \(this consumer"),
        ({"start": 25}, "partition", r"start must be between 0 and 24 .*, got 25$"),
        ({"start": 24}, "partition", None),  # nothing left to send: a legal resume
        ({"start": U64}, "dynamic", rf"start must be between 0 and {I64}, got {U64}"),
    ],
)
def test_out_of_range_positions_are_refused_before_any_read(
    serve_loaders: ServeLoaders,
    tmp_path: Path,
    request_fields: dict[str, int],
    sharing: str,
    message: str | None,
) -> None:
    log = str(tmp_path / "reads")
    served = serve_loaders(
        LoaderSpec(
            name="counted",
            dataset="tests.datasets:Counted",
            dataset_kwargs={"log": log, "n": 48},
            num_workers=2,
        )
    )
    consumer = pb.Consumer(sharing=sharing, rank=1, world_size=2)
    request = pb.StreamRequest(loader="counted", consumer=consumer)
    for field, value in request_fields.items():
        setattr(request, field, value)
    if message is None:
        assert _last_frame(served.address, request).HasField("end")
        return
    error, _ = _stream_error(served.address, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert re.search(message, error.details() or ""), error.details()
    assert read_counts(log) == {}  # refused before the dataset was touched


@pytest.mark.parametrize(("epoch", "refused"), [(I64, False), (2**63, True), (U64, True)])
def test_a_samplers_own_seed_plus_the_epoch_stays_in_range(
    serve_loaders: ServeLoaders, epoch: int, refused: bool
) -> None:
    # DistributedSampler seeds its generator with its own seed + epoch (set_epoch): any epoch
    # the server accepts must keep that sum within torch's range, whatever the request's seed.
    served = serve_loaders(
        LoaderSpec(
            name="own-seed",
            dataset="tests.datasets:Squares",
            dataset_kwargs={"n": 8},
            sampler="torch.utils.data:DistributedSampler",
            sampler_kwargs={"num_replicas": 1, "rank": 0, "seed": 2**63 - 1},
        )
    )
    request = pb.StreamRequest(loader="own-seed", epoch=epoch, seed=-(2**63))
    if refused:
        error, _ = _stream_error(served.address, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        expected = rf"epoch must be between 0 and {I64} .*, got {epoch}$"
        assert re.search(expected, error.details() or ""), error.details()
        return
    assert _last_frame(served.address, request).end.batches == 8


def test_the_largest_job_costs_what_its_joined_ranks_cost(serve_loaders: ServeLoaders) -> None:
    # One rank of a 2**20-rank partition: the server must not build state for the ranks that
    # never join (it once built a lane per rank, 1.1 GB and 6 s before the first batch).
    served = serve_loaders(LoaderSpec(name="wide", dataset="tests.datasets:Squares", batch_size=4))
    consumer = pb.Consumer(sharing="partition", rank=3, world_size=MAX_WORLD_SIZE)
    tracemalloc.start()
    try:
        end = _last_frame(served.address, pb.StreamRequest(loader="wide", consumer=consumer), 120)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # DistributedSampler pads the 50 samples to one per rank: rank 3 gets sample 3 alone.
    assert end.end.batches == 1
    # The padded index list of 2**20 ints is the one thing this size must cost (~40 MB).
    assert peak < 200 << 20, f"{peak / 2**20:.0f} MiB traced for one joined rank"
