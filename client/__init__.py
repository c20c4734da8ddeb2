"""The remote-loader client: `RemoteLoader`, a drop-in for torch's DataLoader, and its errors."""

from remote_loader.client.epoch import LoaderStats
from remote_loader.client.errors import (
    AuthenticationError,
    ConnectionLostError,
    DatasetError,
    LoaderNotFoundError,
    LoaderTimeoutError,
    ProtocolError,
    RemoteLoaderError,
    RequestError,
    ServerBusyError,
    ServerError,
    TransportError,
)
from remote_loader.client.loader import RemoteLoader
from remote_loader.client.security import TLS

__all__ = [
    "TLS",
    "AuthenticationError",
    "ConnectionLostError",
    "DatasetError",
    "LoaderNotFoundError",
    "LoaderStats",
    "LoaderTimeoutError",
    "ProtocolError",
    "RemoteLoader",
    "RemoteLoaderError",
    "RequestError",
    "ServerBusyError",
    "ServerError",
    "TransportError",
]
