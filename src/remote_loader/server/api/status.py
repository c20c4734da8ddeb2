"""How a failed call ends on the wire: the one mapping of errors to statuses (`statuses`), and
its status details and trailing metadata (the reason and, for a broken loader, its original
exception), fitted under gRPC's metadata limit.

See NOTE [ Error reasons ] in protos/reasons.py; `abort_with` sends them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NoReturn

import grpc

from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import reasons
from remote_loader.server.errors import CallFailed, LoaderBroken
from remote_loader.server.transports.base import captured_error

# gRPC clients refuse a trailer (status details included) past grpc.max_metadata_size, 8 KiB by
# default, and report RESOURCE_EXHAUSTED instead of the call's own status: a broken loader would
# reach the trainer as a request too large. The details and the exception share what is left
# after the reason and the status: DETAILS_LIMIT bytes of percent-encoded details (grpc-message
# percent-encodes all but printable ASCII) and ERROR_LIMIT bytes of CapturedError, which a
# -bin key sends base64-encoded (4/3 as many).
DETAILS_LIMIT = 3072
ERROR_LIMIT = 2304
# How much of a remote error's message is kept when the error is too big (its traceback, which
# repeats the message on its last line, is clipped first).
MESSAGE_LIMIT = 512


@contextlib.contextmanager
def statuses(context: grpc.ServicerContext) -> Iterator[None]:
    """The one mapping of errors to statuses (server/errors.py): a CallFailed ends the call
    with its status and message. (A stream maps its own errors once it has started, so that
    its end line can log the status; anything else there is reported as a CallFailed.)"""
    try:
        yield
    except CallFailed as exc:
        abort_with(context, exc)


def abort_with(context: grpc.ServicerContext, error: CallFailed) -> NoReturn:
    """Ends the call with `error`'s status and message, and its reason (and a broken loader's
    exception) in the trailing metadata (NOTE [ Error reasons ], `trailer`): abort sends what
    set_trailing_metadata set."""
    details, metadata = trailer(error)
    context.set_trailing_metadata(metadata)
    context.abort(grpc.StatusCode[error.status], details)
    raise AssertionError("unreachable: context.abort raises")


def trailer(error: CallFailed) -> tuple[str, tuple[tuple[str, str | bytes], ...]]:
    """The details and trailing metadata that end a call with `error`."""
    metadata: tuple[tuple[str, str | bytes], ...] = reasons.metadata(error.reason)
    if isinstance(error, LoaderBroken) and error.original is not None:
        metadata += ((reasons.ERROR_KEY, fitted_error(captured_error(error.original))),)
    return clip_middle(str(error), DETAILS_LIMIT, details_size), metadata


def details_size(text: str) -> int:
    """The bytes `text` takes as grpc-message: printable ASCII but "%" as is, else %XX per
    UTF-8 byte."""
    return sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in text.encode())


def clip_middle(text: str, limit: int, size: Callable[[str], int] = len) -> str:
    """`text` if its size is at most `limit`, else its start and end with the middle left out:
    a call's details begin with what failed and end with the exception's own line."""
    if size(text) <= limit:
        return text
    keep = limit // 2
    while True:
        cut = len(text) - 2 * keep
        clipped = f"{text[:keep]}\n... ({cut} characters left out) ...\n{text[len(text) - keep :]}"
        if size(clipped) <= limit or keep == 0:
            return clipped
        keep = keep * 3 // 4


def fitted_error(error: pb.CapturedError, limit: int = ERROR_LIMIT) -> bytes:
    """`error` serialized in at most `limit` bytes: its message and traceback clipped in the
    middle (the traceback keeps its first frames and its last, with the exception's line)."""
    if error.ByteSize() <= limit:
        return error.SerializeToString()
    fitted = pb.CapturedError()
    fitted.CopyFrom(error)
    fitted.message = clip_middle(error.message, MESSAGE_LIMIT, _utf8_size)
    keep = limit
    while True:
        fitted.traceback = clip_middle(error.traceback, keep, _utf8_size) if keep > 0 else ""
        if fitted.ByteSize() <= limit or keep == 0:
            return fitted.SerializeToString()
        keep = keep * 3 // 4


def _utf8_size(text: str) -> int:
    return len(text.encode())
