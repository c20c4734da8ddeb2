"""A gRPC channel to a remote-loader server, plaintext or TLS from PEM bytes, sending a bearer
token on every call: one way to reach a server for both the client's RemoteLoader and the
server CLI's `health` and `top` commands.

The token rides on every call as metadata added by a channel interceptor, not as gRPC call
credentials: grpc refuses call credentials on a plaintext channel, and a token is also useful
there (a private network, TLS ended by a proxy).

Each side reads its own PEM files, with its own errors (a ValueError for a RemoteLoader's
`TLS(...)`, a ConfigError for the CLI's flags); what they then ask of grpc is the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:  # generic in grpc-stubs only
    _UnaryUnary = grpc.UnaryUnaryClientInterceptor[Any, Any]
    _UnaryStream = grpc.UnaryStreamClientInterceptor[Any, Any]
else:
    _UnaryUnary = grpc.UnaryUnaryClientInterceptor
    _UnaryStream = grpc.UnaryStreamClientInterceptor


@dataclasses.dataclass(frozen=True)
class ChannelTLS:
    """TLS material for a channel, in PEM.

    `ca`: the CA that signed the server's certificate (None: the system's CAs); `cert` and
    `key`: this client's certificate chain and private key, for mutual TLS; `server_name`: the
    name the server's certificate must carry, when it is not the host of the address.
    """

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def dial(
    address: str, options: Sequence[tuple[str, Any]] = (), tls: ChannelTLS | None = None
) -> grpc.Channel:
    """A channel to `address` with `options`: plaintext when `tls` is None, else TLS."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    # The certificate is checked against the address's host unless told otherwise.
    extra = [] if tls.server_name is None else [("grpc.ssl_target_name_override", tls.server_name)]
    return grpc.secure_channel(address, tls.credentials(), options=[*options, *extra])


def with_token(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """`channel`, sending `authorization: Bearer <token>` on every call (None: as it is)."""
    if token is None:
        return channel
    return grpc.intercept_channel(channel, _BearerToken(token))


@dataclasses.dataclass
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: grpc.Metadata | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class _BearerToken(_UnaryUnary, _UnaryStream):
    """Adds `authorization: Bearer <token>` to every unary and server-streaming call."""

    def __init__(self, token: str) -> None:
        self._metadatum = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            (*(details.metadata or ()), self._metadatum),
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.ClientCallDetails, Any], grpc.CallFuture[Any]],
        client_call_details: grpc.ClientCallDetails,
        request: Any,
    ) -> grpc.CallFuture[Any]:
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(
        self,
        continuation: Callable[[grpc.ClientCallDetails, Any], grpc.CallIterator[Any]],
        client_call_details: grpc.ClientCallDetails,
        request: Any,
    ) -> grpc.CallIterator[Any]:
        return continuation(self._with_token(client_call_details), request)
