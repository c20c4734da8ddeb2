"""The exceptions a RemoteLoader raises, and the one place gRPC errors become them.

RemoteLoaderError
├── LoaderNotFoundError    the server has no such loader, or several and none was named
├── RequestError           the server refused a request's values (INVALID_ARGUMENT, ...)
├── AuthenticationError    the server refused this client's token (UNAUTHENTICATED,
│                          PERMISSION_DENIED)
├── DatasetError           a batch failed on the server; carries the remote traceback
├── ConnectionLostError    the server cannot be reached, or the stream broke (UNAVAILABLE,
│                          ABORTED: a broadcast consumer detached for holding the others)
├── LoaderTimeoutError     no batch arrived within the loader's `timeout` (also a TimeoutError)
├── ProtocolError          the server sent frames this client cannot read
└── ServerError            any other failure reported by the server (INTERNAL, ...)
    └── ServerBusyError    the server stayed at its max_streams through every retry
                           (RESOURCE_EXHAUSTED)
"""

from __future__ import annotations

import grpc


class RemoteLoaderError(Exception):
    """Base class of every error a RemoteLoader raises."""


class LoaderNotFoundError(RemoteLoaderError):
    """The server has no loader of that name, or hosts several and none was named."""


class RequestError(RemoteLoaderError):
    """The server refused the request's values (an epoch, seed or option it cannot serve)."""


class AuthenticationError(RemoteLoaderError):
    """The server refused this client's credentials: no token, or not the server's token.

    Pass the server's token as RemoteLoader(token=...) or in REMOTE_LOADER_TOKEN.
    """


class DatasetError(RemoteLoaderError):
    """The dataset, sampler or collate_fn raised on the server while making one batch.

    Raised at the batch's position in the epoch; the stream goes on after it, so catching it
    and calling `next()` again yields the following batch (as with torch's DataLoader).
    """

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


class ConnectionLostError(RemoteLoaderError):
    """The server could not be reached, or a stream from it broke off."""


class LoaderTimeoutError(RemoteLoaderError, TimeoutError):
    """No batch arrived within the RemoteLoader's `timeout`."""


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


# The details of a RESOURCE_EXHAUSTED that says the server is full, not a message too big (that
# is RESOURCE_EXHAUSTED too, gRPC's "larger than max"): the service's own refusal (max_streams,
# server/service.py) and grpc's (its maximum_concurrent_rpcs, server/server.py).
BUSY_MARKERS = ("max_streams", "Concurrent RPC limit exceeded")


def server_busy(exc: grpc.RpcError) -> bool:
    """Whether `exc` is a server refusing for now because it is full, which a later attempt
    may pass, rather than a request over a size limit, which none will."""
    if not isinstance(exc, grpc.Call) or exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    details = exc.details() or ""
    return any(marker in details for marker in BUSY_MARKERS)


def map_rpc_error(exc: grpc.RpcError, what: str) -> RemoteLoaderError:
    """The RemoteLoaderError for a failed gRPC call; `what` says what was being done."""
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = (exc.details() if isinstance(exc, grpc.Call) else None) or str(exc)
    message = f"{what}: {details}"
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
    if server_busy(exc):
        return ServerBusyError(f"{message} (status RESOURCE_EXHAUSTED)")
    return ServerError(f"{message} (status {code.name if code else 'unknown'})")
