"""Whether the server's gRPC address can be bound, checked before gRPC binds it, so a port in
use is reported in our words rather than after gRPC's own log lines."""

from __future__ import annotations

import errno
import socket


def check_address_free(address: str) -> None:
    """Raises OSError, in words that say what to do, when gRPC would fail to bind `address`.

    gRPC says only "Failed to bind", after logging its own error line (add_port.cc) and a
    GRPC_VERBOSITY hint to stderr; binding a socket here first, as gRPC binds its listeners
    (SO_REUSEADDR, no SO_REUSEPORT: see create_server's options; a dual-stack socket for an
    IPv6 wildcard), finds the common causes before it prints anything. Like gRPC, any one of
    the addresses HOST resolves to is enough. Port 0 (a free one) and addresses this cannot
    parse are left to gRPC; a race with another process binding in between still meets
    gRPC's error.
    """
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit() or int(port_text) == 0:
        return
    port = int(port_text)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise OSError(f"cannot listen on {address}: cannot resolve {host!r}: {exc}") from exc
    first: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(sockaddr)
            except OSError as exc:
                first = first or exc
                continue
        return  # bound, and closed unused (never listening): gRPC can bind it now
    assert first is not None  # getaddrinfo returns at least one address or raises
    if first.errno == errno.EADDRINUSE:
        why = (
            f"port {port} is already in use (is another server using it? `ss -ltnp "
            f"'sport = :{port}'` shows which process): stop it, or choose another port (port 0 "
            "picks a free one)"
        )
    elif first.errno == errno.EACCES:
        why = f"no permission to use port {port} (ports below 1024 need CAP_NET_BIND_SERVICE)"
    elif first.errno == errno.EADDRNOTAVAIL:
        why = f"{host!r} is not an address of this machine"
    else:
        why = first.strerror or str(first)
    error = OSError(f"cannot listen on {address}: {why}")
    error.errno = first.errno
    raise error from first
