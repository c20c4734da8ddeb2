"""The exceptions a RemoteLoader raises, and the one place gRPC errors become them.

RemoteLoaderError                       (`.reason`: the server's reason code, if any)
├── LoaderNotFoundError    no such loader, or several and none named (loader-not-found,
│                          loader-not-named; NOT_FOUND)
├── RequestError           the server refused a request's values (invalid-request,
│   │                      sharing-refused, undecodable-request; INVALID_ARGUMENT, ...)
│   ├── LoaderBrokenError  the loader cannot make any batch: its dataset or worker_init_fn
│   │                      raised on the server (loader-broken); also of that exception's
│   │                      type where the server sends it and this side can import it
│   ├── SpecChangedError   a resume against a spec that changed since (spec-changed)
│   └── RequestTooLargeError   a request over the server's max_request_bytes
│                          (request-too-large; also a ServerError, as it was before)
├── AuthenticationError    the server refused this client's token (unauthenticated;
│                          UNAUTHENTICATED, PERMISSION_DENIED)
├── DatasetError           a batch failed on the server; carries the remote traceback. Also
│                          an instance of the original exception's type (ValueError, KeyError,
│                          the dataset's own class, ...) where this side can import it, with
│                          torch's message "Caught ValueError in DataLoader worker process 0";
│                          else of RuntimeError, as torch (NOTE [ Remote exception types ] in
│                          client/reraise.py); a plain DatasetError from an older server
├── ConnectionLostError    the server cannot be reached, or the stream broke (unavailable,
│                          closing, client-silent, data-connection-lost, detached, idle-stream;
│                          UNAVAILABLE, ABORTED)
├── LoaderTimeoutError     no batch arrived within the loader's `timeout` (also a TimeoutError,
│                          and a RuntimeError as torch's "DataLoader timed out")
├── ProtocolError          the server sent frames this client cannot read
└── ServerError            any other failure reported by the server (internal; INTERNAL, ...)
    └── ServerBusyError    the server stayed at its max_streams through every retry
                           (server-busy; RESOURCE_EXHAUSTED)

NOTE [ Error reasons ] (protos/reasons.py): the server names each error's kind in the call's
trailing metadata; `map_rpc_error` maps that reason to the exception (REASON_ERRORS), and a
call without one (an older server, or gRPC's own refusals) by its status code.
"""

from __future__ import annotations

from typing import Any

import grpc

from remote_loader.client import reraise
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import reasons


class RemoteLoaderError(Exception):
    """Base class of every error a RemoteLoader raises."""

    # The server's reason code for the error (protos/reasons.py), or the one inferred from a
    # status sent without one; None for errors of this side (a timeout, frames unreadable).
    reason: str | None = None


class LoaderNotFoundError(RemoteLoaderError):
    """The server has no loader of that name, or hosts several and none was named."""


class RequestError(RemoteLoaderError):
    """The server refused the request's values (an epoch, seed or option it cannot serve)."""


class LoaderBrokenError(RequestError):
    """The loader on the server cannot make any batch: its dataset factory or worker_init_fn
    raised in its workers. The message carries the server's traceback; fix the loader and
    restart the server (no retry helps)."""


class SpecChangedError(RequestError):
    """The saved state was made with another spec of the loader (its fingerprint differs):
    resuming would not line the batches up. Start the epoch afresh, or serve the old spec."""


class AuthenticationError(RemoteLoaderError):
    """The server refused this client's credentials: no token, or not the server's token.

    Pass the server's token as RemoteLoader(token=...) or in REMOTE_LOADER_TOKEN.
    """


