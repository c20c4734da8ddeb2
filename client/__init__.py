"""The remote-loader client: `RemoteLoader`, a drop-in for torch's DataLoader, and its errors."""

from remote_loader.client.errors import (
    ConnectionLostError,
    DatasetError,
    LoaderNotFoundError,
    LoaderTimeoutError,
    ProtocolError,
    RemoteLoaderError,
    RequestError,
    ServerError,
)
from remote_loader.client.loader import RemoteLoader

__all__ = [
    "ConnectionLostError",
    "DatasetError",
    "LoaderNotFoundError",
    "LoaderTimeoutError",
    "ProtocolError",
    "RemoteLoader",
    "RemoteLoaderError",
    "RequestError",
    "ServerError",
]
