"""A shared-memory ring's doorbell: the client rings it after each release, so a server waiting
for the client sleeps until then instead of polling the ring's cursor.

NOTE [ Doorbell ]

A ring's cursor is a word in shared memory, which Python cannot block on (no futex), so the
server polled it while it waited for the client (for room in the ring, or for a slot batch to
be released): from 50-400 us backing off to 2 ms, several wake-ups for every batch a client
slower than the loader released, on every stream; with broadcast, every consumer of a job. Beside
each ring the server now makes a FIFO, /dev/shm/rl-bell-<the ring's hex>, and keeps its reading
end; the client opens the writing end when it maps the ring (O_NONBLOCK; it unlinks the name
then, as it does the ring's), marks the ring's header, and writes a byte after every release.
The server, waiting:

    loop: the cursor says ready -> done; drain the FIFO; the cursor says ready -> done;
          poll() the FIFO for at most BELL_TICK

A release the server missed when it last looked comes with a byte it has not drained yet, so
poll() returns at once and no wake-up is lost: the client writes the byte after the cursor, and
each side's system call orders its memory accesses. BELL_TICK bounds how late the server sees
what does not ring: the stream cancelled, the consumer detached, the client's heartbeat stopped.

Bounds: the FIFO holds 64 KiB (Linux's pipe buffer). A full one (a server that has not waited
for 65536 releases) fails the client's write with EAGAIN, ignored: the server finds bytes there
anyway. Failures: a client that closes its end (its stream ended, it exited) makes the FIFO read
as end-of-file, and the server polls that ring from then on; a client that could not open it (an
older client, a /dev/shm that refuses FIFOs) never marks the header, and the server polls. The
name goes like the ring's: unlinked by the client once it has opened it, by the server when it
closes the ring, and by the server's resource tracker if the server dies first.
"""

from __future__ import annotations

import contextlib
import os
import select
import stat
from collections.abc import Callable
from multiprocessing import resource_tracker

BELL_PREFIX = "rl-bell-"
# Seconds between two looks at what does not ring (cancelled, detached, silent) while waiting.
BELL_TICK = 0.02
_DRAIN = 65536  # bytes read at once: the whole pipe buffer


class Doorbell:
    """The server's end of one ring's doorbell: the FIFO `directory`/`name`, open for reading.

    Raises OSError when the FIFO cannot be made (the ring then works by polling alone).
    """

    def __init__(self, directory: str, name: str, owner_uid: int | None = None) -> None:
        self.name = name
        self._path = os.path.join(directory, name)
        os.mkfifo(self._path, 0o600)
        # Like a ring's name: the resource tracker unlinks it (as shm_unlink would, under
        # /dev/shm) if this process dies before close() does.
        resource_tracker.register("/" + name, "shared_memory")
        try:
            # Non-blocking: opening a FIFO's reading end otherwise waits for a writer.
            self._fd: int | None = os.open(
                self._path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
            )
            if owner_uid is not None and os.geteuid() == 0 and owner_uid != 0:
                os.fchown(self._fd, owner_uid, -1)  # a root server's client must open it
        except BaseException:
            self._forget_name()
            raise
        # poll(), not select(): a server's descriptors (worker slots, sockets) may pass 1024.
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)

    def wait(self, ready: Callable[[], bool], stopped: Callable[[], bool]) -> bool | None:
        """Sleeps until `ready()` (True) or `stopped()` (False), woken by the client's rings;
        None once the client has closed its end: the caller polls instead. Only call it after
        the client marked the ring's header (before, no writer ever opened the FIFO, which
        reads as end-of-file too)."""
        while not ready():
            if stopped():
                return False
            if not self._drain():
                return None
            if ready():
                return True
            self._poll.poll(BELL_TICK * 1000)
        return True

    def _drain(self) -> bool:
        """Reads what the client rang so far; False at end-of-file (no writer is left)."""
        if self._fd is None:
            return False
        while True:
            try:
                rung = os.read(self._fd, _DRAIN)
            except BlockingIOError:
                return True  # empty, a writer still has it open
            if not rung:
                self._close_fd()
                return False
            if len(rung) < _DRAIN:
                return True

    def _close_fd(self) -> None:
        if self._fd is not None:
            self._poll.unregister(self._fd)
            os.close(self._fd)
            self._fd = None

    def _forget_name(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        resource_tracker.unregister("/" + self.name, "shared_memory")

    def close(self) -> None:
        """Unlinks the name (if the client has not) and closes the reading end; idempotent."""
        if self._path:
            self._forget_name()
            self._path = ""
        self._close_fd()


class Ringer:
    """The client's end of a ring's doorbell: opens the FIFO at `path` for writing, then unlinks
    the name. Raises OSError when there is none (an older server) or it is not a FIFO."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                raise OSError(f"{path} is not a FIFO")
        except BaseException:
            os.close(fd)
            raise
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # the two descriptors keep it alive now
        self._fd: int | None = fd

    def ring(self) -> None:
        """Wakes a server waiting on the ring (after a release). Never blocks."""
        if self._fd is None:
            return
        try:
            os.write(self._fd, b"\0")
        except BlockingIOError:
            pass  # full: the server has 64 KiB of rings to find already
        except OSError:
            self.close()  # the server closed its end (EPIPE): nobody waits any more

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
