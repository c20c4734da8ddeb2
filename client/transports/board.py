"""Following a broadcast job's board: the Frames of a stream whose server announced one.

The receiver reads a stream as (Frame, data) pairs. Without a board they are the gRPC
stream's messages. Once the server announced its broadcast Run's board (NOTE [ Broadcast
board ] in remote_loader.protos.board), the batches in workers' slots are read off the board
instead, as the Frames the server would have sent (ShmBatch.slot, copied out by the shared-memory
end, which releases them on the control ring), and the gRPC stream is read only where a record
says so: an error or a batch sent as Frames, and the end of the epoch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from functools import partial

from remote_loader.client.errors import ConnectionLostError, ProtocolError
from remote_loader.client.transports.base import BatchReused, TransportUnusable
from remote_loader.client.transports.shm import ShmEnd
from remote_loader.protos import board, shm, wire
from remote_loader.protos import loader_pb2 as pb

# Waiting for a record: the first look after this, backing off to MAX_POLL (a batch the Run is
# making is milliseconds away; the client's receive queue hides the rest).
FIRST_POLL = 50e-6
MAX_POLL = 0.002

# Asleep, how often a client looks at its call and at whether it was stopped.
WAKE_TICK = 0.05

_EMPTY = memoryview(b"")


class Following:
    """Iterates one stream's (Frame, data) pairs, following the board once it is announced.

    `messages`: the gRPC call's messages; `call_done()`: whether the call has ended (then its
    status is read, by taking its next message); `answered()`: a message arrived (the server
    has read the offer); `stopped()`: the receiver's; `beat()`: tells the server this client is
    alive (NOTE [ Ring space ]); `start`: the stream's first position.
    """

    def __init__(
        self,
        what: str,
        messages: Iterator[bytes],
        shm_end: ShmEnd,
        *,
        call_done: Callable[[], bool],
        answered: Callable[[], None],
        stopped: Callable[[], bool],
        beat: Callable[[], None],
        start: int,
    ) -> None:
        self._what = what
        self._messages = messages
        self._shm = shm_end
        self._call_done = call_done
        self._answered = answered
        self._stopped = stopped
        self._beat = beat
        self._position = start  # the next position to read off the board
        self._board: board.BoardReader | None = None
        self._control: shm.RingReader | None = None
        self._announce: pb.ShmBoard | None = None
        # A position read as Frames is released on the control ring when the receiver asks
        # for the next one (it has handled the Frames by then).
        self._owed: int | None = None
        self._parts_left = 0  # Frames still to come of a batch read off the gRPC stream
        self._ended = False  # the END record was read: the gRPC stream has the rest

    def __iter__(self) -> Following:
        return self

    def __next__(self) -> tuple[pb.Frame, memoryview]:
        if self._board is None or self._ended or self._parts_left:
            meta, data = self._grpc()
            if self._parts_left:
                self._parts_left -= 1
            elif self._board is None and meta.HasField("board"):
                self._open(meta.board)
                return next(self)
            return meta, data
        if self._owed is not None:
            assert self._control is not None
            self._control.release(self._owed)
            self._owed = None
        position = self._position
        record = self._record(position)
        if record is None:
            raise StopIteration  # the receiver was stopped
        self._position += 1
        if record.kind == board.SLOT:
            return self._slot_frame(position, record), _EMPTY
        if record.kind not in (board.END, board.FRAME):
            raise ProtocolError(f"{self._what}: batch {position}: unknown record {record.kind}")
        # The server sends what follows in the gRPC stream once it looks: it is told now.
        assert self._control is not None
        self._control.ring()
        if record.kind == board.END:
            self._ended = True
            return self._grpc()
        self._owed = position + 1
        meta, data = self._grpc()
        if not meta.HasField("error"):
            self._parts_left = max(meta.parts - meta.part - 1, 0)
        return meta, data

    def _grpc(self) -> tuple[pb.Frame, memoryview]:
        message = next(self._messages)
        self._answered()
        try:
            return wire.parse_frame(message)
        except wire.FrameError as exc:
            raise ProtocolError(f"{self._what}: {exc}") from exc

    def _open(self, announced: pb.ShmBoard) -> None:
        try:
            self._control = self._shm.control_ring(
                announced.control, announced.control_bytes, listen=True
            )
            self._board = board.BoardReader(announced.name, announced.records)
        except shm.ShmUnavailable as exc:
            raise TransportUnusable(ShmEnd.name, str(exc), "over gRPC") from exc
        self._announce = announced

    def _record(self, position: int) -> board.Record | None:
        """Position `position`'s record once published; None if the receiver was stopped.
        Raises what the gRPC call ended with when it ended first."""
        assert self._board is not None
        poll = FIRST_POLL
        while True:
            # Whether the call had ended before the look: if it ends just after, the record it
            # ended on (END) is found by the next look, not missed.
            done = self._call_done()
            try:
                record = self._board.read(position)
            except board.StaleRecord as exc:
                raise BatchReused(f"{self._what}: {exc}") from exc
            if record is not None:
                return record
            if self._stopped():
                return None
            if done:
                # Detached, failed, or the server went away: the status says which. Frames
                # still queued (for records this client never reached) are moot now.
                for _ in self._messages:
                    pass
                raise ConnectionLostError(
                    f"{self._what}: the stream ended while batch {position} was awaited on "
                    "the broadcast board"
                )
            self._beat()  # waiting is not silence (NOTE [ Ring space ])
            # Asleep until the Run publishes (it wakes a client that says it sleeps), or a
            # tick to look at the call; polling where the server cannot wake it.
            control = self._control
            assert control is not None
            if control.can_sleep():
                control.wait_for(partial(_past, self._board, position), WAKE_TICK)
            else:
                time.sleep(poll)
                poll = min(poll * 2, MAX_POLL)

    def _slot_frame(self, position: int, record: board.Record) -> pb.Frame:
        """The Frame the server would have sent for a batch in a worker's slot."""
        announced = self._announce
        assert announced is not None
        return pb.Frame(
            batch=position,
            part=0,
            parts=1,
            total_bytes=record.total_bytes,
            header_bytes=record.header_bytes,
            shm=pb.ShmBatch(
                ring=announced.control,
                ring_bytes=announced.control_bytes,
                offset=record.offset,
                release=position + 1,
                slot=pb.ShmSlot(
                    pid=record.pid,
                    fd=record.fd,
                    inode=record.inode,
                    size=record.size,
                    generation=record.generation,
                ),
            ),
        )

    def close(self) -> None:
        if self._board is not None:
            self._board.close()
            self._board = None


def _past(reader: board.BoardReader, position: int) -> bool:
    """Whether `position`'s record is published."""
    return reader.published() > position
