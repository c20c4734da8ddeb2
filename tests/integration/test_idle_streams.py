"""Streams whose clients read nothing give their places to new streams at a full server, and
keep them while it has room (NOTE [ Idle streams ] in server/api/admission.py), over real gRPC.

The unit tests (no server, no process, no Ray): tests/unit/test_idle_streams.py.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from remote_loader.client import RemoteLoader, ServerError
from remote_loader.client.types import Transport
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import wire
from remote_loader.server.config.spec import LoaderSpec
from tests.helpers import ServeLoaders, wait_until

# A ceiling for work that takes milliseconds on a quiet machine and seconds on a busy one.
BUSY_MACHINE = 30.0
# 1 MB batches: gRPC's window and the socket buffers (or a ring) fill after a few, so a client
# that stops reading leaves the server's send waiting on it.
BLOBS = LoaderSpec(
    name="blobs",
    dataset="tests.datasets:Blobs",
    dataset_kwargs={"n": 400, "nbytes": 1 << 20},
    num_workers=1,
)
SMALL = LoaderSpec(
    name="small", dataset="tests.datasets:Squares", dataset_kwargs={"n": 24}, batch_size=4
)


def _raw_streams(address: str, count: int) -> tuple[grpc.Channel, list[Any], int]:
    """`count` Stream calls of loader "blobs", each read for one message and then left alone
    (their connection stays up and answers pings); returns the channel, the calls admitted and
    how many were refused (RESOURCE_EXHAUSTED)."""
    channel = grpc.insecure_channel(address)
    stream = channel.unary_stream(
        wire.STREAM_METHOD,
        request_serializer=pb.StreamRequest.SerializeToString,
        response_deserializer=pb.Frame.FromString,
    )
    admitted: list[Any] = []
    refused = 0
    for _ in range(count):
        call: Any = stream(pb.StreamRequest(loader="blobs"), timeout=10 * BUSY_MACHINE)
        try:
            next(call)
            admitted.append(call)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            refused += 1
    return channel, admitted, refused


def _served_when_admitted(address: str, loader: str, **options: Any) -> list[Any]:
    """Every batch of an epoch of `loader`, retrying (as a trainer's script would) while the
    server refuses the stream for being full; fails after BUSY_MACHINE seconds of refusals."""
    deadline = time.monotonic() + BUSY_MACHINE
    while True:
        with RemoteLoader(address, loader, retries=0, **options) as trainer:
            try:
                return list(trainer)
            except ServerError as exc:
                assert "RESOURCE_EXHAUSTED" in str(exc), exc
                if time.monotonic() > deadline:
                    raise
        time.sleep(0.2)


def _end_lines(caplog: pytest.LogCaptureFixture) -> Iterator[dict[str, str]]:
    for record in caplog.records:
        message = record.getMessage()
        if record.name == "remote_loader.server.api.stream" and message.startswith("stream end "):
            yield {
                k: v.strip('"') for k, v in re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', message)
            }


def _aborted(caplog: pytest.LogCaptureFixture) -> list[dict[str, str]]:
    return [end for end in _end_lines(caplog) if end.get("status") == "ABORTED"]


@pytest.mark.timeout(120)
def test_streams_that_read_nothing_give_their_places_to_a_trainer(
    serve_loaders: ServeLoaders, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="remote_loader.server.api.stream")
    served = serve_loaders(BLOBS, SMALL, max_streams=4, idle_stream_timeout=1.0)
    # Twice max_streams raw clients: four hold every place (on a busy machine, a late one may
    # already take the place of one that has been stuck for a second), the others are refused.
    channel, stuck, refused = _raw_streams(served.address, 8)
    try:
        assert len(stuck) >= 4 and len(stuck) + refused == 8
        # A trainer is served once a stuck stream has read nothing for idle_stream_timeout.
        batches = _served_when_admitted(served.address, "small")
        assert [b["index"].tolist() for b in batches] == [
            list(range(i, i + 4)) for i in range(0, 24, 4)
        ]
        # The stuck streams that gave their places (one for the trainer, and any a late raw
        # client took) end with a status saying why: their clients get the messages they had
        # buffered, then ABORTED. (Stream numbers count the admitted streams, in order.)
        assert wait_until(lambda: bool(_aborted(caplog)), BUSY_MACHINE)
        aborted = _aborted(caplog)
        assert {end["loader"] for end in aborted} == {"blobs"}
        assert all(end["outcome"] == "error" for end in aborted)
        for end in aborted:
            with pytest.raises(grpc.RpcError) as info:
                for _ in stuck[int(end["stream"]) - 1]:
                    pass
            assert info.value.code() == grpc.StatusCode.ABORTED
            details = info.value.details() or ""
            assert re.search(r"no batch read for \d+ s while another stream waited", details)
            assert "idle_stream_timeout=1 s" in details
        # Only places that someone needed were given up: three stuck streams still hold theirs,
        # the fourth is the trainer's, free again.
        assert len(stuck) - len(aborted) == 3
    finally:
        for call in stuck:
            call.cancel()
        channel.close()
    assert served.server.service.wait_streams(BUSY_MACHINE)


@pytest.mark.timeout(60)
def test_a_paused_trainer_keeps_its_stream_while_the_server_has_room(
    serve_loaders: ServeLoaders,
) -> None:
    blobs = dataclasses.replace(BLOBS, dataset_kwargs={"n": 24, "nbytes": 1 << 20})
    served = serve_loaders(blobs, max_streams=2, idle_stream_timeout=0.5)
    with RemoteLoader(served.address, "blobs", device="cpu", retries=0) as trainer:
        it = iter(trainer)
        first = next(it)
        time.sleep(3.0)  # six idle timeouts, but no stream waits for its place
        rest = list(it)
        assert trainer.stats().reconnects == 0
    assert [b["index"].item() for b in [first, *rest]] == list(range(24))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["auto", "tcp", "grpc"])
def test_a_paused_trainer_closed_for_a_newcomer_resumes_where_it_was(
    serve_loaders: ServeLoaders, caplog: pytest.LogCaptureFixture, transport: Transport
) -> None:
    caplog.set_level(logging.INFO, logger="remote_loader.server.api.stream")
    blobs = dataclasses.replace(BLOBS, dataset_kwargs={"n": 64, "nbytes": 1 << 20})
    served = serve_loaders(blobs, SMALL, max_streams=1, idle_stream_timeout=1.0)
    with RemoteLoader(served.address, "blobs", device="cpu", transport=transport) as paused:
        it = iter(paused)
        first = next(it)
        # Paused (an evaluation, say) while another trainer waits for the only place: the
        # paused stream gives it up once its client has taken nothing for 1 s (over shm, its
        # ring or its zero-copy leases are full; over tcp and grpc, its socket or window).
        assert len(_served_when_admitted(served.address, "small")) == 6
        # Back to training: the batches it had buffered, then the rest from a new stream
        # (a resume; over shm, zero-copy slots gone with the old stream also start one).
        rest = list(it)
    assert [b["index"].item() for b in [first, *rest]] == list(range(64))
    assert [end["loader"] for end in _aborted(caplog)] == ["blobs"]
