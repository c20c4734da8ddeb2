"""A broadcast job's board: where its batches lie, published once for every same-host consumer.

NOTE [ Broadcast board ]

With sharing="broadcast" every consumer of a job reads the same batches. On one host, with
zero-copy slots (NOTE [ Zero-copy slots ] in protos/slots.py), no consumer costs the server a
copy of a batch, but each still cost it a gRPC message per batch, and a thread woken to take the
entry, build the message, wait for gRPC to send it and hand the entry back: 0.25-0.4 ms of the
server's CPU per batch and consumer on the 2-core box, so four consumers cost 1.4-1.7x the
server CPU of one. So a broadcast Run publishes each batch once, on a board in /dev/shm that
every same-host consumer of its job follows by position:

    the Run's thread, once per batch          each client (zero-copy: same host, same user)
    --------------------------------          ---------------------------------------------
    writes position p's record (where the     waits until `published` > p: says it sleeps
    batch lies in its worker's slot) into     (a byte in its control ring), looks once more
    record p % records, then stores p + 1     and sleeps on a bell of its own, at most
    in `published`, then wakes the clients    WAKE_TICK (50 ms, to watch its gRPC call);
    that said they sleep                      reads record p (a seqlock: the record's position
                                              word before and after), copies the batch out of
                                              the slot (the generation check of NOTE
    when its lane is full: reads every        [ Zero-copy slots ]) and stores p + 1 in its
    follower's position from its control      control ring's cursor; rings that ring's
    ring, retires what all have passed, and   doorbell only if asked to, or when it waits on
    if still full asks the slowest to ring    the server (a FRAME or END record)
    after each release (a byte in the ring's
    header), looking again every 10 ms (HUNGRY_POLL) in case a ring was missed

    each stream's thread: asleep on the control ring's doorbell, at most FOLLOW_TICK (0.1 s);
    moves the consumer's cursor to the client's (waking the Run if it waits for room) and
    sends the Frames that records point to: an error at its position, the end of the epoch

So a batch costs the server one record, whatever the number of same-host consumers, and a
consumer costs it a wake-up per release only while the job waits for that consumer.

A record is one of: SLOT (the batch lies in a worker's slot), FRAME (the batch or the error at
p comes as Frames in the gRPC stream, as without a board) or END (the epoch ends at p: the end
Frame follows in the gRPC stream). The gRPC stream carries nothing else after its first Frame,
which announces the board; the call still ends with its status, so a consumer detached for
stalling, a loader that broke or a server that went away ends the client's wait as before.

Bounds: a board holds its Run's `broadcast_window` + 2 records (a window past MAX_RECORDS gets
no board: its streams are sent their batches). A broadcast lane holds at most the window's
entries, those waiting to be put in order included, so record p is rewritten (for p + records)
only after every consumer still attached has passed p. A consumer detached meanwhile
(detach_timeout) may find its record rewritten (the position word changed: the read is thrown
away) or its slot reused (the generation changed): either is a broken stream to it, resumed
from p as any other, and the gRPC status says why. Clients map the board read-only: none can
spoil what the others read. Their cursors live in their own streams' control rings, beside
their heartbeats (NOTE [ Ring space ] in protos/shm.py). The board is the server's: unlinked
when its Run closes, or by the server's resource tracker if the server dies first.

The client's bell: its control ring's doorbell Ringer (NOTE [ Doorbell ]) binds a socket of its
own beside the server's, /dev/shm/rl-bell-<32 hex>, mode 0600, and rings once; the server, on
that first datagram, connects its bell to the name it came from (only such a name), unlinks it
and marks the ring's header, and from then on the client sleeps instead of polling (it polls,
from 50 us backing off to 2 ms, until then, or against a server without a bell). A wake-up can
be missed only when the client's "I sleep" and the server's `published` cross in the store
buffers; WAKE_TICK bounds what that costs.

Ordering: a record is written before `published` moves past it, and its position word is
cleared before and set after its body; a reader loads them the other way round. Nothing in
between releases the GIL or makes a system call, so nothing but the processor orders them,
and x86 keeps stores in order and loads in order (TSO). Weaker machines (arm64, ppc64le) may
not, and Python has no fence to put between them: a reader could take a record's new position
word with its old body, the batch of a previous lap. So a server makes a board only where
`ordered_here()`, and a client offers to follow one only where its own machine says so (the
two may differ under emulation); elsewhere broadcast consumers are sent a Frame per batch and
still read their slots (the GIL's hand-offs around a slot's copy order most of what that
needs; NOTE [ Zero-copy slots ] says what they leave on arm64).
"""

from __future__ import annotations

import mmap
import os
import platform
import re
import secrets
import struct
from typing import NamedTuple

from remote_loader.protos import shm

BOARD_PREFIX = "rl-board-"
_BOARD_NAME = re.compile(r"rl-board-[0-9a-f]{32}")

# What a record says about its position.
SLOT = 1  # the batch lies in a worker's slot
FRAME = 2  # the batch (or the error at its place) comes as Frames in the gRPC stream
END = 3  # the epoch ends here: the end Frame follows in the gRPC stream

