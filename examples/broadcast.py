"""Two trainings that share one loader's epoch: every batch is loaded once, streamed to both.

python examples/broadcast.py               # starts a server on the demo image folder itself

remote-loader serve --address 127.0.0.1:50051 &
python examples/broadcast.py --address 127.0.0.1:50051

Two consumer processes (say, trainings of two different models on the same data) each create
`RemoteLoader(address, sharing="broadcast", job="shared-demo", rank=i, world_size=2)`, joining
the same job, and read one epoch. With sharing="broadcast" the server's workers decode and
collate each batch once for all the consumers of the job, and every consumer receives the whole
epoch, batch for batch the same. Because world_size=2 names the group, the server holds the
first batch until both have joined, so neither misses the shared production by starting a
little late.

The script records the sample indices of each batch both consumers received and checks the two
sequences are identical; it exits non-zero if they are not.
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.queues as mp_queues
import queue
import sys
import time
from collections import Counter
from collections.abc import Sequence
from multiprocessing.process import BaseProcess

import torch

from remote_loader.client import RemoteLoader
from remote_loader.server import Server, ServerSettings
from remote_loader.server.datasets import demo_spec

CONSUMERS = 2
JOB = "shared-demo"
# Generous: the first run also builds the demo image folder.
RESULT_TIMEOUT = 300.0

# What a consumer sends back: its rank, then its batches' indices and the dataset's length, or
# what went wrong.
Result = tuple[int, list[list[int]], int, str | None]


def start_server() -> Server:
    """The demo image folder, served by this process on a free port."""
    server = Server(ServerSettings(address="127.0.0.1:0"), [demo_spec()])
    server.start()
    return server


def consume(rank: int, address: str, results: mp_queues.Queue[Result]) -> None:
    """One consumer: reads an epoch of the shared broadcast and sends back its batches' indices."""
    torch.set_num_threads(1)  # it only reads; leave the cores to the server's workers
    try:
        with RemoteLoader(
            address, sharing="broadcast", job=JOB, rank=rank, world_size=CONSUMERS, device="cpu"
        ) as loader:
            batches = [batch[2].tolist() for batch in loader]
            # One write for the whole line: the consumers share stdout, which is unbuffered in
            # spawned processes, and print() would write the newline separately.
            sys.stdout.write(
                f"consumer {rank}: {len(batches)} batches (len(loader) {len(loader)})\n"
            )
            sys.stdout.flush()
            results.put((rank, batches, int(loader.info.dataset_length), None))
    except Exception as exc:
        # The parent waits for one result per consumer; an error must arrive as one too.
        results.put((rank, [], 0, f"{type(exc).__name__}: {exc}"))
        raise


def collect(results: mp_queues.Queue[Result], procs: Sequence[BaseProcess]) -> dict[int, Result]:
    collected: dict[int, Result] = {}
    deadline = time.monotonic() + RESULT_TIMEOUT
    while len(collected) < len(procs):
        try:
            result = results.get(timeout=1.0)
        except queue.Empty:
            # A consumer that died without a word (killed, out of memory) never sends a result.
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            continue
        collected[result[0]] = result
    return collected


def run(address: str) -> bool:
    ctx = multiprocessing.get_context("spawn")
    results: mp_queues.Queue[Result] = ctx.Queue()
    procs = [
        ctx.Process(target=consume, args=(rank, address, results), name=f"consumer-{rank}")
        for rank in range(CONSUMERS)
    ]
    started = time.monotonic()
    for p in procs:
        p.start()
    collected = collect(results, procs)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join()
    seconds = time.monotonic() - started

    failed = [
        f"consumer {rank}: {collected[rank][3] if rank in collected else 'no result'}"
        for rank in range(CONSUMERS)
        if rank not in collected or collected[rank][3] is not None
    ]
    if failed:
        print("\n".join(failed))
        return False
    sequences = [collected[rank][1] for rank in range(CONSUMERS)]
    dataset_length = collected[0][2]
    identical = all(seq == sequences[0] for seq in sequences)
    # Broadcast hands every consumer the whole epoch, not a share of it.
    whole = Counter(i for batch in sequences[0] for i in batch) == Counter(range(dataset_length))
    samples = sum(len(batch) for batch in sequences[0])
    print(
        f"{CONSUMERS} consumers, job {JOB!r}, {seconds:.1f} s: {len(sequences[0])} batches, "
        f"{samples} samples each; every sample once: {'yes' if whole else 'NO'}"
    )
    print(f"identical: {'yes' if identical else 'NO'}")
    return identical and whole


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--address", default=None, help="a running server (default: start one on the demo data)"
    )
    args = parser.parse_args()

    server = None if args.address else start_server()
    address = server.address if server is not None else args.address
    try:
        ok = run(address)
    finally:
        if server is not None:
            server.stop()
    print("broadcast example " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
