"""Direct lanes: a Ray actor on the server's own host talks to the server as a worker process.

NOTE [ Ray direct lane ]

Through Ray, each task is an actor call and each batch an object: measured on the benchmark
machine (2 cores, images workload, 2.4 MB batches), the bridge spent 1.05 ms of CPU a batch on
calls and copies and each actor 0.9 ms more than a worker process does for the same batch, and
the Ray pool gave 0.17x the local pool. An actor that shares the server's host needs none of
it: at start it connects to a Unix socket of the server's (the abstract namespace, so nothing
is left on disk and only this host's network namespace sees it), proves it was sent by the
pool (a secret token the pool gave its bridge) and offers a probe of its shared memory. When
the server can open the probe through /proc/<pid>/fd and finds the token the actor wrote in
it (the same pid namespace and user, not a process of the same pid elsewhere), the lane is
taken: from then on the actor's EpochStarts and Tasks go down the lane, and its Results come
back up it, naming slots of the actor's own (server/collating.py) that the server maps once,
exactly as a worker process's. Ray still places, starts, supervises and kills the actor; a
lane that closes is the actor's death (the first task sent and unanswered is the one it was
making, as for a worker process).

Not taken (another host, another pid or network namespace, `ray_direct = false`): the actor's
batches come through Ray (NOTE [ Ray data path ] in server/pool_ray.py).

Bounds: one lane per actor of this host, each a socket with what the kernel buffers; hellos
of actors not yet placed wait at most HELLO_TIMEOUT, and at most one per actor spawned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import os
import secrets
import socket
import struct
import threading
import time
from multiprocessing.connection import Connection

import torch

# How long an accepted connection may take to say hello, and how long the server waits for the
# hello of an actor that said it attached.
HELLO_TIMEOUT = 5.0
# The hello: the pool's secret, the actor's incarnation, its probe (pid, fd, inode, size) and
# the token written in it.
_HELLO = struct.Struct("!32sqqqQQ16s")


@dataclasses.dataclass(frozen=True)
class SlotRef:
    """A shared-memory file of an actor's, as a same-host process opens it: /proc/<pid>/fd/<fd>."""

    pid: int
    fd: int
    inode: int
    size: int


def share(buffer: torch.Tensor) -> SlotRef:
    """The reference a same-host process opens `buffer`'s shared memory by."""
    fd, size = buffer.untyped_storage()._share_fd_cpu_()
    return SlotRef(os.getpid(), fd, os.fstat(fd).st_ino, size)


def open_slot(ref: SlotRef) -> torch.Tensor:
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
    secret: bytes


class Probe:
    """An actor's proof that the server can map its memory: a small shared file holding a
    random token, kept for the actor's life."""

    def __init__(self) -> None:
        self.token = os.urandom(16)
        self._buffer = torch.frombuffer(bytearray(self.token), dtype=torch.uint8).share_memory_()
        self.ref = share(self._buffer)


def attach(lane: LaneAddress, incarnation: int, probe: Probe) -> Connection | None:
    """The actor's end of its lane, hello said; None when the server's socket is not reachable
    from here (another host or network namespace)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(HELLO_TIMEOUT)
        sock.connect(lane.path)
        sock.settimeout(None)
    except OSError:
        sock.close()
        return None
    conn = Connection(sock.detach())
    ref = probe.ref
    hello = _HELLO.pack(lane.secret, incarnation, ref.pid, ref.fd, ref.inode, ref.size, probe.token)
    try:
        conn.send_bytes(hello)
    except OSError:
        conn.close()
        return None
    return conn


class Lanes:
    """The server's side: a listening socket, and the lanes of actors whose hello checked out,
    by incarnation, until the pool takes them."""

    def __init__(self) -> None:
        self.address = LaneAddress(
            f"\0remote-loader-{os.getpid()}-{secrets.token_hex(8)}", secrets.token_bytes(32)
        )
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.address.path)
        self._sock.listen(64)
        self._sock.settimeout(0.5)  # so that the accepting thread sees `close`
        # Per incarnation: its lane, or None when its hello checked out but its memory does not
        # map here. At most one per actor spawned, until taken.
        self._ready: dict[int, Connection | None] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="rl-ray-lanes", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            conn = Connection(sock.detach())
            try:
                incarnation, mappable = self._hello(conn)
            except (OSError, EOFError, ValueError):
                incarnation, mappable = None, False
            if incarnation is None or not mappable:
                conn.close()  # the actor's lane thread ends; its batches come through Ray
            if incarnation is None:
                continue
            with self._cond:
                old = self._ready.pop(incarnation, None)
                self._ready[incarnation] = conn if mappable else None
                self._cond.notify_all()
            if old is not None:
                old.close()

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
            probe = open_slot(SlotRef(pid, fd, inode, size))
        except OSError:
            return int(incarnation), False  # another pid namespace, or not permitted
        return int(incarnation), bytes(probe.numpy()) == token

    def take(self, incarnation: int, timeout: float = HELLO_TIMEOUT) -> Connection | None:
        """The lane of an actor that said it attached; None when its memory does not map here
        or its hello did not come within `timeout` (its batches then come through Ray)."""
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
        with contextlib.suppress(OSError):
            self._sock.close()
        self._thread.join(2.0)
        with self._cond:
            for conn in self._ready.values():
                if conn is not None:
                    conn.close()
            self._ready.clear()
            self._cond.notify_all()
