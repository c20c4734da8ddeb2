"""The broadcast board (NOTE [ Broadcast board ] in protos/board.py): same-host broadcast
consumers read where each batch lies off their Run's board instead of a gRPC message each.

Unit tests of the board's records, then real servers: consumers follow the board and receive
every batch once, an error arrives at its position, a stalled consumer is detached and resumes,
and what cannot follow (another sharing mode, an older client, in-process loading) is sent its
batches as before.
"""

from __future__ import annotations

import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from remote_loader.client import RemoteLoader
from remote_loader.client.errors import ConnectionLostError, DatasetError
from remote_loader.protos import board, shm
from remote_loader.server.engine import Delivery
from remote_loader.server.lanes import BroadcastLane
from remote_loader.server.spec import LoaderSpec
from tests.conftest import ServeLoaders, assert_same
from tests.test_limits import _fields
from tests.test_sharing import run_concurrently
from tests.test_shm import expected, sizes_spec

# --- the records -------------------------------------------------------------------------------


# The board is used only where the machine keeps its loads and stores in order (NOTE [ Broadcast
# board ]); these tests assert that it is used.
needs_board = pytest.mark.skipif(
    not board.ordered_here(), reason="the broadcast board is used on x86 only"
)


def slot_record(n: int) -> board.Record:
    return board.Record(board.SLOT, total_bytes=n, header_bytes=64, pid=1, fd=2, inode=3)


def test_a_record_is_read_once_published_and_never_torn() -> None:
    writer = board.BoardWriter(4)
    try:
        reader = board.BoardReader(writer.name, 4)
        assert reader.read(0) is None  # not published yet
        for position in range(6):
            writer.publish(position, slot_record(100 + position), oldest=max(0, position - 3))
            assert reader.read(position) == slot_record(100 + position)
        assert reader.published() == 6
        # Position 1's record was rewritten for position 5: a reader that far behind is told.
        with pytest.raises(board.StaleRecord, match="batch 1 was rewritten"):
            reader.read(1)
        reader.close()
    finally:
        writer.close()
    assert not os.path.exists(os.path.join(shm.SHM_DIR, writer.name))


def test_a_board_refuses_to_overwrite_a_record_still_read() -> None:
    writer = board.BoardWriter(3)
    try:
        for position in range(3):
            writer.publish(position, slot_record(1), oldest=0)
        with pytest.raises(RuntimeError, match="would overwrite position 0"):
            writer.publish(3, slot_record(1), oldest=0)
        with pytest.raises(ValueError, match="published already"):
            writer.publish(1, slot_record(1), oldest=1)
    finally:
        writer.close()


def test_a_client_maps_the_board_read_only_and_refuses_what_is_not_one() -> None:
    writer = board.BoardWriter(2)
    try:
        reader = board.BoardReader(writer.name, 2)
        assert reader._mm is not None
        with pytest.raises(TypeError):  # read-only: no consumer can spoil the others' records
            reader._mm[0] = 1
        reader.close()
        with pytest.raises(shm.ShmUnavailable, match="invalid board"):
            board.BoardReader("../etc/passwd", 2)
        with pytest.raises(shm.ShmUnavailable, match="bytes, the server said"):
            board.BoardReader(writer.name, 3)
    finally:
        writer.close()
    with pytest.raises(shm.ShmUnavailable, match="cannot open"):
        board.BoardReader(writer.name, 2)  # closed: the name went with the Run


def test_a_quiet_client_rings_only_when_asked_or_waiting() -> None:
    ring = shm.RingWriter(shm.ALIGN)
    try:
        reader = shm.RingReader(ring.name, ring.capacity)
        bell = ring._bell
        assert bell is not None
        reader.release(1)
        assert bell._drain()  # rings by default (every ring that is not a board's)
        ring.ask_for_rings(False)
        reader.release(2)
        assert not bell._drain()
        reader.ring()  # waiting on the server (a record that asks for Frames): rings anyway
        assert bell._drain()
        ring.ask_for_rings(True)
        reader.release(3)
        assert bell._drain()
        reader.close()
    finally:
        ring.close()


def test_a_broadcast_lane_never_holds_more_than_its_window() -> None:
    # The board is the window's length: a batch back before the one due first waits in the
    # reorder buffer, and counts, or the lane would take a task more and outgrow its board.
    lane = BroadcastLane(in_order=True, window=2)
    lane.begin(iter([[0], [1], [2]]), 0, iterable=False)
    lane.issued, lane.outstanding = 2, 2  # two tasks submitted
    lane.outstanding -= 1
    lane.reorder.put(1, Delivery(blob=memoryview(b"x")))  # task 1 is back before task 0
    assert list(lane.reorder.ready()) == []
    assert not lane.wants_task()


