"""Reaching the server: what an address must look like, and how long a RemoteLoader waits for
the server, with every wait under a deadline (NOTE [ Waiting for the server ])."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from remote_loader.client.errors import (
    ConnectionLostError,
    RemoteLoaderError,
    ServerBusyError,
    map_rpc_error,
    server_busy,
)
from remote_loader.client.security import TLS, open_channel
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import wire

# NOTE [ Waiting for the server ]
#
# No wait for the server is without a deadline; what each costs:
#
# - The first connection (RemoteLoader(), ListLoaders and Describe): each attempt is the call
#   itself, made without gRPC's wait_for_ready and with `connect_timeout` as its deadline. A
#   connection refused (nothing listens, the TLS handshake failed), a handshake that stalls (a
#   stopped process, a host dropping packets: gRPC gives one up after its reconnect backoff, at
#   most about 2 s with the loader's channel options, which also set its connect deadline) or
#   a server that is full or draining fails the attempt (UNAVAILABLE, RESOURCE_EXHAUSTED from
#   its concurrency limit), and the next one follows after the backoff: `backoff`, doubling up
#   to MAX_BACKOFF, `retries` times. A server whose connection is up but that does not answer
#   the call within `connect_timeout` (DEADLINE_EXCEEDED) ends it at once: it is there, and
#   another attempt would wait as long again. Bound: first_connect_bound(); with no server,
#   the backoff total alone. gRPC's own reconnection runs beside these attempts (every 0.1 s
#   growing to 2 s), and an attempt sees its latest outcome: a server that starts listening is
#   seen within about 2 s.
#
# - Each stream (an epoch's first, and each resume of a broken one): the receiver waits for the
#   server to answer a ListLoaders call made with wait_for_ready and `connect_timeout` as its
#   deadline, so through refusals: a stream that broke had a server a moment ago, and waiting
#   is what lets a restarting server be resumed. Then the Stream call is made without
#   wait_for_ready, so that it cannot wait for a connection with no deadline (a stream has
#   none: it lasts an epoch). No answer in time counts as one break (client/receiver.py);
#   after `retries` breaks in a row with no batch between, the training loop gets
#   ConnectionLostError. Bound: stream_bound().
#
# - A server at its max_streams refuses a stream with RESOURCE_EXHAUSTED naming the setting:
#   and the reason server-busy: a break like any other, retried with the same backoff, then
#   ServerBusyError. A message over a size limit is RESOURCE_EXHAUSTED too (gRPC's "larger than
#   max"): no retry can help it, so it is raised at once (server_busy() tells them apart by the
#   reason, NOTE [ Error reasons ]).

# Reconnecting: the first wait, and the most any one wait grows to (it doubles per attempt).
DEFAULT_BACKOFF = 0.5
MAX_BACKOFF = 8.0
# How often a wait for the connection looks whether the stream was stopped meanwhile.
POLL_INTERVAL = 0.1
# The port the server listens on unless told otherwise (its `address` default), for messages.
DEFAULT_PORT = 50051
# gRPC target schemes whose rest is a list of host:port (dns: may name its DNS server first).
_HOST_SCHEMES = ("dns:", "ipv4:", "ipv6:")
# Targets that name no TCP port at all.
_PORTLESS_SCHEMES = ("unix:", "unix-abstract:", "vsock:")

T = TypeVar("T")


def delay(backoff: float, attempt: int) -> float:
    """Seconds before retry `attempt` (1, 2, ...): `backoff` doubling per attempt, at most
    MAX_BACKOFF."""
    return float(min(backoff * 2 ** (attempt - 1), MAX_BACKOFF))


def backoff_total(backoff: float, retries: int) -> float:
    """Seconds of backoff over all `retries` retries."""
    return sum(delay(backoff, k) for k in range(1, retries + 1))


def first_connect_bound(connect_timeout: float, retries: int, backoff: float) -> float:
    """The longest RemoteLoader() waits for a server before ConnectionLostError: `retries` + 1
    attempts of at most `connect_timeout` each, and the backoff between them (a refused
    attempt takes next to no time: with no server it is the backoff total)."""
    return backoff_total(backoff, retries) + (retries + 1) * connect_timeout


def stream_bound(connect_timeout: float, retries: int, backoff: float) -> float:
    """The longest a stream is resumed after it broke, with the server gone, before the
    training loop gets ConnectionLostError: each retry waits its backoff and then up to
    `connect_timeout` for the connection."""
    return backoff_total(backoff, retries) + retries * connect_timeout


def check_address(address: str) -> None:
    """Raises ValueError for an address gRPC would take but that names no port (gRPC would
    quietly dial port 443), or a port that is not one; TypeError for a non-string.

    Accepted: "host:port", "[v6]:port", "dns:///host:port", "ipv4:a.b.c.d:port[,...]",
    "ipv6:[v6]:port[,...]", and the portless "unix:path", "unix-abstract:name", "vsock:cid:port".
    """
    if not isinstance(address, str):
        raise TypeError(f"address must be a string 'host:port', got {type(address).__name__}")
    target = address.strip()
    if target.startswith(_PORTLESS_SCHEMES):
        return
    for scheme in _HOST_SCHEMES:
        if target.startswith(scheme):
            rest = target[len(scheme) :]
            if rest.startswith("//"):  # dns://[dns-server]/host:port
                rest = rest[2:].partition("/")[2]
            for part in rest.split(","):
                _check_host_port(address, part)
            return
    if "://" in target:
        return  # another resolver's target (xds:///..., a custom one): gRPC's to read
    _check_host_port(address, target)


def _check_host_port(address: str, target: str) -> None:
    if not target:
        raise ValueError(
            f"address {address!r} names no host: expected host:port, e.g. "
            f"'localhost:{DEFAULT_PORT}'"
        )
    if target.startswith("["):  # [v6] or [v6]:port
        host, closed, rest = target[1:].partition("]")
        if not closed or not host:
            raise ValueError(
                f"address {address!r}: an IPv6 address is written [address]:port, e.g. "
                f"'[::1]:{DEFAULT_PORT}'"
            )
        if not rest:
            raise _no_port(address, f"[{host}]")
        if not rest.startswith(":"):
            raise ValueError(
                f"address {address!r}: expected [{host}]:port after the IPv6 address, e.g. "
                f"'[{host}]:{DEFAULT_PORT}'"
            )
        _check_port(address, rest[1:], f"[{host}]")
        return
    if target.count(":") > 1:  # a bare IPv6 address: its last group cannot be told from a port
        raise ValueError(
            f"address {address!r}: an IPv6 address goes in brackets, followed by its port: "
            f"'[{target}]:{DEFAULT_PORT}' (or '[address]:port' for another port)"
        )
    host, sep, port = target.rpartition(":")
    if not sep:
        raise _no_port(address, target)
    if not host:
        raise ValueError(
            f"address {address!r} names no host: expected host:port, e.g. 'localhost{target}'"
        )
    _check_port(address, port, host)


def _no_port(address: str, host: str) -> ValueError:
    return ValueError(
        f"address {address!r} has no port: expected host:port, e.g. '{host}:{DEFAULT_PORT}' "
        f"(the server's default port is {DEFAULT_PORT})"
    )


def _check_port(address: str, port: str, host: str) -> None:
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"address {address!r}: the port must be a number from 1 to 65535, got {port!r}; "
            f"expected host:port, e.g. '{host}:{DEFAULT_PORT}'"
        )


def wait_ready(
    probe: Callable[[float], grpc.Future[Any]], timeout: float, stopped: Callable[[], bool]
) -> bool:
    """Waits up to `timeout` s for the server to answer `probe(deadline)`, a unary call made
    with wait_for_ready (so through refusals, under its deadline); False if it did not, or if
    `stopped()` turned true meanwhile (looked at every POLL_INTERVAL). Any answer, even an
    error status, is the server's: True.

    A call rather than grpc.channel_ready_future: that subscribes to the channel's state, and
    grpc's polling thread then raises in the background ("Channel closed!") when the loader
    closes the channel soon after (it asks to connect once more after its subscriber left).
    """
    future = probe(timeout)
    try:
        while not stopped():
            try:
                future.result(timeout=POLL_INTERVAL)
            except grpc.FutureTimeoutError:
                continue
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.Call) else None
                return code not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
            return True
        return False
    finally:
        future.cancel()  # nothing if it is done


def first_call(
    call: Callable[[float], T],
    *,
    what: str,
    address: str,
    connect_timeout: float,
    retries: int,
    backoff: float,
    hint: str,
) -> T:
    """`call(deadline)`, a unary call made without wait_for_ready, retried as NOTE [ Waiting
    for the server ] says; its gRPC errors as RemoteLoaderErrors. `hint` ends the message of
    a server that cannot be reached (plaintext or TLS)."""
    started = time.monotonic()
    attempt = 0
    while True:
        try:
            return call(connect_timeout)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise ConnectionLostError(
                    f"{what}: no answer from {address} within {connect_timeout:g} s "
                    f"(connect_timeout); is the server running and the address right? {hint}"
                ) from exc
            busy = server_busy(exc)
            if code != grpc.StatusCode.UNAVAILABLE and not busy:
                raise map_rpc_error(exc, f"{what} at {address}") from exc
            if attempt >= retries:
                raise _gave_up(exc, what, address, attempt + 1, started, busy, hint) from exc
        attempt += 1
        time.sleep(delay(backoff, attempt))


def _gave_up(
    exc: grpc.RpcError,
    what: str,
    address: str,
    attempts: int,
    started: float,
    busy: bool,
    hint: str,
) -> RemoteLoaderError:
    details = (exc.details() if isinstance(exc, grpc.Call) else None) or str(exc)
    tried = f"{attempts} attempt{'s' if attempts > 1 else ''} in {time.monotonic() - started:.1f} s"
    if busy:
        return ServerBusyError(f"{what}: the server at {address} stayed full ({tried}): {details}")
    return ConnectionLostError(
        f"{what}: cannot reach {address} ({tried}; retries and backoff set how many and how "
        f"long): {details}. Is the server running and the address right? {hint}"
    )


@dataclasses.dataclass(frozen=True)
class Stubs:
    """The service's three methods on one channel."""

    describe: Any  # DescribeRequest -> LoaderInfo
    list: Any  # ListLoadersRequest -> ListLoadersResponse
    stream: Any  # StreamRequest -> raw Frame bytes, parsed by the receiver without a copy


