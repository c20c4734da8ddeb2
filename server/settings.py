"""Server settings: the config file's `[server]` table, REMOTE_LOADER_* variables, flags.

Each setting comes from, in order of precedence: a `serve` flag given on the command line, the
environment variable REMOTE_LOADER_<NAME> (e.g. REMOTE_LOADER_MAX_STREAMS), the `[server]` table
of the config file, the default below.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from remote_loader.protos import wire
from remote_loader.server.spec import ConfigError

ENV_PREFIX = "REMOTE_LOADER_"


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """How a server listens and streams (not what it serves: that is the loader specs)."""

    # HOST:PORT to listen on; port 0 picks a free one.
    address: str = "0.0.0.0:50051"
    # Streams served at once; one more is refused with RESOURCE_EXHAUSTED.
    max_streams: int = 32
    # Largest frame payload in bytes (see protos/wire.py for why 4 MiB).
    chunk_size: int = wire.DEFAULT_CHUNK_SIZE
    # On SIGTERM, seconds running streams get to finish.
    grace: float = 5.0
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(
                f"server address must be HOST:PORT (port 0 picks a free one), got {self.address!r}"
            )
        if self.max_streams < 1:
            raise ConfigError(f"server max_streams must be at least 1, got {self.max_streams}")
        if not 0 < self.chunk_size <= wire.MAX_CHUNK_SIZE:
            raise ConfigError(
                f"server chunk_size must be between 1 and {wire.MAX_CHUNK_SIZE} bytes, "
                f"got {self.chunk_size}"
            )
        if not self.grace >= 0:
            raise ConfigError(f"server grace must be >= 0 seconds, got {self.grace}")
        level = self.log_level.upper()
        if not isinstance(logging.getLevelName(level), int):
            raise ConfigError(
                f"server log_level must be DEBUG, INFO, WARNING, ERROR or CRITICAL, "
                f"got {self.log_level!r}"
            )
        object.__setattr__(self, "log_level", level)

    def describe(self) -> str:
        return ", ".join(f"{f.name} {getattr(self, f.name)}" for f in dataclasses.fields(self))


_FIELDS = {f.name: f for f in dataclasses.fields(ServerSettings)}
_TYPES: dict[str, type] = {
    "address": str,
    "max_streams": int,
    "chunk_size": int,
    "grace": float,
    "log_level": str,
}


def _from_file(key: str, value: Any) -> Any:
    kind = _TYPES[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ConfigError(f"[server] {key} must be {_kind_name(kind)}, got {value!r}")
    return value


def _from_env(key: str, text: str) -> Any:
    kind = _TYPES[key]
    if kind is str:
        return text
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(
            f"environment variable {ENV_PREFIX}{key.upper()}={text!r} must be {_kind_name(kind)}"
        ) from None


def _kind_name(kind: type) -> str:
    return {str: "a string", int: "an integer", float: "a number"}[kind]


def resolve_settings(
    table: Mapping[str, Any] | None,
    env: Mapping[str, str],
    flags: Mapping[str, Any] | None = None,
) -> ServerSettings:
    """The settings from a `[server]` table, the environment and flags (None: not given)."""
    values: dict[str, Any] = {}
    table = table or {}
    unknown = sorted(set(table) - set(_FIELDS))
    if unknown:
        raise ConfigError(
            f"[server]: unknown setting(s) {', '.join(unknown)}; allowed: {', '.join(_FIELDS)}"
        )
    for key, value in table.items():
        values[key] = _from_file(key, value)
    for key in _FIELDS:
        text = env.get(ENV_PREFIX + key.upper())
        if text is not None and text.strip():
            values[key] = _from_env(key, text.strip())
    for key, value in (flags or {}).items():
        if value is not None:
            values[key] = value
    return ServerSettings(**values)