class DatasetError(RemoteLoaderError):
    """The dataset, sampler or collate_fn raised on the server while making one batch.

    Raised at the batch's position in the epoch; the stream goes on after it, so catching it
    and calling `next()` again yields the following batch (as with torch's DataLoader). The
    error raised is also of the original exception's type where the client can import it
    (`except ValueError` catches it, as with torch's DataLoader; client/reraise.py).
    """

    position: int  # the batch's position in the epoch
    where: str  # e.g. "in DataLoader worker process 1"
    remote_type: str  # the original exception's class name
    remote_message: str  # str() of the original exception
    remote_traceback: str  # its traceback, formatted on the server

    def __init__(
        self, position: int, where: str, remote_type: str, message: str, remote_traceback: str
    ) -> None:
        self.position = position
        self.where = where
        self.remote_type = remote_type
        self.remote_message = message
        self.remote_traceback = remote_traceback
        super().__init__(
            f"{remote_type} at batch {position} {where}.\nOriginal {remote_traceback.rstrip()}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception pickles its args (the message): rebuild from the five parts instead.
        parts = (self.position, self.where, self.remote_type, self.remote_message)
        return (DatasetError, (*parts, self.remote_traceback))


def dataset_error(position: int, error: pb.CapturedError) -> DatasetError:
    """The DatasetError for batch `position`, which failed on the server with `error`: also of
    the original type, with torch's message, where this side has that type (NOTE [ Remote
    exception types ] in client/reraise.py); a plain one as before where it has not."""
    original = reraise.original_class(error.module, error.qualname)
    if original is None:
        return DatasetError(position, error.where, error.type, error.message, error.traceback)
    message = reraise.torch_message(original, error.where, error.traceback)
    rebuild = (_unpickle_dataset_error, (position, error.SerializeToString()))
    exc = reraise.raise_as(original, DatasetError, message, rebuild)
    exc.position = position
    exc.where = error.where
    exc.remote_type = error.type
    exc.remote_message = error.message
    exc.remote_traceback = error.traceback
    return exc


class ConnectionLostError(RemoteLoaderError):
    """The server could not be reached, or a stream from it broke off."""


class LoaderTimeoutError(RemoteLoaderError, TimeoutError, RuntimeError):
    """No batch arrived within the RemoteLoader's `timeout`.

    Also a RuntimeError: torch's DataLoader raises RuntimeError("DataLoader timed out after N
    seconds"), and a script written for it catches that."""


class TransportError(RemoteLoaderError):
    """transport="tcp" was asked for and the stream cannot have it: the server offers no data
    connection (data_address "off", another version), or it could not be made (a firewall, a
    TLS check). transport="auto" goes on inside the gRPC stream instead."""


class ProtocolError(RemoteLoaderError):
    """The server sent frames this client cannot read (a bug, or mismatched versions)."""


class ServerError(RemoteLoaderError):
    """The server reported a failure that is not the dataset's (status INTERNAL, UNKNOWN, ...)."""


class ServerBusyError(ServerError):
    """The server refused the stream for now, being full (its max_streams), and still was after
    the client's `retries`: raise the server's max_streams or run fewer streams at once."""


class RequestTooLargeError(RequestError, ServerError):
    """A request over the server's max_request_bytes (a job or loader name too long): no retry
    helps. Also a ServerError, which this error was before it had a class of its own."""


# Each reason a server sends (protos/reasons.py) and the error it raises here.
REASON_ERRORS: dict[str, type[RemoteLoaderError]] = {
    reasons.INVALID_REQUEST: RequestError,
    reasons.SHARING_REFUSED: RequestError,
    reasons.UNDECODABLE_REQUEST: RequestError,
    reasons.REQUEST_TOO_LARGE: RequestTooLargeError,
    reasons.LOADER_NOT_FOUND: LoaderNotFoundError,
    reasons.LOADER_NOT_NAMED: LoaderNotFoundError,
    reasons.LOADER_BROKEN: LoaderBrokenError,
    reasons.SPEC_CHANGED: SpecChangedError,
    reasons.SERVER_BUSY: ServerBusyError,
    reasons.DETACHED: ConnectionLostError,
    reasons.IDLE_STREAM: ConnectionLostError,
    reasons.UNAVAILABLE: ConnectionLostError,
    reasons.CLOSING: ConnectionLostError,
    reasons.CLIENT_SILENT: ConnectionLostError,
    reasons.DATA_CONNECTION_LOST: ConnectionLostError,
    reasons.UNAUTHENTICATED: AuthenticationError,
    reasons.INTERNAL: ServerError,
}

# Fallback only, for a RESOURCE_EXHAUSTED that carries no reason: the details that say the
# server is full, not a message too big (RESOURCE_EXHAUSTED too, gRPC's "larger than max").
# grpc's own refusal (its maximum_concurrent_rpcs, server/api/server.py) never carries a reason;
# a server older than the reasons refused with text naming max_streams (server/api/service.py).
BUSY_MARKERS = ("max_streams", "Concurrent RPC limit exceeded")


def reason(exc: grpc.RpcError) -> str | None:
    """The kind of error that ended the call: the reason the server sent in its trailing
    metadata, else for RESOURCE_EXHAUSTED the one its text implies (server-busy, or gRPC's
    refusal of a request over max_request_bytes); None: the status code alone tells."""
    if not isinstance(exc, grpc.Call):
        return None
    try:
        sent = reasons.reason_of(exc.trailing_metadata())
    except Exception:  # a call that ended before any metadata: no reason, the code tells
        sent = None
    if sent is not None:
        return sent
    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    details = exc.details() or ""
    if any(marker in details for marker in BUSY_MARKERS):
        return reasons.SERVER_BUSY
    return reasons.REQUEST_TOO_LARGE


def server_busy(exc: grpc.RpcError) -> bool:
    """Whether `exc` is a server refusing for now because it is full, which a later attempt
    may pass, rather than a request over a size limit, which none will."""
    return reason(exc) == reasons.SERVER_BUSY


def map_rpc_error(exc: grpc.RpcError, what: str) -> RemoteLoaderError:
    """The RemoteLoaderError for a failed gRPC call; `what` says what was being done."""
    error = _error(exc, what)
    error.reason = reason(exc)
    return error


def _error(exc: grpc.RpcError, what: str) -> RemoteLoaderError:
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = (exc.details() if isinstance(exc, grpc.Call) else None) or str(exc)
    message = f"{what}: {details}"
    kind = REASON_ERRORS.get(reason(exc) or "")
    if kind is not None:
        if issubclass(kind, ServerError):  # says its status, as below
            return kind(f"{message} (status {code.name if code else 'unknown'})")
        if kind is LoaderBrokenError:
            return broken_error(message, _captured_error(exc))
        return kind(message)
    # No reason (an older server, or an error of gRPC's): the status code says what it can.
    if code == grpc.StatusCode.NOT_FOUND:
        return LoaderNotFoundError(message)
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return AuthenticationError(message)
    if code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
    ):
        return RequestError(message)
    # ABORTED: the server let go of this stream (a broadcast consumer detached for stalling).
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED):
        return ConnectionLostError(message)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ConnectionLostError(f"{what}: no answer from the server in time ({details})")
    return ServerError(f"{message} (status {code.name if code else 'unknown'})")


