"""The same-host shared-memory transport (NOTE [ Shared-memory transport ] in protos/shm.py)
without a server: the probe, the ring and its bounds, ring sizes, no room in /dev/shm, a copy
striped over threads, and who may open a ring.

The tests that start a server, a process or Ray: tests/integration/test_shm.py.
"""

from __future__ import annotations

import errno
import os
import random
from typing import Any

import numpy as np
import pytest

from remote_loader.client import assembly
from remote_loader.protos import shm, shm_probe, striping
from tests.helpers import (
    copiers,
    rings,
)

# No ring or bell is left in /dev/shm after a test.
pytestmark = pytest.mark.usefixtures("no_ring_left_behind")


# --- the probe -----------------------------------------------------------------------------


def test_a_probe_proves_a_shared_dev_shm_and_is_removed() -> None:
    probe = shm_probe.Probe()
    assert os.path.exists(os.path.join(shm.SHM_DIR, probe.name))
    assert shm_probe.verify_probe(probe.name, probe.nonce) == os.geteuid()
    assert not os.path.exists(os.path.join(shm.SHM_DIR, probe.name))
    probe.remove()  # idempotent


def test_a_wrong_nonce_or_a_missing_probe_is_refused() -> None:
    probe = shm_probe.Probe()
    assert shm_probe.verify_probe(probe.name, bytes(shm_probe.NONCE_BYTES)) is None
    assert not os.path.exists(os.path.join(shm.SHM_DIR, probe.name))  # removed either way
    assert shm_probe.verify_probe(probe.name, probe.nonce) is None  # gone: another host, in effect


@pytest.mark.parametrize(
    "name",
    [
        "../../etc/passwd",
        "rl-probe-../../etc/passwd",
        "rl-probe-" + "0" * 31,
        "rl-ring-" + "0" * 32,
    ],
)
def test_the_server_opens_only_probe_shaped_names(name: str) -> None:
    assert shm_probe.verify_probe(name, bytes(shm_probe.NONCE_BYTES)) is None


def test_a_probe_that_is_a_link_is_not_followed(tmp_path: Any) -> None:
    target = tmp_path / "secret"
    nonce = os.urandom(shm_probe.NONCE_BYTES)
    target.write_bytes(nonce)
    name = "rl-probe-" + "ab" * 16
    link = os.path.join(shm.SHM_DIR, name)
    os.symlink(target, link)
    try:
        assert shm_probe.verify_probe(name, nonce) is None
    finally:
        if os.path.lexists(link):
            os.unlink(link)
    assert target.read_bytes() == nonce


# --- the ring ------------------------------------------------------------------------------


def test_batches_go_round_the_ring_and_wait_for_the_reader() -> None:
    writer = shm.RingWriter(4 * shm.ALIGN * 4)  # room for 4 batches of 4 lines
    reader = shm.RingReader(writer.name, writer.capacity)
    assert writer.name not in rings()  # the reader unlinked the name at once
    try:
        sent = [np.full(200 + i, i, dtype=np.uint8) for i in range(12)]
        received: list[np.ndarray] = []
        placed = []
        for batch in sent[:4]:
            placed.append(writer.place(batch.data, lambda: False))
        # Full: the next one waits until stopped.
        assert writer.place(sent[4].data, lambda: True) is None
        for batch in sent[4:]:
            offset, release = placed.pop(0)  # type: ignore[misc]
            received.append(reader.view(offset, len(received) + 200).copy())
            reader.release(release)
            placed.append(writer.place(batch.data, lambda: False))
        while placed:
            offset, release = placed.pop(0)  # type: ignore[misc]
            received.append(reader.view(offset, len(received) + 200).copy())
            reader.release(release)
        assert len(received) == len(sent)
        for a, b in zip(sent, received, strict=True):
            np.testing.assert_array_equal(a, b)
        assert writer.consumed() == release  # the reader released every batch
    finally:
        reader.close()
        writer.close()


