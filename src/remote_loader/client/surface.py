"""What scripts read of a RemoteLoader: the attributes (its base class, read-only: a
DataLoader's, as the server's loader has them, and its own arguments, as given), and the
warnings torch would give here."""

from __future__ import annotations

import builtins
import sys
import warnings
from collections.abc import Callable
from typing import Any, Generic, NoReturn, Protocol, TypeVar, overload

import torch

from remote_loader.client.options import FromOptions, LoaderOptions
from remote_loader.client.security import TLS
from remote_loader.client.standins import (
    RemoteBatchSampler,
    RemoteIterableDataset,
    RemoteMapDataset,
    RemoteSampler,
    ServerSideError,
    option,
    refuse_rebuild,
    remote_dataset,
)
from remote_loader.client.types import Sharing, Transport
from remote_loader.protos import loader_pb2 as pb

T = TypeVar("T")


def num_workers(info: pb.LoaderInfo) -> int:
    return int(option(info, "num_workers", 0))


def prefetch_factor(info: pb.LoaderInfo) -> int | None:
    """torch's value: None without workers, else the spec's (2 when it gives none)."""
    if num_workers(info) == 0:
        return None
    factor = option(info, "prefetch_factor", None)
    return 2 if factor is None else int(factor)


class HasInfo(Protocol):
    @property
    def info(self) -> pb.LoaderInfo: ...


class FromInfo(Generic[T]):
    """A read-only attribute of a RemoteLoader, read from what Describe said (its `info`)."""

    def __init__(self, read: Callable[[pb.LoaderInfo], T], doc: str) -> None:
        self._read = read
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, loader: None, owner: type) -> FromInfo[T]: ...
    @overload
    def __get__(self, loader: HasInfo, owner: type) -> T: ...
    def __get__(self, loader: HasInfo | None, owner: type) -> FromInfo[T] | T:
        return self if loader is None else self._read(loader.info)

    def __set__(self, loader: HasInfo, value: Any) -> NoReturn:
        # Read-only, as a DataLoader's are after its __init__: the server's loader decides.
        raise AttributeError(
            f"{self._name} is the server's loader option (read from loader.info); it cannot be "
            "set here: change the loader's spec on the server"
        )