def open_stubs(address: str, tls: TLS | None, token: str | None) -> tuple[grpc.Channel, Stubs]:
    """A channel to `address` with the loader's options, and the service's stubs on it."""
    channel = open_channel(
        address,
        tls=tls,
        token=token,
        options=[
            ("grpc.max_receive_message_length", wire.MAX_CHUNK_SIZE + wire.FRAME_OVERHEAD),
            # Reconnect soon after a server restart, rather than after grpc's default backoff
            # (which grows to two minutes).
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
            *wire.CLIENT_KEEPALIVE_OPTIONS,
        ],
    )
    return channel, Stubs(
        describe=channel.unary_unary(
            f"/{wire.SERVICE_NAME}/Describe",
            request_serializer=pb.DescribeRequest.SerializeToString,
            response_deserializer=pb.LoaderInfo.FromString,
        ),
        list=channel.unary_unary(
            f"/{wire.SERVICE_NAME}/ListLoaders",
            request_serializer=pb.ListLoadersRequest.SerializeToString,
            response_deserializer=pb.ListLoadersResponse.FromString,
        ),
        stream=channel.unary_stream(
            wire.STREAM_METHOD,
            request_serializer=pb.StreamRequest.SerializeToString,
            response_deserializer=_as_is,
        ),
    )


def _as_is(message: bytes) -> bytes:
    return message
