"""Reaching the server (NOTE [ Waiting for the server ] in client/connect.py): a server that dies
and stays down, no server at all, a full server, addresses without a port, the job's name."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from typing import Any, TypedDict

import pytest

from remote_loader.client import (
    ConnectionLostError,
    RemoteLoader,
    ServerBusyError,
    ServerError,
    connect,
)
from remote_loader.client.types import Transport
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.sharing.membership import DEFAULT_JOB
from tests.helpers import (
    SLOW,
    SLOW_SAMPLES,
    SQUARES,
    ServeLoaders,
    StartServer,
    assert_same,
    free_port,
    log_fields,
    log_lines,
    serve_process,
    stop_process,
    wait_until,
)

# How much later than its bound a wait may end on this loaded machine and still count as
# bounded: the tests are for "it ends", not for its speed (pytest-timeout catches a hang).
MARGIN = 20.0


class Policy(TypedDict):
    """A RemoteLoader's retry policy, as its keyword arguments."""

    retries: int
    backoff: float
    connect_timeout: float


# --- a server that dies and stays down -------------------------------------------------------


def _kill(proc: Any) -> None:
    """SIGKILL the server: no goodbye to its clients."""
    proc.kill()
    proc.wait(timeout=10)
    # Not communicate(): the dead server's workers may hold its pipes until their watchdog
    # sees it gone.
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _until_error(it: Any) -> tuple[Exception, float]:
    """Reads `it` until it raises; the error and the seconds it took."""
    started = time.monotonic()
    with pytest.raises(ConnectionLostError) as info:
        while True:
            next(it)
    return info.value, time.monotonic() - started


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_a_server_killed_mid_epoch_ends_in_connection_lost_within_the_bound(
    transport: Transport,
) -> None:
    proc, address = serve_process(
        "--dataset",
        SLOW_SAMPLES["dataset"],
        "--dataset-kwargs",
        json.dumps(SLOW_SAMPLES["dataset_kwargs"]),
        "--batch-size",
        "2",
        "--num-workers",
        "2",
    )
    policy: Policy = {"retries": 2, "backoff": 0.2, "connect_timeout": 1.0}
    try:
        with RemoteLoader(address, device="cpu", transport=transport, prefetch=1, **policy) as rl:
            it = iter(rl)
            for _ in range(3):
                next(it)
            _kill(proc)
            # Each retry waits its backoff and up to connect_timeout for the connection.
            error, seconds = _until_error(it)
            assert "broke 3 times in a row" in str(error) and "retries=2" in str(error)
            assert seconds < connect.stream_bound(**policy) + MARGIN, seconds
            # A new epoch's first stream waits with a deadline too (that was the hang as well).
            error, seconds = _until_error(iter(rl))
            bound = connect.stream_bound(**policy) + policy["connect_timeout"]
            assert seconds < bound + MARGIN, seconds
    finally:
        if proc.poll() is None:
            stop_process(proc)


# --- no server at all ------------------------------------------------------------------------


def test_no_server_fails_after_the_backoff_not_connect_timeout() -> None:
    # Refused at once, every attempt: the retries' backoff is all it costs, not a whole
    # connect_timeout (60 s here) per attempt.
    policy: Policy = {"retries": 3, "backoff": 0.2, "connect_timeout": 60.0}
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(ConnectionLostError, match=r"cannot reach .* \(4 attempts in .*refused"):
        RemoteLoader(address, **policy)
    seconds = time.monotonic() - started
    backoff = connect.backoff_total(policy["backoff"], policy["retries"])
    assert backoff <= seconds < backoff + MARGIN, seconds


@pytest.mark.timeout(90)
def test_a_stopped_server_costs_at_most_connect_timeout_per_attempt() -> None:
    # SIGSTOP: the kernel still takes the connection, nothing answers on it.
    proc, address = serve_process("--dataset", "tests.datasets:Squares", "--batch-size", "4")
    policy: Policy = {"retries": 2, "backoff": 0.2, "connect_timeout": 2.0}
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(ConnectionLostError, match=address):
            RemoteLoader(address, **policy)
        seconds = time.monotonic() - started
        assert seconds < connect.first_connect_bound(**policy) + MARGIN, seconds
    finally:
        # Killed, not stopped: after SIGSTOP and SIGCONT the server does not always exit on
        # SIGTERM (a server matter, not this test's).
        os.kill(proc.pid, signal.SIGCONT)
        _kill(proc)


# --- a full server ---------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_full_server_is_retried_until_a_stream_ends(serve_loaders: ServeLoaders) -> None:
    served = serve_loaders(SLOW, SQUARES, max_streams=1)
    with RemoteLoader(served.address, "slow") as first:
        running = iter(first)
        assert next(running) == 0  # the one stream allowed is running (and stays open)
        # Full through every retry: ServerBusyError, saying so.
        with (
            RemoteLoader(served.address, "squares", retries=1, backoff=0.05) as busy,
            pytest.raises(ServerBusyError, match=r"stayed full through 2 attempts"),
        ):
            next(iter(busy))
        waiting = RemoteLoader(served.address, "squares", retries=8, backoff=0.1)
        it = iter(waiting)
        # The stream opens at the first next() (NOTE [ An iterator's epoch ]): ask for it
        # in a thread, which waits through the refusals.
        head: list[Any] = []
        asking = threading.Thread(target=lambda: head.append(next(it)), daemon=True)
        asking.start()
        assert wait_until(lambda: waiting.stats().reconnects >= 2, 60)  # refused, and retrying
    # The first stream has ended: the waiting one gets its place and every batch.
    with waiting:
        asking.join(timeout=60)
        assert not asking.is_alive()
        got = head + list(it)
        assert waiting.stats().reconnects >= 2
    with RemoteLoader(served.address, "squares") as again:
        expected = list(again)
    assert_same(got, expected)


