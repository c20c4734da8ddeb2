"""The same-host shared-memory transport (NOTE [ Shared-memory transport ] in protos/shm.py) on
real servers: the negotiation, fallbacks to gRPC Frames (a batch too big, no room in /dev/shm, a
ring the client cannot open), and release of the shared memory when either side goes away.

The unit tests (no server, no process, no Ray): tests/unit/test_shm.py.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from remote_loader.client import RemoteLoader
from remote_loader.client.types import Transport
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import shm, shm_probe, striping
from remote_loader.server.config.spec import LoaderSpec
from tests.helpers import (
    ServeLoaders,
    assert_same,
    copiers,
    expected,
    raw_stream,
    rings,
    serve_sizes,
    sizes_spec,
    stop_process,
    subprocess_env,
    wait_until,
)

# No ring or bell is left in /dev/shm after a test.
pytestmark = pytest.mark.usefixtures("no_ring_left_behind")


def mapped_rings(pid: int) -> list[str]:
    """The rings process `pid` still maps (named or unlinked)."""
    with open(f"/proc/{pid}/maps") as f:
        return [line for line in f if shm.RING_PREFIX in line]


# --- over a real server --------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_same_host_streams_go_through_shared_memory(
    serve_loaders: ServeLoaders, num_workers: int
) -> None:
    sizes = [300_000] * 12
    served = serve_loaders(sizes_spec(sizes, num_workers))
    ways: tuple[tuple[Transport, str], ...] = (("auto", "shm"), ("grpc", "grpc"))
    for transport, way in ways:
        with RemoteLoader(served.address, transport=transport) as loader:
            assert loader.last_transport is None
            assert_same(list(loader), expected(sizes))
            assert loader.last_transport == way
            assert loader.stats().transport == way
    assert not mapped_rings(os.getpid())  # both ends let go of every ring


def test_rings_grow_with_the_batches_and_huge_batches_go_as_frames(
    serve_loaders: ServeLoaders,
) -> None:
    # 1 KB batches make a 4 KiB ring; 100 KB needs a new one; 3 MB passes max_ring_bytes.
    sizes = [1000, 1000, 1000, 100_000, 1000, 3_000_000, 1000, 100_000]
    served = serve_loaders(sizes_spec(sizes), max_ring_bytes=1 << 20, zero_copy=False)
    with RemoteLoader(served.address) as loader:
        received = []
        transports = []
        for batch in loader:
            received.append(batch)
            transports.append(loader.last_transport)
    assert_same(received, expected(sizes))
    assert transports[5] == "grpc"
    assert transports[:5] == ["shm"] * 5 and transports[6:] == ["shm"] * 2


def test_last_transport_is_the_handed_out_batchs_not_the_receivers_latest(
    serve_loaders: ServeLoaders,
) -> None:
    # The receiver runs ahead of a slow training loop: while the loop holds batch 0 (from the
    # ring), batch 1 (over the ring's limit) may already have arrived as frames.
    sizes = [1000, 3_000_000, 1000]
    served = serve_loaders(sizes_spec(sizes), max_ring_bytes=1 << 20, zero_copy=False)
    with RemoteLoader(served.address, device="cpu") as loader:
        transports = []
        for _ in loader:
            time.sleep(0.5)  # a training step: the receiver fetches what comes next meanwhile
            transports.append((loader.last_transport, loader.stats().transport))
    assert transports == [("shm", "shm"), ("grpc", "grpc"), ("shm", "shm")]


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("zero_copy", [False, True])
def test_batches_that_grow_every_time_all_arrive_over_shared_memory(
    serve_loaders: ServeLoaders, num_workers: int, zero_copy: bool
) -> None:
    # Issue 13's reproduction: each batch twice the last (padded NLP batches, curricula).
    sizes = [1000 << k for k in range(8)]
    served = serve_loaders(sizes_spec(sizes, num_workers), zero_copy=zero_copy)
    with RemoteLoader(served.address, timeout=20, device="cpu") as loader:
        received = list(loader)
        assert loader.last_transport == "shm"
    assert_same(received, expected(sizes))


@pytest.mark.parametrize("zero_copy", [False, True])
def test_a_batch_sampler_whose_batches_grow_arrives_whole_over_shared_memory(
    serve_loaders: ServeLoaders, zero_copy: bool
) -> None:
    # Batches of 1, 2, 3, ... samples: the shape of a bucketing or curriculum batch sampler.
    served = serve_loaders(
        LoaderSpec(
            name="growing",
            dataset="tests.datasets:Sizes",
            dataset_kwargs={"sizes": [4000] * 36},
            batch_sampler="tests.datasets:GrowingBatches",
            num_workers=2,
        ),
        zero_copy=zero_copy,
    )
    with RemoteLoader(served.address, timeout=20, device="cpu") as loader:
        received = list(loader)
        assert loader.last_transport == "shm"
    assert [len(b) for b in received] == list(range(1, 9))
    # Sample i is 4000 bytes of i % 256: every sample of the epoch arrived, once.
    firsts = sorted(int(row[0]) for batch in received for row in batch)
    assert firsts == list(range(36))
    assert all(bool((row == row[0]).all()) for batch in received for row in batch)


@pytest.mark.parametrize("zero_copy", [False, True])
def test_batches_copied_in_by_several_threads_arrive_whole(
    serve_loaders: ServeLoaders, copy_threads: None, zero_copy: bool
) -> None:
    sizes = [2 * striping.MIN_STRIPE + 1000 * i for i in range(6)]  # two stripes each
    served = serve_loaders(sizes_spec(sizes), zero_copy=zero_copy)
    with RemoteLoader(served.address, timeout=20, device="cpu") as loader:
        received = list(loader)
        assert loader.last_transport == "shm"
    assert_same(received, expected(sizes))
    assert copiers()


def test_no_room_for_a_ring_falls_back_to_grpc(
    serve_loaders: ServeLoaders, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes = [200_000] * 6
    served = serve_loaders(sizes_spec(sizes))

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)  # the server's /dev/shm is full
    with RemoteLoader(served.address) as loader:
        assert_same(list(loader), expected(sizes))
        assert loader.last_transport == "grpc"


def test_a_ring_the_client_cannot_open_falls_back_without_losing_a_batch(
    serve_loaders: ServeLoaders, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes = [200_000] * 10
    served = serve_loaders(sizes_spec(sizes), zero_copy=False)
    real = shm.RingReader.__init__
    opened = []

    def refuse_after_the_first(self: shm.RingReader, name: str, capacity: int) -> None:
        opened.append(name)
        if len(opened) > 1:  # e.g. a server running as another user
            raise shm.ShmUnavailable(f"cannot open the server's ring {name}: Permission denied")
        real(self, name, capacity)

    monkeypatch.setattr(shm.RingReader, "__init__", refuse_after_the_first)
    with RemoteLoader(served.address) as loader:
        it = iter(loader)
        first = [next(it) for _ in range(3)]
        assert loader.last_transport == "shm"
    with RemoteLoader(served.address) as loader:  # its first ring is refused: from batch 0 on
        rest = list(loader)  # the data connection, the next transport "auto" tries
        assert loader.last_transport == "tcp"
    assert_same(first, expected(sizes)[:3])
    assert_same(rest, expected(sizes))


def offer() -> tuple[shm_probe.Probe, pb.StreamRequest]:
    probe = shm_probe.Probe()
    request = pb.StreamRequest(shm=pb.ShmOffer(probe=probe.name, nonce=probe.nonce))
    return probe, request


def first_ring_frame(address: str, request: pb.StreamRequest) -> tuple[Any, pb.Frame]:
    """Starts a raw Stream call and reads until its first batch frame, which names a ring."""
    channel, call = raw_stream(address, request)
    frame: pb.Frame = next(iter(call))
    assert frame.HasField("shm"), frame
    return (channel, call), frame


def test_a_client_that_never_opens_its_ring_leaves_nothing_behind(
    serve_loaders: ServeLoaders,
) -> None:
    served = serve_loaders(sizes_spec([400_000] * 40))
    probe, request = offer()
    (channel, call), frame = first_ring_frame(served.address, request)
    assert frame.shm.ring in rings()
    assert len(mapped_rings(os.getpid())) == 1  # the server's mapping (it runs in here)
    call.cancel()  # the client goes away without ever opening the ring
    channel.close()
    assert wait_until(lambda: frame.shm.ring not in rings(), 2.0)
    assert wait_until(lambda: not mapped_rings(os.getpid()), 2.0)
    assert not os.path.exists(os.path.join(shm.SHM_DIR, probe.name))


@pytest.mark.timeout(60)
def test_a_killed_server_leaves_no_ring_behind() -> None:
    proc, address = serve_sizes([400_000] * 8, 1)
    try:
        _, request = offer()
        (channel, _call), frame = first_ring_frame(address, request)
        assert frame.shm.ring in rings()  # named, and nobody but the server has opened it
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=10)
        channel.close()
        # The server's resource tracker outlives it and unlinks the name.
        assert wait_until(lambda: frame.shm.ring not in rings(), 15.0), rings()
    finally:
        if proc.poll() is None:
            stop_process(proc)


@pytest.mark.parametrize("zero_copy", [False, True])
def test_a_killed_client_frees_its_ring_on_the_server(
    serve_loaders: ServeLoaders, zero_copy: bool
) -> None:
    # Zero-copy, the ring is the stream's control ring, and its slot leases end with it.
    served = serve_loaders(sizes_spec([400_000] * 200), zero_copy=zero_copy)
    script = (
        "import sys\n"
        "from remote_loader.client import RemoteLoader\n"
        "loader = RemoteLoader(sys.argv[1], prefetch=1)\n"
        "for i, batch in enumerate(loader):\n"
        "    print(loader.last_transport, flush=True)\n"
        "    if i == 2:\n"
        "        import time; time.sleep(60)\n"
    )
    client = subprocess.Popen(
        [sys.executable, "-c", script, served.address],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    assert client.stdout is not None
    assert [client.stdout.readline().strip() for _ in range(3)] == ["shm"] * 3
    assert wait_until(lambda: len(mapped_rings(os.getpid())) == 1, 2.0)
    client.kill()
    client.communicate()
    assert wait_until(lambda: not mapped_rings(os.getpid()), 3.0), mapped_rings(os.getpid())


def test_max_ring_bytes_0_turns_shared_memory_off(serve_loaders: ServeLoaders) -> None:
    sizes = [1000] * 4
    served = serve_loaders(sizes_spec(sizes, 0), max_ring_bytes=0)
    with RemoteLoader(served.address) as loader:
        assert_same(list(loader), expected(sizes))
        assert loader.last_transport == "tcp"  # the next transport "auto" tries


def test_a_whole_epoch_in_the_ring_still_reaches_a_late_reader(serve_loaders: ServeLoaders) -> None:
    # Every batch fits the ring at once: the server is done before the client has read the first
    # frame, and must not take the ring's name away before the client has opened it.
    sizes = [100_000] * 3
    served = serve_loaders(sizes_spec(sizes, 0))
    for _ in range(5):
        with RemoteLoader(served.address, prefetch=1) as loader:
            it = iter(loader)
            # The server has placed and sent everything: its stream is over.
            assert served.server.service.wait_streams(10)
            received = list(it)
            assert loader.last_transport == "shm"
        assert_same(received, expected(sizes))


@pytest.mark.timeout(60)
def test_serve_max_ring_bytes_0_streams_without_shared_memory() -> None:
    proc, address = serve_sizes([1000, 1000], 0, "--max-ring-bytes", "0")
    try:
        with RemoteLoader(address) as loader:
            assert_same(list(loader), expected([1000, 1000]))
            assert loader.last_transport == "tcp"  # the next transport "auto" tries
    finally:
        code, err = stop_process(proc)
    assert code == 0, err
