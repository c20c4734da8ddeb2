"""RemoteLoader: a drop-in for torch's DataLoader whose batches are made by a remote server."""

from __future__ import annotations

import functools
import queue
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch

from remote_loader.client import connect
from remote_loader.client import state as state_module
from remote_loader.client.connect import DEFAULT_BACKOFF
from remote_loader.client.epoch import EpochIterator, LoaderStats
from remote_loader.client.errors import LoaderNotFoundError, SpecChangedError
from remote_loader.client.options import (
    check_options,
    compression_codec,
    membership,
    resolve_device,
)
from remote_loader.client.receiver import Item, Receiver
from remote_loader.client.security import TLS, resolve_tls, resolve_token
from remote_loader.client.transports import StreamEnds, Transports
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import tcp
from remote_loader.protos.buffers import BufferPool
from remote_loader.protos.slots import SlotMaps

DEFAULT_PREFETCH = 2
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_RETRIES = 5


class RemoteLoader:
    """Iterates a loader hosted by a remote-loader server, like a `torch.utils.data.DataLoader`.

    Args:
        address: the server, "host:port" ("[v6]:port" for an IPv6 address; any gRPC target
            naming a port, or a "unix:" socket); one without a port is a ValueError.
        loader: which of the server's loaders; None picks its only one.
        rank, world_size: this consumer's place in its job. Default: the initialized
            `torch.distributed` group, else the RANK / WORLD_SIZE environment variables, else
            0 / 1.
        sharing: how the job's consumers share an epoch. "partition": each rank receives its own
            equal share (DistributedSampler semantics). "broadcast": every consumer receives
            every batch, made once for all. "dynamic": first come, first served.
        job: consumers with the same job name share one production of each epoch; name it
            when several jobs use one server. Default "default".
        seed: overrides the loader's seed; an epoch's batches depend only on (spec, seed, epoch).
        device: where batches' tensors go; default the current CUDA device if there is one,
            else the CPU. numpy arrays, strings and numbers stay on the host.
        pin_memory: receive into pinned host memory before the copy to a CUDA device (no effect
            without CUDA).
        prefetch: decoded batches held ready ahead of the training loop (the receive queue's
            bound; with CUDA, at most this many + 2 pinned batches exist at once).
        timeout: seconds to wait for one batch before LoaderTimeoutError; None waits as long as
            the stream is alive.
        connect_timeout: seconds one attempt waits for a server that does not answer, when
            connecting and before each stream (NOTE [ Waiting for the server ] in
            client/connect.py); a refused connection is retried after the backoff instead.
        token: the server's token, sent on every call as `authorization: Bearer <token>`;
            None takes the REMOTE_LOADER_TOKEN environment variable, "" sends none.
        tls: None or False: plaintext; True: TLS, trusting the system's CAs; a `TLS(ca=...,
            cert=..., key=..., server_name=...)` for a private CA or mutual TLS.
        retries: how many times in a row a broken stream is resumed without a batch arriving
            before the error reaches the training loop (0: never resume); also how many times
            the first connection is tried again after a refusal.
        backoff: seconds before the first resume attempt; doubles per attempt, up to 8 s.
        transport: "auto" moves batches through shared memory when the server shares this
            host's /dev/shm (the same machine, or containers sharing IPC), else on data
            connections beside the gRPC stream when the server offers them (TCP sockets, TLS
            with `tls`), else inside the gRPC stream, each falling back on its own, losing and
            repeating nothing; "tcp" skips shared memory and never falls back: a stream whose
            data connections the server does not offer or this client cannot make raises
            TransportError; "grpc" always streams them inside gRPC messages. See
            `last_transport`.
        data_connections: how many TCP data connections a stream may open (1 to 8; the server
            may grant fewer). Each batch is cut into a stripe per connection, sent and read all
            at once, but into no more stripes than it has MiB (a batch under 2 MiB goes on
            one): several fill a fast link (25-100 GbE) that one connection cannot. None (the
            default): up to 4; under TLS one per two of this host's CPUs, at most 4 (one on
            two cores: TLS stripes' readers take Python's GIL back after every 16 KiB record,
            and more of them than spare cores only take turns).
        compression: "lz4" or "zstd": the server's workers compress each tensor that shrinks
            and this client decompresses it, for links slower than decompression (about 1-10
            Gbit/s); "none" (the default): the bytes as they are, what shared memory and fast
            links want. A server without the codec's package sends them uncompressed. All
            consumers of a job should ask alike: each choice is a production of its own.

    Each `iter()` streams the next epoch (0, 1, 2, ...), or the one given to `set_epoch()`.
    """

    def __init__(
        self,
        address: str,
        loader: str | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        sharing: str = "partition",
        job: str | None = None,
        seed: int | None = None,
        device: torch.device | str | None = None,
        pin_memory: bool = True,
        prefetch: int = DEFAULT_PREFETCH,
        timeout: float | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        retries: int = DEFAULT_RETRIES,
        backoff: float = DEFAULT_BACKOFF,
        transport: str = "auto",
        data_connections: int | None = None,
        compression: str = "none",
        token: str | None = None,
        tls: bool | TLS | None = None,
    ) -> None:
        connect.check_address(address)
        check_options(
            sharing=sharing,
            job=job,
            seed=seed,
            prefetch=prefetch,
            timeout=timeout,
            retries=retries,
            backoff=backoff,
            transport=transport,
            data_connections=data_connections,
        )
        self.compression = compression_codec(compression)
        self.rank, self.world_size = membership(rank, world_size)
        self.sharing = sharing
        # The server's name for the job an empty one means, so that state_dict() says what the
        # server's logs and metrics do.
        self.job = job or state_module.DEFAULT_JOB
        self.address = address
        self.seed = seed
        self.device = resolve_device(device)
        self.pin_memory = bool(pin_memory) and self.device.type == "cuda"
        self.prefetch = prefetch
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.backoff = backoff
        self.transport = transport
        self.data_connections = data_connections
        self._epoch = 0
        self._start = 0  # the first batch of the next iter(): not 0 after load_state_dict()
        # The earlier job of another world size whose epoch the next iter() finishes
        # (load_state_dict; client/state.py), and the one of the epoch being read.
        self._reshard: dict[str, Any] | None = None
        self._iter_reshard: dict[str, Any] | None = None
        self._reshard_length = 0  # this consumer's share of that epoch (the server's count)
        self._iterator: EpochIterator | None = None
        # A data connection could not be made: later epochs do not try again (a firewall that
        # drops the connection would cost every epoch tcp.CONNECT_TIMEOUT).
        self._no_data_connection = False
        # The workers' slots this loader's streams have mapped (NOTE [ Zero-copy slots ] in
        # protos/slots.py): every epoch reads the same pool's, so each is mapped once.
        self._slot_maps = SlotMaps()
        # Batches for the CPU are received into reused buffers (NOTE [ Reused buffers ] in
        # protos/buffers.py): enough for the prefetched batches, the one being received, and the
        # loop's current and previous ones. Pinned memory is torch's allocator's to cache.
        self._buffers = BufferPool(keep=prefetch + 4) if self.device.type == "cpu" else None
        self._closed = False
        self.tls = resolve_tls(tls)
        # The data connections' TLS: the channel's CA, certificate, key (NOTE [ TLS data
        # connection ] in protos/tcp.py); made once, here, so a bad file fails at once.
        self._data_tls = self.tls.data_context() if self.tls is not None else None
        if transport == "tcp" and tcp.target_host(address) is None:
            raise ValueError(
                f'transport="tcp" needs an address naming one TCP host (HOST:PORT), got '
                f"{address!r}: the data connections go to that host"
            )
        self._channel, stubs = connect.open_stubs(address, self.tls, resolve_token(token))
        self._describe, self._list, self._stream = stubs.describe, stubs.list, stubs.stream
        try:
            self.name = loader if loader is not None else self._only_loader(connect_timeout)
            self.info: pb.LoaderInfo = self._call(
                self._describe,
                pb.DescribeRequest(loader=self.name, consumer=self._consumer()),
                "describing the loader",
                connect_timeout,
            )
        except BaseException:
            self._channel.close()
            raise

    # --- connection ---------------------------------------------------------------------

    def _consumer(self) -> pb.Consumer:
        return pb.Consumer(
            sharing=self.sharing, job=self.job, rank=self.rank, world_size=self.world_size
        )

    def _data_connection_failed(self) -> None:
        self._no_data_connection = True

    def _wait_ready(self, timeout: float, stopped: Callable[[], bool]) -> bool:
        """Waits up to `timeout` s for the server to answer; False if it did not, or if
        `stopped()` turned true meanwhile."""
        return connect.wait_ready(
            lambda deadline: self._list.future(
                pb.ListLoadersRequest(), timeout=deadline, wait_for_ready=True
            ),
            timeout,
            stopped,
        )

    def _call(self, method: Any, request: Any, what: str, deadline: float) -> Any:
        """A unary call, tried again after a refusal (NOTE [ Waiting for the server ])."""
        hint = (
            "(this client speaks TLS: does the server, with this CA, and does it want a client "
            "certificate?)"
            if self.tls is not None
            else "(this client speaks plaintext: a TLS server needs tls=...)"
        )
        return connect.first_call(
            lambda timeout: method(request, timeout=timeout, wait_for_ready=False),
            what=what,
            address=self.address,
            connect_timeout=deadline,
            retries=self.retries,
            backoff=self.backoff,
            hint=hint,
        )

    def _only_loader(self, deadline: float) -> str:
        names = list(
            self._call(self._list, pb.ListLoadersRequest(), "listing loaders", deadline).names
        )
        if len(names) != 1:
            raise LoaderNotFoundError(
                f"the server at {self.address} hosts {len(names)} loaders "
                f"({', '.join(names) or 'none'}); pass loader=NAME to pick one"
            )
        return str(names[0])

    # --- DataLoader surface --------------------------------------------------------------

    @property
    def batch_size(self) -> int | None:
        """The loader's batch size; None without automatic batching or with a batch_sampler."""
        return self.info.batch_size if self.info.HasField("batch_size") else None

    @property
    def epoch(self) -> int:
        """The epoch the next `iter()` streams."""
        return self._epoch

    @property
    def last_transport(self) -> str | None:
        """How the latest batch handed out arrived: "shm" (shared memory), "tcp" (the data
        connection), "grpc", or None before any."""
        return self._iterator.transport if self._iterator is not None else None

    def set_epoch(self, epoch: int) -> None:
        """Makes the next `iter()` stream this epoch (later ones follow from it)."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        self._epoch = epoch

    def __len__(self) -> int:
        """Batches this consumer receives per epoch (its share, when partitioned; of the
        epoch's rest when it resumes one begun on another world size)."""
        it = self._iterator
        if self._reshard is not None or (
            self._iter_reshard is not None and it is not None and not it.finished
        ):
            return self._reshard_length
        if self.sharing == "dynamic":
            raise TypeError(
                "len() is unknown with sharing='dynamic': how many batches this consumer "
                "receives depends on how fast the job's other consumers take theirs"
            )
        if not self.info.has_length:
            # The server refuses a map-style dataset whose __len__ raises: a map-style loader
            # without a length has a sampler (or batch_sampler) without one.
            why = (
                "its dataset is an IterableDataset without __len__"
                if self.info.dataset_kind == "iterable"
                else "its dataset is map-style, but its sampler or batch_sampler has no __len__"
            )
            raise TypeError(f"loader {self.name!r} has no len(): {why}")
        return int(self.info.length)

    def __iter__(self) -> EpochIterator:
        if self._closed:
            raise RuntimeError("this RemoteLoader is closed")
        if self._iterator is not None:
            self._iterator.close()  # one stream at a time, like a DataLoader's single iterator
        request = pb.StreamRequest(
            loader=self.name,
            epoch=self._epoch,
            consumer=self._consumer(),
            fingerprint=self.info.fingerprint,
            compression=self.compression,
        )
        if self.seed is not None:
            request.seed = self.seed
        if self._reshard is not None:
            request.reshard.CopyFrom(state_module.reshard_message(self._reshard))
        self._iterator = EpochIterator(
            request.epoch,
            self._start,
            functools.partial(self._receiver, request, self._start),
            self.prefetch,
            self.timeout,
            self.__len__,
        )
        self._iter_reshard, self._reshard = self._reshard, None
        self._epoch += 1
        self._start = 0
        return self._iterator

    def _receiver(self, request: pb.StreamRequest, start: int, out: queue.Queue[Item]) -> Receiver:
        """The thread that reads `request`'s epoch from batch `start` into `out` (not started)."""
        what = f"loader {self.name!r} epoch {request.epoch} from {self.address}"

        def open_stream(first: int, ends: StreamEnds) -> Any:
            again = pb.StreamRequest()
            again.CopyFrom(request)
            again.start = first
            ends.offer(again)
            # Not wait_for_ready: the receiver has waited for the connection, with a deadline
            # (NOTE [ Waiting for the server ]); this call would wait for one without any.
            return self._stream(again, wait_for_ready=False)

        transports = Transports(
            what,
            use_shm=self.transport == "auto",
            # A TLS client's data connections speak TLS (NOTE [ TLS data connection ]).
            tcp_host=(
                tcp.target_host(self.address)
                if self.transport != "grpc" and not self._no_data_connection
                else None
            ),
            data_connections=self.data_connections,
            on_tcp_failed=self._data_connection_failed,
            slot_maps=self._slot_maps,
            tcp_tls=self._data_tls,
            tcp_server_name=self.tls.server_name if self.tls is not None else None,
            tcp_required=self.transport == "tcp",
        )
        receiver = Receiver(
            open_stream,
            out,
            transports=transports,
            device=self.device,
            pin=self.pin_memory,
            what=what,
            buffers=self._buffers,
            start=start,
            retries=self.retries,
            backoff=self.backoff,
            wait_ready=self._wait_ready,
            connect_timeout=self.connect_timeout,
        )
        return receiver

    # --- resuming ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this consumer is: JSON-serialisable, for `load_state_dict` on a new loader.

        `batches` counts batches yielded to the training loop (not merely prefetched). At the end
        of an epoch the state points at the start of the next one, as torchdata's
        StatefulDataLoader does.
        """
        epoch, batches, reshard = self._epoch, self._start, self._reshard
        it = self._iterator
        if it is not None and not it.finished:
            epoch, batches, reshard = it.epoch, it.batches, self._iter_reshard
            if (
                reshard is None
                and self.info.has_length
                and self.sharing != "dynamic"
                and batches >= len(self)
            ):
                epoch, batches = epoch + 1, 0
        return {
            "version": state_module.STATE_VERSION,
            "loader": self.name,
            "fingerprint": self.info.fingerprint,
            "seed": self.seed if self.seed is not None else int(self.info.seed),
            "epoch": epoch,
            "batches": batches,
            "sharing": self.sharing,
            "job": self.job,
            "rank": self.rank,
            "world_size": self.world_size,
            "reshard": reshard,
        }

    @staticmethod
    def job_state(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """One state for a whole partition job from its ranks' `state_dict()`s (one per rank,
        same epoch), for ranks that were not in step when they saved them; the ranks of a job
        of any world size then each `load_state_dict` it. DDP ranks are in step: any one
        rank's own state does the same."""
        return state_module.job_state(states)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Makes the next `iter()` continue where `state` (from `state_dict()`, or
        `job_state()`) left off.

        With partition sharing the state may be of a job of another world size: this rank then
        receives its share of what that job had not consumed of the epoch (each new rank the
        same number of batches; a remainder as `partition_drop_last` says), and the epochs
        after are ordinary ones. Raises ValueError for a state of another loader or consumer
        (sharing, job; rank at the same world size) and SpecChangedError (a RequestError) when
        the server's spec changed since (its fingerprint differs).
        """
        state_module.check(state)
        if state["loader"] != self.name:
            raise ValueError(
                f"the state is of loader {state['loader']!r}, this RemoteLoader reads {self.name!r}"
            )
        point = state_module.resume_point(state, self.sharing, self.job, self.rank, self.world_size)
        if state["fingerprint"] != self.info.fingerprint:
            raise SpecChangedError(
                f"loader {self.name!r} at {self.address} has changed since the state was saved "
                f"(spec fingerprint {state['fingerprint']} then, {self.info.fingerprint} now): "
                "resuming would not line the batches up"
            )
        if point.reshard is not None:
            # The server checks the resume now (a refusal says why here, not at iter()) and
            # says how many batches this rank's share of the epoch's rest holds, for len().
            asked = pb.DescribeRequest(
                loader=self.name,
                consumer=self._consumer(),
                epoch=point.epoch,
                seed=point.seed,
                reshard=state_module.reshard_message(point.reshard),
            )
            info = self._call(self._describe, asked, "resuming", self.connect_timeout)
            self._reshard_length = int(info.length)
        if self._iterator is not None:
            self._iterator.close()
            self._iterator = None
        self.seed = point.seed
        self._epoch = point.epoch
        self._start = point.start
        self._reshard = point.reshard

    # --- statistics ----------------------------------------------------------------------

    def stats(self) -> LoaderStats:
        """The latest epoch's figures (see LoaderStats); zeros before the first `next()`."""
        if self._iterator is None:
            return LoaderStats(epoch=self._epoch)
        return self._iterator.stats()

    # --- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Stops any running stream and closes the connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._iterator is not None:
            self._iterator.close()
            self._iterator = None
        self._slot_maps.close()
        self._channel.close()

    def __enter__(self) -> RemoteLoader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<RemoteLoader {self.name!r} at {self.address} {self.sharing} "
            f"rank={self.rank}/{self.world_size} epoch={self._epoch} {state}>"
        )
