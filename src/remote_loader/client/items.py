"""What the receiver queues for the epoch iterator: a ready batch or an error at each position,
then the stream's end (the queue protocol is Receiver's, client/receiver.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from remote_loader.client.errors import RemoteLoaderError


@dataclasses.dataclass
class Ready:
    """A decoded batch; on CUDA, `event` marks the end of its copy to the device."""

    batch: Any
    device_payload: torch.Tensor | None = None
    event: Any = None  # torch.cuda.Event when the batch was copied on a side stream
    nbytes: int = 0  # the encoded batch's size (header and tensor data), for stats()
    transport: str = "grpc"  # how it arrived: "shm", "tcp", "node" or "grpc"
    # Its stream's wait for the workers, and this receiver's time on it (NOTE [ Stall stages ]).
    workers_wait: float = 0.0
    copy_seconds: float = 0.0


@dataclasses.dataclass
class Failed:
    """An error to raise at this point of the stream; `final` ends the stream."""

    error: RemoteLoaderError
    final: bool


@dataclasses.dataclass
class Finished:
    """The stream ended normally after `batches` batches."""

    batches: int


Item = Ready | Failed | Finished
