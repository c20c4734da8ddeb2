"""Failures: dead workers under load, vanished clients, a killed or stopped server.

Every test here is bounded well under 30 s; see NOTE [ Worker Failures ] in server/engine/ledger.py.
What every pool backend promises (a poison sample given up, a stuck batch timed out, a death
costing nothing) runs for the local and the Ray pool in tests/integration/test_pool_contract.py.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from grpc_health.v1 import health_pb2

from remote_loader.client import ConnectionLostError, RemoteLoader, RequestError
from remote_loader.server.config.spec import LoaderSpec
from tests.helpers import (
    ServeLoaders,
    descendants,
    health_status,
    persistent_pool,
    process_alive,
    serve_process,
    subprocess_env,
    wait_until,
)


def slow(name: str = "slow", n: int = 40, seconds: float = 0.004, **options: Any) -> LoaderSpec:
    values: dict[str, Any] = {
        "name": name,
        "dataset": "tests.datasets:Slow",
        "dataset_kwargs": {"n": n, "seconds": seconds},
        "batch_size": 2,
        "num_workers": 2,
        "persistent_workers": True,
    }
    values.update(options)
    return LoaderSpec(**values)


def values(batches: Any) -> list[int]:
    return [int(v) for batch in batches for v in batch]


@pytest.mark.timeout(30)
def test_killed_workers_are_replaced_and_nothing_is_lost(serve_loaders: ServeLoaders) -> None:
    served = serve_loaders(slow())
    pool = persistent_pool(served, "slow")
    rng = random.Random(0)
    kills = 0
    with RemoteLoader(served.address) as loader:
        for _ in range(20):
            got: list[int] = []
            kill_at = rng.randrange(0, 20)
            for i, batch in enumerate(loader):
                got.extend(int(v) for v in batch)
                if i == kill_at:
                    os.kill(rng.choice(pool.pids), signal.SIGKILL)
                    kills += 1
            assert got == list(range(40))  # every batch once, in order, no error
        # A death after the epoch's last task is noticed when the next epoch polls.
        assert values(loader) == list(range(40))
    assert served.hosts["slow"].persistent_pool is pool  # the same pool, its workers replaced
    assert pool.restarts == kills == 20


CLIENT = """
import sys
from remote_loader.client import RemoteLoader
with RemoteLoader(sys.argv[1], prefetch=1) as loader:
    for i, batch in enumerate(loader):
        print(i, flush=True)
