"""The `remote-loader` command: `serve` hosts loaders, `demo` runs a server and two trainers,
`check-config` validates a config file, `health` asks a server whether it is serving."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from remote_loader.server.datasets import DEMO_DATASET, demo_spec
from remote_loader.server.settings import ServerSettings, resolve_settings
from remote_loader.server.spec import (
    ConfigError,
    LoaderSpec,
    add_spec_arguments,
    read_config,
    spec_from_args,
)

if TYPE_CHECKING:
    from remote_loader.server.host import LoaderHost

DEFAULTS = ServerSettings()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="remote-loader", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="host loaders over gRPC",
        description="Host the loaders of a config file, or one loader given "
        "by flags, or (with neither) the built-in demo image folder.",
    )
    serve.add_argument("--config", help="TOML file with [loaders.NAME] tables")
    # Server settings: None means "not given", so the environment and [server] can set them.
    serve.add_argument(
        "--address",
        help=f"HOST:PORT to listen on; port 0 picks a free one (default {DEFAULTS.address})",
    )
    serve.add_argument(
        "--chunk-size",
        type=int,
        help=f"largest frame payload in bytes (default {DEFAULTS.chunk_size})",
    )
    serve.add_argument(
        "--max-streams",
        type=int,
        help=f"streams served at once; more are refused (default {DEFAULTS.max_streams})",
    )
    serve.add_argument(
        "--grace",
        type=float,
        help=f"on SIGTERM, seconds running streams get to finish (default {DEFAULTS.grace:g})",
    )
    serve.add_argument("--log-level", help=f"default {DEFAULTS.log_level}")
    serve.add_argument(
        "--metrics-address",
        help="HOST:PORT to serve Prometheus metrics on (port 0 picks a free one); "
        "default: no metrics endpoint",
    )
    serve.add_argument(
        "--max-batch-bytes",
        type=int,
        help="largest encoded batch in bytes; a bigger one is an error at its position "
        f"(default {DEFAULTS.max_batch_bytes})",
    )
    serve.add_argument(
        "--max-ring-bytes",
        type=int,
        help="largest shared-memory ring of a same-host stream in bytes; 0: never use shared "
        f"memory (default {DEFAULTS.max_ring_bytes})",
    )
    serve.add_argument(
        "--zero-copy",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let same-host clients of this user and pid namespace read batches in the "
        "workers' shared memory, with no copy by the server (default on)",
    )
    serve.add_argument(
        "--data-address",
        help="HOST:PORT for clients' data connections (batch bytes beside the gRPC stream), "
        '"auto" (the --address host, a free port; none with TLS) or "off" '
        f"(default {DEFAULTS.data_address})",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        help=f"largest request message in bytes (default {DEFAULTS.max_request_bytes})",
    )
    serve.add_argument(
        "--ray-address",
        help='the Ray cluster of loaders with pool = "ray" (HOST:PORT of its head, or '
        '"auto"); default: start a local Ray instance',
    )
    # The token itself has no flag (a command line is visible in `ps`): REMOTE_LOADER_TOKEN.
    serve.add_argument(
        "--token-file",
        help="file holding the token clients must send (or set REMOTE_LOADER_TOKEN); "
        "default: no token",
    )
    serve.add_argument("--tls-cert", help="PEM certificate chain: serve TLS (with --tls-key)")
    serve.add_argument("--tls-key", help="PEM private key of --tls-cert")
    serve.add_argument(
        "--tls-client-ca", help="PEM CA: clients must present a certificate it signed (mTLS)"
    )
    serve.add_argument(
        "--reflection",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="turn on gRPC server reflection (default off)",
    )
    add_spec_arguments(serve)

    check = sub.add_parser(
        "check-config",
        help="validate a config file and list its loaders",
        description="Builds every loader of FILE as `serve` would (imports, datasets, torch's "
        "option checks) without starting workers; exits 2 at the first error.",
    )
    check.add_argument("file", help="TOML file with [loaders.NAME] tables")

    health = sub.add_parser(
        "health",
        help="exit 0 if the server at ADDR is SERVING (for container health checks)",
    )
    health.add_argument("address", help="HOST:PORT of a remote-loader server")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    health.add_argument(
        "--service", default="", help="health service name (default: the whole server)"
    )
    # No token: the health service answers without one (server/auth.py).
    health.add_argument(
        "--tls", action="store_true", help="use TLS, trusting the system's CAs (see --tls-ca)"
    )
    health.add_argument("--tls-ca", help="PEM CA the server's certificate is checked against")
    health.add_argument("--tls-cert", help="PEM client certificate, for an mTLS server")
    health.add_argument("--tls-key", help="PEM private key of --tls-cert")
    health.add_argument(
        "--tls-server-name",
        help="name to check the server's certificate against, when ADDR's host is not in it "
        "(e.g. 127.0.0.1 inside the server's container)",
    )

    demo = sub.add_parser("demo", help="run a server and two trainers on the demo images")
    demo.add_argument(
        "--trainers",
        type=int,
        default=2,
        help="trainer processes, the ranks of one job partitioning each epoch (default 2)",
    )
    demo.add_argument("--epochs", type=int, default=2)
    demo.add_argument("--batch-size", type=int, default=32)
    demo.add_argument("--num-workers", type=int, default=2)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "check-config":
        return _check_config(args.file)
    if args.command == "health":
        return _health(args.address, args.timeout, args.service, _health_tls(args))
    return run_demo(args.trainers, args.epochs, args.batch_size, args.num_workers)


def _serve(args: argparse.Namespace) -> int:
    from remote_loader.server.server import serve

    try:
        table = None
        if args.config:
            if args.dataset:
                raise ConfigError("pass either --config or --dataset, not both")
            specs, table = read_config(args.config)
        elif args.dataset:
            spec = spec_from_args(args)
            specs = {spec.name: spec}
        else:
            spec = demo_spec()
            specs = {spec.name: spec}
        # Settings without a flag (the token, keepalive) are None here: not given.
        flags = {key: getattr(args, key, None) for key in vars(DEFAULTS)}
        settings = resolve_settings(table, os.environ, flags)
        logging.basicConfig(
            level=settings.log_level,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        return serve(settings, specs)
    except (ConfigError, OSError) as exc:
        print(f"remote-loader: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as exc:  # an option torch rejects, with torch's message
        print(f"remote-loader: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


def _check_config(path: str) -> int:
    """Builds each loader of `path` (no workers started) and prints what it serves."""
    import multiprocessing

    from remote_loader.server.host import LoaderHost

    name: str | None = None  # the loader being built, for the error message
    try:
        specs, table = read_config(path)
        settings = resolve_settings(table, os.environ)
        print(f"server: {settings.describe()}")
        # Workers are never started here, so the context is only stored.
        ctx = multiprocessing.get_context("forkserver")
        for name, spec in specs.items():
            host = LoaderHost(spec, ctx)
            print(
                f"{name}: {spec.dataset}, {host.dataset_kind} dataset, batch_size "
                f"{spec.batch_size}, {_length_text(host)}, {_workers_text(spec)}, "
                f"{_pool_text(spec, settings.ray_address)}, sharing {', '.join(spec.sharing)}, "
                f"fingerprint {spec.fingerprint()}"
            )
    except ConfigError as exc:
        print(f"remote-loader: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # an option torch rejects, or a dataset factory that raises
        where = f"loader {name!r}: " if name is not None else ""
        print(f"remote-loader: error: {where}{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(f"{path}: {len(specs)} loader(s), all valid")
    return 0


def _length_text(host: LoaderHost) -> str:
    """Batches per epoch, or why they are unknown (LoaderHost refused a map-style dataset
    whose __len__ raises, so here an unknown length is an unsized IterableDataset's, or a
    sampler's that has no __len__)."""
    try:
        return f"{len(host)} batches/epoch"
    except TypeError as exc:
        if host.batching.is_iterable:
            return "length unknown (IterableDataset without __len__)"
        return f"length unknown (map-style, but {exc})"


def _workers_text(spec: LoaderSpec) -> str:
    """num_workers as configured: "auto" is not the one worker the pool starts with."""
    if spec.autotune:
        return f"num_workers auto (1 to max_workers {spec.max_workers})"
    return f"num_workers {spec.num_workers}"


def _pool_text(spec: LoaderSpec, ray_address: str | None) -> str:
    if spec.num_workers == 0:
        return f"pool {spec.pool} (no workers: loads in the server process)"
    if spec.pool == "ray":
        where = f"ray_address {ray_address}" if ray_address else "a local Ray instance"
        return f"pool ray ({where}, ray_num_cpus {spec.ray_num_cpus:g})"
    return f"pool {spec.pool}"


@dataclasses.dataclass(frozen=True)
class HealthTLS:
    """How `health` reaches a TLS server: PEM paths (None: the system's CAs, no client cert)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None


def _health_tls(args: argparse.Namespace) -> HealthTLS | None:
    given = (args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    if not args.tls and all(v is None for v in given):
        return None
    return HealthTLS(*given)


def _health_channel(address: str, tls: HealthTLS | None) -> Any:
    """A channel to `address`, as a RemoteLoader opens it; ConfigError for TLS files that
    cannot be read."""
    from remote_loader.protos.channel import ChannelTLS, dial
    from remote_loader.server.auth import read_pem

    if tls is None:
        return dial(address)
    if (tls.cert is None) != (tls.key is None):
        raise ConfigError("--tls-cert and --tls-key go together: give both or neither")
    pem = ChannelTLS(
        ca=None if tls.ca is None else read_pem("--tls-ca", tls.ca),
        key=None if tls.key is None else read_pem("--tls-key", tls.key),
        cert=None if tls.cert is None else read_pem("--tls-cert", tls.cert),
        server_name=tls.server_name,
    )
    return dial(address, tls=pem)


def _health(address: str, timeout: float, service: str, tls: HealthTLS | None = None) -> int:
    """0 if `address` answers SERVING, 1 if it answers anything else, 2 if it does not answer."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        channel = _health_channel(address, tls)
    except ConfigError as exc:
        print(f"remote-loader: error: {exc}", file=sys.stderr)
        return 2
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as exc:
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            print(f"remote-loader: {address}: no health answer: {details}", file=sys.stderr)
            return 2
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


# --- demo -------------------------------------------------------------------------------------


# How long a spawned server may take to build its loaders and start listening.
SERVE_START_TIMEOUT = 120.0
# How long the demo waits for a trainer before it stops it.
DEMO_TRAINER_TIMEOUT = 600.0


def demo_flags(batch_size: int = 32, num_workers: int = 2) -> list[str]:
    """`serve` flags for the demo loader: the built-in image folder, shuffled, with indices."""
    flags = [
        "--dataset",
        DEMO_DATASET,
        "--name",
        "demo",
        "--dataset-kwargs",
        json.dumps({"return_index": True}),
        "--batch-size",
        str(batch_size),
        "--shuffle",
        "--num-workers",
        str(num_workers),
    ]
    if num_workers > 0:
        flags.append("--persistent-workers")
    return flags


def serve_command(args: Sequence[str]) -> list[str]:
    """The command line of `remote-loader serve ARGS` listening on 127.0.0.1, port 0."""
    return [
        sys.executable,
        "-m",
        "remote_loader.server.cli",
        "serve",
        "--address",
        "127.0.0.1:0",
        *args,
    ]


def spawn_serve(
    args: Sequence[str], env: Mapping[str, str] | None = None, stderr: int | None = None
) -> tuple[subprocess.Popen[str], int]:
    """Starts `remote-loader serve ARGS --address 127.0.0.1:0` as a process.

    Returns the process and the port it listens on, read from its first line of output; raises
    RuntimeError (with the server's stderr, when piped) if it exits before serving.
    """
    proc = subprocess.Popen(
        [*serve_command(args), "--log-level", "WARNING"],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=None if env is None else dict(env),
    )
    assert proc.stdout is not None
    # Bounded: a server stuck before it listens must not hang the caller.
    ready, _, _ = select.select([proc.stdout], [], [], SERVE_START_TIMEOUT)
    line = proc.stdout.readline() if ready else ""  # "remote-loader: serving ... on port N"
    match = re.search(r"on port (\d+)$", line.strip())
    if match is None:
        proc.kill()
        _, err = proc.communicate()
        raise RuntimeError(
            f"remote-loader serve did not start (exit code {proc.returncode})"
            + (f": {err.strip()}" if err else "")
        )
    return proc, int(match.group(1))


def run_demo(trainers: int, epochs: int, batch_size: int, num_workers: int) -> int:
    """Starts a server and `trainers` trainer processes, shows their progress, checks the data."""
    from tqdm import tqdm

    from remote_loader.server.datasets import demo_folder

    print(f"remote-loader demo: images in {demo_folder()}", flush=True)
    started = time.monotonic()
    server, port = spawn_serve(demo_flags(batch_size, num_workers))
    reports: dict[int, dict[str, Any]] = {}
    try:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "remote_loader.client.demo",
                    "--address",
                    f"127.0.0.1:{port}",
                    "--rank",
                    str(rank),
                    "--world-size",
                    str(trainers),
                    "--epochs",
                    str(epochs),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in range(trainers)
        ]
        bars = [
            tqdm(desc=f"trainer {rank}", unit="batch", position=rank, leave=True)
            for rank in range(trainers)
        ]
        lock = threading.Lock()

        def follow(rank: int, proc: subprocess.Popen[str]) -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                msg = json.loads(line)
                with lock:
                    if "total" in msg:
                        bars[rank].total = msg["total"]
                        bars[rank].refresh()
                    elif "batch" in msg:
                        bars[rank].update(1)
                    else:
                        reports[rank] = msg

        threads = [threading.Thread(target=follow, args=(r, p)) for r, p in enumerate(procs)]
        for t in threads:
            t.start()
        codes = [_wait_or_kill(p, DEMO_TRAINER_TIMEOUT) for p in procs]
        for t in threads:
            t.join()
        for bar in bars:
            bar.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    return _summary(reports, codes, time.monotonic() - started, epochs)


