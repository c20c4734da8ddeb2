"""Direct lanes: a Ray actor talks to the server as a worker process does, not through Ray.

NOTE [ Ray direct lane ]

Through Ray, each task is an actor call and each batch an object: measured on the benchmark
machine (2 cores, images workload, 2.4 MB batches), the bridge spent 1.05 ms of CPU a batch on
calls and copies and each actor 0.9 ms more than a worker process does for the same batch, and
the Ray pool gave 0.17x the local pool. So at start an actor attaches a lane of its own to the
server: the server's Unix socket (abstract namespace: nothing left on disk, seen only from this
host's network namespace) when it can reach it, else its TCP listener (on the address the
server's host reaches the cluster from). It proves the pool sent it (a secret token the pool
gave its bridge) and offers a probe of its shared memory. The server answers which lane it is:

- SLOTS, when it can open the probe through /proc/<pid>/fd and finds the token the actor wrote
  in it (this host, the same pid namespace and user, not a process of the same pid elsewhere):
  the actor's batches lie in slots of its own that the server maps once, exactly as a worker
  process's, and each Result names one;
- KEEP, otherwise (another host, container or pid namespace), unless the server was told not
  to (`ray_node_fetch = false`): the batch stays in the actor's slot, for trainers to fetch from its
  node (NOTE [ Node data connection ] in protos/node.py); its Result names the node;
- COPY, where KEEP is off: each Result is followed on the lane by the encoded batch, which the
  server receives straight into a slot of its own for the actor (one kernel copy; no object
  store, no bridge).

Either way the actor's EpochStarts and Tasks go down the lane and its Results come up it; Ray
still places, starts, supervises and kills the actor, and a lane that closes is the actor's
death (the first task sent and unanswered is the one it was making, as for a worker process).
An actor that reaches neither socket, or a server with `ray_direct = false`, answers the
bridge's calls through Ray's object store (NOTE [ Ray data path ] in server/engine/ray/backend.py).

Bounds: one lane per actor; hellos of actors not yet placed wait at most HELLO_TIMEOUT, at most
one per actor spawned; a COPY lane has at most the actor's tasks in flight in its socket.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import os
import pickle
import secrets
import select
import socket
import struct
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from remote_loader.protos import node

# How long an accepted connection may take to say hello, and how long the server waits for the
# hello of an actor that said it attached.
HELLO_TIMEOUT = 5.0
# How long a batch on a COPY lane may go without a byte before the actor counts as lost (a
# stopped process, a partitioned node): the pool's thread reads it, and must not wait for good.
BATCH_STALL = 30.0
# The hello: the pool's secret, the actor's incarnation, its probe (pid, fd, inode, size) and
# the token written in it.
_HELLO = struct.Struct("!32sqqqQQ16s")


@dataclasses.dataclass(frozen=True)
class ProcFd:
    """A shared-memory file of an actor's, as a same-host process opens it: /proc/<pid>/fd/<fd>
    (not a worker's slot as a client maps it: server/batch/delivery.py's SlotRef)."""

    pid: int
    fd: int
    inode: int
    size: int


def proc_fd(buffer: torch.Tensor) -> ProcFd:
    """The reference a same-host process opens `buffer`'s shared memory by."""
    fd, size = buffer.untyped_storage()._share_fd_cpu_()
    return ProcFd(os.getpid(), fd, os.fstat(fd).st_ino, size)


def open_slot(ref: ProcFd) -> torch.Tensor:
    """The actor's slot, mapped here; OSError when it cannot be opened or is not the file the
    actor named (a descriptor number reused since)."""
    fd = os.open(f"/proc/{ref.pid}/fd/{ref.fd}", os.O_RDWR)
    try:
        st = os.fstat(fd)
        if st.st_ino != ref.inode or st.st_size != ref.size:
            raise OSError(f"/proc/{ref.pid}/fd/{ref.fd} is not the actor's slot any more")
        storage = torch.UntypedStorage._new_shared_fd_cpu(fd, ref.size)  # type: ignore[attr-defined]
    finally:
        os.close(fd)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


@dataclasses.dataclass(frozen=True)
class LaneAddress:
    """Where and how an actor attaches (given to its constructor through the bridge)."""

    path: str  # a Unix socket in the abstract namespace (a leading NUL)
    tcp: tuple[str, int] | None  # the TCP listener, for actors that cannot reach `path`
    secret: bytes