"""


@pytest.mark.timeout(30)
def test_a_killed_client_frees_the_server_within_two_seconds(
    serve_loaders: ServeLoaders,
) -> None:
    served = serve_loaders(slow(n=400, seconds=0.01))
    host = served.hosts["slow"]
    pool = persistent_pool(served, "slow")
    env = subprocess_env()

    def client() -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", CLIENT, served.address],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    warm = client()  # a whole epoch first: the server's threads are all started after it
    warm.communicate(timeout=20)
    assert wait_until(lambda: not host.runs.active(), 2)
    baseline = threading.active_count()
    victim = client()
    assert victim.stdout is not None
    for _ in range(3):
        victim.stdout.readline()
    # Mid-epoch (the pool may have made all the lane lets it ahead of a slow client).
    assert host.runs.active()
    victim.kill()
    victim.communicate()
    killed = time.monotonic()
    assert wait_until(
        lambda: (
            not host.runs.active()
            and pool.outstanding == 0
            and threading.active_count() <= baseline
        ),
        2.0,
    ), (host.runs.active(), pool.outstanding, threading.active_count(), baseline)
    assert time.monotonic() - killed < 2.0
    # The workers skip what was queued for that epoch, and serve the next client at once.
    with RemoteLoader(served.address) as loader:
        assert values(loader) == list(range(400))


SLOW_FLAGS = [
    "--dataset",
    "tests.datasets:Slow",
    "--dataset-kwargs",
    '{"n": 100, "seconds": 0.05}',
    "--batch-size",
    "2",
    "--num-workers",
    "2",
    "--persistent-workers",
]


@pytest.mark.timeout(30)
def test_killed_server_leaves_no_worker_and_no_shared_memory() -> None:
    shm_before = set(os.listdir("/dev/shm"))
    proc, address = serve_process(*SLOW_FLAGS)
    with RemoteLoader(address, retries=0) as loader:
        it = iter(loader)
        next(it)  # the workers hold shared-memory slots now
        family = descendants(proc.pid)
        assert len(family) >= 3  # the fork server and two workers (and a resource tracker)
        proc.kill()
        proc.communicate()
        started = time.monotonic()
        assert wait_until(lambda: not any(process_alive(p) for p in family), 10.0)
        gone_after = time.monotonic() - started
    assert gone_after < 10.0
    # Nothing of the server's is left: its tensors never had names there, and the named
    # semaphores of its queues are unlinked by its resource tracker once it is gone. (Entries
    # of this process may disappear meanwhile: they are not the server's.)
    assert wait_until(lambda: not set(os.listdir("/dev/shm")) - shm_before, 10.0), (
        set(os.listdir("/dev/shm")) - shm_before
    )


# Generous ceilings, not timings: on a busy 2-core machine a signal, a health check or a
# process exit may each take seconds; what these tests check is the order of events.
BUSY_MACHINE = 30.0


@pytest.mark.timeout(180)
def test_sigterm_drains_then_exits_zero() -> None:
    grace = 120.0  # never reached: the running stream is held, then let go, by the test
    proc, address = serve_process(*SLOW_FLAGS, "--grace", str(grace))
    assert health_status(address) == health_pb2.HealthCheckResponse.SERVING
    got: list[int] = []
    errors: list[BaseException] = []
    reading, release = threading.Event(), threading.Event()

    def consume() -> None:
        try:
            with RemoteLoader(address, retries=0) as loader:
                for batch in loader:
                    got.extend(int(v) for v in batch)
                    reading.set()
                    release.wait(BUSY_MACHINE * 2)  # mid-epoch until the test lets go
        except BaseException as exc:
            errors.append(exc)

    running = threading.Thread(target=consume)
    running.start()
    try:
        assert reading.wait(BUSY_MACHINE)
        proc.send_signal(signal.SIGTERM)
        # Draining: health turns NOT_SERVING and new work is refused while the stream runs.
        assert wait_until(
            lambda: health_status(address) == health_pb2.HealthCheckResponse.NOT_SERVING,
            BUSY_MACHINE,
        )
        with pytest.raises(ConnectionLostError, match="shutting down"):
            RemoteLoader(address, retries=0)
        assert running.is_alive() and len(got) < 100
    finally:
        release.set()
    running.join(timeout=BUSY_MACHINE * 2)
    assert not errors and got == list(range(100))  # the running stream finished whole
    ended = time.monotonic()
    _, err = proc.communicate(timeout=BUSY_MACHINE)
    assert proc.returncode == 0, err
    # It exits once its streams are done, not at the end of the grace period.
    assert time.monotonic() - ended < BUSY_MACHINE < grace


@pytest.mark.timeout(120)
def test_sigterm_cancels_streams_that_outlast_the_grace() -> None:
    grace = 1.0
    flags = [*SLOW_FLAGS, "--grace", str(grace)]
    # 100 samples of 0.5 s on 2 workers: 25 s of batches, far beyond the grace.
    flags[flags.index("--dataset-kwargs") + 1] = '{"n": 100, "seconds": 0.5}'
    proc, address = serve_process(*flags)
    with RemoteLoader(address, retries=0) as loader:
        it = iter(loader)
        next(it)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        with pytest.raises(ConnectionLostError):
            for _ in it:
                pass
    _, err = proc.communicate(timeout=BUSY_MACHINE)
    assert proc.returncode == 0, err
    # Cancelled after the grace, not served to its end (which takes 25 s).
    assert time.monotonic() - signalled < min(BUSY_MACHINE, 20)


@pytest.mark.timeout(300)
def test_fifty_respawns_under_running_streams_do_not_deadlock(
    serve_loaders: ServeLoaders,
) -> None:
    served = serve_loaders(slow(n=200, seconds=0.002))
    pool = persistent_pool(served, "slow")
    stop = threading.Event()
    epochs = [0, 0]
    delivered = [0, 0]  # batches each rank has received
    errors: list[BaseException] = []

    def rank(r: int) -> None:  # two ranks share the pool's Run
        try:
            with RemoteLoader(served.address, rank=r, world_size=2) as loader:
                while not stop.is_set():
                    got: list[int] = []
                    for batch in loader:
                        got.extend(int(v) for v in batch)
                        delivered[r] += 1
                    assert got == list(range(r, 200, 2))
                    epochs[r] += 1
        except BaseException as exc:
            errors.append(exc)

    def progressed(settled: int) -> Callable[[], bool]:
        return lambda: bool(errors) or sum(delivered) >= settled

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    # Every task in flight when a worker dies has been delivered once this many more batches
    # have: 4 submitted (2 workers x prefetch 2) plus 2 lanes' windows of 4 made, unsent.
    in_flight = 4 + 2 * 4
    kills = 0
    rng = random.Random(1)
    while kills < 50 and not errors:
        mark = sum(delivered)
        try:
            os.kill(rng.choice(pool.pids), signal.SIGKILL)
            kills += 1
        except ProcessLookupError:
            continue  # already dead, not yet replaced
        # Paced by progress, not by the clock: on a loaded machine a fixed pace can kill the
        # respawned worker again and again before it finishes the batch it was given, and a
        # batch whose worker dies MAX_TASK_ATTEMPTS times is (rightly) delivered as an error.
        assert wait_until(progressed(mark + in_flight), BUSY_MACHINE), f"no progress, kill {kills}"
    stop.set()
    for t in threads:
        t.join(timeout=BUSY_MACHINE)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert not errors, errors[0]
    assert kills == 50 and min(epochs) >= 1
    with RemoteLoader(served.address) as loader:  # a death after the last poll is seen here
        assert values(loader) == list(range(200))
    assert pool.restarts == kills


@pytest.mark.timeout(30)
def test_failing_worker_init_fn_fails_the_stream_with_its_traceback(
    serve_loaders: ServeLoaders,
) -> None:
    spec = LoaderSpec(
        name="init",
        dataset="tests.datasets:Squares",
        num_workers=2,
        worker_init_fn="tests.datasets:failing_init",
    )
    served = serve_loaders(spec)
    with RemoteLoader(served.address) as loader, pytest.raises(RequestError) as info:
        next(iter(loader))
    text = str(info.value)
    assert "cannot make batches: RuntimeError in DataLoader worker process" in text
    assert "worker_init_fn fails on purpose" in text
    assert 'tests/datasets.py", line' in text  # the original traceback
