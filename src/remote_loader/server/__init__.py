"""The remote-loader server: loader specs, sampling, the worker pool and the gRPC service.

from remote_loader.server import LoaderSpec, Server, ServerSettings

spec = LoaderSpec(name="images", dataset="my_project.data:make_dataset", batch_size=64)
with Server(ServerSettings(address="127.0.0.1:0"), [spec]) as server:
    ...  # trainers iterate RemoteLoader(server.address, "images")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from remote_loader.server.api.server import Server
    from remote_loader.server.api.settings import ServerSettings
    from remote_loader.server.config.spec import ConfigError, LoaderSpec

__all__ = ["ConfigError", "LoaderSpec", "Server", "ServerSettings"]

# Imported on first use, not here: workers import remote_loader.server.worker.loop (so this package)
# in the fork server, which must never run gRPC (grpc/grpc#16001) and loads it only when the
# main module does (NOTE [ Fork server preload ] in server/engine/forkserver.py).
_WHERE = {
    "Server": "remote_loader.server.api.server",
    "ServerSettings": "remote_loader.server.api.settings",
    "ConfigError": "remote_loader.server.config.spec",
    "LoaderSpec": "remote_loader.server.config.spec",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'remote_loader.server' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_WHERE[name]), name)