# The server's answer to a hello that checked out: the lane's kind. KEEP: as COPY, but the
# actor keeps each batch in its slot and serves it to whoever the server names it to (NOTE
# [ Node data connection ] in protos/node.py).
SLOTS, COPY, KEEP = b"S", b"C", b"K"


@dataclasses.dataclass(frozen=True)
class SlotSize:
    """A new slot of a KEEP lane's actor, which the server cannot map: its size (the server
    keeps a buffer as large, to receive the batch into when it sends one itself)."""

    size: int


@dataclasses.dataclass
class DirectLane:
    """A taken direct lane (not a sharing lane: server/sharing/lanes.py): its connection,
    whether batches come on it as bytes (COPY), and whether they stay on the actor's node
    instead (KEEP)."""

    conn: Connection
    copy: bool
    keep: bool = False
    # KEEP: the key trainers' tickets are checked with (protos/node.py), on the actor's side.
    key: bytes = b""


class ActorProbe:
    """An actor's proof that the server can map its memory: a small shared file holding a
    random token, kept for the actor's life (a client's proof of a shared /dev/shm is
    protos/shm_probe.py's Probe)."""

    def __init__(self) -> None:
        self.token = os.urandom(16)
        self._buffer = torch.frombuffer(bytearray(self.token), dtype=torch.uint8).share_memory_()
        self.ref = proc_fd(self._buffer)


def _connect(lane: LaneAddress) -> socket.socket | None:
    """A socket to the server's Unix listener, else its TCP one; None when neither answers."""
    targets: list[tuple[int, Any]] = [(socket.AF_UNIX, lane.path)]
    if lane.tcp is not None:
        targets.append((socket.AF_INET, lane.tcp))
    for family, address in targets:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(HELLO_TIMEOUT)
            sock.connect(address)
            sock.settimeout(None)
        except OSError:
            sock.close()
            continue
        if family == socket.AF_INET:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    return None


def attach(lane: LaneAddress, incarnation: int, probe: ActorProbe) -> DirectLane | None:
    """The actor's end of its lane, hello said and answered; None when the server cannot be
    reached from here, or did not take the lane."""
    sock = _connect(lane)
    if sock is None:
        return None
    conn = Connection(sock.detach())
    ref = probe.ref
    hello = _HELLO.pack(lane.secret, incarnation, ref.pid, ref.fd, ref.inode, ref.size, probe.token)
    try:
        conn.send_bytes(hello)
        if conn.poll(HELLO_TIMEOUT):
            verdict = conn.recv_bytes(1)
            if verdict in (SLOTS, COPY, KEEP):
                key = node.node_key(lane.secret) if verdict == KEEP else b""
                return DirectLane(conn, copy=verdict == COPY, keep=verdict == KEEP, key=key)
    except (OSError, EOFError):
        pass
    conn.close()
    return None


def recv_bytes_into(conn: Connection, into: memoryview, stall: float = BATCH_STALL) -> int:
    """One message the peer sent with `send_bytes`, read straight into `into` (the kernel's
    copy only; Connection.recv_bytes_into reads it whole into a BytesIO first, then copies it
    again: three passes over each batch and a fresh buffer's page faults). Returns its size;
    OSError when it does not fit, TimeoutError when no byte came for `stall` seconds."""
    fd = conn.fileno()
    size: int = struct.unpack("!i", _read_exactly(fd, 4, stall))[0]
    if size == -1:  # a message of 2 GiB or more: the size follows as 8 bytes
        size = struct.unpack("!Q", _read_exactly(fd, 8, stall))[0]
    if size > len(into):
        raise OSError(f"a {size}-byte message where {len(into)} bytes were room for it")
    view = into[:size]
    while view:
        _wait_readable(fd, stall)
        got = os.readv(fd, [view])
        if got == 0:
            raise EOFError("the lane closed in the middle of a batch")
        view = view[got:]
    return size


