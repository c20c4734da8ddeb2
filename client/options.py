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


def membership(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size) as given, else torch.distributed's, else RANK / WORLD_SIZE, else 0/1."""
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if rank is None or world_size is None:
        default_rank, default_size = _default_membership()
        rank = default_rank if rank is None else rank
        world_size = default_size if world_size is None else world_size
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank {rank} is out of range for world_size {world_size}: "
            f"it must be in [0, {world_size - 1}]"
        )
    return rank, world_size


def _default_membership() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    values = []
    for var, default in (("RANK", 0), ("WORLD_SIZE", 1)):
        text = os.environ.get(var)
        if text is None or not text.strip():
            values.append(default)
            continue
        try:
            values.append(int(text))
        except ValueError:
            raise ValueError(
                f"the environment variable {var}={text!r} is not an integer; fix it or pass "
                f"{var.lower()}= to RemoteLoader"
            ) from None
    return values[0], values[1]


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
