"""What scripts read of a DataLoader, on a RemoteLoader: the attributes (its base class,
read-only, as the server's loader has them), and the warnings torch would give here."""

from __future__ import annotations

import builtins
import sys
import warnings
from collections.abc import Callable
from typing import Any, Generic, NoReturn, Protocol, TypeVar, overload

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


class DataLoaderSurface:
    """The attributes scripts read of a torch DataLoader, as RemoteLoader's server has them:
    read-only, from what Describe said (`info`, the loader's), with stand-ins for the dataset and
    samplers (client/standins.py), made by `_stand_in` once the loader is described."""

    name: str  # the loader's, on its server

    @property
    def info(self) -> pb.LoaderInfo:
        raise NotImplementedError

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
