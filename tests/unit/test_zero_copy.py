"""Zero-copy slots (NOTE [ Zero-copy slots ] in protos/slots.py) without a server: the generation
seqlock tells a whole batch from a slot rewritten under a copy, and a slot map refuses a
descriptor that is not the named file.

The tests that start a server, a process or Ray: tests/integration/test_zero_copy.py.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from remote_loader.protos import slots

# --- the seqlock and the maps ----------------------------------------------------------------


def test_the_generation_tells_a_whole_batch_from_a_slot_rewritten_under_a_copy(
    tmp_path: Any,
) -> None:
    path = tmp_path / "slot"
    path.write_bytes(bytes(4096))
    fd = os.open(path, os.O_RDWR)
    try:
        writer = np.memmap(path, dtype=np.uint8, mode="r+")
        generation = slots.begin_write(writer.data)
        assert generation % 2 == 0 and slots.generation(writer.data) == generation - 1
        writer[slots.SLOT_HEADER : slots.SLOT_HEADER + 4] = [1, 2, 3, 4]
        slots.end_write(writer.data, generation)

        maps = slots.SlotMaps()
        inode = os.fstat(fd).st_ino
        view = maps.view(os.getpid(), fd, inode, 4096)
        slots.check_generation(view, generation)  # whole: no error
        assert bytes(view[slots.SLOT_HEADER : slots.SLOT_HEADER + 4]) == b"\x01\x02\x03\x04"
        again = slots.begin_write(writer.data)  # the worker reuses the slot mid-copy
        with pytest.raises(slots.StaleSlot, match="rewritten"):
            slots.check_generation(view, generation)
        slots.end_write(writer.data, again)
        with pytest.raises(slots.StaleSlot):
            slots.check_generation(view, generation)  # a later batch is still not this one
        del view
        maps.close()
    finally:
        os.close(fd)


def test_a_slot_map_refuses_a_descriptor_that_is_not_the_named_file(tmp_path: Any) -> None:
    (tmp_path / "a").write_bytes(bytes(128))
    fd = os.open(tmp_path / "a", os.O_RDONLY)
    try:
        maps = slots.SlotMaps()
        inode = os.fstat(fd).st_ino
        with pytest.raises(slots.SlotUnavailable, match="not the slot"):
            maps.view(os.getpid(), fd, inode + 1, 128)  # the number was reused for another file
        with pytest.raises(slots.SlotUnavailable, match="not the slot"):
            maps.view(os.getpid(), fd, inode, 256)
        with pytest.raises(slots.SlotUnavailable, match="cannot open"):
            maps.view(os.getpid(), 10_000, inode, 128)
        assert len(maps.view(os.getpid(), fd, inode, 128)) == 128
        maps.close()
    finally:
        os.close(fd)
