"""Requests the server must refuse or bound cheaply: elastic resumes planned in one pass (held to
the per-rank algorithm they replaced) and outside the lock other streams need, at most
MAX_RESHARD_RANKS ranks; Describe's epoch checked as Stream's; undecodable requests in one log
line; client-chosen names echoed short; probes of killed clients swept.

The unit tests (no server, no process, no Ray): tests/unit/test_requests.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from remote_loader.client import RemoteLoader
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import shm, shm_probe, wire
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.errors import ECHO_LIMIT
from remote_loader.server.sharing.elastic import (
    MAX_RESHARD_RANKS,
)
from tests import datasets
from tests.helpers import ServeLoaders, subprocess_env

DESCRIBE = f"/{wire.SERVICE_NAME}/Describe"
U64, I64 = 2**64 - 1, 2**63 - 1


# --- the bound, and the lock other streams need -------------------------------------------------


def _describe(address: str, request: pb.DescribeRequest) -> pb.LoaderInfo:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            DESCRIBE,
            request_serializer=pb.DescribeRequest.SerializeToString,
            response_deserializer=pb.LoaderInfo.FromString,
        )
        info: pb.LoaderInfo = call(request, timeout=60)
        return info


def _frames(address: str, request: pb.StreamRequest) -> list[pb.Frame]:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(
            wire.STREAM_METHOD,
            request_serializer=pb.StreamRequest.SerializeToString,
            response_deserializer=pb.Frame.FromString,
        )
        return list(call(request, timeout=60))


def _error(call: Any, *args: Any) -> grpc.Call:
    with pytest.raises(grpc.RpcError) as info:
        call(*args)
    assert isinstance(info.value, grpc.Call)
    return info.value


SQUARES = LoaderSpec(
    name="sq", dataset="tests.datasets:Squares", dataset_kwargs={"n": 40}, batch_size=4
)


@pytest.mark.parametrize("method", ["Describe", "Stream"])
def test_a_resume_on_more_than_max_reshard_ranks_is_refused_naming_the_bound(
    serve_loaders: ServeLoaders, method: str
) -> None:
    served = serve_loaders(SQUARES)
    one_rank = pb.Reshard(world_size=1, consumed=[0])

    def ask(world_size: int) -> Any:
        consumer = pb.Consumer(world_size=world_size)
        if method == "Describe":
            request = pb.DescribeRequest(consumer=consumer, reshard=one_rank)
            return _describe(served.address, request)
        return _frames(served.address, pb.StreamRequest(consumer=consumer, reshard=one_rank))

    # The bound counts every job's ranks: MAX_RESHARD_RANKS - 1 new ones + 1 old one is allowed.
    answer = ask(MAX_RESHARD_RANKS - 1)
    if method == "Describe":
        assert answer.length == 1  # 10 batches padded to one per rank
    else:
        assert answer[-1].end.batches == 1
    error = _error(ask, MAX_RESHARD_RANKS)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert f"MAX_RESHARD_RANKS={MAX_RESHARD_RANKS}" in (error.details() or "")
    assert f"make {MAX_RESHARD_RANKS + 1} ranks" in (error.details() or "")


GATED = LoaderSpec(
    name="gated",
    dataset="tests.datasets:Squares",
    dataset_kwargs={"n": 12},
    batch_size=2,
    sampler="tests.datasets:Gated",
)


def test_a_resharding_stream_plans_without_holding_up_another_trainer(
    serve_loaders: ServeLoaders,
) -> None:
    # The resharding stream's plan waits (tests.datasets:Gated) until the other trainer has
    # its first batch: were it planned under the registry's lock, that batch could not come.
    served = serve_loaders(GATED)
    datasets.PLAN_GATE.clear()
    datasets.PLAN_ENTERED.clear()
    wide: list[pb.Frame] = []
    resume = pb.StreamRequest(
        loader="gated",
        epoch=datasets.GATED_EPOCH,
        consumer=pb.Consumer(job="wide", rank=0, world_size=2),
        reshard=pb.Reshard(world_size=1, consumed=[0]),
    )
    planning = threading.Thread(target=lambda: wide.extend(_frames(served.address, resume)))
    other_first: list[Any] = []
    try:
        planning.start()
        assert datasets.PLAN_ENTERED.wait(60), "the resharding stream never began its plan"
        with RemoteLoader(served.address, "gated", job="other", timeout=60) as other:

            def first() -> None:
                # contextlib.suppress: closing the loader ends a fetch still waiting
                with contextlib.suppress(Exception):
                    other_first.append(next(iter(other)))

            fetch = threading.Thread(target=first)
            fetch.start()
            fetch.join(60)
            planned_meanwhile = not datasets.PLAN_GATE.is_set()
    finally:
        datasets.PLAN_GATE.set()
    planning.join(60)
    assert other_first and planned_meanwhile, "the other trainer waited for the plan"
    assert [int(i) for i in other_first[0]["index"]] == [0, 1]
    assert not planning.is_alive() and wide[-1].end.batches == 3  # 6 batches, 3 per rank


# --- Describe checks what Stream checks ---------------------------------------------------------


@pytest.mark.parametrize("method", ["Describe", "Stream"])
@pytest.mark.parametrize("epoch", [2**63, U64])
@pytest.mark.parametrize("resharded", [False, True])
def test_describe_and_stream_refuse_an_epoch_alike(
    serve_loaders: ServeLoaders, method: str, epoch: int, resharded: bool
) -> None:
    served = serve_loaders(SQUARES)
    reshard = pb.Reshard(world_size=1, consumed=[0]) if resharded else pb.Reshard()
    consumer = pb.Consumer(world_size=2)
    if method == "Describe":
        request: Any = pb.DescribeRequest(consumer=consumer, epoch=epoch, reshard=reshard)
        error = _error(_describe, served.address, request)
    else:
        request = pb.StreamRequest(consumer=consumer, epoch=epoch, reshard=reshard)
        error = _error(_frames, served.address, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert (error.details() or "").startswith(f"epoch must be between 0 and {I64} ")
    assert (error.details() or "").endswith(f", got {epoch}")


# --- undecodable requests ---------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ListLoaders", "Describe", "Stream"])
def test_an_undecodable_request_is_refused_in_one_log_line(
    serve_loaders: ServeLoaders, caplog: pytest.LogCaptureFixture, method: str
) -> None:
    served = serve_loaders(SQUARES)
    garbage = b"\xff\xff\xff\xff"  # field 0x1fffffff... with no valid wire type: never parses
    caplog.set_level(logging.INFO)
    with grpc.insecure_channel(served.address) as channel:
        path = f"/{wire.SERVICE_NAME}/{method}"
        if method == "Stream":
            stream = channel.unary_stream(path, None, None)
            error = _error(lambda: list(stream(garbage, timeout=30)))
        else:
            error = _error(channel.unary_unary(path, None, None), garbage, 30)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert f"the {method} request could not be decoded" in (error.details() or "")
    about = [r for r in caplog.records if "undecodable" in r.getMessage() or r.exc_info]
    assert len(about) == 1, [r.getMessage() for r in about]
    line = about[0].getMessage()
    assert f"undecodable {method} request from ipv4:127.0.0.1:" in line
    assert about[0].exc_info is None and "\n" not in line
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# --- client-chosen names are echoed short --------------------------------------------------------


def test_a_long_loader_name_is_echoed_short(serve_loaders: ServeLoaders) -> None:
    served = serve_loaders(SQUARES)
    name = "n" * 60_000
    error = _error(_describe, served.address, pb.DescribeRequest(loader=name))
    details = error.details() or ""
    assert error.code() == grpc.StatusCode.NOT_FOUND, details
    assert f"no loader named '{'n' * ECHO_LIMIT}...(60000 characters)'" in details
    assert len(details) < 200


def test_long_job_sharing_and_compression_names_are_echoed_short(
    serve_loaders: ServeLoaders, caplog: pytest.LogCaptureFixture
) -> None:
    served = serve_loaders(SQUARES)
    long = "j" * 20_000
    clipped = f"{'j' * ECHO_LIMIT}...(20000 characters)"
    for consumer, compression in [(pb.Consumer(sharing=long), ""), (pb.Consumer(), long)]:
        request = pb.StreamRequest(consumer=consumer, compression=compression)
        error = _error(_frames, served.address, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert clipped in (error.details() or "") and len(error.details() or "") < 300
    caplog.set_level(logging.INFO)
    assert _frames(served.address, pb.StreamRequest(consumer=pb.Consumer(job=long)))[-1].end
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stream ")]
    assert lines and all(len(line) < 1000 for line in lines)
    assert all(f'job="{clipped}"' in line or f"job={clipped}" in line for line in lines[:1])


# --- probes left by killed clients ---------------------------------------------------------------


def _killed_clients_probe() -> str:
    """The name of a probe whose client was SIGKILLed before its stream began."""
    code = (
        "import os, signal\n"
        "from remote_loader.protos import shm_probe\n"
        "probe = shm_probe.Probe()\n"
        "print(probe.name, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    name = proc.stdout.strip()
    assert os.path.exists(os.path.join(shm.SHM_DIR, name))
    return name


def _age(name: str, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(os.path.join(shm.SHM_DIR, name), (then, then))


@pytest.mark.skipif(not shm.available(), reason="needs /dev/shm")
def test_a_killed_clients_probe_is_swept_by_the_next_client(serve_loaders: ServeLoaders) -> None:
    served = serve_loaders(SQUARES)
    stale, fresh = _killed_clients_probe(), _killed_clients_probe()
    try:
        _age(stale, shm_probe.PROBE_STALE_AFTER + 5)  # as if it had been left a while ago
        with RemoteLoader(served.address, "sq") as loader:
            assert len(list(loader)) == 10
        assert not os.path.exists(os.path.join(shm.SHM_DIR, stale))
        # A probe younger than PROBE_STALE_AFTER may be a live client's: left alone.
        assert os.path.exists(os.path.join(shm.SHM_DIR, fresh))
    finally:
        for name in (stale, fresh):
            Path(shm.SHM_DIR, name).unlink(missing_ok=True)


@pytest.mark.skipif(not shm.available(), reason="needs /dev/shm")
def test_the_server_sweeps_stale_probes_when_it_reads_one() -> None:
    stale = _killed_clients_probe()
    try:
        _age(stale, shm_probe.PROBE_STALE_AFTER + 5)
        live = shm_probe.Probe()  # ... which sweeps as well: make the stale one again after it
        live.remove()
        Path(shm.SHM_DIR, stale).write_bytes(b"\0" * shm_probe.NONCE_BYTES)
        _age(stale, shm_probe.PROBE_STALE_AFTER + 5)
        assert shm_probe.read_probe("rl-probe-" + "0" * 32, b"\0" * shm_probe.NONCE_BYTES) is None
        assert not os.path.exists(os.path.join(shm.SHM_DIR, stale))
    finally:
        Path(shm.SHM_DIR, stale).unlink(missing_ok=True)
