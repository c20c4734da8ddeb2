"""RemoteLoader: a drop-in for torch's DataLoader whose batches are made by a remote server."""

from __future__ import annotations

import queue
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import torch

from remote_loader.client import options as options_module
from remote_loader.client import standins, surface
from remote_loader.client import state as state_module
from remote_loader.client.connect import DEFAULT_BACKOFF
from remote_loader.client.described import Descriptions
from remote_loader.client.epoch import EpochIterator, LoaderStats
from remote_loader.client.errors import SpecChangedError
from remote_loader.client.items import Item
from remote_loader.client.link import ServerLink
from remote_loader.client.options import LoaderOptions, resolve_options
from remote_loader.client.receiver import Receiver
from remote_loader.client.report import StallReporter
from remote_loader.client.security import TLS
from remote_loader.client.stall import StallWindow
from remote_loader.client.surface import LoaderSurface
from remote_loader.client.types import Compression, Sharing, Transport
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos.buffers import BufferPool

DEFAULT_PREFETCH = 2
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_RETRIES = 5


class RemoteLoader(LoaderSurface):
    """Iterates a loader hosted by a remote-loader server, like a `torch.utils.data.DataLoader`.

    Args:
        address: the server, "host:port" ("[v6]:port" for an IPv6 address; any gRPC target
            naming a port, or a "unix:" socket); one without a port is a ValueError.
        loader: which of the server's loaders; None picks its only one.
        rank, world_size: this consumer's place in its job. Default: the job's, read at the
            first `iter()` (the loader may be made before the job's launcher or
            torch.distributed has said): the initialized `torch.distributed` group, else the
            RANK / WORLD_SIZE environment variables (LOCAL_RANK where it must be the rank:
            client/options.py `membership`), else 0 / 1. A world of several ranks where nothing
            says the rank is a ValueError, never rank 0.
        sharing: how the job's consumers share an epoch. "partition": each rank receives its own
            equal share (DistributedSampler semantics). "broadcast": every consumer receives
            every batch, made once for all. "dynamic": first come, first served.
        job: consumers with the same job name share one production of each epoch; name it
            when several jobs use one server. Default "default".
        seed: overrides the loader's seed; an epoch's batches depend only on (spec, seed, epoch).
        device: where batches' tensors go; default CUDA if there is one, else the CPU; CUDA
            without an index: the current device at the first `iter()`. numpy arrays,
            strings and numbers stay on the host.
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
        transport: "auto" (shared memory on the same host, else TCP data connections beside
            the gRPC stream, else the stream itself, each falling back on its own, losing and
            repeating nothing), "tcp" (data connections or TransportError) or "grpc" (inside
            gRPC messages); see `last_transport` and docs/transports.md.
        data_connections: how many TCP data connections a stream may open (1 to 8, the
            server may grant fewer), each batch striped over them; None: up to 4, fewer under
            TLS (docs/transports.md, "Data connection").
        compression: "lz4" or "zstd" for links slower than decompression (about 1-10 Gbit/s),
            "none" (the default) otherwise; all consumers of a job should ask alike: each
            choice is a production of its own (docs/transports.md, "Compression").

    Each iterator streams the next epoch (0, 1, ...), or the one `set_epoch()` or
    `sampler.set_epoch()` gave, taken at its first `next()` (NOTE [ An iterator's epoch ]).
    It has a DataLoader's attributes (`dataset`, `sampler`, `batch_size`, ...: surface.py),
    raises a batch's exception as its own type (reraise.py), gives the server's torch warnings
    at each `iter()`, and pickles as its arguments (NOTE [ A pickled loader ] in options.py).
    """

    def __init__(
        self,
        address: str,
        loader: str | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        sharing: Sharing = "partition",
        job: str | None = None,
        seed: int | None = None,
        device: torch.device | str | None = None,
        pin_memory: bool = True,
        prefetch: int = DEFAULT_PREFETCH,
        timeout: float | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        retries: int = DEFAULT_RETRIES,
        backoff: float = DEFAULT_BACKOFF,
        transport: Transport = "auto",
        data_connections: int | None = None,
        compression: Compression = "none",
        token: str | None = None,
        tls: bool | TLS | None = None,
    ) -> None:
        options, members = resolve_options(
            address,
            rank=rank,
            world_size=world_size,
            sharing=sharing,
            job=job,
            seed=seed,
            device=device,
            pin_memory=pin_memory,
            prefetch=prefetch,
            timeout=timeout,
            connect_timeout=connect_timeout,
            retries=retries,
            backoff=backoff,
            transport=transport,
            data_connections=data_connections,
            compression=compression,
            token=token,
            tls=tls,
        )
        self._members, self._seed = members, seed
        self._cursor = state_module.Cursor()
        self._iterator: EpochIterator | None = None
        # The dataset's len() when len(loader) was last asked of an IterableDataset's loader:
        # torch's _IterableDataset_len_called, past which an epoch's batches draw its warning.
        self._len_called: int | None = None
        # Batches for the CPU are received into reused buffers (NOTE [ Reused buffers ] in
        # protos/buffers.py): enough for the prefetched batches, the one being received, and the
        # loop's current and previous ones. Pinned memory is torch's allocator's to cache.
        self._buffers = BufferPool(keep=prefetch + 4) if options.device.type == "cpu" else None
        self._closed = False
        self._link = ServerLink(options, self._buffers)
        self._slot_maps = self._link.slot_maps
        # The trainer's stall over its last seconds, reported to the server once a second while
        # it reads (NOTE [ Stall stages ] in protos/stall.py).
        self._stall = StallWindow()
        self._reporter = StallReporter(self._link.channel, self._stall)
        try:
            self.name = loader if loader is not None else self._link.only_loader()
            self._described = Descriptions(self._link, self.name, options, members)
        except BaseException:
            self._link.close()
            raise
        self._stand_in(address, self.set_epoch, lambda: self.epoch, self._samples, self.__len__)

    # --- the consumer, and what it was given ------------------------------------------------

    @property
    def info(self) -> pb.LoaderInfo:
        """What the server said of the loader (Describe): to this consumer once its first
        `iter()` has fixed its rank, before then as it was first described."""
        return self._described.info

    @property
    def rank(self) -> int:
        """This consumer's rank: as given, else the job's, read afresh until the first `iter()`
        keeps it; ValueError while the job has several ranks and nothing says which."""
        return self._members.current()[0]

    @property
    def world_size(self) -> int:
        """The job's size: as given, else the job's, read afresh until the first `iter()`."""
        return self._members.current()[1]

    @property
    def options(self) -> LoaderOptions:
        """The constructor's arguments, checked and resolved (`address`, `device`, ...:
        surface.py); the link's, whose CUDA device the first iter() places."""
        return self._link.options

    @property
    def seed(self) -> int | None:
        """The seed that overrides the loader's (None: the loader's own); a load_state_dict()
        sets the state's."""
        return self._seed

    @property
    def last_transport(self) -> str | None:
        """How the latest batch handed out arrived: "shm" (shared memory), "tcp" (the data
        connection), "grpc", or None before any."""
        return self._iterator.transport if self._iterator is not None else None

    # --- epochs ----------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the next iterator streams."""
        return self._cursor.epoch

    def set_epoch(self, epoch: int) -> None:
        """Makes the next iterator stream this epoch (later ones follow), whatever iterators
        came before: one made but not yet read takes it too (NOTE [ An iterator's epoch ]).
        The epoch a `load_state_dict()` resumes keeps its position; another starts at 0."""
        self._cursor.set_epoch(epoch)

    def _samples(self) -> int:
        """len(sampler): the samples this consumer receives per epoch."""
        members = self._members.current()
        info = self._described.of(members)
        return standins.sampler_length(info, self.sharing, members[1], self.__len__)

    def __len__(self) -> int:
        """Batches this consumer receives per epoch (its share, when partitioned; of the
        epoch's rest when it resumes one begun on another world size)."""
        resharded = self._cursor.resharded_length(self._reading() is not None)
        if resharded is not None:
            return resharded
        info = None if self.sharing == "dynamic" else self._described.of(self._members.current())
        length = surface.loader_length(self.name, info)  # TypeError where there is none
        if info is not None and info.dataset_kind == "iterable" and info.HasField("dataset_length"):
            self._len_called = int(info.dataset_length)
        return length

    def __iter__(self) -> EpochIterator:  # the rank and CUDA device are fixed by the first one
        if self._closed:
            raise RuntimeError("this RemoteLoader is closed")
        self._described.of(self._members.fix())
        self._link.options = options_module.placed(self._link.options)
        if self._iterator is not None:
            self._iterator.close()  # one stream at a time, like a DataLoader's single iterator
        surface.reissue_warnings(self.info, stacklevel=2)
        reported, workers = self._len_called, surface.num_workers(self.info)

        def overlength(yielded: int) -> str | None:
            if reported is None or yielded <= reported:
                return None
            return surface.overlength_message(self._dataset, reported, yielded, workers)

        self._iterator = EpochIterator(
            self._begin,
            lambda: (self._cursor.epoch, self._cursor.start),
            self.prefetch,
            self.options.timeout,
            self.__len__,
            overlength,
            self._stall,
        )
        return self._iterator

    def _begin(self, out: queue.Queue[Item]) -> tuple[int, int, Receiver]:
        """An iterator's first `next()` (NOTE [ An iterator's epoch ]): it takes the next epoch
        from where it stands, and the loader's next epoch becomes the one after. Returns the
        epoch, the batch it starts from and the receiver (not started) that fills `out`."""
        cursor = self._cursor
        epoch, start, reshard = cursor.epoch, cursor.start, cursor.reshard
        request = pb.StreamRequest(
            loader=self.name,
            epoch=epoch,
            consumer=self._described.consumer(self._members.fix()),
            fingerprint=self.info.fingerprint,
            compression=self.compression,
        )
        if self.seed is not None:
            request.seed = self.seed
        if reshard is not None:
            request.reshard.CopyFrom(state_module.reshard_message(reshard))
        what = f"loader {self.name!r} epoch {epoch} from {self.address}"
        receiver = self._link.receiver(request, start, out, what)
        cursor.take()  # once nothing above failed: an iterator that could not begin took none
        self._reporter.follow(self.name, request.consumer, epoch)
        return epoch, start, receiver

    def _reading(self) -> EpochIterator | None:  # the one reading an epoch (begun, not ended)
        it = self._iterator
        return it if it is not None and it.started and not it.finished else None

    # --- resuming ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this consumer is, as JSON, for `load_state_dict` on a new loader: `batches`
        yielded to the training loop (not merely prefetched); at an epoch's end, the start of
        the next one, as torchdata's StatefulDataLoader says."""
        cursor = self._cursor
        epoch, batches, reshard = cursor.epoch, cursor.start, cursor.reshard
        it = self._reading()
        if it is not None:
            epoch, batches, reshard = it.epoch, it.batches, cursor.taken_reshard
            if (
                reshard is None
                and self.info.has_length
                and self.sharing != "dynamic"
                and batches >= len(self)
            ):
                epoch, batches = epoch + 1, 0
        rank, world_size = self._members.current()
        return {
            "version": state_module.STATE_VERSION,
            "loader": self.name,
            "fingerprint": self.info.fingerprint,
            "seed": self.seed if self.seed is not None else int(self.info.seed),
            "epoch": epoch,
            "batches": batches,
            "sharing": self.sharing,
            "job": self.job,
            "rank": rank,
            "world_size": world_size,
            "reshard": reshard,
        }

    @staticmethod
    def job_state(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """One state for a partition job from its ranks' `state_dict()`s (one per rank, same
        epoch), when they were not in step (DDP ranks are: any one's will do); the ranks of a
        job of any world size then each `load_state_dict` it."""
        return state_module.job_state(states)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Makes the next `iter()` continue where `state` (`state_dict()`, `job_state()`) left off.

        With partition sharing the state may be of a job of another world size: this rank then
        receives its share of what that job had not consumed of the epoch (each new rank the
        same number of batches; a remainder as `partition_drop_last` says), and the epochs
        after are ordinary ones. Any rank's state will do (NOTE [ Any rank's state ]). Raises
        ValueError for another loader's or consumer's state, and SpecChangedError when the
        server's spec changed since (its fingerprint differs).
        """
        state_module.check(state)
        if state["loader"] != self.name:
            raise ValueError(
                f"the state is of loader {state['loader']!r}, this RemoteLoader reads {self.name!r}"
            )
        members = self._members.fix()  # the position is this rank's from now on
        self._described.of(members)
        point = state_module.resume_point(state, self.sharing, self.job, *members)
        if state["fingerprint"] != self.info.fingerprint:
            raise SpecChangedError(
                f"loader {self.name!r} at {self.address} has changed since the state was saved "
                f"(spec fingerprint {state['fingerprint']} then, {self.info.fingerprint} now): "
                "resuming would not line the batches up"
            )
        length = self._described.resumed_length(point, members)
        if self._iterator is not None:
            self._iterator.close()
            self._iterator = None
        self._seed = point.seed
        self._cursor.resume(point, length)

    # --- statistics ----------------------------------------------------------------------

    def stats(self) -> LoaderStats:
        """The latest epoch's figures (see LoaderStats); zeros before the first `next()`."""
        if self._iterator is None:
            return LoaderStats(epoch=self.epoch)
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
        self._reporter.close()
        self._link.close()

    def __getstate__(self) -> dict[str, Any]:  # NOTE [ A pickled loader ] in options.py
        given, cursor = self.options.given, self._cursor
        return {"given": given, "loader": self.name, "cursor": cursor, "seed": self._seed}

    def __setstate__(self, state: dict[str, Any]) -> None:
        RemoteLoader.__init__(self, loader=state["loader"], **state["given"])
        self._cursor, self._seed = state["cursor"], state["seed"]

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
        members = self._members.known()
        place = f"rank={members[0]}/{members[1]}" if members else "rank=?"
        return (
            f"<RemoteLoader {self.name!r} at {self.address} {self.sharing} "
            f"{place} epoch={self.epoch} {state}>"
        )
