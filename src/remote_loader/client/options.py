"""RemoteLoader's option rules: what each argument accepts, with an error that says what was
wrong and what to pass instead, and the defaults it takes from its surroundings (the job
membership from torch.distributed or RANK / WORLD_SIZE, the CUDA device)."""

from __future__ import annotations

import os

import torch

from remote_loader.client.errors import RemoteLoaderError
from remote_loader.protos import compression as compression_module
from remote_loader.protos import tcp

SHARING_MODES = ("partition", "broadcast", "dynamic")
TRANSPORTS = ("auto", "tcp", "grpc")


def check_options(
    *,
    sharing: str,
    job: str | None,
    seed: int | None,
    prefetch: int,
    timeout: float | None,
    retries: int,
    backoff: float,
    transport: str,
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
    """Where batches go: `device`, with a CUDA device's index filled in; None: the current
    CUDA device if there is one, else the CPU."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise RemoteLoaderError(f"device {device!r} was asked for, but CUDA is not available")
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    elif resolved.type != "cpu":
        raise ValueError(f"device must be 'cpu' or a CUDA device, got {device!r}")
    return resolved
