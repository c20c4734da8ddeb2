"""What an elastic resume to many ranks costs the server (NOTE [ Resharding cost ] in
server/sharing/elastic.py): a Describe's answer time, and another trainer's first batch while a wide
resharding Stream is admitted.

    python benchmarks/reshard.py [--ranks 65536] [--samples 1000]

The server is a separate `remote-loader serve` process (tests.datasets:Squares, batch_size 4,
shuffled); requests go over gRPC on loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import grpc

from remote_loader.client import RemoteLoader
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import wire
from remote_loader.server.sharing.elastic import MAX_RESHARD_RANKS

# Run as a script, this file's folder is on sys.path, not the repository root that holds the
# `benchmarks` package.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.processes import start_server, stop_process  # noqa: E402

# Seconds any one call may take before the benchmark calls it a failure rather than slow.
CALL_TIMEOUT = 120.0
DESCRIBE_METHOD = f"/{wire.SERVICE_NAME}/Describe"


def describe(address: str, request: pb.DescribeRequest) -> tuple[float, str]:
    """Seconds to the answer, and the answer (its length, or the error's code and message)."""
    with grpc.insecure_channel(
        address, options=[("grpc.max_send_message_length", 64 << 20)]
    ) as channel:
        call = channel.unary_unary(
            DESCRIBE_METHOD,
            request_serializer=pb.DescribeRequest.SerializeToString,
            response_deserializer=pb.LoaderInfo.FromString,
        )
        started = time.perf_counter()
        try:
            info = call(request, timeout=CALL_TIMEOUT)
            what = f"length {info.length}"
        except grpc.RpcError as exc:
            assert isinstance(exc, grpc.Call)
            what = f"{exc.code().name}: {(exc.details() or '')[:110]}"
        return time.perf_counter() - started, what


def whole_stream(address: str, request: pb.StreamRequest, out: dict[str, float]) -> None:
    """Seconds from calling Stream to its end, into out["seconds"] (rank 0 of the wide job
    gets one batch: the time is the plan's)."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(
            wire.STREAM_METHOD,
            request_serializer=pb.StreamRequest.SerializeToString,
            response_deserializer=pb.Frame.FromString,
        )
        started = time.perf_counter()
        frames = list(call(request, timeout=CALL_TIMEOUT))
        out["seconds"] = time.perf_counter() - started
        out["batches"] = frames[-1].end.batches


def wide_request(ranks: int) -> tuple[pb.Consumer, pb.Reshard]:
    """Rank 0 of `ranks` resuming an epoch one rank began and had not read from."""
    return (
        pb.Consumer(sharing="partition", job="wide", rank=0, world_size=ranks),
        pb.Reshard(world_size=1, consumed=[0]),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=65536, help="the resumed job's world_size")
    parser.add_argument("--samples", type=int, default=1000, help="the dataset's samples")
    args = parser.parse_args(argv)
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores, load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    flags = ["--address", "127.0.0.1:0", "--name", "sq", "--log-level", "WARNING"]
    flags += ["--dataset", "tests.datasets:Squares", "--batch-size", "4", "--shuffle"]
    flags += ["--dataset-kwargs", json.dumps({"n": args.samples})]
    flags += ["--max-request-bytes", str(4 << 20)]  # an old job's count per rank
    proc, address = start_server(flags)
    try:
        consumer, reshard = wide_request(args.ranks)
        for label, request in [
            (
                f"Describe, world_size {args.ranks} from 1 rank",
                pb.DescribeRequest(loader="sq", consumer=consumer, reshard=reshard),
            ),
            (
                f"Describe, world_size 1 from {args.ranks} ranks",
                pb.DescribeRequest(
                    loader="sq",
                    consumer=pb.Consumer(sharing="partition", job="narrow", world_size=1),
                    reshard=pb.Reshard(world_size=args.ranks, consumed=[0] * args.ranks),
                ),
            ),
            (
                f"Describe, {MAX_RESHARD_RANKS // 2} ranks from {MAX_RESHARD_RANKS // 2}",
                pb.DescribeRequest(
                    loader="sq",
                    consumer=pb.Consumer(world_size=MAX_RESHARD_RANKS // 2),
                    reshard=pb.Reshard(
                        world_size=MAX_RESHARD_RANKS // 2, consumed=[0] * (MAX_RESHARD_RANKS // 2)
                    ),
                ),
            ),
            (
                f"Describe, one rank past MAX_RESHARD_RANKS={MAX_RESHARD_RANKS}",
                pb.DescribeRequest(
                    loader="sq",
                    consumer=pb.Consumer(world_size=MAX_RESHARD_RANKS),
                    reshard=pb.Reshard(world_size=1, consumed=[0]),
                ),
            ),
        ]:
            seconds, what = describe(address, request)
            print(f"{label}: {seconds:.3f} s ({what})")

        # Another trainer's first batch while a resharding Stream plans its epoch: the new
        # job's ranks from one old rank, and the old job's ranks (all but 4 of them done)
        # finished by 2 new ones; each epoch planned afresh (a Run per epoch).
        few = [0] * 4 + [1] * (args.ranks - 4)  # 1000 samples: one batch per old rank
        for epoch, (label, resume) in enumerate(
            [
                (
                    f"world_size {args.ranks} from 1 rank",
                    pb.StreamRequest(loader="sq", consumer=consumer, reshard=reshard),
                ),
                (
                    f"world_size 2 from {args.ranks} ranks",
                    pb.StreamRequest(
                        loader="sq",
                        consumer=pb.Consumer(sharing="partition", job="two", world_size=2),
                        reshard=pb.Reshard(world_size=args.ranks, consumed=few),
                    ),
                ),
            ],
            start=1,
        ):
            resume.epoch = epoch
            resumed: dict[str, float] = {}
            thread = threading.Thread(target=whole_stream, args=(address, resume, resumed))
            with RemoteLoader(address, "sq", job=f"other{epoch}") as other:
                other.set_epoch(epoch)
                thread.start()
                started = time.perf_counter()
                next(iter(other))
                other_first = time.perf_counter() - started
            thread.join(CALL_TIMEOUT)
            print(
                f"Stream, {label}: {resumed['batches']:.0f} batches, ended after "
                f"{resumed['seconds']:.3f} s; another trainer's first batch meanwhile: "
                f"{other_first:.3f} s"
            )
    finally:
        stop_process(proc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
