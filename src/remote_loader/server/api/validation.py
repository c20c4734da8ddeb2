"""What the Loader service checks in a request before anything reads the dataset: that it
decodes at all, and the epoch, elastic origin and start that Stream and Describe share.

A request whose bytes do not parse would make grpc log a full traceback (its deserializer
raising) and answer INTERNAL; `decoder` hands the handler an `Undecodable` instead, which it
refuses with INVALID_ARGUMENT and one log line naming the peer and the method.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import NoReturn, TypeVar

import grpc

from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import reasons
from remote_loader.server.errors import InvalidRequest, clip
from remote_loader.server.sharing.elastic import Reshard, ReshardError
from remote_loader.server.sharing.host import LoaderHost
from remote_loader.server.sharing.membership import Membership

log = logging.getLogger(__name__)


M = TypeVar("M")


@dataclasses.dataclass(frozen=True)
class Undecodable:
    """A request whose bytes did not parse as its method's message, and why."""

    error: str


def decoder(message: Callable[[bytes], M]) -> Callable[[bytes], M | Undecodable]:
    """A request_deserializer for `message` (a message class's FromString) that never raises:
    grpc logs a traceback for each exception its deserializer raises."""

    def decode(data: bytes) -> M | Undecodable:
        try:
            return message(data)
        except Exception as exc:  # DecodeError, or whatever a malformed message raises
            return Undecodable(f"{type(exc).__name__}: {clip(str(exc))}")

    return decode


def decoded(method: str, request: M | Undecodable, context: grpc.ServicerContext) -> M:
    """`request`; ends the call with INVALID_ARGUMENT, logging one line, if it did not decode."""
    if isinstance(request, Undecodable):
        _refuse(method, request, context)
    return request


def _refuse(method: str, request: Undecodable, context: grpc.ServicerContext) -> NoReturn:
    log.warning("undecodable %s request from %s: %s", method, context.peer(), request.error)
    context.set_trailing_metadata(reasons.metadata(reasons.UNDECODABLE_REQUEST))
    context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the {method} request could not be decoded ({request.error}); is the client a "
        "remote_loader client speaking remote_loader.v1?",
    )
    raise AssertionError("unreachable: context.abort raises")


# torch.Generator.manual_seed takes [-2**63, 2**64 - 1]; an epoch's generator is seeded
# seed + epoch (server/config/sampling.py), and a DistributedSampler-style sampler seeds its own
# generator with its seed + epoch. Seeds are int64 (request and spec), so an epoch of at most
# 2**63 - 1 keeps every such sum in range whatever the seed.
MAX_EPOCH = 2**63 - 1
# A stream's positions travel as uint64 (Frame.batch, StreamEnd.batches) and are counted on from
# `start`: a start past this could not be numbered to the end of any epoch.
MAX_START = 2**63 - 1


def check_epoch(
    host: LoaderHost,
    membership: Membership,
    epoch: int,
    seed: int,
    reshard_message: pb.Reshard,
) -> tuple[Reshard | None, int | None]:
    """The consumer's elastic origin and its batches in `epoch` (None where not known in
    advance: dynamic sharing, unsized iterables), checked before any read: InvalidRequest for
    what Stream and Describe both refuse (this one check serves both)."""
    if epoch > MAX_EPOCH:
        raise InvalidRequest(
            f"epoch must be between 0 and {MAX_EPOCH} (the epoch's generators are seeded with "
            f"seed + epoch, as DistributedSampler does), got {epoch}"
        )
    reshard: Reshard | None = None
    try:
        reshard = Reshard.of(reshard_message)
        if reshard is not None and membership.sharing != "partition":
            raise ReshardError(
                "only partition sharing resumes on another world size (a broadcast or "
                "dynamic consumer's position does not depend on the world size)"
            )
        return reshard, host.length(membership, reshard, seed, epoch)
    except TypeError:  # unsized IterableDataset, or dynamic sharing: no end known in advance
        return reshard, None
    except ReshardError as exc:
        raise InvalidRequest(
            f"cannot resume epoch {epoch} on world_size {membership.world_size}: {exc}"
        ) from exc


def check_start(host: LoaderHost, start: int, length: int | None) -> str | None:
    """What is wrong with a stream's start in an epoch of `length` batches, or None."""
    if length is None:
        if start > MAX_START:
            return f"start must be between 0 and {MAX_START}, got {start}"
        return None
    if start > length:
        return (
            f"start must be between 0 and {length} (this consumer's batches in an epoch of "
            f"loader {host.spec.name!r}), got {start}"
        )
    return None