def test_a_listening_client_is_woken_by_the_server_and_its_name_goes() -> None:
    ring = shm.RingWriter(shm.ALIGN)
    try:
        reader = shm.RingReader(ring.name, ring.capacity, listen=True)
        assert not reader.can_sleep()  # the server has not answered its hello yet
        ringer = reader._ringer
        assert ringer is not None and os.path.exists(ringer.listening)
        ring.sleep(0.5)  # the server drains the hello: it connects, and unlinks the name
        assert reader.can_sleep()
        assert not os.path.exists(ringer.listening)
        published = [False]
        started = time.monotonic()

        def publish() -> None:
            published[0] = True
            ring.wake_client()

        waker = threading.Timer(0.2, publish)
        waker.start()
        reader.wait_for(lambda: published[0], timeout=5.0)
        assert published[0] and time.monotonic() - started < 2.0  # woken, not timed out
        ring.wake_client()  # not waiting: nothing is sent, the next sleep is not cut short
        started = time.monotonic()
        reader.wait_for(lambda: False, timeout=0.2)
        assert time.monotonic() - started >= 0.15
        reader.close()
    finally:
        ring.close()


def test_a_following_client_waiting_for_a_slow_loader_sleeps_instead_of_polling(
    serve_loaders: ServeLoaders, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = LoaderSpec(
        name="slow",
        dataset="tests.datasets:Slow",
        dataset_kwargs={"n": 6, "seconds": 0.15},
        batch_size=1,
        num_workers=1,
    )
    served = serve_loaders(spec)
    looks = [0]
    real = board.BoardReader.read

    def counted(self: board.BoardReader, position: int) -> board.Record | None:
        looks[0] += 1
        return real(self, position)

    monkeypatch.setattr(board.BoardReader, "read", counted)
    got = broadcast(served.address, 0, 1, device="cpu")()
    assert [int(b) for b in got] == list(range(6))
    # 6 batches 0.15 s apart: woken once per record (and at WAKE_TICK), where polling from
    # 50 us backing off to 2 ms looks about 80 times per batch.
    assert looks[0] < 6 * 12, looks[0]


# --- real servers ------------------------------------------------------------------------------


def board_batches(caplog: pytest.LogCaptureFixture) -> list[int]:
    """board_batches= of every stream end line logged so far (0 where the field is absent)."""
    return [
        int(_fields(record.getMessage()).get("board_batches", 0))
        for record in caplog.records
        if record.getMessage().startswith("stream end")
    ]


def broadcast(
    address: str, rank: int, world_size: int, **kwargs: Any
) -> Callable[[], list[torch.Tensor]]:
    def consume() -> list[torch.Tensor]:
        with RemoteLoader(
            address, sharing="broadcast", rank=rank, world_size=world_size, **kwargs
        ) as loader:
            return list(loader)

    return consume


def offering_to_follow(monkeypatch: pytest.MonkeyPatch, board_flag: bool) -> None:
    """Makes every client's request say `board_flag`, whatever it would have said."""
    from remote_loader.client.transports import StreamEnds

    real = StreamEnds.offer

    def offer(self: StreamEnds, request: object) -> None:
        real(self, request)  # type: ignore[arg-type]
        request.board = board_flag  # type: ignore[attr-defined]

    monkeypatch.setattr(StreamEnds, "offer", offer)


def two_consumers_are_sent_their_batches(
    serve_loaders: ServeLoaders, caplog: pytest.LogCaptureFixture, broadcast_window: int = 3
) -> None:
    """Two broadcast consumers of 8 batches get them all, and neither follows a board."""
    sizes = [200_000] * 8
    served = serve_loaders(sizes_spec(sizes, broadcast_window=broadcast_window))
    got = run_concurrently(*(broadcast(served.address, r, 2, device="cpu") for r in range(2)))
    for received in got:
        assert_same(received, expected(sizes))
    assert board_batches(caplog) == [0, 0]


@needs_board
def test_broadcast_consumers_follow_the_board_and_get_every_batch_once(
    serve_loaders: ServeLoaders, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="remote_loader.server.service")
    sizes = [300_000, 20, 1_000_000, 300_000] * 6
    served = serve_loaders(sizes_spec(sizes, broadcast_window=3))
    for _ in range(2):  # a second epoch: a new Run, a new board
        got = run_concurrently(*(broadcast(served.address, r, 3, device="cpu") for r in range(3)))
        for received in got:
            assert_same(received, expected(sizes))
    # Every stream read its whole epoch off the board: no gRPC message per batch.
    assert board_batches(caplog) == [len(sizes)] * 6
    assert not [n for n in os.listdir(shm.SHM_DIR) if n.startswith(board.BOARD_PREFIX)]


def test_what_cannot_follow_a_board_is_sent_its_batches(
    serve_loaders: ServeLoaders, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="remote_loader.server.service")
    sizes = [200_000] * 8
    with_workers = serve_loaders(sizes_spec(sizes, broadcast_window=3))
    in_process = serve_loaders(sizes_spec(sizes, num_workers=0, broadcast_window=3))
    assert_same(broadcast(in_process.address, 0, 1, device="cpu")(), expected(sizes))
    with RemoteLoader(with_workers.address, device="cpu") as loader:  # partition
        assert_same(list(loader), expected(sizes))
    assert_same(broadcast(with_workers.address, 0, 1, transport="grpc")(), expected(sizes))
    assert board_batches(caplog) == [0, 0, 0]


@needs_board
def test_an_error_arrives_at_its_position_on_the_board(
    serve_loaders: ServeLoaders, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="remote_loader.server.service")
    spec = LoaderSpec(
        name="failing",
        dataset="tests.datasets:Failing",
        dataset_kwargs={"n": 20, "bad": 7},
        batch_size=2,
        num_workers=2,
        broadcast_window=3,
    )
    served = serve_loaders(spec)

    def consume() -> list[object]:
        got: list[object] = []
        with RemoteLoader(
            served.address, sharing="broadcast", world_size=2, rank=len(seen), device="cpu"
        ) as loader:
            seen.append(loader)
            it = iter(loader)
            while True:
                try:
                    got.append(next(it).tolist())
                except DatasetError as exc:
                    got.append(exc.position)
                except StopIteration:
                    return got

    seen: list[RemoteLoader] = []
    results = run_concurrently(consume, consume)
    want: list[object] = [[2 * i, 2 * i + 1] for i in range(10)]
    want[3] = 3  # the batch holding sample 7 fails, at its place; the epoch goes on
    assert results == [want, want]
    assert board_batches(caplog) == [10, 10]  # the error counts as a position passed


@needs_board
@pytest.mark.parametrize("retries", [0, 5])
def test_a_stalled_consumer_following_the_board_is_detached(
    serve_loaders: ServeLoaders, caplog: pytest.LogCaptureFixture, retries: int
) -> None:
    caplog.set_level(logging.INFO, logger="remote_loader.server.service")
    spec = LoaderSpec(
        name="blobs",
        dataset="tests.datasets:Blobs",
        dataset_kwargs={"n": 40, "nbytes": 1 << 18},
        batch_size=1,
        num_workers=2,
        broadcast_window=2,
        detach_timeout=1.0,
    )
    served = serve_loaders(spec)
    stalled = RemoteLoader(
        served.address,
        sharing="broadcast",
        rank=2,
        world_size=3,
        prefetch=1,
        retries=retries,
        device="cpu",
    )
    stalled_it = iter(stalled)
    first = int(next(stalled_it)["index"][0])  # joined; it reads no further while others run

    def consumer(rank: int) -> Callable[[], int]:
        def consume() -> int:
            with RemoteLoader(
                served.address, sharing="broadcast", rank=rank, world_size=3, device="cpu"
            ) as loader:
                return sum(1 for _ in loader)

        return consume

    started = time.monotonic()
    assert run_concurrently(consumer(0), consumer(1)) == [40, 40]
    assert time.monotonic() - started < 20
    if retries == 0:
        with pytest.raises(ConnectionLostError, match=r"detached .*detach_timeout"):
            for _ in stalled_it:
                pass
    else:  # resumed from its next batch, a production of its own: nothing lost or repeated
        rest = [int(b["index"][0]) for b in stalled_it]
        assert [first, *rest] == list(range(40))
    stalled.close()
    assert board_batches(caplog).count(40) >= 2  # the two that read on followed the board


def test_no_board_where_the_machine_may_reorder_its_loads_and_stores(
    serve_loaders: ServeLoaders, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NOTE [ Broadcast board ]: its seqlock has no fence but x86's ordering; elsewhere the
    # server sends the consumers their batches, even to a client that offers to follow (one
    # whose own machine is, or is emulated as, x86).
    caplog.set_level(logging.INFO, logger="remote_loader.server.service")
    monkeypatch.setattr(board, "ordered_here", lambda: False)
    offering_to_follow(monkeypatch, True)
    two_consumers_are_sent_their_batches(serve_loaders, caplog)


@pytest.mark.parametrize("ordered", [True, False])
def test_a_client_offers_to_follow_a_board_only_where_its_loads_stay_in_order(
    ordered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from remote_loader.client.transports import StreamEnds
    from remote_loader.protos import loader_pb2 as pb

    monkeypatch.setattr(board, "ordered_here", lambda: ordered)
    ends = StreamEnds("test", shm.Probe(), None, lambda: False)
    try:
        request = pb.StreamRequest()
        ends.offer(request)
        assert request.HasField("shm")
        assert request.board is ordered
    finally:
        ends.close()


@pytest.mark.parametrize(
    ("machine", "ordered"),
    [
        ("x86_64", True),
        ("AMD64", True),
        ("i686", True),
        ("aarch64", False),
        ("arm64", False),
        ("ppc64le", False),
        ("riscv64", False),
    ],
)
def test_only_x86_counts_as_ordered(
    machine: str, ordered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(platform, "machine", lambda: machine)  # what board reads
    assert board.ordered_here() is ordered


def test_a_window_longer_than_a_board_is_sent_its_batches(
    serve_loaders: ServeLoaders, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="remote_loader.server.service")
    two_consumers_are_sent_their_batches(serve_loaders, caplog, board.MAX_RECORDS)


def test_an_older_client_that_does_not_offer_to_follow_is_sent_its_batches(
    serve_loaders: ServeLoaders, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="remote_loader.server.service")
    offering_to_follow(monkeypatch, False)
    two_consumers_are_sent_their_batches(serve_loaders, caplog)