class OnServer:
    """A DataLoader attribute that is code on the server (collate_fn, worker_init_fn): reading
    it raises ServerSideError, so hasattr() is False, as for an object that has none."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, loader: HasInfo | None, owner: type) -> NoReturn:
        path = option(loader.info, self._name, None) if loader is not None else None
        raise ServerSideError(
            f"{self._name} runs on the server ({path or 'torch default'}); the client has none "
            "to call: change it in the loader's spec on the server"
        )

    def __set__(self, loader: HasInfo, value: Any) -> NoReturn:
        raise AttributeError(
            f"{self._name} runs on the server: setting it here would change nothing; change it "
            "in the loader's spec on the server"
        )


class LoaderSurface:
    """The attributes scripts read of a RemoteLoader, all read-only: a torch DataLoader's, as
    the server's loader has them, from what Describe said (`info`, the loader's), with
    stand-ins for the dataset and samplers (client/standins.py), made by `_stand_in` once the
    loader is described; and the loader's own arguments, checked and resolved (`options`,
    client/options.py)."""

    name: str  # the loader's, on its server

    @property
    def info(self) -> pb.LoaderInfo:
        raise NotImplementedError

    @property
    def options(self) -> LoaderOptions:
        raise NotImplementedError

    address = FromOptions[str]("The server, as given.")
    sharing = FromOptions[Sharing]("How the job's consumers share an epoch.")
    job = FromOptions[str]("The job's name (the server's default when none was given).")
    device = FromOptions[torch.device](
        "Where batches' tensors go (CUDA's index: the current device's at the first iter())."
    )
    prefetch = FromOptions[int]("Decoded batches held ready ahead of the training loop.")
    connect_timeout = FromOptions[float]("Seconds one attempt waits for a silent server.")
    retries = FromOptions[int]("Resumes of a broken stream in a row before its error is raised.")
    backoff = FromOptions[float]("Seconds before the first resume; doubled per attempt.")
    transport = FromOptions[Transport]("How batches travel: auto, tcp or grpc.")
    data_connections = FromOptions[int | None]("TCP data connections per stream (None: auto).")
    compression = FromOptions[str]('The codec the batches come compressed with; "" for none.')
    tls = FromOptions[TLS | None]("The TLS the connection speaks; None: plaintext.")

    @property
    def pin_memory(self) -> bool:
        """Whether batches are received into pinned memory (only where they go to CUDA)."""
        return self.options.pin_memory

    @property
    def timeout(self) -> float:
        """Seconds `next()` waits for a batch (the `timeout` argument), 0 for no bound, as a
        DataLoader's `timeout` says."""
        timeout = self.options.timeout
        return timeout if timeout is not None else 0

    def _stand_in(
        self,
        address: str,
        set_epoch: Callable[[int], None],
        epoch: Callable[[], int],
        samples: Callable[[], int],
        batches: Callable[[], int],
    ) -> None:
        """Makes the stand-ins: `set_epoch(e)` sets the loader's next epoch, `epoch()` says it,
        `samples()` and `batches()` are this consumer's per epoch (len(sampler), len(loader))."""
        self._dataset = remote_dataset(self.info, address)
        self._sampler = RemoteSampler(self.name, set_epoch, epoch, samples)
        batching = self.batch_size is not None or option(self.info, "batch_sampler", None)
        self._batch_sampler = (
            RemoteBatchSampler(self._sampler, self.batch_size, self.drop_last, batches)
            if batching
            else None  # torch has none without automatic batching
        )

    @property
    def dataset(self) -> RemoteMapDataset | RemoteIterableDataset:
        """A stand-in for the dataset, which lives on the server: len(), repr(), and an
        isinstance of torch's Dataset or IterableDataset as the server's; other attributes,
        items and iteration are refused, saying why."""
        refuse_rebuild(sys._getframe(1), self.name)
        return self._dataset

    @property
    def sampler(self) -> RemoteSampler:
        """The sampler, drawn on the server: `set_epoch(e)` sets the next epoch; len() is the
        samples this consumer receives per epoch (TypeError where that is not known here)."""
        return self._sampler

    @property
    def batch_sampler(self) -> RemoteBatchSampler | None:
        """The batch sampler, drawn on the server (None without automatic batching, as
        torch's): len() is len(loader); `set_epoch(e)` and `sampler` as the sampler's."""
        return self._batch_sampler

    @property
    def batch_size(self) -> int | None:
        """The loader's batch size; None without automatic batching or with a batch_sampler."""
        return self.info.batch_size if self.info.HasField("batch_size") else None

    num_workers = FromInfo(num_workers, "The server's worker processes.")
    prefetch_factor = FromInfo(
        prefetch_factor, "Batches per server worker in flight; None without workers."
    )
    persistent_workers = FromInfo(
        lambda info: bool(option(info, "persistent_workers", False)),
        "Whether the server keeps its workers between epochs.",
    )
    drop_last = FromInfo(
        lambda info: bool(option(info, "drop_last", False)),
        "Whether a short last batch is dropped (partition_drop_last is the shares').",
    )
    in_order = FromInfo(
        lambda info: bool(option(info, "in_order", True)),
        "Whether batches come in sampler order (all consumers receive them so).",
    )
    generator = FromInfo(
        lambda info: None, "None: each epoch's generator is the server's, seeded seed + epoch."
    )
    collate_fn = OnServer()
    worker_init_fn = OnServer()


def loader_length(name: str, info: pb.LoaderInfo | None) -> int:
    """len() of loader `name`: the batches its consumer receives per epoch, as Describe said
    (`info`; None for sharing="dynamic"). TypeError, saying why, where it has none."""
    if info is None:
        raise TypeError(
            "len() is unknown with sharing='dynamic': how many batches this consumer "
            "receives depends on how fast the job's other consumers take theirs"
        )
    if not info.has_length:
        # The server refuses a map-style dataset whose __len__ raises: a map-style loader
        # without a length has a sampler (or batch_sampler) without one.
        why = (
            "its dataset is an IterableDataset without __len__"
            if info.dataset_kind == "iterable"
            else "its dataset is map-style, but its sampler or batch_sampler has no __len__"
        )
        raise TypeError(f"loader {name!r} has no len(): {why}")
    return int(info.length)


def reissue_warnings(info: pb.LoaderInfo, stacklevel: int) -> None:
    """Warns here what the server's torch warned about this loader (LoaderInfo.warnings), as a
    local DataLoader warns at each iter(); a category this side does not know is UserWarning."""
    for warning in info.warnings:
        found = getattr(builtins, warning.category, None)
        category = found if isinstance(found, type) and issubclass(found, Warning) else UserWarning
        warnings.warn(warning.message, category, stacklevel=stacklevel + 1)


def overlength_message(dataset: object, reported: int, yielded: int, workers: int) -> str:
    """torch's warning (_BaseDataLoaderIter.__next__, its very text) when an IterableDataset's
    loader yields more than the dataset's len() said, once len(loader) was asked."""
    message = (
        f"Length of IterableDataset {dataset} was reported to be {reported}"
        f"(when accessing len(dataloader)), but {yielded} samples have been fetched. "
    )
    if workers > 0:
        message += (
            "For multiprocessing data-loading, this could be caused by not properly "
            "configuring the IterableDataset replica at each worker. Please see "
            "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for "
            "examples."
        )
    return message
