"""The TCP data connection: batch bytes on a plain socket beside the gRPC stream.

NOTE [ TCP data connection ]

Over gRPC a batch's bytes are copied by grpc into its send slice, by the kernel twice through
the socket, by grpc into a Python `bytes` on the client and by the receiver into its buffer, with
a thread handoff per message (py-spy profiles in benchmarks/RESULTS.md). When the client cannot
share the server's /dev/shm (another host), a stream can still skip grpc's copies by carrying
the bytes on a socket of their own, leaving gRPC the ordered control: which batch comes next,
errors at their positions, the end of the stream, status and cancellation.

    client                                    server
    ------                                    ------
    StreamRequest.tcp = true                  (a stream without shared memory, on a server
                                              whose data listener is on) registers a fresh
                                              32-byte ticket and sends Frame.tcp_channel: the
                                              listener's port and the ticket
    connects to the gRPC target's host at     the listener reads HELLO (MAGIC + ticket) within
    that port and sends HELLO; waits for      HANDSHAKE_TIMEOUT; a known, unused ticket gets
    ACK (all within CONNECT_TIMEOUT)          ACK and its socket goes to its stream; anything
                                              else is closed without a word
    per batch: reads a Frame with on_tcp      per batch: sends that Frame, then the encoded
    (sizes only), then exactly total_bytes    batch itself, straight from the worker's shared
    from the socket, header first, then       memory (one kernel copy, no Python copy)
    the payload straight into its (pinned)
    buffer (one kernel copy)

Why a ticket and not the token: the ticket reaches the client only inside the Stream call, which
passed the token check (server/auth.py), so a data connection is as authorized as its stream;
it is random, used once and forgotten when its stream stops waiting for it (ACCEPT_TIMEOUT).
The socket is plaintext: a server with TLS does not offer it (its batches stay inside TLS).

Falling back, losing and repeating nothing: a client that cannot connect (another network, a
firewall, a proxy in between) cancels the call and opens a new one from the same batch with
`tcp` off, so the server stops waiting at once. A socket that breaks mid-stream is a broken
stream: the client resumes from its next batch, like any other break (client/receiver.py;
the client's end is client/transports/tcp.py, the server's server/transports/tcp.py).

Bounds: a stream has one data connection; the server writes a batch only after sending its
Frame and only as fast as the client reads (the kernel's socket buffers, SOCKET_BUFFER each
way, are all that is in flight); the listener holds at most MAX_HANDSHAKES connections that have
not yet said HELLO (a new one evicts the oldest: a real client says it at once).

Liveness: after HELLO the client writes only heartbeats, one byte (BEAT) each, when its queue is
full (every receiver poll, 0.1 s, while the training loop is busy). A server whose send has made no
progress reads them; none for `client_silence` seconds means the client is frozen or its host
hung, and the stream ends (SilentClientError) instead of waiting on it for good. gRPC's own
keepalive let such a client go only after ~60 s, measured, whatever keepalive_time_ms said.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import time
from collections.abc import Callable

MAGIC = b"RLDC\x01"  # "remote-loader data connection", version 1
TICKET_BYTES = 32
HELLO_BYTES = len(MAGIC) + TICKET_BYTES
ACK = b"\x06"
# The client's whole connect + HELLO + ACK; the server waits longer for it (ACCEPT_TIMEOUT), so
# a client that gave up has always cancelled its call before the server stops waiting.
CONNECT_TIMEOUT = 3.0
ACCEPT_TIMEOUT = 10.0
# A connection that has not sent its HELLO this long after connecting is closed.
HANDSHAKE_TIMEOUT = 5.0
MAX_HANDSHAKES = 64
# No byte for this long in the middle of a batch: the connection is lost (the same budget as
# gRPC's keepalive, protos/wire.py: ping after 20 s of silence, give up 10 s later).
STALL_TIMEOUT = 30.0
# Kernel socket buffers, each way. Loopback autotuning stops at a few MiB; at 4 MiB a 9.6 MB
# batch needs three refills, and memory in flight stays far below a ring's.
SOCKET_BUFFER = 4 * 1024 * 1024
# How often a blocked send or receive wakes up to check whether its stream is still wanted.
POLL_INTERVAL = 0.1


BEAT = b"\x00"


class SilentClientError(ConnectionError):
    """The client neither read nor sent a heartbeat for `client_silence` seconds."""


def beat(sock: socket.socket) -> None:
    """The client's heartbeat: one byte, never blocking (a full buffer already says enough)."""
    # A full buffer (BlockingIOError) already says enough; a broken connection shows up where
    # the client reads.
    with contextlib.suppress(OSError):
        sock.send(BEAT, socket.MSG_DONTWAIT)


