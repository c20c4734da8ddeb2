"""The same-host transport: batches through a shared-memory ring, gRPC carrying only where they are.

NOTE [ Shared-memory transport ]

Over TCP every batch is copied by grpc into its send buffer, by the kernel through the socket,
and by grpc again into the message the client reads (py-spy: most of both processes' time for
large batches). When client and server see the same /dev/shm (one machine, or containers that
share IPC), a stream can skip all of that:

    client                                    server
    ------                                    ------
    Probe (protos/shm_probe.py): rl-probe-<hex>   opens it (O_NOFOLLOW, a regular file, only that
    in /dev/shm with a random nonce; in the   name pattern), compares the nonce, unlinks it.
    StreamRequest (ShmOffer)                  Equal: the two share /dev/shm, use shm.
                                              Anything else: plain Frames, as without an offer.
                                              Ring: /dev/shm/rl-ring-<hex>, created after the
                                              first batch (its size follows the batch size),
                                              space reserved with posix_fallocate (a full tmpfs
                                              is ENOSPC now, not SIGBUS later), 0600, owned by
                                              the probe's owner, registered with
                                              multiprocessing's resource tracker.
    opens the ring named by the first         copies each batch into the ring (one memcpy) and
    ShmBatch frame and unlinks its name:      sends a Frame with an ShmBatch: ring, offset and
    from then on only the two mappings        the cursor to release once it is read.
    keep it alive.
    copies the batch out (its one copy,       waits until the client's cursor leaves room for
    into pinned memory with CUDA), stores     the next batch (asleep on the ring's doorbell,
    the frame's `release` into the ring's     NOTE [ Doorbell ] in protos/doorbell.py); stops
    cursor word and rings the doorbell.       waiting when the stream is cancelled or the
                                              consumer detached.

Bounds: one ring per stream, at most `max_ring_bytes` (a bigger batch goes as plain Frames);
the server is at most a ring ahead of the client, so the ring replaces gRPC's buffering.

Release, whoever dies: the ring's name exists only between its creation and the client opening
it. After that, the memory is freed when the last of the two mappings goes, and a process's
mappings go when it exits, however it exits. The client marks the ring attached once it has
mapped it; the server unlinks a ring (at the stream's end, or when it moves to a larger one)
only after that mark or once the stream is cancelled, so a client that is a few batches behind
still finds it. If the client never opens it, the server unlinks it when the stream ends; if the
server is killed before that, its resource tracker (a separate process, outliving it) unlinks
it. The probe is unlinked by the server when it reads it and by
the client when the stream's first message or error arrives, whichever comes first.
See NOTE [ Stale probes ] in protos/shm_probe.py for a client killed in between.

The ring is the fallback of a faster way: a client that also shares the server's pid namespace
and user reads each batch in its worker's slot, and the server copies nothing; its stream's ring
then only carries the release cursor and the heartbeat (NOTE [ Zero-copy slots ] in
protos/slots.py). The probe's offer says which (ShmOffer.pid, probe_fd).

NOTE [ Ring space ]

How the ring follows batch sizes. Positions are logical byte counts since the ring was made
(monotonic); a batch at logical `start` lies at `start % capacity`. Batches never wrap: one
that does not fit before the end skips the tail, starting at the next multiple of `capacity`.

    written   end of the last batch placed (server)     consumed  cursor the client released
    a batch [start, end) may be placed when    end - consumed <= capacity   (its bytes are free)
                                          or   consumed == written          (the ring is empty)

The second rule matters: the skipped tail is never covered by a release (the client releases
the `end` of each batch it read, and no batch ends inside the tail), so a batch that needs more
than the space before the wrap point could otherwise wait for a cursor that never comes. That
was the hang of sequences whose batches grow: 1 KB, 2 KB, then 4 KB, which fits only an empty
4-batch ring, after 3 KB were written. Both rules keep the invariant that the bytes of a batch
the client has not released are never overwritten.

Growth: a ring holds RING_BATCHES batches of the size that made it (capped at max_ring_bytes).
A batch larger than the ring moves the stream to a new ring sized for it, after the client has
mapped the old one (it reads the old ring's batches first: frames arrive in order); sizes only
ever go up within a stream, so a stream whose batches shrink keeps its ring. A batch larger
than max_ring_bytes goes as plain Frames and the ring stays as it is. Every wait for room ends
when the stream is cancelled (the client closed or died), when the consumer is detached
(broadcast's detach_timeout), or when the client's heartbeat stops: its receiver bumps a
counter in the ring's header on every release and, while its queue is full, on every poll
(0.1 s), so a training loop may pause for as long as it likes, but a client that is
frozen (SIGSTOP, a hung host, a GIL held for good) is let go after the server's
`client_silence` seconds (keepalive_time_ms + keepalive_timeout_ms, 30 s by default): the
stream ends with UNAVAILABLE and its ring is freed. gRPC's own keepalive does not cover this:
with no data pending on the stream, measured, it let a frozen client go only after ~60 s
whatever keepalive_time_ms said.

Cursor: the ring's first 64 bytes hold the client's `consumed` cursor (a little-endian u64 of
bytes released since the ring was made, monotonic). Only the client writes it, only the server
reads it; an aligned 8-byte store is not torn on the platforms torch supports, and the client
stores it only after its copy has finished.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
import struct
import time
from collections.abc import Callable
from multiprocessing import resource_tracker

import numpy as np

from remote_loader.protos import doorbell

SHM_DIR = "/dev/shm"
RING_PREFIX = "rl-ring-"
# A client names the ring the server opens: only this exact shape is accepted, so no request
# can point the server at anything else (no "/", no "..", fixed length; the probe's in
# protos/shm_probe.py).
_RING_NAME = re.compile(r"rl-ring-[0-9a-f]{32}")

# Ring layout: [0, 8) the consumed cursor, [8, 16) the attached flag (the client has mapped the
# ring), [16, 24) the client's heartbeat, [24] the client rings the doorbell (NOTE [ Doorbell ]
# in protos/doorbell.py), [25, 28) unused (a broadcast board's flags, removed: never set, so a
# client that still reads [25] rings as it should), [28] the server has closed its end (the
# stream is over for it), the rest of the first 64 bytes unused, then the data.
RING_HEADER = 64
_CURSOR = struct.Struct("<Q")
_ATTACHED_AT = 8
_HEARTBEAT_AT = 16
_RINGS_AT = 24
_CLOSED_AT = 28
ALIGN = 64  # batches start on a cache line (and on the codec's ALIGN)

# A ring holds this many batches of the first batch's size: the receiver copies a batch out as
# soon as its frame arrives, so a few are enough to keep both sides busy.
RING_BATCHES = 4
# Default cap on one stream's ring (a [server] setting): docker's default /dev/shm is 64 MiB,
# hence the compose file's shm_size.
DEFAULT_MAX_RING_BYTES = 256 * 1024 * 1024

# Waiting for room without a doorbell: polls start short (a batch is usually copied out within a
# millisecond or two) and back off to this, so a stalled client costs the server little.
_MAX_POLL = 0.002


class ShmUnavailable(OSError):
    """Shared memory cannot be used here (no /dev/shm, another host, no room, no permission)."""


def available() -> bool:
    """Whether this process can use the shared-memory transport at all (Linux's /dev/shm)."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK)


def segment_path(name: str) -> str:
    """Where the segment (ring, doorbell, probe) called `name` lives."""
    return os.path.join(SHM_DIR, name)


def unlink_segment(name: str) -> None:
    """Removes segment `name`, if it is still there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(segment_path(name))


# --- the ring ------------------------------------------------------------------------------


def wait_until(ready: Callable[[], bool], stopped: Callable[[], bool], poll: float = 50e-6) -> bool:
    """Polls `ready()`, backing off to _MAX_POLL, until it is true (True) or `stopped()` is
    (False): the client's side of a ring has no way to wake the server."""
    while not ready():
        if stopped():
            return False
        time.sleep(poll)
        poll = min(poll * 2, _MAX_POLL)
    return True


def _bell_name(ring: str) -> str:
    """The doorbell beside ring `ring` (NOTE [ Doorbell ]): the same random part."""
    return doorbell.BELL_PREFIX + ring[len(RING_PREFIX) :]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def ring_bytes_for(batch_nbytes: int, max_ring_bytes: int) -> int | None:
    """The data size of a ring for batches of about `batch_nbytes`; None if one would not fit."""
    one = _aligned(max(batch_nbytes, 1))
    if one > max_ring_bytes:
        return None
    return min(RING_BATCHES * one, max_ring_bytes // ALIGN * ALIGN)


def create_segment(name: str, size: int, owner_uid: int | None = None) -> mmap.mmap:
    """Creates /dev/shm/`name` (mode 0600, `size` bytes reserved) and maps it read-write.

    The resource tracker unlinks the name if this process dies before `forget_segment(name)`.
    A root process gives the file to `owner_uid` (the client's user). Raises ShmUnavailable.
    """
    try:
        fd = os.open(segment_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise ShmUnavailable(f"cannot create {segment_path(name)}: {exc}") from exc
    # From here the name exists: the resource tracker unlinks it if this process dies before
    # forget_segment does (the name it expects is shm_open's, with a leading slash).
    resource_tracker.register("/" + name, "shared_memory")
    try:
        try:
            # Reserve the pages now: tmpfs hands them out lazily, and a full /dev/shm would
            # otherwise be a SIGBUS in the middle of a copy.
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise ShmUnavailable(
                    f"no room in {SHM_DIR} for {size} bytes ({exc.strerror}); raise the "
                    "container's shm_size, or lower max_ring_bytes"
                ) from exc
            raise ShmUnavailable(f"cannot size {segment_path(name)}: {exc}") from exc
        if owner_uid is not None and os.geteuid() == 0 and owner_uid != 0:
            # A root server serving a non-root client: the file must be the client's to open.
            os.fchown(fd, owner_uid, -1)
        return mmap.mmap(fd, size)
    except BaseException:
        forget_segment(name)
        raise
    finally:
        os.close(fd)  # the mapping keeps the file


def forget_segment(name: str) -> None:
    """Unlinks /dev/shm/`name` (if still there) and takes it off the resource tracker's list."""
    unlink_segment(name)
    resource_tracker.unregister("/" + name, "shared_memory")


class RingWriter:
    """The server's end of one stream's ring: places batches, waits for the client's cursor."""

    def __init__(self, capacity: int, owner_uid: int | None = None) -> None:
        if capacity <= 0 or capacity % ALIGN:
            raise ValueError(f"ring capacity must be a positive multiple of {ALIGN}: {capacity}")
        self.name = RING_PREFIX + secrets.token_hex(16)
        self.capacity = capacity
        self._written = 0  # bytes placed since the ring was made (monotonic, like the cursor)
        self._mm = create_segment(self.name, RING_HEADER + capacity, owner_uid)
        self._data: np.ndarray | None = np.frombuffer(self._mm, dtype=np.uint8, offset=RING_HEADER)
        self._closed = False
        self._bell: doorbell.Doorbell | None = None
        # Without one (no Unix sockets in /dev/shm here), waits for the client poll the cursor.
        with contextlib.suppress(OSError):
            self._bell = doorbell.Doorbell(SHM_DIR, _bell_name(self.name), owner_uid)

    def consumed(self) -> int:
        return int(_CURSOR.unpack_from(self._mm, 0)[0])

    def place(
        self, blob: memoryview, stopped: Callable[[], bool], poll: float = 50e-6
    ) -> tuple[int, int] | None:
        """Copies `blob` into the ring once there is room: (offset, release cursor).

        None when `stopped()` turned true while waiting for the client (cancelled, detached).
        """
        assert self._data is not None, "ring closed"
        n = len(blob)
        need = _aligned(max(n, 1))
        if need > self.capacity:
            raise ValueError(f"a {n}-byte batch does not fit a {self.capacity}-byte ring")
        written = self._written
        start = written
        pos = start % self.capacity
        if pos + need > self.capacity:
            start += self.capacity - pos  # no batch wraps: skip to the start of the ring
            pos = 0
        end = start + need

        # See NOTE [ Ring space ]: the skipped tail is free space no release ever covers, so
        # an emptied ring always has room (without that, a batch that does not fit before the
        # wrap point waited for a cursor that could never get there).
        def room() -> bool:
            consumed = self.consumed()
            return end - consumed <= self.capacity or consumed >= written

        if not self.wait(room, stopped, poll):
            return None
        # numpy copies without holding the GIL, so other streams' threads run meanwhile.
        np.copyto(self._data[pos : pos + n], np.frombuffer(blob, dtype=np.uint8))
        self._written = end
        return pos, end

    def wait(self, ready: Callable[[], bool], stopped: Callable[[], bool], poll: float) -> bool:
        """Waits for the client to make `ready()` true: asleep on the ring's doorbell while the
        client rings it (NOTE [ Doorbell ]), else polling from `poll` s. False: `stopped()`."""
        if self._bell is not None and self._mm[_RINGS_AT]:
            return self._bell.wait(ready, stopped)
        return wait_until(ready, stopped, poll)

    def attached(self) -> bool:
        return bool(self._mm[_ATTACHED_AT])

    def heartbeat(self) -> int:
        """The client's heartbeat counter (NOTE [ Ring space ]: a frozen client stops it)."""
        return int(_CURSOR.unpack_from(self._mm, _HEARTBEAT_AT)[0])

    def wait_attached(self, stopped: Callable[[], bool]) -> bool:
        """Waits until the client has mapped the ring (its name may go then); False if stopped."""
        return wait_until(self.attached, stopped, 50e-6)

    def close(self) -> None:
        """Unlinks the name (if the client has not) and drops this side's mapping; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._mm[_CLOSED_AT] = 1  # a client reading on learns the stream is over for the server
        forget_segment(self.name)
        if self._bell is not None:
            self._bell.close()
            self._bell = None
        self._data = None
        with contextlib.suppress(BufferError):  # a view is alive; the mapping goes with it
            self._mm.close()


class RingReader:
    """The client's end: opens the ring the server named, then unlinks the name at once."""

    def __init__(self, name: str, capacity: int) -> None:
        if not _RING_NAME.fullmatch(name):
            raise ShmUnavailable(f"the server named an invalid ring {name!r}")
        self.name = name
        self.capacity = capacity
        try:
            fd = os.open(segment_path(name), os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            where = segment_path(name)
            raise ShmUnavailable(f"cannot open the server's ring {where}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size != RING_HEADER + capacity:
                raise ShmUnavailable(
                    f"ring {name} is {size} bytes, the server said {RING_HEADER + capacity}"
                )
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
            unlink_segment(name)  # both mappings keep it alive now; nothing is left to clean up
        self._mm[_ATTACHED_AT] = 1
        self._ringer: doorbell.Ringer | None = None
        try:
            self._ringer = doorbell.Ringer(segment_path(_bell_name(name)))
            self._mm[_RINGS_AT] = 1
        except OSError:
            pass  # an older server, or no socket it can reach: it polls the cursor
        self._beats = 0
        self._data: np.ndarray | None = np.frombuffer(self._mm, dtype=np.uint8, offset=RING_HEADER)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """The batch at `offset` (valid until `release`)."""
        assert self._data is not None, "ring closed"
        if offset % ALIGN or offset + nbytes > self.capacity:
            raise ValueError(
                f"batch at offset {offset} of {nbytes} bytes lies outside the "
                f"{self.capacity}-byte ring"
            )
        return self._data[offset : offset + nbytes]

    def release(self, cursor: int) -> None:
        _CURSOR.pack_into(self._mm, 0, cursor)
        self.beat()
        if self._ringer is not None:
            self._ringer.ring()  # after the cursor: NOTE [ Doorbell ]

    def server_closed(self) -> bool:
        """Whether the server has closed its end: it let go of the stream (its status follows
        the Frames already sent)."""
        return bool(self._mm[_CLOSED_AT])

    def beat(self) -> None:
        """Tells the server this client is alive (its receiver runs): NOTE [ Ring space ]."""
        if self._data is not None:
            self._beats += 1
            _CURSOR.pack_into(self._mm, _HEARTBEAT_AT, self._beats)

    def close(self) -> None:
        self._data = None
        if self._ringer is not None:
            self._ringer.close()
            self._ringer = None
        with contextlib.suppress(BufferError):  # a view is alive; the mapping goes with it
            self._mm.close()
