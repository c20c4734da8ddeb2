"""The TCP data connection: batch bytes on plain sockets beside the gRPC stream.

NOTE [ TCP data connection ]

Over gRPC a batch's bytes are copied by grpc into its send slice, by the kernel twice through
the socket, by grpc into a Python `bytes` on the client and by the receiver into its buffer, with
a thread handoff per message (py-spy profiles in benchmarks/RESULTS.md). When the client cannot
share the server's /dev/shm (another host), a stream can still skip grpc's copies by carrying
the bytes on a socket of their own, leaving gRPC the ordered control: which batch comes next,
errors at their positions, the end of the stream, status and cancellation.

    client                                    server
    ------                                    ------
    StreamRequest.tcp = true, with            (a stream without shared memory, on a server
    data_connections = n (0 means 1)          whose data listener is on) registers
                                              m = min(n, MAX_DATA_CONNECTIONS) fresh 32-byte
                                              tickets and sends Frame.tcp_channel: the
                                              listener's port, `ticket` and `more_tickets`
    connects m times to the gRPC target's     the listener reads HELLO (MAGIC + ticket) within
    host at that port, all at once, and       HANDSHAKE_TIMEOUT; a known, unused ticket gets
    sends HELLO on each; waits for each       ACK and its socket goes to its stream; anything
    ACK (all within CONNECT_TIMEOUT)          else is closed without a word. The stream waits
                                              for all m (ACCEPT_TIMEOUT); connection i is the
                                              one that sent ticket i
    per batch: reads a Frame with on_tcp      per batch: sends that Frame, then the encoded
    (sizes only); cuts the total_bytes into   batch itself, cut alike, straight from the
    stripes(total_bytes, m) and reads stripe  worker's shared memory (one kernel copy, no
    i from connection i, all at once: header  Python copy): stripe 0 on the stream's thread,
    first, then the payload straight into     the others at the same time from its pool; the
    its (pinned) buffer (one kernel copy)     next Frame goes once every stripe is written

Striping: one TCP connection tops out below a 25-100 GbE link (one core copies its bytes in the
kernel, one window limits it), so a stream may spread each batch over several. Both ends cut it
the same way from what both know, the batch's size and the stream's connection count:
`stripes(total, m)` (protos/striping.py) gives min(m, total // MIN_STRIPE) (at least 1)
contiguous ranges of the blob, their boundaries multiples of STRIPE_ALIGN, and stripe i goes on
connection i. Nothing numbers a stripe on the wire, so a connection carries exactly its stripes,
batch after batch, in order. A client that asks nothing (data_connections=None) asks for
DEFAULT_DATA_CONNECTIONS and lets the batch's size decide how many carry it; a small batch goes
on connection 0 alone. One connection is the protocol as it was before striping, so old and new
ends agree: an old client sends no data_connections (0: one), an old server announces no
more_tickets.

Why a ticket and not the token: the ticket reaches the client only inside the Stream call, which
passed the token check (server/api/auth.py), so a data connection is as authorized as its stream;
it is random, used once and forgotten when its stream stops waiting for it (ACCEPT_TIMEOUT).
On a TLS server the connections speak TLS (NOTE [ TLS data connection ]).

Falling back, losing and repeating nothing: a client that cannot make every connection
(another network, a firewall, a proxy in between) closes those it made, cancels the call and
opens a new one from the same batch with `tcp` off, so the server stops waiting at once; under
transport="tcp" it raises TransportError instead (never gRPC behind the caller's back), as it
does when a batch Frame arrives in-band on a stream that asked for data connections. A
server that got only some of them by ACCEPT_TIMEOUT closes those and sends Frames, as when none
came. Any one socket that breaks mid-stream is a broken stream: every stripe reader and writer
of that batch stops (each checks its stream's `stopped()` and its batch's failure at least
every POLL_INTERVAL), and the client resumes from that batch, like any other break
(client/receiver.py; the client's end is client/transports/tcp.py, the server's
server/transports/tcp.py).

Bounds, per stream: at most MAX_DATA_CONNECTIONS data connections; connections - 1 threads on
each side (a pool made with the connections and closed with them; a batch's call returns only
once all its stripes have, so no thread touches a batch after it, nor outlives its stream); and
in flight, only the kernel's socket buffers, SOCKET_BUFFER each way per connection: the server
writes a batch only after sending its Frame and only as fast as the client reads. The listener
holds at most MAX_HANDSHAKES connections that have not yet said HELLO (a new one evicts the
oldest: a real client says it at once).

Liveness: after HELLO the client writes only heartbeats, one byte (BEAT) each on every
connection, when its queue is full (every receiver poll, 0.1 s, while the training loop is
busy). A server whose send on a connection has made no progress reads that connection's; none
for `client_silence` seconds on it means the client is frozen or its host hung, and the stream
ends (SilentClientError) instead of waiting on it for good. gRPC's own keepalive let such a
client go only after ~60 s, measured, whatever keepalive_time_ms said.

NOTE [ TLS data connection ]

A server with TLS wraps every data connection in TLS (Python's ssl) with what its gRPC port
uses: the certificate chain and key, and with a client CA, mutual TLS (server/api/auth.py builds
the context beside grpc's credentials; at least TLS 1.2, no renegotiation, no session tickets).
The listener's thread runs the TLS handshake before HELLO, non-blocking like the rest, within
the same HANDSHAKE_TIMEOUT. A client with `tls` wraps with its channel's CA (else the system's),
client certificate and server_name (else the host it dials): the same trust as gRPC, so a
client that reaches gRPC reaches these, and a failed check says so (DataConnectionError, then
TransportUnusable or TransportError). The ticket still comes inside the authenticated stream.

Bytes: the client reads each stripe with recv_into straight into its buffer (OpenSSL decrypts
in place of the kernel's copy, a record of at most 16 KiB per call); the server hands OpenSSL at
most TLS_WRITE per send, because a TLS write is all or nothing and one that times out (the
POLL_INTERVAL wake-ups) must be repeated with the same bytes, which the send loop does. After
HELLO the server never decrypts what the client sends: heartbeats (TLS records) are read as raw
bytes (`drain`), a sign of life only, so no read can disturb a write pending in OpenSSL; the
end of a stream half-closes the TCP socket under TLS (no close_notify: every batch's length is
known from its Frame, so a cut-off batch shows as one).

Stripes under TLS: a plain stripe's reader takes megabytes per recv_into call, a TLS one a
record, and its thread takes the GIL back after each: four readers on a trainer of two cores
only take turns for it (its process spent 13.3-13.6 ms of CPU on a 9.63 MB batch, one reader
10.4-11.7, a raw TLS receiver 10.5-10.9; `python benchmarks/tls_cost.py --batches 200
--epochs 1`, three runs; the server hands OpenSSL a MiB per call either way). So a TLS client
naming no count asks for `default_connections(tls=True)`: one per two of its CPUs, at most
DEFAULT_DATA_CONNECTIONS (one on two or three CPUs, four from eight), the rest for its
training loop; a plain client asks for DEFAULT_DATA_CONNECTIONS whatever its CPUs.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import socket
import ssl
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
# NOTE [ A slow handshake ]: a client that cannot make its data connections goes on inside
# gRPC and stops asking (a port out of reach would cost each epoch CONNECT_TIMEOUT); but one
# only too slow to handshake (HandshakeTimeout: 2-4 trainers starting at once on a quarter
# core, benchmarks/headline.py) was busy then: later epochs ask again, SLOW_HANDSHAKES in all.
SLOW_HANDSHAKES = 3
# A connection that has not sent its HELLO this long after connecting is closed.
HANDSHAKE_TIMEOUT = 5.0
# At least MAX_DATA_CONNECTIONS: the connections of one stream, made at once, never evict each
# other (the oldest is evicted first).
MAX_HANDSHAKES = 64
# No byte for this long in the middle of a batch: the connection is lost (the same budget as
# gRPC's keepalive, protos/wire.py: ping after 20 s of silence, give up 10 s later).
STALL_TIMEOUT = 30.0
# Kernel socket buffers, each way. Loopback autotuning stops at a few MiB; at 4 MiB a 9.6 MB
# batch needs three refills, and memory in flight stays far below a ring's.
SOCKET_BUFFER = 4 * 1024 * 1024
# How often a blocked send or receive wakes up to check whether its stream is still wanted.
POLL_INTERVAL = 0.1
# Data connections per stream (striping, in the NOTE): the most a server grants, and what a
# client that names none asks for. One connection carried 1.8 GB/s on loopback here (RESULTS.md): a
# 25 GbE link (3.1 GB/s) wants 2 to 4, a 100 GbE one (12.5 GB/s) about 8.
MAX_DATA_CONNECTIONS = 8
DEFAULT_DATA_CONNECTIONS = 4  # under TLS, fewer on a client of few CPUs: default_connections

BEAT = b"\x00"
# The most a TLS data connection's send hands OpenSSL at once (NOTE [ TLS data connection ]).
TLS_WRITE = 1 << 20


class SilentClientError(ConnectionError):
    """The client neither read nor sent a heartbeat for `client_silence` seconds."""


def beat(sock: socket.socket) -> None:
    """The client's heartbeat: one byte, never blocking: a full buffer (BlockingIOError) already
    says enough, and a broken connection shows up where the client reads."""
    with contextlib.suppress(OSError):
        if isinstance(sock, ssl.SSLSocket):
            # A TLS record, sent only where the buffer has room: the server reads this side's
            # bytes as bytes, never as records (NOTE [ TLS data connection ]), but what it
            # reads must be TLS all the same, for whatever sits in between.
            if select.select([], [sock], [], 0)[1]:
                sock.send(BEAT)
        else:
            sock.send(BEAT, socket.MSG_DONTWAIT)


class DataConnectionError(ConnectionError):
    """The data connection could not be made, or broke."""


class HandshakeTimeout(DataConnectionError):
    """The data port took the connection, but its handshake (TLS, HELLO, ACK) did not end in
    time: a client or server too busy at that moment, not a port out of reach."""


def default_connections(*, tls: bool, cpus: int | None = None) -> int:
    """The data connections a client that names no count asks for: DEFAULT_DATA_CONNECTIONS,
    and under TLS one per two of `cpus` (default: the CPUs this process may run on), at least
    one and at most that (NOTE [ TLS data connection ], stripes under TLS)."""
    if not tls:
        return DEFAULT_DATA_CONNECTIONS
    if cpus is None:
        cpus = len(os.sched_getaffinity(0))
    return max(1, min(DEFAULT_DATA_CONNECTIONS, cpus // 2))


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


def connect(
    host: str,
    port: int,
    ticket: bytes,
    timeout: float = CONNECT_TIMEOUT,
    *,
    tls: ssl.SSLContext | None = None,
    server_name: str | None = None,
) -> socket.socket:
    """A data connection to `host:port`, handshaken within `timeout` s in all; raises
    DataConnectionError. With `tls`, TLS first (NOTE [ TLS data connection ]), the server's
    certificate checked for `server_name` (None: `host`)."""
    deadline = time.monotonic() + timeout
    slow = f"the handshake with {host}:{port} did not end within {timeout:g} s"
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise DataConnectionError(f"cannot connect to {host}:{port}: {exc}") from exc
    if tls is not None:
        try:
            tune(sock)
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock = tls.wrap_socket(sock, server_hostname=server_name or host)
        except ssl.SSLCertVerificationError as exc:
            sock.close()
            raise DataConnectionError(
                f"the TLS data connection to {host}:{port} failed the certificate check: "
                f"{exc.verify_message or exc} (it trusts the CA and checks the server_name that "
                "the gRPC channel does: TLS(ca=..., server_name=...))"
            ) from exc
        except (ssl.SSLError, OSError) as exc:
            sock.close()
            if isinstance(exc, TimeoutError):
                raise HandshakeTimeout(f"TLS: {slow}") from exc
            raise DataConnectionError(
                f"no TLS handshake with {host}:{port}: {exc} (does that port speak TLS? a "
                "proxy that ends TLS in front of the server offers no data connection)"
            ) from exc
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        tune(sock)
        sock.sendall(hello(ticket))
        answer = sock.recv(1)
    except OSError as exc:
        sock.close()
        # Past the deadline, whatever ended it was the wait: the server too closes a connection
        # whose HELLO comes HANDSHAKE_TIMEOUT late (NOTE [ A slow handshake ]).
        if isinstance(exc, TimeoutError) or time.monotonic() >= deadline:
            raise HandshakeTimeout(slow) from exc
        raise DataConnectionError(f"no handshake with {host}:{port}: {exc}") from exc
    if answer != ACK:
        sock.close()
        if time.monotonic() >= deadline:
            raise HandshakeTimeout(f"{slow} (the server closed it)")
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
    view = as_bytes(data)
    sent, total = 0, len(view)
    # TLS writes all it is given or nothing, and a timeout mid-write leaves the rest pending in
    # OpenSSL, to be written by the same call again: in pieces, so that progress shows.
    piece = TLS_WRITE if isinstance(sock, ssl.SSLSocket) else total
    heard = time.monotonic()
    while sent < total:
        try:
            sent += sock.send(view[sent : sent + piece])
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
    got = drain(sock)
    if got is None:
        raise ConnectionResetError("the client closed its data connection")
    return got > 0


def drain(sock: socket.socket) -> int | None:
    """Reads what the client sent (heartbeats) without waiting: how many bytes, or None when it
    has closed its end (EOF, or a reset).

    The socket's own bytes, under TLS too: the server reads nothing from the client after its
    HELLO, so this side's records are only a sign of life (NOTE [ TLS data connection ])."""
    total = 0
    while True:
        try:
            # socket.socket's recv, not SSLSocket's: the raw bytes, without waiting.
            got = socket.socket.recv(sock, 65536, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError, TimeoutError):
            return total
        except OSError:
            return None
        if not got:
            return None
        total += len(got)


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
    view = as_bytes(out)
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


def as_bytes(view: memoryview) -> memoryview:
    """`view` as one-dimensional bytes, which a stripe's range indexes."""
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
