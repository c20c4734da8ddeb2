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

from remote_loader.protos import shm, wire
from remote_loader.server.api.admission import DEFAULT_IDLE_STREAM_TIMEOUT
from remote_loader.server.api.auth import ServerTLS, check_token, load_tls, token_from_file
from remote_loader.server.batch.messages import DEFAULT_MAX_BATCH_BYTES
from remote_loader.server.config.spec import ConfigError
from remote_loader.server.engine.options import PoolOptions
from remote_loader.server.telemetry.series import DEFAULT_MAX_CONSUMERS

ENV_PREFIX = "REMOTE_LOADER_"
# Requests are a few plain fields (loader, epoch, seed, consumer): anything near this is a
# mistake or an attack. Below MIN_REQUEST_BYTES even ordinary requests would be refused.
DEFAULT_MAX_REQUEST_BYTES = 64 * 1024
MIN_REQUEST_BYTES = 1024
# Settings that come only from the environment: a secret does not belong in a config file
# (often committed, mounted world-readable) nor on a command line (visible in `ps`).
ENV_ONLY = frozenset({"token"})


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """How a server listens and streams (not what it serves: that is the loader specs)."""

    # HOST:PORT to listen on; port 0 picks a free one.
    address: str = "0.0.0.0:50051"
    # Streams served at once; one more is refused with RESOURCE_EXHAUSTED, unless a stream
    # whose client has taken nothing for idle_stream_timeout seconds gives it its place.
    max_streams: int = 32
    # Largest frame payload in bytes (see protos/wire.py for why 4 MiB).
    chunk_size: int = wire.DEFAULT_CHUNK_SIZE
    # On SIGTERM, seconds running streams get to finish.
    grace: float = 5.0
    # Seconds a stream's client may leave its batches untaken before the stream gives its
    # place to one arriving at a full server (it ends with ABORTED, and a RemoteLoader resumes;
    # NOTE [ Idle streams ] in server/api/admission.py). 0: no stream gives way.
    idle_stream_timeout: float = DEFAULT_IDLE_STREAM_TIMEOUT
    log_level: str = "INFO"
    # HOST:PORT of the Prometheus metrics endpoint (server/telemetry/metrics.py); empty: no
    # endpoint.
    metrics_address: str = ""
    # Consumer label sets (job, sharing, rank) each loader gives metric series of their own;
    # consumers past them are counted under job="other", rank="other"
    # (server/telemetry/series.py), so client-chosen job names cannot grow the metrics without
    # bound.
    metrics_max_consumers: int = DEFAULT_MAX_CONSUMERS
    # Largest encoded batch in bytes; a bigger one is an error at its position (why 2 GiB:
    # DEFAULT_MAX_BATCH_BYTES).
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES
    # Largest shared-memory ring of one same-host stream, in bytes (protos/shm.py); a batch
    # bigger than it goes as gRPC frames; 0 turns the shared-memory transport off.
    max_ring_bytes: int = shm.DEFAULT_MAX_RING_BYTES
    # A same-host client of this server's user and pid namespace reads batches in the workers'
    # slots themselves, with no copy by the server (NOTE [ Zero-copy slots ] in protos/slots.py);
    # false: every same-host batch is copied into the stream's ring.
    zero_copy: bool = True
    # Where clients on other hosts open their data connections (NOTE [ TCP data connection ] in
    # protos/tcp.py; over TLS when the server serves TLS): "auto", the address's host on a free
    # port; HOST:PORT, a fixed port (to publish from a container); "off", batches stay inside
    # gRPC.
    data_address: str = "auto"
    # Largest request message in bytes (grpc.max_receive_message_length).
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # Keepalive, see protos/wire.py: the server pings a connection silent for keepalive_time_ms
    # and drops it when no answer comes within keepalive_timeout_ms (a trainer whose host
    # vanished stops holding its stream); it accepts a client's pings as often as every
    # min_ping_interval_ms, which must not exceed the clients' wire.KEEPALIVE_TIME_MS.
    keepalive_time_ms: int = wire.KEEPALIVE_TIME_MS
    keepalive_timeout_ms: int = wire.KEEPALIVE_TIMEOUT_MS
    min_ping_interval_ms: int = wire.KEEPALIVE_TIME_MS // 2
    # A file holding the token clients must send ("authorization: Bearer <token>"); the
    # environment variable REMOTE_LOADER_TOKEN may hold the token itself instead. Neither: no
    # token is asked for. The health service stays open either way (see server/api/auth.py).
    token_file: str | None = None
    # TLS: the server's PEM certificate chain and private key (both or neither); with
    # tls_client_ca, clients must present a certificate signed by that CA (mutual TLS).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # gRPC server reflection (grpcurl and the like); it needs the token like any other call.
    reflection: bool = False
    # The Ray cluster of loaders with pool = "ray" (ray.init's address: HOST:PORT of the head's
    # GCS, or "auto"); None starts a local Ray instance on this host.
    ray_address: str | None = None
    # Ray actors talk to the server on direct lanes: in shared memory on this host, their
    # batches as bytes on a socket from elsewhere (NOTE [ Ray direct lane ] in
    # server/engine/ray/lane.py); false: every batch through Ray's calls and object store.
    ray_direct: bool = True
    # With ray_direct: trainers fetch a batch made on another host from that node (NOTE
    # [ Node data connection ] in protos/node.py); false: through this server. Ignored under
    # TLS (the node connections are not encrypted).
    ray_node_fetch: bool = True
    # The token itself, from REMOTE_LOADER_TOKEN only (ENV_ONLY); never shown.
    token: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if _port_of(self.address) is None:
            raise ConfigError(
                f"server address must be HOST:PORT (port 0 picks a free one), got {self.address!r}"
            )
        if self.max_streams < 1:
            raise ConfigError(f"server max_streams must be at least 1, got {self.max_streams}")
        if not self.idle_stream_timeout >= 0:
            raise ConfigError(
                "server idle_stream_timeout must be >= 0 seconds (0: a stream whose client "
                f"reads nothing keeps its place), got {self.idle_stream_timeout}"
            )
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
        if self.metrics_address:
            port = _port_of(self.metrics_address)
            if port is None:
                raise ConfigError(
                    "server metrics_address must be HOST:PORT (port 0 picks a free one), or "
                    f"empty for no metrics endpoint, got {self.metrics_address!r}"
                )
            if self.metrics_address == self.address and port != 0:
                raise ConfigError(
                    f"server metrics_address {self.metrics_address} is the gRPC address too: "
                    "give the metrics endpoint a port of its own"
                )
        if self.data_address not in ("auto", "off"):
            port = _port_of(self.data_address)
            if port is None:
                raise ConfigError(
                    'server data_address must be "auto", "off" or HOST:PORT (port 0 '
                    f"picks a free one), got {self.data_address!r}"
                )
            if self.data_address in (self.address, self.metrics_address) and port != 0:
                raise ConfigError(
                    f"server data_address {self.data_address} is taken by the gRPC or metrics "
                    "address: give data connections a port of their own"
                )
        if self.metrics_max_consumers < 0:
            raise ConfigError(
                "server metrics_max_consumers must be >= 0 (0: every consumer is counted under "
                f'job="other"), got {self.metrics_max_consumers}'
            )
        if self.max_batch_bytes < 1:
            raise ConfigError(
                f"server max_batch_bytes must be at least 1 byte, got {self.max_batch_bytes}"
            )
        if self.max_ring_bytes < 0:
            raise ConfigError(
                f"server max_ring_bytes must be >= 0 bytes (0: no shared memory), "
                f"got {self.max_ring_bytes}"
            )
        self._check_limits()
        self._check_security()

    def _check_limits(self) -> None:
        if not MIN_REQUEST_BYTES <= self.max_request_bytes <= wire.MAX_CHUNK_SIZE:
            raise ConfigError(
                f"server max_request_bytes must be between {MIN_REQUEST_BYTES} and "
                f"{wire.MAX_CHUNK_SIZE} bytes (requests are a few plain fields), "
                f"got {self.max_request_bytes}"
            )
        for key in ("keepalive_time_ms", "keepalive_timeout_ms", "min_ping_interval_ms"):
            if getattr(self, key) < 1:
                raise ConfigError(f"server {key} must be at least 1 ms, got {getattr(self, key)}")
        if self.min_ping_interval_ms > wire.KEEPALIVE_TIME_MS:
            raise ConfigError(
                f"server min_ping_interval_ms must be at most {wire.KEEPALIVE_TIME_MS} (clients "
                f"ping every {wire.KEEPALIVE_TIME_MS} ms; a server that accepts pings less "
                f"often treats them as abuse), got {self.min_ping_interval_ms}"
            )

    def _check_security(self) -> None:
        """Reads the files the security settings name, so a bad path fails start-up (and
        check-config), not the first client."""
        if self.token is not None and self.token_file is not None:
            raise ConfigError(
                "both REMOTE_LOADER_TOKEN and server token_file are set: give the token one way"
            )
        if self.token is not None:
            check_token(self.token, f"environment variable {ENV_PREFIX}TOKEN")
        self.auth_token()
        self.server_tls()

    def auth_token(self) -> str | None:
        """The token clients must send (from REMOTE_LOADER_TOKEN or token_file); None: none."""
        if self.token_file is not None:
            return token_from_file(self.token_file)
        return self.token

    def server_tls(self) -> ServerTLS | None:
        """The TLS material tls_cert, tls_key and tls_client_ca name; None: plaintext."""
        return load_tls(self.tls_cert, self.tls_key, self.tls_client_ca)

    def pool_options(self) -> PoolOptions:
        """What every loader's pool is made with (server/engine/options.py)."""
        return PoolOptions(
            max_batch_bytes=self.max_batch_bytes,
            ray_address=self.ray_address,
            ray_direct=self.ray_direct,
            # NOTE [ Node data connection ]: the node connections are not encrypted.
            ray_node_fetch=self.ray_node_fetch and self.tls_cert is None,
        )

    def describe(self) -> str:
        shown = [f"{f.name} {getattr(self, f.name)}" for f in dataclasses.fields(self) if f.repr]
        return ", ".join([*shown, "token set" if self.auth_token() else "no token"])


