"""RemoteLoader's options: what each argument accepts, with an error that says what was
wrong and what to pass instead; the defaults it takes from its surroundings (the job
membership from torch.distributed or RANK / WORLD_SIZE, the CUDA device); and LoaderOptions,
the arguments once checked and resolved, which the loader reads through read-only attributes
(FromOptions) and hands to what it builds."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Generic, NoReturn, Protocol, TypeVar, cast, overload

import torch

from remote_loader.client import connect
from remote_loader.client.errors import RemoteLoaderError
from remote_loader.client.security import TLS, resolve_tls, resolve_token
from remote_loader.client.state import DEFAULT_JOB
from remote_loader.client.types import SHARING_MODES, TRANSPORTS, Compression, Sharing, Transport
from remote_loader.protos import compression as compression_module
from remote_loader.protos import tcp

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class LoaderOptions:
    """A RemoteLoader's arguments, checked (check_options) and resolved: the job's name for
    none, the device, TLS and the token. Made once by RemoteLoader.__init__, read through its
    read-only attributes, and handed whole to what it builds (ServerLink, which makes each
    epoch's Transports and Receiver from it). Not here: the rank and world size, read from the
    job until the first stream (JobRank), and the seed, which load_state_dict sets."""

    address: str
    sharing: Sharing
    job: str
    device: torch.device
    pin_memory: bool  # asked for, and the batches go to CUDA
    prefetch: int
    timeout: float | None
    connect_timeout: float
    retries: int
    backoff: float
    transport: Transport
    data_connections: int | None
    compression: str  # the codec: "lz4", "zstd", or "" for none
    tls: TLS | None
    token: str | None = dataclasses.field(default=None, repr=False)
    # NOTE [ A pickled loader ]: the arguments as given, before anything was resolved. A
    # RemoteLoader pickles as these, its loader's name, its cursor (the next epoch and where it
    # starts) and its seed, and unpickles by connecting anew with them, as a DataLoader pickles
    # as its arguments: Lightning's ddp_spawn and torch.multiprocessing.spawn hand the loader a
    # DataModule made before them to processes of their own, where the device, the token from
    # the environment and the rank (at the first iter()) are that process's. A stream running
    # in the pickling process is not carried: the copy's next iterator takes the next epoch.
    given: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)


class HasOptions(Protocol):
    @property
    def options(self) -> LoaderOptions: ...


class FromOptions(Generic[T]):
    """A read-only attribute of a RemoteLoader: its LoaderOptions' field of the same name."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, loader: None, owner: type) -> FromOptions[T]: ...
    @overload
    def __get__(self, loader: HasOptions, owner: type) -> T: ...
    def __get__(self, loader: HasOptions | None, owner: type) -> FromOptions[T] | T:
        return self if loader is None else cast(T, getattr(loader.options, self._name))

    def __set__(self, loader: HasOptions, value: Any) -> NoReturn:
        raise AttributeError(
            f"{self._name} was given to RemoteLoader(...) and cannot be changed: make a new "
            "RemoteLoader with the value you want"
        )


def check_options(
    *,
    sharing: Sharing,
    job: str | None,
    seed: int | None,
    prefetch: int,
    timeout: float | None,
    retries: int,
    backoff: float,
    transport: Transport,
    data_connections: int | None,
) -> None:
    """Raises ValueError / TypeError for the first argument of RemoteLoader that is not one it
    accepts."""
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 1:
        raise ValueError(f"prefetch must be a positive integer, got {prefetch!r}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be positive seconds or None, got {timeout!r}")
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise ValueError(f"retries must be a non-negative integer, got {retries!r}")
    if not backoff >= 0:
        raise ValueError(f"backoff must be non-negative seconds, got {backoff!r}")
    if seed is not None and not isinstance(seed, int):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if data_connections is not None and (
        not isinstance(data_connections, int)
        or isinstance(data_connections, bool)
        or not 1 <= data_connections <= tcp.MAX_DATA_CONNECTIONS
    ):
        raise ValueError(
            f"data_connections must be an integer from 1 to {tcp.MAX_DATA_CONNECTIONS} "
            f"(TCP connections per stream), or None to let each batch's size decide; got "
            f"{data_connections!r}"
        )
    if sharing not in SHARING_MODES:
        raise ValueError(f"sharing must be one of {', '.join(SHARING_MODES)}, got {sharing!r}")
    if job is not None and not isinstance(job, str):
        raise TypeError(f"job must be a string or None, got {type(job).__name__}")


def resolve_options(
    address: str,
    *,
    rank: int | None,
    world_size: int | None,
    sharing: Sharing,
    job: str | None,
    seed: int | None,
    device: torch.device | str | None,
    pin_memory: bool,
    prefetch: int,
    timeout: float | None,
    connect_timeout: float,
    retries: int,
    backoff: float,
    transport: Transport,
    data_connections: int | None,
    compression: Compression,
    token: str | None,
    tls: bool | TLS | None,
) -> tuple[LoaderOptions, JobRank]:
    """RemoteLoader's arguments checked (the first wrong one raises, in the order of old) and
    resolved: its LoaderOptions, and its JobRank (the rank and world size, read from the job
    until its first stream)."""
    given = dict(locals())  # the arguments alone: nothing else is bound yet
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
    codec = compression_codec(compression)
    members = JobRank(rank, world_size)
    resolved = resolve_device(device)
    options = LoaderOptions(
        address=address,
        sharing=sharing,
        # The server's name for the job an empty one means, so that state_dict() says what the
        # server's logs and metrics do.
        job=job or DEFAULT_JOB,
        device=resolved,
        pin_memory=bool(pin_memory) and resolved.type == "cuda",
        prefetch=prefetch,
        timeout=timeout,
        connect_timeout=connect_timeout,
        retries=retries,
        backoff=backoff,
        transport=transport,
        data_connections=data_connections,
        compression=codec,
        tls=resolve_tls(tls),
        token=resolve_token(token),
        given=given,
    )
    return options, members


def compression_codec(compression: str) -> str:
    """The codec `compression` names ("" for "none"); ValueError if it is unknown or its
    package is missing here, where the batches would be decompressed."""
    codec = compression_module.check(compression)  # raises ValueError
    if codec and not compression_module.available(codec):
        raise ValueError(
            f"compression={compression!r} needs its package here to decompress the "
            f"batches: {compression_module.install_hint(codec)}"
        )
    return codec


class RankUnknown(ValueError):
    """The job has several ranks and nothing says which this process is."""


def membership(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): each as given, else torch.distributed's (once initialized), else the
    RANK / WORLD_SIZE environment variables, else rank 0 of world 1.

    A world of several ranks with no rank found is RankUnknown, never rank 0: Lightning's DDP
    launcher sets WORLD_SIZE and LOCAL_RANK, not RANK, and initializes torch.distributed only
    after a DataModule made the loader. LOCAL_RANK stands for the rank when it must be the same
    number: on a job of one node (LOCAL_WORLD_SIZE equal to the world size), or where
    LOCAL_WORLD_SIZE is unset and NODE_RANK and GROUP_RANK are 0 or unset (the first node, whose
    local ranks are the job's first ranks, as torchrun and Lightning number them).
    """
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if rank is None or world_size is None:
        found_rank, found_size = _job_membership()
        world_size = found_size if world_size is None else world_size
        rank = found_rank if rank is None else rank
        if rank is None and world_size > 1:
            rank = _local_rank(world_size)
        if rank is None and world_size > 1:
            raise RankUnknown(
                f"this job has world_size {world_size}, but nothing says this process's rank: "
                "torch.distributed is not initialized and RANK is not set"
                f"{_local_rank_note()}. Pass rank=... to RemoteLoader, initialize "
                "torch.distributed (init_process_group) before the first iter(), or set RANK"
            )
    rank = 0 if rank is None else rank
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank {rank} is out of range for world_size {world_size}: "
            f"it must be in [0, {world_size - 1}]"
        )
    return rank, world_size


class JobRank:
    """A consumer's (rank, world_size): the arguments, and the job's values (`membership`) for
    those not given, read afresh at each use until `fix()` keeps them for good. A loader is
    often made before its job's launcher or torch.distributed has said who it is (in a
    DataModule's __init__); its first stream is not."""

    def __init__(self, rank: int | None, world_size: int | None) -> None:
        self._asked = (rank, world_size)
        self.fixed: tuple[int, int] | None = None  # once `fix()`ed
        if rank is not None and world_size is not None:
            self.fixed = membership(rank, world_size)  # nothing to wait for: check it now
        else:
            for name, value in (("rank", rank), ("world_size", world_size)):
                if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                    raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")

    def current(self) -> tuple[int, int]:
        """The membership now (RankUnknown, a ValueError, when the rank cannot be told)."""
        return self.fixed if self.fixed is not None else membership(*self._asked)

    def fix(self) -> tuple[int, int]:
        """The membership now, kept from here on."""
        if self.fixed is None:
            self.fixed = membership(*self._asked)
        return self.fixed

    def known(self) -> tuple[int, int] | None:
        """The membership now, or None where the rank cannot be told yet."""
        try:
            return self.current()
        except RankUnknown:
            return None


def _job_membership() -> tuple[int | None, int]:
    """torch.distributed's (rank, world size) once initialized, else RANK's (None when unset)
    and WORLD_SIZE's (1 when unset)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    size = _env_int("WORLD_SIZE")
    return _env_int("RANK"), 1 if size is None else size


def _local_rank(world_size: int) -> int | None:
    """LOCAL_RANK, where it is the job's rank too (see membership); else None."""
    local = _env_int("LOCAL_RANK")
    if local is None:
        return None
    local_world = _env_int("LOCAL_WORLD_SIZE")
    if local_world is not None:
        return local if local_world == world_size else None
    first_node = all(_env_int(var) in (None, 0) for var in ("NODE_RANK", "GROUP_RANK"))
    return local if first_node else None


def _local_rank_note() -> str:
    if _env_int("LOCAL_RANK") is None:
        return ""
    said = ", ".join(
        f"{var}={os.environ[var]}"
        for var in ("LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK")
        if os.environ.get(var, "").strip()
    )
    return (
        f" (LOCAL_RANK={os.environ['LOCAL_RANK']} is the rank on this node; with {said} it "
        "need not be the job's, which it is only on a job's first node)"
    )


def _env_int(var: str) -> int | None:
    text = os.environ.get(var)
    if text is None or not text.strip():
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"the environment variable {var}={text!r} is not an integer; fix it or pass "
            f"{_ARGUMENT.get(var, 'rank')}= to RemoteLoader"
        ) from None


# The RemoteLoader argument that stands in for each environment variable read above.
_ARGUMENT = {"WORLD_SIZE": "world_size", "LOCAL_WORLD_SIZE": "world_size"}


def resolve_device(device: torch.device | str | None) -> torch.device:
    """Where batches go: `device`; None: CUDA if there is one, else the CPU. A CUDA device
    without an index keeps none until the first iter() (`placed`)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise RemoteLoaderError(f"device {device!r} was asked for, but CUDA is not available")
    elif resolved.type != "cpu":
        raise ValueError(f"device must be 'cpu' or a CUDA device, got {device!r}")
    return resolved


def placed(options: LoaderOptions) -> LoaderOptions:
    """`options` with its CUDA device's index filled in, at the first iter().

    NOTE [ The device at the first iter() ]: a loader named no CUDA device's index takes the
    current device when its first iterator is made, as torch's DataLoader pins for the current
    device when its iterator is made, not when it is built. Lightning builds a DataModule's
    loaders before its DDP strategy calls torch.cuda.set_device(local_rank): read at
    construction, every rank's batches went to cuda:0 (and each rank's CUDA context with them),
    and asking for the current device there initialized CUDA in a process that ddp_notebook
    then forks, which CUDA refuses."""
    device = options.device
    if device.type != "cuda" or device.index is not None:
        return options
    return dataclasses.replace(options, device=torch.device("cuda", torch.cuda.current_device()))