# Layout: [0, 8) `published` (the position after the last record written), the rest of a cache
# line unused; then `records` records of RECORD bytes: the position word (position + 1; 0 while
# it is being written), then the body.
HEADER = 64
RECORD = 128
_WORD = struct.Struct("<Q")
# kind, total_bytes, header_bytes, then the slot (ShmSlot's fields and the batch's offset).
_BODY = struct.Struct("<10Q")
_BODY_AT = 8
# Boards a client asks for hold at most this many records (a broadcast_window past it would be
# a server's mistake, not a reason to map gigabytes).
MAX_RECORDS = 1 << 16
# platform.machine() of the machines that keep stores and loads in order (see Ordering above).
ORDERED_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686"})


def ordered_here() -> bool:
    """Whether this machine orders the board's loads and stores by itself (x86)."""
    return platform.machine().lower() in ORDERED_MACHINES


class Record(NamedTuple):
    """One position's record (the slot fields are 0 unless `kind` is SLOT)."""

    kind: int
    total_bytes: int = 0
    header_bytes: int = 0
    pid: int = 0
    fd: int = 0
    inode: int = 0
    size: int = 0
    offset: int = 0
    generation: int = 0
    reserved: int = 0


class StaleRecord(RuntimeError):
    """The record was rewritten for a later position: its reader fell out of the job."""


def _size(records: int) -> int:
    return HEADER + records * RECORD


class BoardWriter:
    """The server's end: one broadcast Run's board. Not thread-safe: the Run's `cond` guards it."""

    def __init__(self, records: int) -> None:
        if not 1 <= records <= MAX_RECORDS:
            raise ValueError(f"a board holds 1 to {MAX_RECORDS} records, not {records}")
        self.name = BOARD_PREFIX + secrets.token_hex(16)
        self.records = records
        # Mode 0600: only a client of this server's user maps the workers' slots (and so follows
        # a board) at all.
        self._mm: mmap.mmap | None = shm.create_segment(self.name, _size(records))
        self.published = 0

    def publish(self, position: int, record: Record, oldest: int) -> None:
        """Writes `record` for `position` (the next one: positions go up) and makes it visible.

        `oldest`: the first position some consumer may still read; the record it is in must not
        be rewritten (a lane larger than the board is a bug, not a slow consumer)."""
        if self._mm is None:
            return  # closed: the Run is closing, nobody follows the board
        if position < self.published:
            raise ValueError(f"position {position} was published already ({self.published})")
        if position - oldest >= self.records:
            raise RuntimeError(
                f"the board holds {self.records} records: position {position} would overwrite "
                f"position {oldest}, which is still read"
            )
        at = HEADER + (position % self.records) * RECORD
        _WORD.pack_into(self._mm, at, 0)  # a reader that sees this throws its read away
        _BODY.pack_into(self._mm, at + _BODY_AT, *record)
        _WORD.pack_into(self._mm, at, position + 1)
        self.published = position + 1
        _WORD.pack_into(self._mm, 0, self.published)

    def close(self) -> None:
        """Unlinks the name and drops the mapping; idempotent. Readers keep their maps."""
        if self._mm is None:
            return
        mm, self._mm = self._mm, None
        shm.forget_segment(self.name)
        mm.close()


class BoardReader:
    """A client's end: the board the server named, mapped read-only (its name stays: other
    consumers of the job open it too)."""

    def __init__(self, name: str, records: int) -> None:
        if not _BOARD_NAME.fullmatch(name):
            raise shm.ShmUnavailable(f"the server named an invalid board {name!r}")
        if not 1 <= records <= MAX_RECORDS:
            raise shm.ShmUnavailable(f"the server named a board of {records} records")
        self.name = name
        self.records = records
        path = os.path.join(shm.SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise shm.ShmUnavailable(f"cannot open the server's board {path}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size != _size(records):
                raise shm.ShmUnavailable(
                    f"board {name} is {size} bytes, the server said {_size(records)}"
                )
            self._mm: mmap.mmap | None = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)

    def published(self) -> int:
        """The position after the last record published."""
        assert self._mm is not None, "board closed"
        return int(_WORD.unpack_from(self._mm, 0)[0])

    def read(self, position: int) -> Record | None:
        """Position `position`'s record; None if it is not published yet. Raises StaleRecord
        if it was rewritten for a later position (this reader was left behind)."""
        mm = self._mm
        assert mm is not None, "board closed"
        if int(_WORD.unpack_from(mm, 0)[0]) <= position:
            return None
        at = HEADER + (position % self.records) * RECORD
        before = _WORD.unpack_from(mm, at)[0]
        record = Record(*_BODY.unpack_from(mm, at + _BODY_AT))
        after = _WORD.unpack_from(mm, at)[0]
        if before != position + 1 or after != before:
            raise StaleRecord(
                f"the board's record of batch {position} was rewritten: this consumer fell "
                "more than the board's length behind"
            )
        return record

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
