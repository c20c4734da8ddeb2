"""Zero-copy slots (NOTE [ Zero-copy slots ] in protos/slots.py): a same-host client of the
server's user and pid namespace reads each batch in the worker's slot; the server copies none.

On real servers: the server never touches the ring's data, broadcast consumers read one slot, a
slot rewritten under a copy is never delivered, and the ring is what a client in another pid
namespace, a client that cannot open a slot, or a server with zero_copy = false gets.

The unit tests (no server, no process, no Ray): tests/unit/test_zero_copy.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from remote_loader.client import RemoteLoader
from remote_loader.client.errors import ConnectionLostError, DatasetError
from remote_loader.client.types import Sharing
from remote_loader.protos import shm, slots
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.transports.shm import ShmSender
from tests.helpers import (
    ServeLoaders,
    assert_same,
    expected,
    run_concurrently,
    sizes_spec,
    subprocess_env,
)


@pytest.fixture
def ring_copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The sizes of the batches the (in-process) server copied into a ring."""
    copies: list[int] = []
    real = shm.RingWriter.place

    def counting(self: shm.RingWriter, blob: memoryview, *args: Any, **kwargs: Any) -> Any:
        copies.append(len(blob))
        return real(self, blob, *args, **kwargs)

    monkeypatch.setattr(shm.RingWriter, "place", counting)
    yield copies


@pytest.fixture
def slot_frames(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The batch numbers the (in-process) server sent as a Frame naming a worker's slot."""
    sent: list[int] = []
    real = ShmSender._lend

    def counting(self: ShmSender, batch: int, *args: Any, **kwargs: Any) -> Any:
        frame = real(self, batch, *args, **kwargs)
        if frame is not None:
            sent.append(batch)
        return frame

    monkeypatch.setattr(ShmSender, "_lend", counting)
    yield sent


def broadcast(
    address: str, rank: int, world_size: int, **kwargs: Any
) -> Callable[[], list[torch.Tensor]]:
    def consume() -> list[torch.Tensor]:
        with RemoteLoader(
            address, sharing="broadcast", rank=rank, world_size=world_size, **kwargs
        ) as loader:
            return list(loader)

    return consume


# --- over a real server ------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_same_host_client_reads_the_workers_slots_and_the_server_copies_nothing(
    serve_loaders: ServeLoaders, ring_copies: list[int], num_workers: int
) -> None:
    sizes = [300_000, 10, 2_000_000, 300_000] * 4  # slots reused, dropped and made again
    served = serve_loaders(sizes_spec(sizes, num_workers))
    with RemoteLoader(served.address, device="cpu") as loader:
        for _ in range(2):  # a second epoch reads the same slots
            assert_same(list(loader), expected(sizes))
            assert loader.last_transport == "shm"
    assert ring_copies == []


def test_zero_copy_false_copies_every_batch_into_the_ring(
    serve_loaders: ServeLoaders, ring_copies: list[int]
) -> None:
    sizes = [300_000] * 6
    served = serve_loaders(sizes_spec(sizes), zero_copy=False)
    with RemoteLoader(served.address, device="cpu") as loader:
        assert_same(list(loader), expected(sizes))
        assert loader.last_transport == "shm"
    assert len(ring_copies) == len(sizes)


def test_in_process_loading_has_no_slots_and_uses_the_ring(
    serve_loaders: ServeLoaders, ring_copies: list[int]
) -> None:
    sizes = [300_000] * 4
    served = serve_loaders(sizes_spec(sizes, num_workers=0))
    with RemoteLoader(served.address, device="cpu") as loader:
        assert_same(list(loader), expected(sizes))
    assert len(ring_copies) == len(sizes)


def test_broadcast_consumers_read_one_slot_per_batch_and_the_server_copies_nothing(
    serve_loaders: ServeLoaders, ring_copies: list[int]
) -> None:
    sizes = [500_000] * 24
    served = serve_loaders(sizes_spec(sizes, broadcast_window=3))

    def consumer(rank: int) -> Callable[[], list[torch.Tensor]]:
        def consume() -> list[torch.Tensor]:
            with RemoteLoader(
                served.address, sharing="broadcast", rank=rank, world_size=4, device="cpu"
            ) as loader:
                got = list(loader)
                assert loader.last_transport == "shm"
            return got

        return consume

    results = run_concurrently(*(consumer(r) for r in range(4)))
    for got in results:
        assert_same(got, expected(sizes))
    assert ring_copies == []


