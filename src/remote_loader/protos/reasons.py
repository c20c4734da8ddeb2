"""Why a call ended in error, as the server says it on the wire: one reason code per kind of
error, shared by both sides (the server imports it to send, the client to read; neither
imports the other).

NOTE [ Error reasons ]

A gRPC status code is too coarse to carry the kind of an error: a broken loader and a changed
spec are both FAILED_PRECONDITION, a full server and a request too large both
RESOURCE_EXHAUSTED. So every error the server ends a call with carries its reason in the
call's trailing metadata, under REASON_KEY (server/api/status.py `abort_with`; the token check,
server/api/auth.py; an undecodable request, server/api/validation.py), and the client maps the
reason to its exception (client/errors.py `map_rpc_error`). A call with no reason (an older server,
or an error gRPC itself ends the call with before any handler runs: a request over
max_request_bytes, its concurrency limit) is mapped by its status code, and, for
RESOURCE_EXHAUSTED, by its text (client/errors.py `inferred_reason`).

Two errors cannot carry a reason: gRPC core refuses a request over max_request_bytes before
the handler runs (the client infers REQUEST_TOO_LARGE), and a stream closed for a newcomer
(NOTE [ Idle streams ]) is cancelled from another thread with grpc's call API, which sends a
status and details but not the handler's trailing metadata (the client maps its ABORTED as a
broken stream, which is what IDLE_STREAM means to it anyway).

Reasons are lower-case words joined by "-", at most REASON_LIMIT characters; a client meeting
one it does not know (a newer server) falls back to the status code.

A loader that cannot make any batch (LOADER_BROKEN: its dataset factory or worker_init_fn raised
in the workers) also sends the exception itself under ERROR_KEY: a serialized CapturedError (the
message an error Frame carries, module and qualname included), so the client can raise it as
its own type, as torch's DataLoader re-raises a worker's exception (`captured_error_of`). Its
message and traceback, and the status details, are clipped in the middle (server/api/status.py) so
the whole trailer stays under gRPC's default 8 KiB metadata limit: past it, the client would
see RESOURCE_EXHAUSTED instead of the error. A client that does not know the key ignores it.
"""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf.message import DecodeError

from remote_loader.protos import loader_pb2 as pb

# The trailing-metadata key of a call's reason (lower case: gRPC metadata keys are).
REASON_KEY = "rl-reason"
# A reason longer than this is not one of ours: ignored, the status code decides.
REASON_LIMIT = 64
# The trailing-metadata key of a broken loader's original exception: a serialized CapturedError
# (binary: gRPC requires such keys to end in "-bin").
ERROR_KEY = "rl-error-bin"

# Request refused for its values (INVALID_ARGUMENT).
INVALID_REQUEST = "invalid-request"
# A sharing mode, rank or world size the loader does not allow (INVALID_ARGUMENT).
SHARING_REFUSED = "sharing-refused"
# The request's bytes did not decode as the method's message (INVALID_ARGUMENT).
UNDECODABLE_REQUEST = "undecodable-request"
# A request over the server's max_request_bytes (RESOURCE_EXHAUSTED); inferred by the client,
# gRPC sends it without a reason.
REQUEST_TOO_LARGE = "request-too-large"
# No loader of that name (NOT_FOUND).
LOADER_NOT_FOUND = "loader-not-found"
# The server hosts several loaders and the request named none (NOT_FOUND).
LOADER_NOT_NAMED = "loader-not-named"
# The loader cannot make any batch: its dataset or worker_init_fn raised (FAILED_PRECONDITION).
LOADER_BROKEN = "loader-broken"
# A resume against another spec: the fingerprint differs (FAILED_PRECONDITION).
SPEC_CHANGED = "spec-changed"
# The server runs its max_streams streams, or gRPC's concurrency limit (RESOURCE_EXHAUSTED).
SERVER_BUSY = "server-busy"
# A broadcast consumer let go for holding the others back (ABORTED).
DETACHED = "detached"
# A stream closed for a newcomer after idle_stream_timeout unread (ABORTED); see above.
IDLE_STREAM = "idle-stream"
# Retry: the server cannot serve the call now (UNAVAILABLE).
UNAVAILABLE = "unavailable"
# The server is draining or shutting down (UNAVAILABLE).
CLOSING = "closing"
# The client's heartbeat stood still for client_silence seconds (UNAVAILABLE).
CLIENT_SILENT = "client-silent"
# The stream's data connection broke mid-batch (UNAVAILABLE).
DATA_CONNECTION_LOST = "data-connection-lost"
# No token, or not the server's (UNAUTHENTICATED).
UNAUTHENTICATED = "unauthenticated"
# The server failed outside the dataset: a bug (INTERNAL).
INTERNAL = "internal"

REASONS: frozenset[str] = frozenset(
    {
        INVALID_REQUEST,
        SHARING_REFUSED,
        UNDECODABLE_REQUEST,
        REQUEST_TOO_LARGE,
        LOADER_NOT_FOUND,
        LOADER_NOT_NAMED,
        LOADER_BROKEN,
        SPEC_CHANGED,
        SERVER_BUSY,
        DETACHED,
        IDLE_STREAM,
        UNAVAILABLE,
        CLOSING,
        CLIENT_SILENT,
        DATA_CONNECTION_LOST,
        UNAUTHENTICATED,
        INTERNAL,
    }
)


def metadata(reason: str) -> tuple[tuple[str, str]]:
    """The trailing metadata that carries `reason`."""
    assert reason in REASONS, reason
    return ((REASON_KEY, reason),)


def reason_of(trailing: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The reason in a call's trailing metadata; None if it has none this side knows."""
    for key, value in trailing or ():
        if key != REASON_KEY:
            continue
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
        return text if len(text) <= REASON_LIMIT and text in REASONS else None
    return None


def captured_error_of(
    trailing: Sequence[tuple[str, str | bytes]] | None,
) -> pb.CapturedError | None:
    """The exception a call's trailing metadata carries under ERROR_KEY; None if it has none
    (an older server, another kind of error) or it does not decode."""
    for key, value in trailing or ():
        if key != ERROR_KEY or not isinstance(value, bytes):
            continue
        try:
            return pb.CapturedError.FromString(value)
        except DecodeError:
            return None
    return None
