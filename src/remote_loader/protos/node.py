"""The node data connection: a trainer fetches a batch from the node that made it, not from the
server, which names where the batch lies.

NOTE [ Node data connection ]

A Ray actor on another host makes a batch into a slot of its own. Sent to the server and from
there to a trainer (a COPY lane, NOTE [ Ray direct lane ] in server/engine/ray/lane.py), every byte
crosses the server host's link twice, and at scale that link bounds the cluster. So the server
decides what it decides by positions (which batch, to whom, in what order, what was consumed)
and tells the trainer where the batch lies; the bytes go from the node to the trainer, as
tf.data service clients read from its workers.

    trainer                      server (coordinator)              actor (on its node)
    -------                      --------------------              -------------------
                                 key = HMAC(pool's lane secret)    the same key (its KEEP
                                                                   lane's secret); a data
                                                                   server on the node's Ray
                                                                   address; batches kept in
                                                                   its slots, each Result
                                                                   naming that address
                                 first batch of a node: connects
                                 its watcher there (HELLO, then a
                                 WATCH request): the node's
                                 events come on it
    StreamRequest.node_fetch     per stream: a nonce, its ticket
                                 = nonce + HMAC(key, nonce);
                                 Frame.node_channel (host, port,
                                 ticket, connections) for each
                                 node, before its first batch
    connects `connections` times                                   checks the ticket (HMAC:
    (in the background), HELLO                                     no state to share), ACK;
    (tcp.MAGIC + ticket) on each                                   at the last of them,
    -> ACK                                                         REACHED(nonce) to the
                                                                   watcher
                                 REACHED (the first batch waits
                                 for it up to REACH_WAIT): each
                                 of the node's batches goes as a
                                 PUSH (nonce, slot, generation,
                                 offset, length) down the
                                 watcher, then as Frame.node
                                 (slot, generation, offset,
                                 sizes); the slot's lease held
                                                                   the stream's pusher checks
                                                                   the slot still holds
                                                                   `generation`, writes each
                                                                   stripe (striping.stripes) on
                                                                   its connection after OK
                                                                   (one kernel copy), checks
                                                                   again, SERVED (nonce,
                                                                   slot, generation, length)
                                                                   to the watcher
    per stripe, all at once: OK,
    then the bytes straight into
    the (pinned) buffer
                                 SERVED every byte of a batch to
                                 the stream: its lease ends, and
                                 the slot goes back to the actor
                                 with its next task

Pushed, not asked for: the node writes a batch as soon as the server names it, so the bytes
are in the trainer's socket buffers, or on their way, when its receiver reads the Frame, as
the server's own data connections do. Asked for (a REQUEST per stripe once the Frame was
read), every batch waited for the actor's process to wake its serving thread, which needs the
GIL its batch-making thread holds for up to the switch interval: 141 b/s against 316 through
the server on one node of benchmarks/ray_hosts.py, where pushing gives 331 against 298. The
server's own fetches (a trainer that cannot reach the node, a batch made again) still ask: a
nonce without PUSHED. Between batches a pusher reads what the trainer sends (heartbeats, while
its queue is full: a paused training loop is not a lost trainer, tcp.send's rule) and ends
when the trainer closes its connections.

The watcher is a connection of the server's own, read by a thread of its own
(server/batch/node_directory.py), not the actor's lane: the lane is read when the pool waits for
results, and a pool with every slot held by trainers waits for nothing until those trainers' SERVED
come.

Why a nonce and an HMAC: the ticket reaches the trainer only inside its Stream call, which
passed the token check, so a node connection is as authorized as its stream; the actor checks
it with a key derived from the secret its lane proved (no message per stream to the nodes).
The count of connections sits in the nonce's last byte, so the node knows when a stream has
made them all.

Falling back, per batch, losing and repeating nothing: until the server has heard REACHED for a
stream and a node, that node's batches go to the stream as before, the server fetching their
bytes itself over a node connection of its own (`fetch`); a trainer that cannot reach a node
(another network, a firewall: it tries in the background, once per stream) never makes the
server hear it, so, after the first batch's REACH_WAIT, all of that node's batches go through
the server. A node the server cannot watch is taken as lost. A server told not to
(`[server] ray_node_fetch = false`: COPY lanes), one serving TLS (these connections are not
encrypted), a broadcast job, or a client that does not ask, never names a node: the bytes then
cross the server as before. An actor lost with batches on its node: NOTE [ Node lost ] in
server/batch/node_directory.py.

A connection that breaks mid-batch, or a slot reused under a read (STALE), breaks the stream,
which the client resumes from that batch as after any data connection break. So does a node
that goes silent: one that sends nothing of a batch the server named there for NODE_SILENCE
(client/transports/node.py: 3 s, where a data connection waits tcp.STALL_TIMEOUT, 30 s) is cut
off from this trainer (a partition, a firewall) or stopped. The node pushes a batch as soon as
it is named and the trainer reads its batches in the order named, so when the trainer waits
for one, every byte named before it on that node is out already: seconds of nothing mean
something is wrong, not that the node is busy. The resumed stream announces the node again;
a trainer that still cannot reach it never makes the server hear REACHED, so after REACH_WAIT
its batches come through the server; the other nodes' batches keep coming from their nodes.
Measured with a trainer cut off from one of two actors' nodes mid-epoch: one resume and about
5 s without a batch, where it took 30.8 s (tests/integration/test_ray_faults.py).

Bounds: per stream and node, at most tcp.MAX_DATA_CONNECTIONS connections; a node's data server
holds at most MAX_NODE_CONNECTIONS (a new one past it closes the oldest) and remembers the
connection counts of at most MAX_NONCES streams. Bytes in flight: the kernel's socket buffers;
the slots a node holds for trainers are the pool's (prefetch_factor * num_workers tasks plus
the batches made and not yet sent) and, per stream, at most NAMED_AHEAD (4) named there and
not yet written whole to the trainer (server/transports/node.py: naming is a Frame, and
without that bound a slow trainer had a whole epoch named ahead, each batch in an actor's
slot), each released once the node has written it or its stream has ended.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from collections.abc import Callable

from remote_loader.protos import tcp

# The request a trainer (or the server) sends for one stripe: slot, generation, offset, length.
REQUEST = struct.Struct("!IQQQ")
# A request for this slot makes the connection the node's watcher (the server's, one per node):
# it then carries the node's EVENTs, REACHED and SERVED, and nothing else.
WATCH = 0xFFFFFFFF
# kind, the stream's nonce, slot, generation, bytes.
EVENT = struct.Struct("!c16sIQQ")
# Down the watcher, from the server: write this batch (slot, generation, offset, length) to the
# stream `nonce`'s connections, stripe i on connection i, each stripe after a status byte.
PUSH = struct.Struct("!16sIQQQ")
# In a nonce's last byte, with the count of connections: the stream's batches are pushed to it
# (a trainer's); without it, each is asked for with a REQUEST (the server's own fetches).
PUSHED = 0x80
REACHED, SERVED = b"R", b"S"
# A batch made again for the server (NOTE [ Node lost ] in server/batch/node_directory.py): REMADE
# (slot: the remake's id, generation: its size, bytes: its header's), or UNMADE (it failed); the
# server fetches it once from slot REMADE_SLOTS + id.
REMADE, UNMADE = b"M", b"U"
REMADE_SLOTS = 0x80000000
OK = tcp.ACK
# The slot no longer holds that generation: the batch is gone (its stream let go of it).
STALE = b"\x15"
NONCE_BYTES = 16
# The most connections one node's data server holds (trainers x connections each).
MAX_NODE_CONNECTIONS = 256
# The streams whose connection count a data server remembers (the oldest forgotten first).
MAX_NONCES = 1024


def node_key(secret: bytes) -> bytes:
    """The key tickets are signed with, from the pool's lane secret (both ends know it)."""
    return hmac.new(secret, b"remote-loader node tickets", hashlib.sha256).digest()