def test_every_broadcast_consumer_is_sent_a_frame_naming_the_slot_of_every_batch(
    serve_loaders: ServeLoaders, slot_frames: list[int]
) -> None:
    # Issue 28: no board in /dev/shm any more (it cut the server's CPU by less than the 20%
    # it had to): each same-host broadcast consumer gets a small Frame per batch naming its
    # slot, on every machine, and every consumer receives every batch once.
    sizes = [300_000, 20, 1_000_000, 300_000] * 6
    served = serve_loaders(sizes_spec(sizes, broadcast_window=3))
    before = set(os.listdir(shm.SHM_DIR))
    for _ in range(2):  # a second epoch: a new Run
        got = run_concurrently(*(broadcast(served.address, r, 3, device="cpu") for r in range(3)))
        for received in got:
            assert_same(received, expected(sizes))
    assert sorted(slot_frames) == sorted(list(range(len(sizes))) * 6)
    left = {n for n in set(os.listdir(shm.SHM_DIR)) - before if n.startswith("rl-")}
    assert not left, left


def test_an_error_arrives_at_its_position_among_broadcast_slot_batches(
    serve_loaders: ServeLoaders, slot_frames: list[int]
) -> None:
    spec = LoaderSpec(
        name="failing",
        dataset="tests.datasets:Failing",
        dataset_kwargs={"n": 20, "bad": 7},
        batch_size=2,
        num_workers=2,
        broadcast_window=3,
    )
    served = serve_loaders(spec)
    ranks = iter(range(2))

    def consume() -> list[object]:
        got: list[object] = []
        with RemoteLoader(
            served.address, sharing="broadcast", world_size=2, rank=next(ranks), device="cpu"
        ) as loader:
            it = iter(loader)
            while True:
                try:
                    got.append(next(it).tolist())
                except DatasetError as exc:
                    got.append(exc.position)
                except StopIteration:
                    return got

    results = run_concurrently(consume, consume)
    want: list[object] = [[2 * i, 2 * i + 1] for i in range(10)]
    want[3] = 3  # the batch holding sample 7 fails, at its place; the epoch goes on
    assert results == [want, want]
    assert sorted(slot_frames) == sorted([b for b in range(10) if b != 3] * 2)


@pytest.mark.parametrize("retries", [0, 5])
def test_a_stalled_broadcast_consumer_reading_slots_is_detached(
    serve_loaders: ServeLoaders, retries: int
) -> None:
    # Its leased slots go back when it is detached; should it read one after that, the slot's
    # generation tells it, and it resumes (or fails with the status's reason), never torn.
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

    assert run_concurrently(consumer(0), consumer(1)) == [40, 40]  # not held by the stalled one
    if retries == 0:
        with pytest.raises(ConnectionLostError, match=r"detached .*detach_timeout"):
            for _ in stalled_it:
                pass
    else:  # resumed from its next batch, a production of its own: nothing lost or repeated
        rest = [int(b["index"][0]) for b in stalled_it]
        assert [first, *rest] == list(range(40))
    stalled.close()


def test_an_older_client_that_offers_to_follow_a_board_is_sent_its_batches(
    serve_loaders: ServeLoaders, monkeypatch: pytest.MonkeyPatch, slot_frames: list[int]
) -> None:
    # StreamRequest field 12 (`board`) is reserved now; a client from before issue 28 still sets
    # it, and is served as any other: a Frame per batch naming its slot.
    from remote_loader.client.transports import StreamEnds

    real = StreamEnds.offer

    def offer(self: StreamEnds, request: Any) -> None:
        real(self, request)
        request.MergeFromString(b"\x60\x01")  # field 12, varint: board = true
        assert b"\x60\x01" in request.SerializeToString()  # kept as an unknown field

    monkeypatch.setattr(StreamEnds, "offer", offer)
    sizes = [200_000] * 8
    served = serve_loaders(sizes_spec(sizes, broadcast_window=3))
    got = run_concurrently(*(broadcast(served.address, r, 2, device="cpu") for r in range(2)))
    for received in got:
        assert_same(received, expected(sizes))
    assert sorted(slot_frames) == sorted(list(range(len(sizes))) * 2)