def _port_of(address: str) -> int | None:
    """The port of a HOST:PORT address; None when `address` is not one."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        return None
    return int(port)


_FIELDS = {f.name: f for f in dataclasses.fields(ServerSettings)}
_TYPES: dict[str, type] = {
    "address": str,
    "max_streams": int,
    "idle_stream_timeout": float,
    "chunk_size": int,
    "grace": float,
    "log_level": str,
    "metrics_address": str,
    "metrics_max_consumers": int,
    "max_batch_bytes": int,
    "max_ring_bytes": int,
    "zero_copy": bool,
    "data_address": str,
    "max_request_bytes": int,
    "keepalive_time_ms": int,
    "keepalive_timeout_ms": int,
    "min_ping_interval_ms": int,
    "token_file": str,
    "tls_cert": str,
    "tls_key": str,
    "tls_client_ca": str,
    "reflection": bool,
    "ray_address": str,
    "ray_direct": bool,
    "ray_node_fetch": bool,
    "token": str,
}


def _from_file(key: str, value: Any) -> Any:
    kind = _TYPES[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ConfigError(f"[server] {key} must be {_kind_name(kind)}, got {value!r}")
    return value


def _from_env(key: str, text: str) -> Any:
    kind = _TYPES[key]
    if kind is str:
        return text
    if kind is bool:
        if text.lower() in _BOOLEANS:
            return _BOOLEANS[text.lower()]
        raise ConfigError(
            f"environment variable {ENV_PREFIX}{key.upper()}={text!r} must be true or false"
        )
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(
            f"environment variable {ENV_PREFIX}{key.upper()}={text!r} must be {_kind_name(kind)}"
        ) from None


def _kind_name(kind: type) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}[kind]


_BOOLEANS = {"true": True, "1": True, "yes": True, "on": True}
_BOOLEANS.update({"false": False, "0": False, "no": False, "off": False})


def resolve_settings(
    table: Mapping[str, Any] | None,
    env: Mapping[str, str],
    flags: Mapping[str, Any] | None = None,
) -> ServerSettings:
    """The settings from a `[server]` table, the environment and flags (None: not given)."""
    values: dict[str, Any] = {}
    table = table or {}
    if ENV_ONLY & set(table):
        raise ConfigError(
            "[server] token: a token does not belong in the config file; put it in a file "
            f"named by token_file, or in the environment variable {ENV_PREFIX}TOKEN"
        )
    unknown = sorted(set(table) - set(_FIELDS))
    if unknown:
        raise ConfigError(
            f"[server]: unknown setting(s) {', '.join(unknown)}; allowed: "
            f"{', '.join(k for k in _FIELDS if k not in ENV_ONLY)}"
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