class DataConnectionError(ConnectionError):
    """The data connection could not be made, or broke."""


def new_ticket() -> bytes:
    return secrets.token_bytes(TICKET_BYTES)


def hello(ticket: bytes) -> bytes:
    if len(ticket) != TICKET_BYTES:
        raise ValueError(f"a ticket is {TICKET_BYTES} bytes, got {len(ticket)}")
    return MAGIC + ticket


def tune(sock: socket.socket) -> None:
    """Large buffers each way, and no Nagle delay for a batch's last segment."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def target_host(target: str) -> str | None:
    """The host a gRPC target names, for a data connection to it; None when it is not TCP.

    "host:port", "[v6]:port", "dns:///host:port", "ipv4:a.b.c.d:port" and "ipv6:[v6]:port" name
    one host; unix sockets, several addresses or a name without a port do not.
    """
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme) :]
            break
    else:
        if ":/" in target or target.startswith(("unix:", "unix-abstract:", "vsock:")):
            return None
    if "," in target or "/" in target:
        return None
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    if host.startswith("["):
        if not host.endswith("]"):
            return None
        host = host[1:-1]
    return host or None


def connect(host: str, port: int, ticket: bytes, timeout: float = CONNECT_TIMEOUT) -> socket.socket:
    """A data connection to `host:port`, handshaken within `timeout` s in all; raises
    DataConnectionError."""
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise DataConnectionError(f"cannot connect to {host}:{port}: {exc}") from exc
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        tune(sock)
        sock.sendall(hello(ticket))
        answer = sock.recv(1)
    except OSError as exc:
        sock.close()
        raise DataConnectionError(f"no handshake with {host}:{port}: {exc}") from exc
    if answer != ACK:
        sock.close()
        raise DataConnectionError(
            f"{host}:{port} refused the data connection (a stale ticket, or not a remote-loader "
            "data port)"
        )
    sock.settimeout(POLL_INTERVAL)
    return sock


def send(
    sock: socket.socket,
    data: memoryview,
    stopped: Callable[[], bool],
    client_silence: float = STALL_TIMEOUT,
) -> bool:
    """Writes all of `data`; False if `stopped()` turned true first.

    `sock` has a POLL_INTERVAL timeout. Raises OSError when the client has gone, and
    SilentClientError when it read nothing and sent no heartbeat for `client_silence` seconds.
    """
    view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    sent, total = 0, len(view)
    heard = time.monotonic()
    while sent < total:
        try:
            sent += sock.send(view[sent:])
            heard = time.monotonic()
        except TimeoutError:
            # sendall would not say how much went before a timeout; send() does, per call.
            if stopped():
                return False
            if _heartbeats(sock):
                heard = time.monotonic()
            elif time.monotonic() - heard >= client_silence:
                raise SilentClientError(
                    f"the client read nothing from its data connection and sent no heartbeat "
                    f"for {client_silence:g} s ({sent} of {total} bytes of a batch sent)"
                ) from None
    return True


def _heartbeats(sock: socket.socket) -> bool:
    """Reads the client's pending heartbeats; whether there were any. Raises OSError when the
    client has closed the connection."""
    try:
        got = sock.recv(4096, socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError, TimeoutError):
        return False
    if not got:
        raise ConnectionResetError("the client closed its data connection")
    return True


def recv_into(
    sock: socket.socket,
    out: memoryview,
    stopped: Callable[[], bool],
    stall_timeout: float = STALL_TIMEOUT,
) -> bool:
    """Fills `out` from `sock`; False if `stopped()` turned true first.

    `sock` has a POLL_INTERVAL timeout. Raises DataConnectionError when the server closed the
    connection or sent nothing for `stall_timeout` seconds.
    """
    view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
    got, total = 0, len(view)
    idle = 0.0
    while got < total:
        try:
            n = sock.recv_into(view[got:], total - got)
        except TimeoutError:
            if stopped():
                return False
            idle += POLL_INTERVAL
            if idle >= stall_timeout:
                raise DataConnectionError(
                    f"the data connection sent nothing for {stall_timeout:g} s "
                    f"({got} of {total} bytes of a batch read)"
                ) from None
            continue
        except OSError as exc:
            raise DataConnectionError(f"the data connection broke: {exc}") from exc
        if n == 0:
            raise DataConnectionError(
                f"the server closed the data connection ({got} of {total} bytes of a batch read)"
            )
        got += n
        idle = 0.0
    return True
