"""Is the GPU waiting? (NOTE [ Stall stages ] in protos/stall.py) The window and the stamp on
their own: each wait split between its stages, the window sliding, a stamped frame parsed, the
board bounded and reporters with the same labels shown as one.

The tests that start a server, a process or Ray: tests/integration/test_stall.py.
"""

from __future__ import annotations

import pytest

from remote_loader.client.stall import StallWindow
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import stall, wire
from remote_loader.server.telemetry.stall import Report, StallBoard


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- the window, the stamp and the board on their own ------------------------------------


def test_each_wait_is_split_between_the_workers_the_transport_and_the_copy() -> None:
    clock = Clock()
    window = StallWindow(window=10.0, clock=clock)
    window.blocked(100.0)
    # Blocked 1 s for a batch the stream waited 0.7 s for, which took the receiver 0.1 s.
    window.waited(100.0, 101.0, workers=0.7, copy=0.1)
    clock.now = 102.0  # then 1 s of training
    figures = window.figures()
    assert figures.window == pytest.approx(2.0)
    assert figures.wait_fraction == pytest.approx(0.5)
    assert figures.stages == pytest.approx({"workers": 0.35, "in flight": 0.1, "copy": 0.05})
    assert figures.stage == "workers"
    assert figures.batches_per_second == pytest.approx(0.5)


def test_the_window_slides_and_counts_a_wait_still_going_on() -> None:
    clock = Clock()
    window = StallWindow(window=10.0, clock=clock)
    window.blocked(100.0)
    window.waited(100.0, 104.0, workers=0.0, copy=0.0)  # 4 s in flight
    for t in range(104, 114):  # then ten 1 s steps with no wait
        window.blocked(float(t))
        window.waited(float(t), float(t))
    clock.now = 114.0
    assert window.figures().wait_fraction == pytest.approx(0.0)  # the long wait slid out
    assert window.figures().stage == ""  # under STAGE_MIN_FRACTION: none named
    window.blocked(114.0)
    clock.now = 119.0  # blocked for 5 s now, no batch yet
    figures = window.figures()
    assert figures.wait_fraction == pytest.approx(0.5)
    assert window.active() and not StallWindow(clock=clock).active()


def test_a_loop_of_thousands_of_batches_a_second_reads_true() -> None:
    # Each wait was kept, at most 4096 of them: at 2000 batches/s the window read 409.6
    # batches/s and a fifth of the stall (NOTE [ Coalesced waits ] in client/stall.py).
    clock = Clock()
    window = StallWindow(window=10.0, clock=clock)
    for i in range(24_000):  # 12 s: a 0.25 ms wait for the workers, then 0.25 ms of training
        start = 100.0 + i / 2000
        window.blocked(start)
        window.waited(start, start + 0.00025, workers=0.00025, copy=0.0)
    clock.now = 112.0
    figures = window.figures()
    assert figures.batches_per_second == pytest.approx(2000, rel=0.01)
    assert figures.wait_fraction == pytest.approx(0.5, rel=0.01)
    assert figures.stages["workers"] == pytest.approx(0.5, rel=0.01)
    assert figures.stage == "workers"


def test_a_stamped_frame_parses_with_its_wait_and_its_data_intact() -> None:
    blob = memoryview(bytes(range(200)))
    first = next(wire.batch_frames(7, blob, 3, 64))
    stamped = stall.stamped(first, 0.25)
    assert stamped is not None
    meta, data = wire.parse_frame(stamped)
    assert meta.batch == 7 and meta.parts == 4 and meta.waited_us == 250_000
    assert bytes(data) == bytes(blob[:64])
    assert stall.stamped(first, 0.0005) is first  # a batch that was ready: no stamp, no copy
    assert wire.parse_frame(first)[0].waited_us == 0
    # A node announced before the batch is passed over: the stamp goes on the batch's handle.
    announce = wire.control_frame(pb.Frame(node_channel=pb.NodeChannel(host="n", port=1)))
    assert stall.stamped(announce, 0.25) is None
    handle = stall.stamped(wire.handle_frame(7, 200, 3, on_tcp=True), 0.25)
    assert handle is not None and wire.parse_frame(handle)[0].waited_us == 250_000


def _report(job: str = "j", rank: int = 0, wait: float = 0.5, stage: str = "workers") -> Report:
    return Report(job, "partition", rank, 8, 0, 10.0, wait, {stage: wait}, stage, 3.0, wait, stage)


def test_the_board_is_bounded_in_reporters_rate_and_time() -> None:
    clock = Clock()
    board = StallBoard(lambda job, sharing, rank: ("l", job, sharing, str(rank)), 2, clock)
    assert board.record(1, _report(rank=0)) is None
    assert board.record(2, _report(rank=1)) is None
    assert "already has 2" in (board.record(3, _report(rank=2)) or "")  # past the cap
    clock.now += 0.2
    assert "at most one per" in (board.record(1, _report()) or "")  # too soon
    clock.now += stall.MIN_REPORT_GAP
    assert board.record(1, _report(wait=0.9)) is None
    (history,) = [list(s.history) for s, _ in board.seen() if s.reporter == 1]
    assert history == [(0.5, 3.0), (0.9, 3.0)]
    clock.now += stall.REPORT_TTL + 1  # both went quiet: forgotten, room for others
    assert board.seen() == [] and board.workers_stall() is None
    assert board.record(3, _report(rank=2)) is None


def test_reporters_with_the_same_labels_show_as_the_one_that_waits_most() -> None:
    board = StallBoard(lambda job, sharing, rank: ("l", "other", sharing, "other"), 8)
    board.record(1, _report(job="a", wait=0.2))
    board.record(2, _report(job="b", wait=0.7, stage="copy"))
    families = {f.name: f for f in board.collect()}
    stalls = families["remote_loader_consumer_stall"].samples
    assert [s.labels["job"] for s in stalls] == ["other"]
    assert stalls[0].value == pytest.approx(0.7)
    by_stage = {
        s.labels["stage"]: s.value
        for s in families["remote_loader_consumer_stall_by_stage"].samples
    }
    assert by_stage == {"workers": 0.0, "in flight": 0.0, "copy": pytest.approx(0.7)}
    assert board.workers_stall() == pytest.approx(0.2)  # only "a" waits on the workers