def test_a_batch_never_wraps_and_a_reader_checks_bounds() -> None:
    writer = shm.RingWriter(3 * shm.ALIGN)
    reader = shm.RingReader(writer.name, writer.capacity)
    try:
        first = writer.place(memoryview(bytes(2 * shm.ALIGN)), lambda: False)
        assert first == (0, 2 * shm.ALIGN)
        reader.release(first[1])
        # Two lines do not fit in the one left at the end: the batch starts the next lap.
        assert writer.place(memoryview(bytes(2 * shm.ALIGN)), lambda: False) == (
            0,
            5 * shm.ALIGN,
        )
        with pytest.raises(ValueError, match="outside"):
            reader.view(2 * shm.ALIGN, 2 * shm.ALIGN)
        with pytest.raises(ValueError, match="does not fit"):
            writer.place(memoryview(bytes(4 * shm.ALIGN)), lambda: False)
    finally:
        reader.close()
        writer.close()


def test_an_emptied_ring_takes_a_batch_too_big_for_the_space_before_the_wrap() -> None:
    # NOTE [ Ring space ]: 1 then 2 lines leave 1 line before the wrap point; a 4-line batch
    # fits only the whole ring, which the reader has emptied. The skipped line is never
    # released, so a rule that waited for the cursor to pass it waited forever.
    writer = shm.RingWriter(4 * shm.ALIGN)
    reader = shm.RingReader(writer.name, writer.capacity)
    try:
        for nbytes in (shm.ALIGN, 2 * shm.ALIGN):
            placed = writer.place(memoryview(bytes(nbytes)), lambda: False)
            assert placed is not None
            reader.release(placed[1])
        polls = 0

        def stopped() -> bool:  # gives up after a few polls instead of waiting forever
            nonlocal polls
            polls += 1
            return polls > 20

        batch = np.arange(4 * shm.ALIGN, dtype=np.uint8)
        placed = writer.place(batch.data, stopped)
        assert placed == (0, 8 * shm.ALIGN), placed
        np.testing.assert_array_equal(reader.view(0, batch.nbytes), batch)
        # While the reader holds a batch, the rule still protects it: no room, wait.
        assert writer.place(memoryview(bytes(shm.ALIGN)), lambda: True) is None
    finally:
        reader.close()
        writer.close()


def test_ring_sizes_follow_the_batch_and_the_cap() -> None:
    assert shm.ring_bytes_for(1000, 1 << 30) == shm.RING_BATCHES * 1024
    assert shm.ring_bytes_for(1000, 2048) == 2048
    assert shm.ring_bytes_for(5000, 4096) is None


def test_no_room_in_dev_shm_is_a_clear_error_not_a_sigbus(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(shm.ShmUnavailable, match="shm_size"):
        shm.RingWriter(1 << 20)


def test_a_large_copy_is_striped_over_threads_byte_for_byte(copy_threads: None) -> None:
    src = np.frombuffer(random.Random(1).randbytes(3 * striping.MIN_STRIPE + 7), dtype=np.uint8)
    dst = np.zeros_like(src)
    assembly.copy_in(dst, src)
    assert bytes(dst) == bytes(src)  # three stripes of uneven sizes
    # The pool's threads and this one: ThreadPoolExecutor starts its second thread only when the
    # first is still busy at the second stripe's submit, which a loaded machine may not see.
    assert 1 <= len(copiers()) <= 2
    small = np.zeros(striping.MIN_STRIPE, dtype=np.uint8)
    assembly.copy_in(small, src[: striping.MIN_STRIPE])  # under two stripes' worth: one plain copy
    assert bytes(small) == bytes(src[: striping.MIN_STRIPE])


def test_the_server_shares_rings_only_with_a_user_that_can_open_them() -> None:
    me = os.geteuid()
    assert shm_probe.can_share_with(me)
    assert shm_probe.can_share_with(0)  # a root client opens any ring
    assert shm_probe.can_share_with(me + 1) == (me == 0)  # a root server gives the ring away


def test_a_probe_is_readable_by_a_server_running_as_another_user() -> None:
    probe = shm_probe.Probe()
    try:
        assert os.stat(os.path.join(shm.SHM_DIR, probe.name)).st_mode & 0o777 == 0o644
    finally:
        probe.remove()