def recv_message(conn: Connection, stall: float = BATCH_STALL) -> Any:
    """One object the peer sent with `send` (a Result), as Connection.recv reads it, but
    TimeoutError when no byte came for `stall` seconds: the pool's thread reads it."""
    fd = conn.fileno()
    size: int = struct.unpack("!i", _read_exactly(fd, 4, stall))[0]
    if size < 0:
        raise OSError("a result of 2 GiB or more on a lane: not one of ours")
    return pickle.loads(_read_exactly(fd, size, stall))


def _read_exactly(fd: int, n: int, stall: float) -> bytes:
    data = b""
    while len(data) < n:
        _wait_readable(fd, stall)
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError("the lane closed")
        data += chunk
    return data


def _wait_readable(fd: int, stall: float) -> None:
    if not select.select([fd], [], [], stall)[0]:
        raise TimeoutError(f"no byte of a batch for {stall:g} s on its actor's lane")


class Lanes:
    """The server's side: its listeners, and the lanes of actors whose hello checked out, by
    incarnation, until the pool takes them. `tcp_host`: the address to listen on for actors
    of other hosts (None: Unix only). `keep`: actors whose memory does not map here keep their
    batches for trainers to fetch (KEEP lanes) rather than send them (COPY)."""

    def __init__(self, tcp_host: str | None = None, keep: bool = False) -> None:
        self._keep = keep
        self._listeners = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)]
        path = f"\0remote-loader-{os.getpid()}-{secrets.token_hex(8)}"
        self._listeners[0].bind(path)
        tcp = None
        if tcp_host is not None:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind((tcp_host, 0))
            self._listeners.append(listener)
            tcp = (tcp_host, listener.getsockname()[1])
        for listener in self._listeners:
            listener.listen(64)
        self.address = LaneAddress(path, tcp, secrets.token_bytes(32))
        # Per incarnation: its lane. At most one per actor spawned, until taken.
        self._ready: dict[int, DirectLane] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="rl-ray-lanes", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                ready, _, _ = select.select(self._listeners, [], [], 0.5)
                accepted = [listener.accept()[0] for listener in ready]
            except (OSError, ValueError):
                return  # closed
            for sock in accepted:
                if sock.family == socket.AF_INET:  # a task is a small message: no Nagle wait
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._greet(Connection(sock.detach()))

    def _greet(self, conn: Connection) -> None:
        """Reads a peer's hello; a lane of the kind its memory allows, or closed."""
        try:
            incarnation, mappable = self._hello(conn)
            if incarnation is not None:
                conn.send_bytes(SLOTS if mappable else KEEP if self._keep else COPY)
        except (OSError, EOFError, ValueError):
            incarnation = None
        if incarnation is None:
            conn.close()
            return
        with self._cond:
            old = self._ready.pop(incarnation, None)
            keep = self._keep and not mappable
            self._ready[incarnation] = DirectLane(conn, copy=not mappable and not keep, keep=keep)
            self._cond.notify_all()
        if old is not None:
            old.conn.close()

    def _hello(self, conn: Connection) -> tuple[int | None, bool]:
        """The incarnation of a peer that knows the secret (else None), and whether its memory
        maps here."""
        if not conn.poll(HELLO_TIMEOUT):
            return None, False
        data = conn.recv_bytes(_HELLO.size)  # never unpickled: the peer is not known yet
        if len(data) != _HELLO.size:
            return None, False
        secret, incarnation, pid, fd, inode, size, token = _HELLO.unpack(data)
        if not hmac.compare_digest(secret, self.address.secret):
            return None, False
        try:
            probe = open_slot(ProcFd(pid, fd, inode, size))
        except OSError:
            return int(incarnation), False  # another host or pid namespace, or not permitted
        return int(incarnation), bytes(probe.numpy()) == token

    def take(self, incarnation: int, timeout: float = HELLO_TIMEOUT) -> DirectLane | None:
        """The lane of an actor that said it attached; None when its hello did not come within
        `timeout` (its batches then come through Ray)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while incarnation not in self._ready:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return None
                self._cond.wait(left)
            return self._ready.pop(incarnation)

    def close(self) -> None:
        self._closed = True
        for listener in self._listeners:
            with contextlib.suppress(OSError):
                listener.close()
        self._thread.join(2.0)
        with self._cond:
            for lane in self._ready.values():
                lane.conn.close()
            self._ready.clear()
            self._cond.notify_all()
