"""How a RemoteLoader proves who it is and whom it talks to: TLS settings and the bearer token
(sent on every call by protos/channel.py's `with_token`).
"""

from __future__ import annotations

import dataclasses
import os
import ssl
from collections.abc import Sequence
from typing import Any

import grpc

from remote_loader.protos.channel import ChannelTLS, dial, with_token

TOKEN_ENV = "REMOTE_LOADER_TOKEN"


@dataclasses.dataclass(frozen=True)
class TLS:
    """TLS for a RemoteLoader's connection (`tls=True` is `TLS()`).

    Args:
        ca: PEM file of the CA that signed the server's certificate; None trusts the system's
            CAs.
        cert, key: PEM files of this client's certificate and private key, for a server that
            asks for one (mutual TLS); both or neither.
        server_name: the name the server's certificate must carry, when it is not the host of
            the address (an IP address, or a name behind a proxy).
    """

    ca: str | os.PathLike[str] | None = None
    cert: str | os.PathLike[str] | None = None
    key: str | os.PathLike[str] | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError(
                "TLS cert and key go together: give both (a client certificate for mutual "
                "TLS) or neither"
            )

    def read(self) -> ChannelTLS:
        """The PEM files' contents, read now; ValueError for one that cannot be read."""
        return ChannelTLS(
            ca=_read_pem("ca", self.ca),
            cert=_read_pem("cert", self.cert),
            key=_read_pem("key", self.key),
            server_name=self.server_name,
        )

    def credentials(self) -> grpc.ChannelCredentials:
        return self.read().credentials()

    def data_context(self) -> ssl.SSLContext:
        """The ssl context of this client's data connections: the gRPC channel's trust (`ca`,
        else the system's CAs) and client certificate, the server's name checked (NOTE [ TLS
        data connection ] in protos/tcp.py). ValueError for files ssl cannot use."""
        self.read()  # a file that cannot be read or is not PEM: read()'s message, as for gRPC
        try:
            context = ssl.create_default_context(
                cafile=None if self.ca is None else os.fspath(self.ca)
            )
            if self.cert is not None and self.key is not None:
                context.load_cert_chain(os.fspath(self.cert), os.fspath(self.key))
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(
                f"TLS: cannot use ca={self.ca!r}, cert={self.cert!r}, key={self.key!r} for the "
                f"data connections: {exc}"
            ) from None
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.options |= ssl.OP_NO_RENEGOTIATION
        return context


def _read_pem(field: str, path: str | os.PathLike[str] | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ValueError(f"TLS {field}: cannot read {os.fspath(path)!r}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"TLS {field}: {os.fspath(path)!r} is not a PEM file")
    return data


def resolve_tls(tls: bool | TLS | None) -> TLS | None:
    """`tls` as a TLS (None: plaintext); True is TLS with the system's CAs."""
    if tls is None or tls is False:
        return None
    if tls is True:
        return TLS()
    if isinstance(tls, TLS):
        return tls
    raise TypeError(f"tls must be None, a bool or a TLS(...), got {type(tls).__name__}")


def resolve_token(token: str | None) -> str | None:
    """`token`, else REMOTE_LOADER_TOKEN; an empty string means none (not even the variable's)."""
    if token is None:
        token = os.environ.get(TOKEN_ENV, "").strip()
        source = f"the environment variable {TOKEN_ENV}"
    else:
        if not isinstance(token, str):
            raise TypeError(f"token must be a string or None, got {type(token).__name__}")
        source = "token"
    if not token:
        return None
    # The token travels as gRPC metadata; the message never shows it.
    if not all(33 <= ord(c) <= 126 for c in token):
        raise ValueError(f"{source} must be printable ASCII without spaces")
    return token


def open_channel(
    address: str,
    options: Sequence[tuple[str, Any]],
    *,
    tls: TLS | None,
    token: str | None,
) -> grpc.Channel:
    """A channel to `address`: TLS or plaintext, sending `token` (if any) on every call."""
    return with_token(dial(address, options, None if tls is None else tls.read()), token)
