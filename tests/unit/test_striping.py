"""Several data connections per stream (NOTE [ TCP data connection ]: striping) without a server:
how a batch is cut (`striping.stripes`) and filled in place (`Assembly.fill_range`), a failed stripe
stopping the others, and a count of connections out of range refused.

The tests that start a server, a process or Ray: tests/integration/test_striping.py.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from remote_loader.client import RemoteLoader
from remote_loader.client.assembly import Assembly
from remote_loader.client.errors import ProtocolError
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import striping, tcp
from tests.helpers import (
    MiB,
)

# --- how a batch is cut and filled ---------------------------------------------------------


@pytest.mark.parametrize("connections", range(1, tcp.MAX_DATA_CONNECTIONS + 1))
@pytest.mark.parametrize(
    "total",
    [0, 1, 1000, MiB - 1, MiB, MiB + 1, 2 * MiB - 1, 2 * MiB, 3 * MiB + 12345, 9_600_000,
     8 * MiB, 8 * MiB + 1, 12_000_000, 100 * MiB + 7],
)  # fmt: skip
def test_stripes_cover_the_batch_in_aligned_contiguous_ranges(total: int, connections: int) -> None:
    stripes = striping.stripes(total, connections)
    assert len(stripes) == min(connections, max(1, total // MiB))
    assert stripes[0][0] == 0 and stripes[-1][1] == total
    for (_, end), (start, _) in itertools.pairwise(stripes):
        assert end == start  # contiguous
        assert start % striping.STRIPE_ALIGN == 0
    sizes = [end - start for start, end in stripes]
    assert total == 0 or min(sizes) > 0
    assert max(sizes) - min(sizes) <= 2 * striping.STRIPE_ALIGN  # none waits long for another
    assert total < MiB or min(sizes) > MiB - striping.STRIPE_ALIGN


@pytest.mark.parametrize("connections", [0, tcp.MAX_DATA_CONNECTIONS + 1])
def test_stripes_need_a_valid_count_of_connections(connections: int) -> None:
    with pytest.raises(ValueError, match="1 to 8 data connections"):
        striping.stripes(1000, connections)


def test_stripes_fill_their_own_ranges_of_a_batch_in_place() -> None:
    blob = random.Random(0).randbytes(3 * MiB + 100)
    header_nbytes = 70  # the padding up to 128 is dropped, the payload starts there
    meta = pb.Frame(batch=3, parts=1, total_bytes=len(blob), header_bytes=header_nbytes)
    # Cut anywhere, even across the header, the padding and the payload, and filled at once.
    cuts = [(0, 5), (5, 100), (100, 200), (200, MiB), (MiB, len(blob))]
    assembly = Assembly(meta, pin=False)
    filled: list[list[memoryview]] = [[] for _ in cuts]  # each stripe's views, in order
    done: list[bool] = []

    def read(i: int, view: memoryview) -> bool:
        lo = cuts[i][0] + sum(len(v) for v in filled[i])
        view[:] = blob[lo : lo + len(view)]
        filled[i].append(view)
        return True

    def run_at_once(tasks: Any) -> bool:
        threads = [threading.Thread(target=lambda t=t: done.append(t())) for t in tasks]
        for thread in reversed(threads):
            thread.start()
        for thread in threads:
            thread.join()
        return all(done)

    assert assembly.receive(read, cuts, run_at_once)
    assert bytes(assembly.header) == blob[:header_nbytes]
    assert bytes(assembly.payload.numpy()) == blob[128:]
    with pytest.raises(ProtocolError, match="do not cover"):
        Assembly(meta, pin=False).receive(read, [(0, 5), (6, len(blob))])


@pytest.mark.parametrize("waiting", [0, 2])  # on this thread, on the pool after the broken one
def test_a_failed_stripe_stops_the_others_and_no_stripe_outlives_the_batch(waiting: int) -> None:
    failed = threading.Event()
    returned: list[str] = []

    def waits_for_the_failure() -> bool:  # a reader whose connection simply stays silent
        while not failed.wait(tcp.POLL_INTERVAL):
            pass
        time.sleep(0.2)  # still busy a little after it noticed
        returned.append("waited")
        return False

    def breaks() -> bool:
        time.sleep(0.1)
        raise tcp.DataConnectionError("a stripe broke")

    with ThreadPoolExecutor(2) as pool:
        started = time.monotonic()
        with pytest.raises(tcp.DataConnectionError, match="a stripe broke"):
            tasks = [lambda: True, breaks, breaks]
            tasks[waiting] = waits_for_the_failure
            striping.concurrently(pool, tasks, failed)
        assert returned == ["waited"]  # it returned before the error was raised
        assert time.monotonic() - started < 2
        failed.clear()
        assert striping.concurrently(pool, [lambda: True] * 3, failed)
        assert not striping.concurrently(pool, [lambda: True, lambda: False], failed)  # stopped
        assert not failed.is_set()


@pytest.mark.parametrize("connections", [0, 9, -1, True, 2.0, "4"])
def test_data_connections_out_of_range_is_refused(connections: Any) -> None:
    with pytest.raises(ValueError, match="data_connections must be an integer from 1 to 8"):
        RemoteLoader("127.0.0.1:1", data_connections=connections)
