"""A ring's doorbell (NOTE [ Doorbell ] in protos/doorbell.py): a server waiting for the client
sleeps until the client releases, falls back to polling when there is no bell, and leaves no
name behind in /dev/shm.

The unit tests (no server, no process, no Ray): tests/unit/test_doorbell.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import pytest

from remote_loader.client import RemoteLoader
from remote_loader.protos import doorbell
from tests.helpers import (
    LONG_TICK,
    ServeLoaders,
    assert_same,
    expected,
    sizes_spec,
)

# No ring or bell is left in /dev/shm after a test.
pytestmark = pytest.mark.usefixtures("no_ring_left_behind")


def test_a_trainer_with_the_default_sigpipe_survives_the_server_closing_the_bell() -> None:
    """A trainer may restore SIGPIPE's default action (killing the process): ringing a bell whose
    server end has closed must not raise it, as a write to a FIFO without a reader would."""
    script = textwrap.dedent(
        """
        import signal
        from remote_loader.protos import shm
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        writer = shm.RingWriter(shm.ALIGN)
        reader = shm.RingReader(writer.name, writer.capacity)
        writer.close()
        reader.release(1)
        reader.release(2)
        reader.close()
        print("alive")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "alive", (done.returncode, done.stderr)


@pytest.mark.parametrize("zero_copy", [True, False])
@pytest.mark.timeout(120)
def test_a_slow_trainers_server_sleeps_on_the_bell(
    serve_loaders: ServeLoaders, monkeypatch: pytest.MonkeyPatch, zero_copy: bool
) -> None:
    """A client slower than its loader: the server waits for every release (a slot lease, or
    room in the ring), each time asleep on the bell until the client's ring ends the wait, and
    the epoch arrives whole."""
    monkeypatch.setattr(doorbell, "BELL_TICK", LONG_TICK)
    waits: list[tuple[bool | None, float]] = []  # what each wait returned, and its seconds
    real = doorbell.Doorbell.wait

    def timed(self: doorbell.Doorbell, *args: Callable[[], bool]) -> bool | None:
        start = time.monotonic()
        done = real(self, *args)
        waits.append((done, time.monotonic() - start))
        return done

    monkeypatch.setattr(doorbell.Doorbell, "wait", timed)
    sizes = [200_000] * 16
    settings = {} if zero_copy else {"zero_copy": False}
    served = serve_loaders(sizes_spec(sizes, num_workers=1), **settings)
    got = []
    with RemoteLoader(served.address, device="cpu", prefetch=1) as loader:
        for batch in loader:
            time.sleep(0.05)  # the train step
            got.append(batch)
        assert loader.last_transport == "shm"
    assert_same(got, expected(sizes))
    assert len(waits) >= 4, waits  # the server waited on the client, on the bell
    assert all(done is True for done, _ in waits), waits
    # Each wait was ended by the client's ring, not by a tick.
    assert max(seconds for _, seconds in waits) < LONG_TICK / 2, waits
