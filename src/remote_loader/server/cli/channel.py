"""How the command line's client commands (`health`, `top`) reach a server: their TLS flags,
the token, and the channel they open (protos/channel.py, the one a RemoteLoader opens too)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping

import grpc

from remote_loader.protos.channel import ChannelTLS, dial, with_token
from remote_loader.server.api.auth import check_token, read_file, read_pem
from remote_loader.server.config.spec import ConfigError

# The variable a RemoteLoader reads its token from (client/security.py), read here alike.
TOKEN_ENV = "REMOTE_LOADER_TOKEN"


@dataclasses.dataclass(frozen=True)
class ClientTLS:
    """How a command reaches a TLS server: PEM paths (None: the system's CAs, no client cert)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `tls_from_args`, as a RemoteLoader's TLS(...) takes them."""
    parser.add_argument(
        "--tls", action="store_true", help="use TLS, trusting the system's CAs (see --tls-ca)"
    )
    parser.add_argument("--tls-ca", help="PEM CA the server's certificate is checked against")
    parser.add_argument("--tls-cert", help="PEM client certificate, for an mTLS server")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--tls-server-name",
        help="name to check the server's certificate against, when ADDR's host is not in it "
        "(e.g. 127.0.0.1 inside the server's container)",
    )


def tls_from_args(args: argparse.Namespace) -> ClientTLS | None:
    given = (args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    if not args.tls and all(v is None for v in given):
        return None
    return ClientTLS(*given)


def token_from(token_file: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The token to send: `token_file`'s, else REMOTE_LOADER_TOKEN's, else none; ConfigError
    for one that cannot travel (never showing it)."""
    if token_file is not None:
        text = read_file("--token-file", token_file).decode("ascii", "replace").strip()
        return check_token(text, f"--token-file {token_file!r}")
    text = environ.get(TOKEN_ENV, "").strip()
    return check_token(text, TOKEN_ENV) if text else None


def open_channel(address: str, tls: ClientTLS | None, token: str | None = None) -> grpc.Channel:
    """A channel to `address`, as a RemoteLoader opens it; ConfigError for TLS files that
    cannot be read."""
    if tls is None:
        return with_token(dial(address), token)
    if (tls.cert is None) != (tls.key is None):
        raise ConfigError("--tls-cert and --tls-key go together: give both or neither")
    pem = ChannelTLS(
        ca=None if tls.ca is None else read_pem("--tls-ca", tls.ca),
        key=None if tls.key is None else read_pem("--tls-key", tls.key),
        cert=None if tls.cert is None else read_pem("--tls-cert", tls.cert),
        server_name=tls.server_name,
    )
    return with_token(dial(address, tls=pem), token)
