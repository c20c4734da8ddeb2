"""The modes a RemoteLoader takes, as Literal aliases (httpx's _types.py): a typo in
`sharing=`, `transport=` or `compression=` is a type error before it is a ValueError."""

from __future__ import annotations

from typing import Literal, get_args

from remote_loader.protos.modes import SHARING_MODES, Compression, Sharing

# How batches travel: "auto" (shared memory, else data connections, else in the gRPC stream),
# "tcp" (data connections or TransportError), "grpc" (in the stream); see RemoteLoader.
Transport = Literal["auto", "tcp", "grpc"]
TRANSPORTS: tuple[Transport, ...] = get_args(Transport)

__all__ = ["SHARING_MODES", "TRANSPORTS", "Compression", "Sharing", "Transport"]
