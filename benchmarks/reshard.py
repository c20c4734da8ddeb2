"""What an elastic resume to many ranks costs the server (NOTE [ Resharding cost ] in
server/elastic.py): a Describe's answer time, and another trainer's first batch while a wide
resharding Stream is admitted.

    python benchmarks/reshard.py [--ranks 65536] [--samples 1000]

The server is a separate `remote-loader serve` process (tests.datasets:Squares, batch_size 4,
shuffled); requests go over gRPC on loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import grpc

from benchmarks.processes import start_server, stop_process
from remote_loader.client import RemoteLoader
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import wire
from remote_loader.server.elastic import MAX_RESHARD_RANKS

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


def first_frame(address: str, request: pb.StreamRequest, out: dict[str, float]) -> None:
    """Seconds from calling Stream to its first frame, into out["seconds"]."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(
            wire.STREAM_METHOD,
            request_serializer=pb.StreamRequest.SerializeToString,
            response_deserializer=pb.Frame.FromString,
        )
        started = time.perf_counter()
        frames = call(request, timeout=CALL_TIMEOUT)
        next(frames)
        out["seconds"] = time.perf_counter() - started
        frames.cancel()


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
    proc, address = start_server(
        [
            "--address", "127.0.0.1:0",
            "--dataset", "tests.datasets:Squares",
            "--dataset-kwargs", json.dumps({"n": args.samples}),
            "--batch-size", "4", "--shuffle", "--name", "sq",
            "--max-request-bytes", str(4 << 20),
            "--log-level", "WARNING",
        ]  # fmt: skip
    )
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

        # Another trainer's first batch while the wide resharding Stream is admitted.
        wide: dict[str, float] = {}
        thread = threading.Thread(
            target=first_frame,
            args=(
                address,
                pb.StreamRequest(loader="sq", consumer=consumer, reshard=reshard, epoch=1),
                wide,
            ),
        )
        with RemoteLoader(address, "sq", job="other") as other:
            thread.start()
            started = time.perf_counter()
            next(iter(other))
            other_first = time.perf_counter() - started
        thread.join(CALL_TIMEOUT)
        print(f"Stream, world_size {args.ranks} from 1 rank: first frame {wide['seconds']:.3f} s")
        print(f"  another trainer's first batch meanwhile: {other_first:.3f} s")
    finally:
        stop_process(proc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
