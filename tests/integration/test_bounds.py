"""No wait without a bound, on every transport.

- A server that stops writing mid-epoch (a sample that never finishes) ends the client's wait
  with LoaderTimeoutError after the loader's `timeout`, naming the batch, and the loader closes
  at once.
- A client that stops reading for good (a process frozen mid-epoch, so its ring, data connection
  or gRPC window fills and the server waits for room) is let go by the server after
  `keepalive_time_ms + keepalive_timeout_ms`: the stream ends, its ring and Run are freed. Over
  shm and tcp the client's heartbeat says it is alive (NOTE [ Ring space ] in protos/shm.py,
  NOTE [ TCP data connection ] in protos/tcp.py); over gRPC, keepalive pings do.
- A client whose training loop merely pauses, longer than that, keeps its stream.
- A stalled broadcast consumer is detached after `detach_timeout`
  (tests/integration/test_sharing.py).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from remote_loader.client import LoaderTimeoutError, RemoteLoader
from remote_loader.client.types import Transport
from remote_loader.server.config.spec import LoaderSpec
from tests.helpers import Served, ServeLoaders, StartServer, rings, subprocess_env, wait_until

TRANSPORTS = [("auto", "shm"), ("tcp", "tcp"), ("grpc", "grpc")]
# A ceiling for work that takes milliseconds on a quiet machine and seconds on a busy one.
BUSY_MACHINE = 30.0


@pytest.mark.parametrize(("transport", "way"), TRANSPORTS)
def test_a_server_that_stops_writing_ends_in_the_clients_timeout(
    start_server: StartServer, transport: Transport, way: str
) -> None:
    # Batch 4 takes an hour: the stream is up (ring mapped, data connection open) and silent.
    address = start_server(
        LoaderSpec(
            name="sleepy",
            dataset="tests.datasets:Sleepy",
            dataset_kwargs={"n": 10, "bad": 4, "seconds": 3600.0},
            num_workers=1,
        )
    )
    timeout = 1.0
    loader = RemoteLoader(address, transport=transport, timeout=timeout, retries=0)
    try:
        it = iter(loader)
        assert [int(next(it)) for _ in range(4)] == [0, 1, 2, 3]
        assert loader.last_transport == way
        waited = time.monotonic()
        with pytest.raises(LoaderTimeoutError, match=r"after 1\.0 seconds waiting for batch 4"):
            next(it)
        assert timeout <= time.monotonic() - waited < timeout + BUSY_MACHINE
    finally:
        closing = time.monotonic()
        loader.close()
        assert time.monotonic() - closing < BUSY_MACHINE  # the stream is cancelled, not drained


def serve_blobs(serve_loaders: ServeLoaders, n: int) -> Served:
    """`n` batches of 1 MB (the ring, the socket buffers or gRPC's window fill in a few), from
    a server whose keepalive lets a silent client go after 0.5 + 1 s."""
    return serve_loaders(
        LoaderSpec(
            name="blobs",
            dataset="tests.datasets:Blobs",
            dataset_kwargs={"n": n, "nbytes": 1 << 20},
            num_workers=1,
        ),
        keepalive_time_ms=500,
        keepalive_timeout_ms=1000,
    )


FROZEN_CLIENT = textwrap.dedent(
    """
    import sys
    from remote_loader.client import RemoteLoader

    loader = RemoteLoader(sys.argv[1], transport=sys.argv[2], device="cpu", retries=0)
    it = iter(loader)
    next(it)
    print(loader.last_transport, flush=True)
    sys.stdin.read()  # the test freezes this process now, and kills it at the end
    """
)


# Over shm and tcp the server bounds the wait itself (the client's heartbeat); over the gRPC
# transport gRPC's keepalive does, once every ping times out as the keepalive's does (NOTE
# [ Ping timeout ] in protos/wire.py: before, 1 run in 3 waited out a 60 s BDP ping first).
@pytest.mark.parametrize(("transport", "way"), TRANSPORTS)
def test_a_frozen_client_is_let_go_after_the_keepalive(
    serve_loaders: ServeLoaders, transport: Transport, way: str
) -> None:
    # 1 MB batches: the ring (4 of them), the socket buffers or gRPC's window fill quickly.
    served = serve_blobs(serve_loaders, 400)
    rings_before = rings()
    client = subprocess.Popen(
        [sys.executable, "-c", FROZEN_CLIENT, served.address, transport],
        env=subprocess_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert client.stdout is not None
        assert client.stdout.readline().strip() == way
        host = served.hosts["blobs"]
        assert host.runs.active(), "the stream's Run is producing"
        client.send_signal(signal.SIGSTOP)  # alive, connected, and reading nothing more
        # Frozen, it neither beats nor answers pings: after keepalive_time + keepalive_timeout
        # (1.5 s) the server ends the stream where it waits.
        assert served.server.service.wait_streams(BUSY_MACHINE), "the stream still runs"
        assert wait_until(lambda: not host.runs.active(), BUSY_MACHINE), "the Run still runs"
        assert wait_until(lambda: not rings() - rings_before, BUSY_MACHINE)
    finally:
        client.kill()
        client.communicate(timeout=BUSY_MACHINE)  # reaps it and closes the pipes


@pytest.mark.parametrize(("transport", "way"), TRANSPORTS)
def test_a_training_loop_that_pauses_longer_than_the_keepalive_keeps_its_stream(
    serve_loaders: ServeLoaders, transport: Transport, way: str
) -> None:
    served = serve_blobs(serve_loaders, 24)
    with RemoteLoader(served.address, transport=transport, device="cpu", retries=0) as loader:
        it = iter(loader)
        first = next(it)
        assert loader.last_transport == way
        time.sleep(4.0)  # an evaluation pass, say: the server waits for room meanwhile
        rest = list(it)
        assert loader.last_transport == way
    assert [b["index"].item() for b in [first, *rest]] == list(range(24))