def _wait_or_kill(proc: subprocess.Popen[str], timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _summary(
    reports: dict[int, dict[str, Any]], codes: list[int], seconds: float, epochs: int
) -> int:
    ok = True
    print(f"\nsummary ({seconds:.1f} s wall)")
    for rank, code in enumerate(codes):
        report = reports.get(rank)
        if code != 0 or report is None:
            print(f"  trainer {rank}: FAILED (exit code {code})")
            ok = False
            continue
        mbps = report["bytes"] / 1e6 / max(report["seconds"], 1e-9)
        print(
            f"  trainer {rank} (rank {rank} of {len(codes)}): {report['batches']} batches, "
            f"{report['samples']} samples, {report['bytes'] / 1e6:.1f} MB at {mbps:.1f} MB/s"
            f" over {report.get('transport') or 'nothing'}"
        )
    if ok:
        ok = _check_partition([reports[r] for r in range(len(codes))], epochs)
    print("demo " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


def _check_partition(reports: list[dict[str, Any]], epochs: int) -> bool:
    """Each epoch: equal shares that together hold every sample, repeats only as padding."""
    size = reports[0]["dataset_length"]
    ok = True
    for epoch in range(epochs):
        shares = [r["received"][epoch] for r in reports]
        counts = Counter(i for share in shares for i in share)
        equal = len({len(share) for share in shares}) == 1
        # DistributedSampler pads the last round with samples from the start of the epoch.
        padding = len(shares[0]) * len(shares) - size
        complete = set(counts) == set(range(size)) and sum(counts.values()) == size + padding
        good = equal and complete and 0 <= padding < len(shares)
        ok = ok and good
        repeats = f", {padding} repeated as padding" if padding else ", none twice"
        print(
            f"  epoch {epoch}: {len(shares)} equal shares of {len(shares[0])} samples; together "
            f"every one of the {size} samples{repeats}: {'yes' if good else 'NO'}"
        )
    return ok


if __name__ == "__main__":
    sys.exit(main())
