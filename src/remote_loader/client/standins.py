"""Stand-ins for a RemoteLoader's dataset, sampler and batch_sampler, which live on the
server: they tell what the client knows (lengths, the epoch) and refuse the rest, saying why and
what to do instead.

The server describes the loader (LoaderInfo): its options as JSON text by name (the spec's
fields, server/config/spec.py `options_text`), the dataset's kind and length, this consumer's
batches per epoch. Everything here is read from that, or from the loader through callables.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, NoReturn

from torch.utils.data import Dataset, IterableDataset, Sampler

from remote_loader.protos import loader_pb2 as pb

# What to do instead of reading the indices or samples here; every refusal below ends with it.
INSTEAD = (
    "iterate the loader for its batches; to skip batches (what accelerate.skip_first_batches "
    "does for a DataLoader), resume with loader.load_state_dict(state) from a "
    "loader.state_dict() taken at that point"
)


def option(info: pb.LoaderInfo, key: str, default: Any) -> Any:
    """The spec's option `key` as Describe sent it (JSON text), or `default` when a server
    does not send it."""
    text = info.options.get(key)
    if text is None:
        return default
    try:
        return json.loads(text)
    except ValueError:
        return default


class ServerSideError(AttributeError):
    """An attribute of a RemoteLoader's dataset (or its collate_fn, worker_init_fn) that lives
    on the server. An AttributeError, so that hasattr() is False and getattr() with a default
    gives the default."""


class _RemoteDataset:
    """The dataset of a RemoteLoader, which lives on the server: its len() where the server
    knows it, its repr; any other attribute, an item or an iteration is refused, saying why."""

    def __init__(self, info: pb.LoaderInfo, address: str) -> None:
        self._loader = info.name
        self._address = address
        self._factory = str(option(info, "dataset", "?"))
        self._kwargs = option(info, "dataset_kwargs", {})
        self._length = int(info.dataset_length) if info.HasField("dataset_length") else None

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError(
                f"the dataset of loader {self._loader!r} ({self._factory}) has no len(): the "
                "server could not take one"
            )
        return self._length

    def __repr__(self) -> str:
        kwargs = ", ".join(f"{k}={v!r}" for k, v in self._kwargs.items())
        return (
            f"<{type(self).__name__} {self._factory}({kwargs}) of loader {self._loader!r} "
            f"at {self._address}>"
        )

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("_"):  # copy, pickle and the like probing: no message needed
            raise AttributeError(name)
        raise ServerSideError(self._refusal(f"its attribute {name!r} cannot be read"))

    def __getitem__(self, index: Any) -> NoReturn:
        raise TypeError(self._refusal(f"its item {index!r} cannot be read"))

    def _refusal(self, what: str) -> str:
        return (
            f"the dataset of loader {self._loader!r} ({self._factory}) lives on the server at "
            f"{self._address}, and {what} from the trainer: {INSTEAD}; what the dataset's "
            "code needs, it reads on the server (its factory's arguments: "
            "loader.info.options['dataset_kwargs'])"
        )


class RemoteMapDataset(_RemoteDataset, Dataset[Any]):
    """A map-style dataset on the server (isinstance of torch's Dataset, as the local one)."""


class RemoteIterableDataset(_RemoteDataset, IterableDataset[Any]):
    """An IterableDataset on the server (isinstance of torch's IterableDataset, as the local
    one, which Lightning and accelerate check)."""

    def __iter__(self) -> Iterator[Any]:
        raise TypeError(self._refusal("it cannot be iterated"))


def remote_dataset(info: pb.LoaderInfo, address: str) -> RemoteMapDataset | RemoteIterableDataset:
    if info.dataset_kind == "iterable":
        return RemoteIterableDataset(info, address)
    return RemoteMapDataset(info, address)


class RemoteSampler(Sampler[int]):
    """The loader's sampler, which draws on the server: `set_epoch(e)` sets the loader's next
    epoch (as DistributedSampler.set_epoch, which Lightning calls every epoch); len() is the
    samples this consumer receives per epoch, where the client can tell (`sampler_length`)."""

    def __init__(
        self,
        loader: str,
        set_epoch: Callable[[int], None],
        epoch: Callable[[], int],
        length: Callable[[], int],
    ) -> None:
        self.loader = loader  # its name
        self._set_epoch = set_epoch
        self._epoch = epoch
        self._length = length

    def set_epoch(self, epoch: int) -> None:
        """Makes the loader's next epoch `epoch` (RemoteLoader.set_epoch)."""
        self._set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The loader's next epoch."""
        return self._epoch()

    def __len__(self) -> int:
        return self._length()

    def __iter__(self) -> Iterator[int]:
        raise TypeError(_indices_refusal(self.loader))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of loader {self.loader!r}, next epoch {self.epoch}>"


class RemoteBatchSampler(Sampler[list[int]]):
    """The loader's batch_sampler, drawn on the server: len() is len(loader), the batches this
    consumer receives; `sampler` is the loader's sampler; `set_epoch(e)` sets the next epoch."""

    def __init__(
        self,
        sampler: RemoteSampler,
        batch_size: int | None,
        drop_last: bool,
        length: Callable[[], int],
    ) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last
        self._length = length

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return self._length()

    def __iter__(self) -> Iterator[list[int]]:
        raise TypeError(_indices_refusal(self.sampler.loader))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of loader {self.sampler.loader!r}>"


def _indices_refusal(loader: str) -> str:
    return (
        f"the indices of loader {loader!r} are drawn on the server, from (spec, seed, epoch): "
        f"they cannot be iterated here; {INSTEAD}"
    )


def sampler_length(
    info: pb.LoaderInfo, sharing: str, world_size: int, batches: Callable[[], int]
) -> int:
    """Samples this consumer receives in an epoch, as len(sampler) tells a local DataLoader's
    user (len(DistributedSampler) = its num_samples, for a rank of a partition); `batches()`
    is len(loader). TypeError where the client cannot tell, saying why."""
    name = info.name
    if info.dataset_kind == "iterable":
        raise TypeError(
            f"loader {name!r} serves an IterableDataset: its sampler (torch's "
            "_InfiniteConstantSampler) has no len()"
        )
    if sharing == "dynamic":
        raise TypeError(
            "len(sampler) is unknown with sharing='dynamic': how many samples this consumer "
            "receives depends on how fast the job's other consumers take theirs"
        )
    if option(info, "batch_sampler", None) is not None:
        raise TypeError(
            f"loader {name!r} has a batch_sampler of its own, on the server: the samples in its "
            "batches are not known here (len(loader.batch_sampler) is the batches)"
        )
    if option(info, "sampler", None) is not None:
        if option(info, "batch_size", 1) is None:
            return batches()  # each sample is a batch
        raise TypeError(
            f"loader {name!r} has a sampler of its own, on the server, whose len() the server "
            "does not send (len(loader) is the batches)"
        )
    if not info.HasField("dataset_length"):
        raise TypeError(f"the dataset of loader {name!r} has no len()")
    samples = int(info.dataset_length)
    if sharing == "broadcast" or world_size == 1:
        return samples
    # A rank's share of a partition: DistributedSampler's num_samples, as the server deals it
    # (server/config/sampling.py share_size).
    if option(info, "partition_drop_last", False) and samples % world_size:
        return max(0, math.ceil((samples - world_size) / world_size))
    return math.ceil(samples / world_size)


def refuse_rebuild(caller: FrameType | None, loader: str) -> None:
    """Raises TypeError when `caller` is accelerate's skip_first_batches, which rebuilds a local
    DataLoader over `loader.dataset`: that one's batches would fail only at its first next(),
    in the training loop, far from the call; this says why at the call."""
    if caller is None or caller.f_code.co_name != "skip_first_batches":
        return
    if not str(caller.f_globals.get("__name__", "")).startswith("accelerate"):
        return
    raise TypeError(
        f"accelerate.skip_first_batches rebuilds a local DataLoader over loader.dataset, but the "
        f"dataset of RemoteLoader {loader!r} lives on the server: instead, {INSTEAD}"
    )
