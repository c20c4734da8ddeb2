"""The committed stubs match loader.proto; Frames written by hand parse as protobuf and back."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from remote_loader.protos import generate, loader_pb2, wire
from tests.helpers import ROOT


def test_committed_stubs_are_fresh() -> None:
    stale = generate.stale_outputs(ROOT / "src" / "remote_loader" / "protos")
    assert not stale, (
        f"{stale} differ from loader.proto; regenerate with `python protos/generate.py`"
    )


def test_a_changed_proto_is_detected(tmp_path: Path) -> None:
    for name in ("loader.proto", *generate.OUTPUTS):
        shutil.copy(ROOT / "src" / "remote_loader" / "protos" / name, tmp_path / name)
    proto = tmp_path / "loader.proto"
    proto.write_text(
        proto.read_text().replace("uint64 epoch = 2;", "uint64 epoch = 2;\n  uint64 extra = 99;")
    )
    assert set(generate.stale_outputs(tmp_path)) >= {"loader_pb2.py", "loader_pb2.pyi"}


@pytest.mark.parametrize(("total", "chunk"), [(0, 8), (1, 8), (8, 8), (9, 8), (1000, 64)])
def test_batch_frames_round_trip(total: int, chunk: int) -> None:
    blob = memoryview(bytes(i % 251 for i in range(total)))
    frames = list(wire.batch_frames(5, blob, min(total, 3), chunk))
    assert len(frames) == wire.num_parts(total, chunk)
    joined = b""
    for part, message in enumerate(frames):
        meta, data = wire.parse_frame(message)
        full = loader_pb2.Frame.FromString(message)  # the same bytes as plain protobuf
        assert bytes(data) == full.data and len(data) <= chunk
        assert (meta.batch, meta.part, meta.parts) == (5, part, len(frames))
        joined += bytes(data)
    first, _ = wire.parse_frame(frames[0])
    assert first.total_bytes == total and first.header_bytes == min(total, 3)
    assert joined == bytes(blob)


def test_control_frames_and_garbage() -> None:
    end = wire.control_frame(loader_pb2.Frame(end=loader_pb2.StreamEnd(batches=3)))
    meta, data = wire.parse_frame(end)
    assert meta.end.batches == 3 and len(data) == 0
    with pytest.raises(wire.FrameError):
        wire.parse_frame(b"\x0a\xff")  # a length that runs past the end
    with pytest.raises(wire.FrameError):
        wire.parse_frame(b"\x0b")  # wire type 3 (groups) is not used
