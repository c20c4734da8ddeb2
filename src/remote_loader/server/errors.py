"""The errors a call can end with, one tree with one mapping to gRPC status codes.

Every error the service reports to a client is a `CallFailed`; its class names the status
(`status`, a grpc.StatusCode name, so this module needs no gRPC and the worker side can import
it) and its kind (`reason`, sent in the call's trailing metadata: NOTE [ Error reasons ] in
protos/reasons.py), and its message is the status details. The service maps them in one place
(server/api/status.py `statuses`): anything else that escapes a call is a bug, reported as INTERNAL.

Names: each class below the root is its reason code in CamelCase (`loader-broken`:
LoaderBroken), the word the client's logs and metadata carry, with no suffix; the client's own
classes (client/errors.py, public) end in Error and are named apart (LoaderBrokenError).

Control flow that is not an error of the call stays outside the tree: StreamStopped (the
client went while the server waited on it) and BorrowAbandoned (a Run closed before it got its
engine) are caught where they are raised.

    class (status, reason)
    CallFailed (INTERNAL, internal)
    +-- InvalidRequest (INVALID_ARGUMENT, invalid-request)
    |   +-- SharingRefused (sharing-refused)    a sharing mode, rank or world_size refused
    +-- LoaderNotFound (NOT_FOUND, loader-not-found)
    |   +-- LoaderNotNamed (loader-not-named)   several loaders, and the request named none
    +-- LoaderBroken (FAILED_PRECONDITION, loader-broken)   no batch can be made
    +-- SpecChanged (FAILED_PRECONDITION, spec-changed)     a resume against another spec
    +-- ServerBusy (RESOURCE_EXHAUSTED, server-busy)        max_streams reached
    +-- Detached (ABORTED, detached)        a stalled broadcast consumer was let go
    +-- Unavailable (UNAVAILABLE, unavailable)  retry: the client resumes where it was
        +-- Closing (closing)               the server is shutting down mid-epoch, or draining
        +-- ClientSilent (client-silent)    the client's heartbeat stood still (frozen or gone)
        +-- DataConnectionLost (data-connection-lost)   the data connection broke mid-batch
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import ClassVar

from remote_loader.protos import reasons

# Characters of a client-chosen value (a loader or job name, a fingerprint) that errors and logs
# echo: a 60 KB loader name echoed whole in NOT_FOUND made its status larger than gRPC's
# metadata limit, and the client saw "metadata size exceeds hard limit" instead.
ECHO_LIMIT = 64


def clip(value: str) -> str:
    """`value` as errors and logs echo it: whole up to ECHO_LIMIT characters, else its first
    ECHO_LIMIT, "..." and its length."""
    if len(value) <= ECHO_LIMIT:
        return value
    return f"{value[:ECHO_LIMIT]}...({len(value)} characters)"


@dataclasses.dataclass(frozen=True)
class CapturedError:
    """An exception raised on the server, captured where it was raised (as torch's
    ExceptionWrapper) and carried as a value to where it is consumed: a batch's position in its
    stream (the wire's CapturedError), or the Run's `fatal` error (LoaderBroken).

    `module` and `qualname` name the exception's class (`builtins` / `ValueError`), so the
    trainer can raise it as its own type, as torch's ExceptionWrapper.reraise does. For one of
    the server's own classes, which a trainer does not import, they name the builtin class it
    derives from (a worker's death, WorkerDiedError: RuntimeError, as torch raises it), `type`
    keeping its own name; empty for an error made up without an exception (no class behind it).
    """

    where: str
    type: str
    message: str
    traceback: str
    module: str = ""
    qualname: str = ""

    @classmethod
    def capture(cls, where: str, exc: BaseException) -> CapturedError:
        text = "".join(traceback.format_exception(exc))
        kind = type(exc)
        if kind.__module__.startswith("remote_loader."):
            raised = next(c for c in kind.__mro__ if c.__module__ == "builtins")
        else:
            raised = kind
        return cls(
            where=where,
            type=kind.__name__,
            message=str(exc),
            traceback=text,
            module=raised.__module__,
            qualname=raised.__qualname__,
        )


class CallFailed(Exception):
    """An error a call ends with; `status` names its gRPC status code."""

    status: ClassVar[str] = "INTERNAL"
    # The kind, for the client (protos/reasons.py): each class below names its own.
    reason: ClassVar[str] = reasons.INTERNAL


class InvalidRequest(CallFailed, ValueError):
    """A request field out of its range, or an option the loader does not allow."""

    status = "INVALID_ARGUMENT"
    reason = reasons.INVALID_REQUEST


class SharingRefused(InvalidRequest):
    """A consumer asked for something the loader does not allow."""

    reason = reasons.SHARING_REFUSED


class LoaderNotFound(CallFailed):
    status = "NOT_FOUND"
    reason = reasons.LOADER_NOT_FOUND


class LoaderNotNamed(LoaderNotFound):
    """The server hosts several loaders and the request named none. NOT_FOUND, as the loader
    it would need is not found: the client says the same (LoaderNotFoundError) when it finds
    several loaders before it asks for one."""

    reason = reasons.LOADER_NOT_NAMED


class LoaderBroken(CallFailed):
    """The loader cannot make any batch: the dataset factory or the worker_init_fn raised in
    its workers. The message carries the original traceback; `original`, the exception itself,
    goes in the trailing metadata too (ERROR_KEY, NOTE [ Error reasons ])."""

    status = "FAILED_PRECONDITION"
    reason = reasons.LOADER_BROKEN

    def __init__(self, message: str, original: CapturedError | None = None) -> None:
        super().__init__(message)
        self.original = original


class SpecChanged(CallFailed):
    """The consumer's saved state names another spec (fingerprint): resuming would misalign."""

    status = "FAILED_PRECONDITION"
    reason = reasons.SPEC_CHANGED


class ServerBusy(CallFailed):
    status = "RESOURCE_EXHAUSTED"
    reason = reasons.SERVER_BUSY


class Detached(CallFailed):
    """This consumer was detached from its Run: it held the others back too long."""

    status = "ABORTED"
    reason = reasons.DETACHED


class Unavailable(CallFailed):
    """Try again: the client's receiver resumes the stream from the batch it was missing."""

    status = "UNAVAILABLE"
    reason = reasons.UNAVAILABLE


class Closing(Unavailable):
    """The server is draining, or shutting down mid-epoch: never a normal end."""

    reason = reasons.CLOSING


class ClientSilent(Unavailable):
    """The client gave no heartbeat (ring counter or data-connection byte) for `client_silence`
    seconds while the server waited on it: it is frozen or gone (NOTE [ Ring space ], NOTE [ TCP
    data connection ])."""

    reason = reasons.CLIENT_SILENT


class DataConnectionLost(Unavailable):
    """The client's data connection broke while a batch was being sent."""

    reason = reasons.DATA_CONNECTION_LOST
