"""The gRPC stage: the Loader service (ListLoaders, Describe, Stream); server/api/server.py binds
and runs it.

A Stream call is checked and counted here; once it is let in, server/api/stream.py sends it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator, Mapping

import grpc

from remote_loader.protos import compression, shm, wire
from remote_loader.protos import loader_pb2 as pb
from remote_loader.server.api.admission import Admission, StreamSlot
from remote_loader.server.api.settings import ServerSettings
from remote_loader.server.api.status import statuses
from remote_loader.server.api.stream import AdmittedStream, Sending, send_stream
from remote_loader.server.api.validation import (
    Undecodable,
    check_epoch,
    check_start,
    decoded,
)
from remote_loader.server.errors import (
    Closing,
    InvalidRequest,
    LoaderNotFound,
    LoaderNotNamed,
    ServerBusy,
    SpecChanged,
    clip,
)
from remote_loader.server.sharing.host import LoaderHost
from remote_loader.server.sharing.membership import DEFAULT_JOB, Membership
from remote_loader.server.telemetry.logfmt import logfmt
from remote_loader.server.transports import (
    DEFAULT_CLIENT_SILENCE,
    DataListener,
)

log = logging.getLogger(__name__)


class LoaderService:
    """The `remote_loader.v1.Loader` service over a set of hosted loaders."""

    def __init__(
        self,
        hosts: Mapping[str, LoaderHost],
        chunk_size: int,
        max_ring_bytes: int = shm.DEFAULT_MAX_RING_BYTES,
        zero_copy: bool = True,
        max_streams: int = ServerSettings.max_streams,
        client_silence: float = DEFAULT_CLIENT_SILENCE,
        idle_stream_timeout: float = ServerSettings.idle_stream_timeout,
    ) -> None:
        if not hosts:
            raise ValueError("a server needs at least one loader")
        if not 0 < chunk_size <= wire.MAX_CHUNK_SIZE:
            raise ValueError(
                f"chunk_size must be between 1 and {wire.MAX_CHUNK_SIZE} bytes, got {chunk_size}"
            )
        self.hosts = dict(hosts)
        self.chunk_size = chunk_size
        # Each stream's shared-memory ring is at most this big (0: never use shared memory).
        self.max_ring_bytes = max_ring_bytes
        # Same-host clients that can may read the workers' slots themselves (protos/slots.py).
        self.zero_copy = zero_copy
        # A same-host client whose ring heartbeat stands still this long while the stream waits
        # for it is let go (NOTE [ Ring space ]): keepalive_time_ms + keepalive_timeout_ms.
        self.client_silence = client_silence
        # Accepts streams' data connections (NOTE [ TCP data connection ]); None: off. Set by
        # create_server once the gRPC port is bound, so a port clash fails before it listens.
        self.listener: DataListener | None = None
        # Draining (SIGTERM): new streams are refused with UNAVAILABLE; running ones go on.
        self.draining = False
        # Stream number max_streams + 1 is refused with RESOURCE_EXHAUSTED, or takes the place
        # of a stream idle for idle_stream_timeout (NOTE [ Idle streams ]); health and Describe
        # are not counted: a full server still answers probes.
        self.admission = Admission(max_streams, idle_stream_timeout)
        self._stream_ids = itertools.count(1)

    def wait_streams(self, timeout: float) -> bool:
        """Waits up to `timeout` s for the running streams to end; True if none is left."""
        return self.admission.wait_idle(timeout)

    def _refuse_when_draining(self) -> None:
        if self.draining:
            raise Closing("the server is shutting down (draining its running streams)")

    def host(self, name: str) -> LoaderHost:
        """The loader named `name` (empty: the only one); LoaderNotFound otherwise."""
        if not name:
            if len(self.hosts) == 1:
                return next(iter(self.hosts.values()))
            raise LoaderNotNamed(
                f"this server hosts several loaders ({', '.join(sorted(self.hosts))}); name one"
            )
        host = self.hosts.get(name)
        if host is None:
            raise LoaderNotFound(
                f"no loader named {clip(name)!r}; this server hosts: "
                f"{', '.join(sorted(self.hosts))}"
            )
        return host

    def _membership(self, host: LoaderHost, consumer: pb.Consumer) -> Membership:
        membership = Membership(
            sharing=consumer.sharing or "partition",
            job=consumer.job or DEFAULT_JOB,
            rank=consumer.rank,
            world_size=consumer.world_size if consumer.HasField("world_size") else 1,
        )
        host.check(membership)  # SharingRefused
        return membership

    def ListLoaders(
        self, request: pb.ListLoadersRequest | Undecodable, context: grpc.ServicerContext
    ) -> pb.ListLoadersResponse:
        decoded("ListLoaders", request, context)
        return pb.ListLoadersResponse(names=sorted(self.hosts))

    def Describe(
        self, request: pb.DescribeRequest | Undecodable, context: grpc.ServicerContext
    ) -> pb.LoaderInfo:
        described = decoded("Describe", request, context)
        with statuses(context):
            return self._describe(described)

    def _describe(self, request: pb.DescribeRequest) -> pb.LoaderInfo:
        self._refuse_when_draining()
        host = self.host(request.loader)
        spec = host.spec
        info = pb.LoaderInfo(
            name=spec.name,
            dataset_kind=host.dataset_kind,
            options=spec.options_text(),
            seed=spec.seed,
            fingerprint=spec.fingerprint(),
        )
        membership = self._membership(host, request.consumer)
        info.sharing.extend(spec.parts.sharing.modes)
        with contextlib.suppress(TypeError):  # unknown for an unsized IterableDataset
            info.epoch_length = len(host)
        seed = request.seed if request.HasField("seed") else spec.seed
        _, length = check_epoch(host, membership, request.epoch, seed, request.reshard)
        if length is not None:  # else unsized IterableDataset, or dynamic sharing
            info.length = length
            info.has_length = True
        if spec.batch_size is not None and spec.batch_sampler is None:
            info.batch_size = spec.batch_size
        with contextlib.suppress(TypeError):
            info.dataset_length = len(host.dataset)
        pool = spec.parts.pool
        if pool.num_workers > 0:
            started = host.pool_info
            info.pool.backend = pool.backend
            info.pool.nodes = int(started.get("nodes", 0))
            info.pool.workers = int(started.get("workers", pool.num_workers))
        # What a local DataLoader would have warned the trainer about (server/config/sampling.py).
        info.warnings.extend(
            pb.LoaderWarning(category=w.category, message=w.message) for w in host.warnings
        )
        return info

    def Stream(
        self, request: pb.StreamRequest | Undecodable, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        streamed = decoded("Stream", request, context)  # before it counts as a stream
        with statuses(context):
            yield from self._counted_stream(streamed, context)

    def _counted_stream(
        self, request: pb.StreamRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        self._refuse_when_draining()
        slot = self.admission.admit(context)
        if slot is None:
            max_streams = self.admission.max_streams
            log.warning(
                "stream refused %s",
                logfmt(
                    peer=context.peer(),
                    loader=clip(request.loader),
                    status="RESOURCE_EXHAUSTED",
                    error=f"max_streams={max_streams} streams are running",
                ),
            )
            idle = self.admission.idle_stream_timeout
            raise ServerBusy(
                f"this server already runs its max_streams={max_streams} streams"
                + (f" (none has gone idle_stream_timeout={idle:g} s unread)" if idle else "")
                + "; retry when one ends, or raise the server's max_streams setting "
                "(--max-streams, REMOTE_LOADER_MAX_STREAMS)"
            )
        try:
            yield from send_stream(self._admit(request, context, slot), self._sending())
        finally:
            self.admission.release(slot)

    def _sending(self) -> Sending:
        return Sending(
            self.chunk_size,
            self.max_ring_bytes,
            self.zero_copy,
            self.client_silence,
            self.listener,
        )

    def _admit(
        self, request: pb.StreamRequest, context: grpc.ServicerContext, slot: StreamSlot
    ) -> AdmittedStream:
        """The stream's loader, membership, seed and elastic origin; a CallFailed error for a
        request refused before anything reads the dataset."""
        host = self.host(request.loader)
        membership = self._membership(host, request.consumer)
        if request.fingerprint and request.fingerprint != host.spec.fingerprint():
            raise SpecChanged(
                f"loader {host.spec.name!r} has changed: its spec's fingerprint is now "
                f"{host.spec.fingerprint()}, the consumer's state was saved with "
                f"{clip(request.fingerprint)}; resuming would not line the batches up. Start the "
                "epoch afresh, or serve the old spec"
            )
        seed = request.seed if request.HasField("seed") else host.spec.seed
        reshard, length = check_epoch(host, membership, request.epoch, seed, request.reshard)
        problem = check_start(host, request.start, length)
        if problem is None:
            try:
                compression.check(clip(request.compression))  # clip: the error echoes it
            except ValueError as exc:
                problem = str(exc)
        if problem is not None:
            raise InvalidRequest(problem)
        return AdmittedStream(
            request,
            context,
            slot,
            host,
            membership,
            seed,
            reshard,
            next(self._stream_ids),  # names the stream in its log lines
        )
