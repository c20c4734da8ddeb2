"""The remote-loader client: `RemoteLoader`, a drop-in for torch's DataLoader, and its errors."""

from remote_loader.client.epoch import LoaderStats
from remote_loader.client.errors import (
    AuthenticationError,
    ConnectionLostError,
    DatasetError,
    LoaderBrokenError,
    LoaderNotFoundError,
    LoaderTimeoutError,
    ProtocolError,
    RemoteLoaderError,
    RequestError,
    RequestTooLargeError,
    ServerBusyError,
    ServerError,
    SpecChangedError,
    TransportError,
)
from remote_loader.client.loader import RemoteLoader
from remote_loader.client.security import TLS

__all__ = [
    "TLS",
    "AuthenticationError",
    "ConnectionLostError",
    "DatasetError",
    "LoaderBrokenError",
    "LoaderNotFoundError",
    "LoaderStats",
    "LoaderTimeoutError",
    "ProtocolError",
    "RemoteLoader",
    "RemoteLoaderError",
    "RequestError",
    "RequestTooLargeError",
    "ServerBusyError",
    "ServerError",
    "SpecChangedError",
    "TransportError",
]
