"""A gRPC channel to a remote-loader server, plaintext or TLS from PEM bytes: one way to reach
a server for both the client's RemoteLoader and the server CLI's `health` command.

Each side reads its own PEM files, with its own errors (a ValueError for a RemoteLoader's
`TLS(...)`, a ConfigError for the CLI's flags); what they then ask of grpc is the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import grpc


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
