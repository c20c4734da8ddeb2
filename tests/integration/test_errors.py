"""Errors keep their kind on the wire (NOTE [ Error reasons ], protos/reasons.py): each kind
raised on a real server (the real situation where one is practical: an unknown loader, a broken
loader, a changed spec, a full server, a request too large, ...) reaches the client as its own
exception; without a reason (an older server) the status code decides, as before.

The unit tests (no server, no process, no Ray): tests/unit/test_errors.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from remote_loader.client import (
    AuthenticationError,
    ConnectionLostError,
    LoaderBrokenError,
    LoaderNotFoundError,
    RemoteLoader,
    RequestError,
    RequestTooLargeError,
    ServerBusyError,
    ServerError,
    SpecChangedError,
)
from remote_loader.client import errors as client_errors
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import reasons, wire
from remote_loader.server.api.status import statuses
from remote_loader.server.config.spec import LoaderSpec
from tests.helpers import SERVER_CLASSES, SQUARES, ServeLoaders

# A stream of this loader stays open for a while: 40 samples of 0.25 s, made one at a time.
SLOW = LoaderSpec(
    name="slow", dataset="tests.datasets:Slow", dataset_kwargs={"n": 40, "seconds": 0.25}
)
BROKEN = LoaderSpec(
    name="broken",
    dataset="tests.datasets:Squares",
    num_workers=1,
    worker_init_fn="tests.datasets:failing_init",
)


# --- every server error class over real gRPC --------------------------------------------------

RAISE_METHOD = "/remote_loader.test.Errors/Raise"


@contextlib.contextmanager
def _raising_server() -> Iterator[grpc.Channel]:
    """A gRPC server on port 0 whose one method raises the server error class named by the
    request through the service's own mapping (`statuses`), or, for "old:NAME", ends the call
    as a server from before the reasons did: the same status and message, no reason."""
    by_name = {cls.__name__: cls for cls in SERVER_CLASSES}

    def handler(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        name = request.decode()
        old = name.startswith("old:")
        cls = by_name[name.removeprefix("old:")]
        message = f"{cls.__name__} raised (max_streams, if busy)"
        if old:
            context.abort(grpc.StatusCode[cls.status], message)
        with statuses(context):
            raise cls(message)
        yield b""  # a generator: a streaming handler, like Stream

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "remote_loader.test.Errors",
                {"Raise": grpc.unary_stream_rpc_method_handler(handler)},
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        server.stop(0)


def _raised(channel: grpc.Channel, name: str) -> grpc.RpcError:
    call = channel.unary_stream(RAISE_METHOD, None, None)(name.encode(), timeout=30)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    return info.value


def test_every_server_error_reaches_the_client_as_its_kind() -> None:
    with _raising_server() as channel:
        for cls in SERVER_CLASSES:
            exc = _raised(channel, cls.__name__)
            assert isinstance(exc, grpc.Call)
            assert exc.code() == grpc.StatusCode[cls.status], cls
            assert (reasons.REASON_KEY, cls.reason) in (exc.trailing_metadata() or ()), cls
            error = client_errors.map_rpc_error(exc, "testing")
            assert type(error) is client_errors.REASON_ERRORS[cls.reason], cls
            assert error.reason == cls.reason
            assert f"{cls.__name__} raised" in str(error)
            # An older server says the same without a reason: the status code decides, and
            # gives this error or a base of it (so `except` clauses written then still catch).
            old = client_errors.map_rpc_error(_raised(channel, f"old:{cls.__name__}"), "testing")
            assert isinstance(error, type(old)), (cls, type(old), type(error))


# --- the real situations ---------------------------------------------------------------------


def test_an_unknown_loader(serve_loaders: ServeLoaders) -> None:
    served = serve_loaders(SQUARES)
    with pytest.raises(LoaderNotFoundError, match="no loader named 'nope'") as info:
        RemoteLoader(served.address, "nope")
    assert info.value.reason == reasons.LOADER_NOT_FOUND


def test_several_loaders_and_none_named_is_not_found_on_both_sides(
    serve_loaders: ServeLoaders,
) -> None:
    served = serve_loaders(SQUARES, SLOW)
    # The client asks which loaders there are first, and says so itself.
    with pytest.raises(LoaderNotFoundError, match="hosts 2 loaders"):
        RemoteLoader(served.address)
    # A request that names none reaches the server: NOT_FOUND, as the client says.
    with grpc.insecure_channel(served.address) as channel:
        describe = channel.unary_unary(
            "/remote_loader.v1.Loader/Describe",
            request_serializer=pb.DescribeRequest.SerializeToString,
            response_deserializer=pb.LoaderInfo.FromString,
        )
        with pytest.raises(grpc.RpcError) as info:
            describe(pb.DescribeRequest(), timeout=30)
    exc = info.value
    assert isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.NOT_FOUND
    error = client_errors.map_rpc_error(exc, "describing")
    assert isinstance(error, LoaderNotFoundError) and error.reason == reasons.LOADER_NOT_NAMED
    assert "several loaders (slow, squares); name one" in str(error)


@pytest.mark.timeout(60)
def test_a_broken_loader(serve_loaders: ServeLoaders) -> None:
    served = serve_loaders(BROKEN)
    with RemoteLoader(served.address) as loader, pytest.raises(LoaderBrokenError) as info:
        next(iter(loader))
    assert isinstance(info.value, RequestError)  # what it was before it had a class
    assert info.value.reason == reasons.LOADER_BROKEN
    assert "worker_init_fn fails on purpose" in str(info.value)


def test_a_changed_spec(serve_loaders: ServeLoaders) -> None:
    old = serve_loaders(SQUARES)
    changed = serve_loaders(LoaderSpec(name="squares", dataset=SQUARES.dataset, batch_size=3))
    with RemoteLoader(old.address) as loader:
        next(iter(loader))
        state = loader.state_dict()
    # The client sees it first, from the fingerprint Describe gave it.
    with RemoteLoader(changed.address) as loader, pytest.raises(SpecChangedError):
        loader.load_state_dict(state)
    # The server refuses a stream that names the old fingerprint with the same kind.
    with grpc.insecure_channel(changed.address) as channel:
        stream = channel.unary_stream(
            wire.STREAM_METHOD,
            request_serializer=pb.StreamRequest.SerializeToString,
            response_deserializer=pb.Frame.FromString,
        )
        with pytest.raises(grpc.RpcError) as info:
            list(stream(pb.StreamRequest(fingerprint=state["fingerprint"], start=1), timeout=30))
    error = client_errors.map_rpc_error(info.value, "streaming")
    assert isinstance(error, SpecChangedError) and isinstance(error, RequestError)
    assert error.reason == reasons.SPEC_CHANGED and "has changed" in str(error)


@pytest.mark.timeout(60)
def test_a_full_server(serve_loaders: ServeLoaders) -> None:
    served = serve_loaders(SLOW, max_streams=1)
    with RemoteLoader(served.address) as first:
        running = iter(first)
        assert next(running) == 0  # the one stream allowed is running (and stays open)
        with (
            RemoteLoader(served.address, connect_timeout=5, retries=0) as second,
            pytest.raises(ServerBusyError) as info,
        ):
            next(iter(second))
    # Told by the reason the server sent, not by the text (which names max_streams too).
    assert info.value.reason == reasons.SERVER_BUSY


def test_a_request_too_large(serve_loaders: ServeLoaders) -> None:
    small = serve_loaders(SQUARES, max_request_bytes=2048)
    with pytest.raises(RequestTooLargeError, match="larger than max") as info:
        RemoteLoader(small.address, job="j" * 4000, retries=0)
    # gRPC refuses it before any handler runs, so with no reason: the client infers it.
    assert info.value.reason == reasons.REQUEST_TOO_LARGE
    assert isinstance(info.value, RequestError) and isinstance(info.value, ServerError)
    assert not isinstance(info.value, ServerBusyError)


def test_a_request_the_server_refuses(serve_loaders: ServeLoaders) -> None:
    served = serve_loaders(SQUARES)
    with grpc.insecure_channel(served.address) as channel:
        stream = channel.unary_stream(
            wire.STREAM_METHOD,
            request_serializer=pb.StreamRequest.SerializeToString,
            response_deserializer=pb.Frame.FromString,
        )
        refused = {
            reasons.INVALID_REQUEST: pb.StreamRequest(compression="bogus"),
            reasons.SHARING_REFUSED: pb.StreamRequest(consumer=pb.Consumer(rank=5, world_size=2)),
        }
        for reason, request in refused.items():
            with pytest.raises(grpc.RpcError) as info:
                list(stream(request, timeout=30))
            error = client_errors.map_rpc_error(info.value, "streaming")
            assert type(error) is RequestError and error.reason == reason, (reason, error)
        garbage = channel.unary_stream(wire.STREAM_METHOD, None, None)
        with pytest.raises(grpc.RpcError) as info:
            list(garbage(b"\xff\xff\xff", timeout=30))
        error = client_errors.map_rpc_error(info.value, "streaming")
        assert type(error) is RequestError and error.reason == reasons.UNDECODABLE_REQUEST


def test_a_draining_server_and_a_wrong_token(serve_loaders: ServeLoaders) -> None:
    served = serve_loaders(SQUARES)
    served.server.service.draining = True  # what SIGTERM sets (server/api/server.py)
    with pytest.raises(ConnectionLostError) as info:
        RemoteLoader(served.address, "squares", retries=0)
    assert info.value.__cause__ is not None
    cause = info.value.__cause__
    assert isinstance(cause, grpc.RpcError)
    assert client_errors.reason(cause) == reasons.CLOSING
    guarded = serve_loaders(SQUARES, token="s3cret-Token_0123456789")
    with pytest.raises(AuthenticationError) as refused:
        RemoteLoader(guarded.address, "squares", token="wrong-Token_9876543210")
    assert refused.value.reason == reasons.UNAUTHENTICATED
