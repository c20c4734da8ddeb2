"""Who may call the server: the bearer-token interceptor, and the PEM files of TLS and mTLS.

The token is checked in a server interceptor, before gRPC picks a handler thread for the call,
so a caller without the right token never reaches a loader (no dataset work, no workers).
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import ssl
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc

from remote_loader.protos import reasons
from remote_loader.server.config.spec import ConfigError

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # generic in grpc-stubs only
    _ServerInterceptor = grpc.ServerInterceptor[Any, Any]
else:
    _ServerInterceptor = grpc.ServerInterceptor

# Services any caller may use without a token. Health stays open because orchestrators (Docker's
# HEALTHCHECK, Kubernetes probes, `remote-loader health`) probe it without credentials, and it
# tells a caller nothing but SERVING / NOT_SERVING.
OPEN_SERVICES = frozenset({"grpc.health.v1.Health"})
# The metadata key and scheme of RFC 6750, as grpc's access_token_call_credentials send them.
AUTH_METADATA_KEY = "authorization"
AUTH_SCHEME = "bearer"
# Where a token may come from, for messages (the token itself is never shown).
TOKEN_SOURCES = "the server's token_file or REMOTE_LOADER_TOKEN"


def check_token(token: str, source: str) -> str:
    """`token` if it can travel as gRPC metadata (printable ASCII, no spaces); else ConfigError.

    `source` says where it came from; the message never contains the token.
    """
    if not token:
        raise ConfigError(f"{source} is empty: a token needs at least one character")
    if not all(33 <= ord(c) <= 126 for c in token):
        raise ConfigError(
            f"{source}: a token must be printable ASCII without spaces (it travels as the "
            "gRPC metadata 'authorization: Bearer <token>'); generate one with "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
        )
    return token


def read_file(setting: str, path: str) -> bytes:
    """The bytes of the file `setting` names ("server tls_cert", "--tls-ca"); ConfigError
    naming both when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(
            f"{setting}: cannot read {path!r}: {exc.strerror or exc}; "
            "fix the path or the file's permissions"
        ) from None


def token_from_file(path: str) -> str:
    """The token in `path`, without surrounding whitespace (a trailing newline is usual)."""
    data = read_file("server token_file", path)
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError:
        text = "\0"  # fails check_token with its message
    return check_token(text, f"server token_file {path!r}")


def read_pem(setting: str, path: str) -> bytes:
    """A PEM file's bytes; ConfigError when it cannot be read or holds no PEM block."""
    data = read_file(setting, path)
    if b"-----BEGIN " not in data:
        raise ConfigError(
            f"{setting}: {path!r} is not a PEM file (no '-----BEGIN' line); "
            "give the certificate or key in PEM form"
        )
    return data


@dataclasses.dataclass(frozen=True)
class ServerTLS:
    """A server's TLS material, in PEM. With `client_ca`, clients must present a certificate
    signed by it (mutual TLS); without, any client may connect (and the token, if any, decides).
    """

    cert: bytes  # the server's certificate chain
    key: bytes  # its private key
    client_ca: bytes | None = None
    # The same material for the data connections' TLS (Python's ssl: NOTE [ TLS data
    # connection ] in protos/tcp.py); None: made without files (tests), so no data connections.
    data_context: ssl.SSLContext | None = dataclasses.field(default=None, compare=False, repr=False)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


def load_tls(cert: str | None, key: str | None, client_ca: str | None) -> ServerTLS | None:
    """The TLS material the settings tls_cert, tls_key and tls_client_ca name; None: no TLS."""
    if (cert is None) != (key is None):
        given, missing = ("tls_cert", "tls_key") if cert is not None else ("tls_key", "tls_cert")
        raise ConfigError(
            f"server {given} is set but {missing} is not: TLS needs both the certificate "
            "chain and its private key (or neither, for a plaintext server)"
        )
    if cert is None or key is None:
        if client_ca is not None:
            raise ConfigError(
                "server tls_client_ca is set without tls_cert and tls_key: checking client "
                "certificates (mTLS) needs the server's own certificate and key"
            )
        return None
    cert_pem = read_pem("server tls_cert", cert)
    key_pem = read_pem("server tls_key", key)
    client_ca_pem = None if client_ca is None else read_pem("server tls_client_ca", client_ca)
    # grpc reports a bad certificate or key only as "Failed to bind to address": check them
    # here, with the ssl module's reasons, so start-up (and check-config) can say which.
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # An empty password: an encrypted key fails here instead of prompting (grpc cannot
        # use one either).
        context.load_cert_chain(cert, key, password="")
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(
            f"server tls_cert {cert!r} and tls_key {key!r} are not a PEM certificate chain "
            f"and its unencrypted private key ({exc}); check that the key belongs to the "
            "certificate"
        ) from None
    if client_ca is not None:
        try:
            context.load_verify_locations(cafile=client_ca)
        except ssl.SSLError as exc:
            raise ConfigError(
                f"server tls_client_ca {client_ca!r} holds no usable PEM certificate ({exc})"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED  # mutual TLS, as on the gRPC port
    # The data connections speak TLS with this context, the gRPC port's material.
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_RENEGOTIATION
    context.num_tickets = 0  # nobody resumes a data connection's session
    return ServerTLS(cert=cert_pem, key=key_pem, client_ca=client_ca_pem, data_context=context)


class TokenInterceptor(_ServerInterceptor):
    """Refuses calls without `authorization: Bearer <token>` with UNAUTHENTICATED.

    Runs before gRPC hands the call to a handler: a refused call is answered by a handler that
    aborts at once, without deserializing its request. Services in OPEN_SERVICES pass.
    """

    def __init__(self, token: str) -> None:
        check_token(token, "the server's token")
        self._token = token.encode("ascii")

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        service = handler_call_details.method.lstrip("/").partition("/")[0]
        if service in OPEN_SERVICES:
            return continuation(handler_call_details)
        problem = self._problem(handler_call_details)
        if problem is None:
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # no such method: UNIMPLEMENTED, the same with or without a token
        log.warning("refused %s: %s", handler_call_details.method, problem)
        return _refusal(handler, problem)

    def _problem(self, details: grpc.HandlerCallDetails) -> str | None:
        """What is wrong with the call's credentials; None if they are right."""
        values = [
            value
            for key, value in details.invocation_metadata or ()
            if key.lower() == AUTH_METADATA_KEY
        ]
        if not values:
            return (
                "this server requires a token: send the metadata 'authorization: Bearer "
                "<token>' (RemoteLoader(token=...) or the REMOTE_LOADER_TOKEN variable)"
            )
        value = values[0]
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        scheme, _, token = text.partition(" ")
        if len(values) > 1 or scheme.lower() != AUTH_SCHEME or not token.strip():
            return "the authorization metadata must be exactly one 'Bearer <token>'"
        # Constant time: how long the comparison takes says nothing about the right token.
        if not hmac.compare_digest(token.strip().encode("latin-1", "replace"), self._token):
            return (
                f"the token sent is not this server's; give the client the token in {TOKEN_SOURCES}"
            )
        return None


def _refusal(
    handler: grpc.RpcMethodHandler[Any, Any], problem: str
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED: `problem`."""

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.set_trailing_metadata(reasons.metadata(reasons.UNAUTHENTICATED))
        context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

    def refuse_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        context.set_trailing_metadata(reasons.metadata(reasons.UNAUTHENTICATED))
        context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

    # No request deserializer: the refused request's bytes are never parsed.
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream)
    return grpc.unary_unary_rpc_method_handler(refuse)