def test_a_request_too_large_is_not_retried(serve_loaders: ServeLoaders) -> None:
    # RESOURCE_EXHAUSTED too, but no retry can help it: raised at once, not after 60 s of
    # backoff.
    small = serve_loaders(SQUARES, max_request_bytes=2048)
    started = time.monotonic()
    with pytest.raises(ServerError, match="larger than max") as info:
        RemoteLoader(small.address, job="j" * 4000, retries=2, backoff=30.0)
    assert not isinstance(info.value, ServerBusyError)
    assert time.monotonic() - started < 30.0


# --- addresses -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("localhost", r"'localhost' has no port: expected host:port, e\.g\. 'localhost:50051'"),
        ("10.0.0.1", r"'10\.0\.0\.1' has no port: expected host:port, e\.g\. '10\.0\.0\.1:50051'"),
        ("[::1]", r"has no port: expected host:port, e\.g\. '\[::1\]:50051'"),
        ("::1", r"IPv6 address goes in brackets, followed by its port: '\[::1\]:50051'"),
        ("[::1", r"an IPv6 address is written \[address\]:port"),
        ("localhost:", r"port must be a number from 1 to 65535, got ''"),
        ("localhost:http", r"port must be a number from 1 to 65535, got 'http'"),
        ("localhost:0", r"port must be a number from 1 to 65535, got '0'"),
        ("localhost:65536", r"port must be a number from 1 to 65535"),
        (":50051", r"names no host: expected host:port, e\.g\. 'localhost:50051'"),
        ("dns:///localhost", r"'dns:///localhost' has no port"),
        ("ipv4:10.0.0.1:50051,10.0.0.2", r"has no port: expected host:port, e\.g\. '10\.0\.0\.2"),
    ],
)
def test_an_address_without_a_port_is_refused_at_once(address: str, message: str) -> None:
    # gRPC would take these and quietly dial port 443 (or fail after connect_timeout).
    started = time.monotonic()
    with pytest.raises(ValueError, match=message):
        RemoteLoader(address, connect_timeout=60.0)
    assert time.monotonic() - started < 30.0


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1:{port}",
        "localhost:{port}",
        "[::1]:{port}",
        "dns:///127.0.0.1:{port}",
        "ipv4:127.0.0.1:{port}",
        "ipv6:[::1]:{port}",
        "unix:/nonexistent/remote-loader.sock",
    ],
)
def test_addresses_with_a_port_or_a_socket_are_dialled(address: str) -> None:
    # Nothing listens there: the connection is refused, not the address.
    with pytest.raises(ConnectionLostError, match="cannot reach"):
        RemoteLoader(address.format(port=free_port()), retries=0)


def test_an_address_reaches_its_server(start_server: StartServer) -> None:
    port = start_server(SQUARES).rsplit(":", 1)[1]
    for address in (f"localhost:{port}", f"dns:///127.0.0.1:{port}", f"ipv4:127.0.0.1:{port}"):
        with RemoteLoader(address) as loader:
            assert len(list(loader)) == 13


# --- the job's name --------------------------------------------------------------------------


def test_state_dict_names_the_job_as_the_server_does(
    serve_loaders: ServeLoaders, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="remote_loader.server.api.stream")
    spec = LoaderSpec(name="squares", dataset="tests.datasets:Squares", batch_size=4, seed=1)
    served = serve_loaders(spec)
    with RemoteLoader(served.address) as loader:
        expected = list(loader)
    with RemoteLoader(served.address) as loader:
        it = iter(loader)
        before = [next(it) for _ in range(5)]
        state = loader.state_dict()
    starts = [log_fields(line) for line in log_lines(caplog, "stream start ", 2)]
    assert [start["job"] for start in starts] == [DEFAULT_JOB, DEFAULT_JOB]
    assert state["job"] == DEFAULT_JOB
    # A state saved when the client said "" for it resumes the same job.
    old = {**json.loads(json.dumps(state)), "job": ""}
    for saved in (old, RemoteLoader.job_state([old])):
        with RemoteLoader(served.address) as loader:
            loader.load_state_dict(saved)
            assert_same(before + list(loader), expected)
    # A job named "" is the default job too; another name is another job.
    with RemoteLoader(served.address, job="") as loader:
        loader.load_state_dict(state)
    with (
        RemoteLoader(served.address, job="other") as loader,
        pytest.raises(ValueError, match="another consumer"),
    ):
        loader.load_state_dict(old)