def test_a_slot_rewritten_under_the_copy_is_resumed_not_delivered(
    serve_loaders: ServeLoaders, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes = [200_000] * 12
    served = serve_loaders(sizes_spec(sizes))
    real = slots.check_generation
    checks = [0]

    def rewritten_once(slot: memoryview, generation: int) -> None:
        checks[0] += 1
        if checks[0] == 10:  # the check after batch 4's copy: as if its worker wrote there
            raise slots.StaleSlot("the slot was rewritten (simulated)")
        real(slot, generation)

    monkeypatch.setattr(slots, "check_generation", rewritten_once)
    with RemoteLoader(served.address, device="cpu", retries=2) as loader:
        assert_same(list(loader), expected(sizes))  # every batch once, in order, none torn
        assert loader.last_transport == "shm"
    assert checks[0] > 10


def test_a_slot_the_client_cannot_open_falls_back_without_losing_a_batch(
    serve_loaders: ServeLoaders, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes = [200_000] * 10
    served = serve_loaders(sizes_spec(sizes))
    real = slots.SlotMaps._open
    opened = [0]

    def refuse_after_the_first(*args: Any) -> Any:
        opened[0] += 1
        if opened[0] > 1:  # e.g. the server's descriptors went with a restarted server
            raise slots.SlotUnavailable("cannot open the server's slot: Permission denied")
        return real(*args)

    monkeypatch.setattr(slots.SlotMaps, "_open", staticmethod(refuse_after_the_first))
    with RemoteLoader(served.address, device="cpu") as loader:
        received = list(loader)
        assert loader.last_transport == "tcp"  # the next transport "auto" tries
    assert_same(received, expected(sizes))


@pytest.mark.timeout(120)
def test_a_client_in_another_pid_namespace_gets_the_ring(serve_loaders: ServeLoaders) -> None:
    # A container that shares /dev/shm but not the pid namespace: the server cannot find the
    # probe under the client's pid, so it copies into a ring the client can open.
    unshare = shutil.which("unshare")
    assert unshare is not None and os.geteuid() == 0, "needs root and util-linux's unshare"
    sizes = [300_000] * 6
    served = serve_loaders(sizes_spec(sizes))
    script = (
        "import json, sys\n"
        "from remote_loader.client import RemoteLoader\n"
        "with RemoteLoader(sys.argv[1], device='cpu') as loader:\n"
        "    sums = [int(b.sum()) for b in loader]\n"
        "    print(json.dumps([sums, loader.last_transport, len(loader._slot_maps._maps)]))\n"
    )
    out = subprocess.run(
        [unshare, "--pid", "--fork", "--mount-proc", sys.executable, "-c", script, served.address],
        capture_output=True,
        text=True,
        timeout=100,
        env=subprocess_env(),
        check=True,
    ).stdout
    sums, transport, mapped = json.loads(out.strip().splitlines()[-1])
    assert sums == [int(t.sum()) for t in expected(sizes)]
    assert transport == "shm" and mapped == 0  # through the ring: no slot was mapped


@pytest.mark.parametrize("sharing", ["partition", "broadcast"])
def test_slots_go_back_to_the_workers_when_a_client_stops_mid_epoch(
    serve_loaders: ServeLoaders, sharing: Sharing
) -> None:
    # A client that leaves with batches leased (broadcast too, whose Run keeps its window for
    # the other consumers): the stream's end gives them back to the persistent pool, which
    # would otherwise make new slots for every client.
    sizes = [400_000] * 40
    served = serve_loaders(
        sizes_spec(
            sizes, num_workers=1, prefetch_factor=2, persistent_workers=True, broadcast_window=2
        )
    )
    for _ in range(6):
        with RemoteLoader(served.address, device="cpu", prefetch=1, sharing=sharing) as loader:
            it = iter(loader)
            for _ in range(3):
                next(it)
    with RemoteLoader(served.address, device="cpu") as loader:
        assert_same(list(loader), expected(sizes))
    pool: Any = served.hosts["sizes"].persistent_pool
    # At most its tasks in flight (2), a stream's leases (4) and the lane's window of batches.
    assert len(pool._slots._views) <= 8, len(pool._slots._views)
