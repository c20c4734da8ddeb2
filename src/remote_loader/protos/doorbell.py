"""A shared-memory ring's doorbell: the client rings it after each release, so a server waiting
for the client sleeps until then instead of polling the ring's cursor.

NOTE [ Doorbell ]

A ring's cursor is a word in shared memory, which Python cannot block on (no futex), so the
server polled it while it waited for the client (for room in the ring, or for a slot batch to
be released): from 50-400 us backing off to 2 ms, about 8 looks per wait measured, for every
batch a client slower than the loader released, on every stream; with broadcast, every consumer
of a job. Beside each ring the server now binds a Unix datagram socket,
/dev/shm/rl-bell-<the ring's hex>; the client connects to it when it maps the ring (and unlinks
the name, as it does the ring's), marks the ring's header, and sends a one-byte datagram after
every release. The server, waiting:

    loop: the cursor says ready -> done; drain the socket; the cursor says ready -> done;
          poll() the socket for at most BELL_TICK

A release the server missed when it last looked comes with a datagram it has not drained yet,
so poll() returns at once and no wake-up is lost: the client sends after it stored the cursor,
and each side's system call orders its memory accesses. BELL_TICK bounds how late the server
sees what does not ring: the stream cancelled, the consumer detached, the client's heartbeat
stopped.

A datagram socket, not a FIFO: a write to a FIFO whose reader has gone raises SIGPIPE, which
kills a trainer that restored its default action; a datagram to a closed socket is
ECONNREFUSED, sent with MSG_NOSIGNAL anyway. Bounds: the socket queues net.unix.max_dgram_qlen
datagrams (10 by default); a full queue fails the client's send with EAGAIN, ignored, since the
server has wake-ups to find already. Failures: a client that could not connect (an older client,
a /dev/shm where it cannot) never marks the header, and the server polls; a client that went
away leaves the server waiting only until `stopped()` says so, at its next tick. The name goes
like the ring's: unlinked by the client once connected, by the server when it closes the ring,
and by the server's resource tracker if the server dies first.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
from collections.abc import Callable
from multiprocessing import resource_tracker

BELL_PREFIX = "rl-bell-"
# Seconds between two looks at what does not ring (cancelled, detached, silent) while waiting.
BELL_TICK = 0.02
_DRAIN = 64  # bytes read per datagram (each is one)


class Doorbell:
    """The server's end of one ring's doorbell: a Unix datagram socket bound at
    `directory`/`name`.

    Raises OSError when it cannot be made (the ring then works by polling alone).
    """

    def __init__(self, directory: str, name: str, owner_uid: int | None = None) -> None:
        self.name = name
        self._path = os.path.join(directory, name)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.setblocking(False)
            self._sock.bind(self._path)
        except BaseException:
            self._sock.close()
            raise
        # Like a ring's name: the resource tracker unlinks it (as shm_unlink would, under
        # /dev/shm) if this process dies before close() does.
        resource_tracker.register("/" + name, "shared_memory")
        try:
            # Connecting takes write permission on the name: only the ring's owner may ring.
            os.chmod(self._path, 0o600)
            if owner_uid is not None and os.geteuid() == 0 and owner_uid != 0:
                os.chown(self._path, owner_uid, -1)  # a root server's client must connect
        except BaseException:
            self.close()
            raise
        # poll(), not select(): a server's descriptors (worker slots, sockets) may pass 1024.
        self._poll = select.poll()
        self._poll.register(self._sock.fileno(), select.POLLIN)

    def wait(self, ready: Callable[[], bool], stopped: Callable[[], bool]) -> bool:
        """Sleeps until `ready()` (True) or `stopped()` (False), woken by the client's rings.
        Only call it once the client marked the ring's header: before, nothing rings."""
        while not ready():
            if stopped():
                return False
            self._drain()
            if ready():
                return True
            self._poll.poll(BELL_TICK * 1000)
        return True

    def _drain(self) -> None:
        """Reads what the client rang so far (at most the socket's queue)."""
        while True:
            try:
                self._sock.recv(_DRAIN)
            except BlockingIOError:
                return

    def close(self) -> None:
        """Unlinks the name (if the client has not) and closes the socket; idempotent."""
        if self._path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
            resource_tracker.unregister("/" + self.name, "shared_memory")
            self._path = ""
        self._sock.close()


class Ringer:
    """The client's end of a ring's doorbell: connects to the socket at `path`, then unlinks
    the name. Raises OSError when there is none (an older server) or it cannot connect."""

    def __init__(self, path: str) -> None:
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.connect(path)
        except BaseException:
            self._sock.close()
            raise
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # connected: the name is not needed any more

    def ring(self) -> None:
        """Wakes a server waiting on the ring (after a release). Never blocks, never raises."""
        if self._sock is None:
            return
        try:
            self._sock.send(b"\0", socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except BlockingIOError:
            pass  # the queue is full: the server has wake-ups to find already
        except OSError:
            self.close()  # the server closed its end (ECONNREFUSED): nobody waits any more

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
