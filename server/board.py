"""The board stage: a broadcast Run's batches published once, and the streams that follow it.

A same-host consumer of a broadcast job that maps the workers' slots itself (NOTE [ Zero-copy
slots ] in protos/slots.py) reads where each batch lies off its Run's board (NOTE [ Broadcast
board ] in protos/board.py), not out of a gRPC message per batch. Here: `Board`, what a
BroadcastLane publishes into, and `follow`, the send loop of such a stream, which in place of
sending batches moves its consumer's cursor to where its client has got.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Generator
from typing import TYPE_CHECKING

from remote_loader.protos import board, shm, wire
from remote_loader.protos import loader_pb2 as pb
from remote_loader.server.errors import ClientSilent
from remote_loader.server.lanes import Entry
from remote_loader.server.transports.base import Sender, StreamStopped, error_frame
from remote_loader.server.transports.shm import ShmSender

if TYPE_CHECKING:  # a Run's policy opens its board (run.py imports this module)
    from remote_loader.server.run import Consumer

log = logging.getLogger(__name__)

# A board holds this many records more than its lane's window: the END record, and one spare.
SPARE_RECORDS = 2
# How long a following stream sleeps between looks at what does not ring its doorbell: a
# cancel, a detach, the client's silence (the client rings for what it waits on: a batch or
# error sent as Frames, the end of the epoch; and after each release while the Run waits).
FOLLOW_TICK = 0.1


class Board:
    """A broadcast lane's board; its Run's `cond` guards it."""

    def __init__(self, window: int) -> None:
        self._writer = board.BoardWriter(window + SPARE_RECORDS)
        self.name = self._writer.name
        self.records = self._writer.records
        self.ended = False

    def publish(self, entry: Entry, oldest: int) -> None:
        """Publishes `entry` at its position; `oldest`: the lane's first entry still held."""
        slot = entry.delivery.slot
        if entry.error is not None or slot is None:
            record = board.Record(board.FRAME)
        else:
            record = board.Record(
                board.SLOT,
                total_bytes=entry.nbytes,
                header_bytes=entry.delivery.header_nbytes,
                pid=os.getpid(),
                fd=slot.fd,
                inode=slot.inode,
                size=slot.size,
                offset=slot.offset,
                generation=slot.generation,
            )
        self._writer.publish(entry.position, record, oldest)

    def end(self, position: int, oldest: int) -> None:
        """The epoch ends at `position` (idempotent)."""
        if not self.ended:
            self.ended = True
            self._writer.publish(position, board.Record(board.END), oldest)

    def close(self) -> None:
        self._writer.close()


@dataclasses.dataclass(frozen=True)
class Following:
    """What a stream that follows its Run's board reads and writes: the board, and the stream's
    control ring, where its client stores its position."""

    board: Board
    control: shm.RingWriter


def following(
    request: pb.StreamRequest, num_workers: int | str, consumer: Consumer, sender: Sender
) -> Following | None:
    """What a stream follows, if it follows its Run's board: a broadcast consumer whose client
    offered to and maps the workers' slots itself (`sender`: zero-copy shared memory), of a
    loader whose batches are in slots (workers), on a machine that orders the board's loads and
    stores (x86: NOTE [ Broadcast board ]). None: it is sent its batches."""
    if not (
        request.board
        and consumer.membership.sharing == "broadcast"
        and isinstance(sender, ShmSender)
        and sender.zero_copy
        and num_workers != 0
        and board.ordered_here()
    ):
        return None
    control = sender.open_control()
    if control is None:
        return None
    try:
        return Following(consumer.follow_board(), control)
    except (shm.ShmUnavailable, ValueError) as exc:  # no room; a window past board.MAX_RECORDS
        log.warning("no broadcast board (%s): batches are sent to each consumer", exc)
        return None


def follow(
    consumer: Consumer,
    following: Following,
    sender: Sender,
    cancelled: threading.Event,
    client_silence: float,
) -> Generator[bytes, None, tuple[int, int, bool]]:
    """The stream of a consumer that follows its Run's board: announces the board, then, until
    the client has passed the last position, moves the consumer's cursor to the client's (the
    position stored in `control`'s cursor) and sends, through `sender`, the batches and errors
    whose records say they come as Frames. Returns (the position after the last batch, encoded
    bytes the client passed, whether the epoch ended: False when cancelled).

    Raises what Consumer.next raises (the loader broke, the consumer was detached) and
    ClientSilent when the client's heartbeat stood still for `client_silence` seconds.
    """
    run = consumer.run
    lane_board, control = following.board, following.control
    announce = pb.ShmBoard(
        name=lane_board.name,
        records=lane_board.records,
        control=control.name,
        control_bytes=control.capacity,
    )
    yield wire.control_frame(pb.Frame(board=announce))
    framed = consumer.cursor  # positions before this one that come as Frames have been sent
    beats, beat_at = control.heartbeat(), time.monotonic()

    def stopped() -> bool:
        return cancelled.is_set() or consumer.detached is not None

    control.ask_for_rings(False)  # until the Run waits on this consumer
    with run.cond:
        consumer.control = control  # the Run reads, asks and wakes the client there
    try:
        while True:
            released = control.consumed()
            if cancelled.is_set():
                return consumer.cursor, consumer.passed_nbytes, False
            with run.cond:
                frames, end = consumer.reach(released, framed)
            try:
                for entry, _ in frames:
                    try:
                        if entry.error is not None:
                            yield error_frame(entry.position, entry)
                        else:
                            yield from sender.send(entry.position, entry, stopped)
                    except StreamStopped:
                        if cancelled.is_set():
                            return consumer.cursor, consumer.passed_nbytes, False
                    framed = entry.position + 1
            finally:
                for _, end_lease in frames:  # sent or not: the slots go back when they are due
                    end_lease()
            if end is not None:
                return end, consumer.passed_nbytes, True
            if cancelled.is_set():
                return consumer.cursor, consumer.passed_nbytes, False
            # Asleep until the client releases a batch (it rings the control ring's doorbell while
            # the Run waits on it), or a tick: what does not ring (a record that asks for Frames,
            # the epoch's end, a cancel or detach, the client's silence) is seen at the next one.
            if control.consumed() == released and not stopped():
                control.sleep(FOLLOW_TICK)
            now_beats, now = control.heartbeat(), time.monotonic()
            if now_beats != beats or control.consumed() != released:
                beats, beat_at = now_beats, now
            elif now - beat_at >= client_silence:
                raise ClientSilent(
                    f"the client following the broadcast board gave no sign of life for "
                    f"{client_silence:g} s"
                )
    finally:
        with run.cond:
            consumer.control = None  # the ring goes with the stream