def new_nonce(connections: int, pushed: bool = False) -> bytes:
    """A stream's nonce: random, its last byte the count of connections it makes to a node,
    with PUSHED where the node pushes the stream's batches."""
    if not 1 <= connections <= tcp.MAX_DATA_CONNECTIONS:
        raise ValueError(
            f"a stream makes 1 to {tcp.MAX_DATA_CONNECTIONS} connections to a node, "
            f"got {connections}"
        )
    return os.urandom(NONCE_BYTES - 1) + bytes([connections | (PUSHED if pushed else 0)])


def connections_of(nonce: bytes) -> int:
    return nonce[-1] & ~PUSHED


def pushed(nonce: bytes) -> bool:
    return bool(nonce[-1] & PUSHED)


def ticket(key: bytes, nonce: bytes) -> bytes:
    """The ticket of the stream `nonce` names: tcp.TICKET_BYTES, the nonce and its HMAC."""
    mac = hmac.new(key, nonce, hashlib.sha256).digest()
    return nonce + mac[: tcp.TICKET_BYTES - NONCE_BYTES]


def nonce_of(key: bytes, presented: bytes) -> bytes | None:
    """The nonce of a ticket signed with `key`; None for anything else."""
    if len(presented) != tcp.TICKET_BYTES:
        return None
    nonce = presented[:NONCE_BYTES]
    if not 1 <= connections_of(nonce) <= tcp.MAX_DATA_CONNECTIONS:
        return None
    return nonce if hmac.compare_digest(ticket(key, nonce), presented) else None


def answer(sock: socket.socket, stopped: Callable[[], bool]) -> bool:
    """Reads a node's status byte before a stripe: True when the bytes follow (read them with
    tcp.recv_into), False if `stopped()` turned true first. Raises tcp.DataConnectionError when
    the connection broke or the batch is gone (STALE)."""
    status = bytearray(1)
    if not tcp.recv_into(sock, memoryview(status), stopped):
        return False
    if bytes(status) == STALE:
        raise tcp.DataConnectionError(
            "the node no longer holds the batch (the server let go of it, or it was rewritten)"
        )
    if bytes(status) != OK:
        raise tcp.DataConnectionError(f"not a node data server's answer: {bytes(status)!r}")
    return True


def ask(
    sock: socket.socket,
    slot: int,
    generation: int,
    offset: int,
    length: int,
    stopped: Callable[[], bool],
) -> bool:
    """Asks a node connection (made with tcp.connect) for `length` bytes of `slot` from
    `offset` and reads its answer: True when the bytes follow (read them with tcp.recv_into),
    False if `stopped()` turned true first. Raises tcp.DataConnectionError when the connection
    broke or the batch is gone (STALE)."""
    try:
        sock.sendall(REQUEST.pack(slot, generation, offset, length))
    except OSError as exc:
        raise tcp.DataConnectionError(f"the node connection broke: {exc}") from exc
    return answer(sock, stopped)


def fetch(
    sock: socket.socket,
    slot: int,
    generation: int,
    offset: int,
    into: memoryview,
    stopped: Callable[[], bool],
) -> bool:
    """`ask` for `len(into)` bytes and read them straight into `into`."""
    if not ask(sock, slot, generation, offset, len(into), stopped):
        return False
    return tcp.recv_into(sock, into, stopped)