def broken_error(message: str, error: pb.CapturedError | None) -> LoaderBrokenError:
    """LoaderBrokenError, also of the type of the exception that broke the loader where the
    server sent it (reasons.ERROR_KEY) and this side has that type, as torch raises a failing
    worker_init_fn's exception as its own type (NOTE [ Remote exception types ])."""
    original = reraise.original_class(error.module, error.qualname) if error else None
    if error is None or original is None:
        return LoaderBrokenError(message)
    rebuild = (_unpickle_broken_error, (message, error.SerializeToString()))
    return reraise.raise_as(original, LoaderBrokenError, message, rebuild)


def _captured_error(exc: grpc.RpcError) -> pb.CapturedError | None:
    if not isinstance(exc, grpc.Call):
        return None
    try:
        return reasons.captured_error_of(exc.trailing_metadata())
    except Exception:  # a call that ended before any metadata: nothing was sent
        return None


# Pickling a typed error (its class is made at run time) rebuilds it from the CapturedError.
def _unpickle_dataset_error(position: int, error: bytes) -> DatasetError:
    return dataset_error(position, pb.CapturedError.FromString(error))


def _unpickle_broken_error(message: str, error: bytes) -> LoaderBrokenError:
    return broken_error(message, pb.CapturedError.FromString(error))
