"""The `remote-loader` command: `serve` hosts loaders, `demo` runs a server and two trainers,
`check-config` validates a config file, `health` asks a server whether it is serving, `top`
shows a running server's loaders and trainers live."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from remote_loader.server.api.settings import ServerSettings, resolve_settings
from remote_loader.server.cli.channel import (
    ClientTLS,
    add_tls_arguments,
    open_channel,
    tls_from_args,
)

# The demo's processes (re-exported: tests and benchmarks start servers with them).
from remote_loader.server.cli.demo import run_demo
from remote_loader.server.cli.demo import serve_command as serve_command
from remote_loader.server.cli.demo import spawn_serve as spawn_serve
from remote_loader.server.config.file import read_config
from remote_loader.server.config.flags import add_spec_arguments, spec_from_args
from remote_loader.server.config.spec import ConfigError, LoaderSpec
from remote_loader.server.datasets import demo_spec

if TYPE_CHECKING:
    from remote_loader.server.sharing.host import LoaderHost

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
    # No token: the health service answers without one (server/api/auth.py).
    add_tls_arguments(health)

    top = sub.add_parser(
        "top",
        help="a live view of a server's loaders and trainers: is the GPU waiting?",
        description="Shows each loader (workers, busy, CPU, rates) and each trainer (stall, "
        "the stage holding it, rate, lag, with the last minute as sparklines), refreshed "
        "every --interval seconds; q or Ctrl-C quits. Token: --token-file or "
        "REMOTE_LOADER_TOKEN, as trainers send it.",
    )
    top.add_argument("address", help="HOST:PORT of a remote-loader server")
    top.add_argument("--once", action="store_true", help="print one plain-text snapshot and exit")
    top.add_argument(
        "--interval", type=float, default=1.0, help="seconds between refreshes (default 1)"
    )
    top.add_argument("--timeout", type=float, default=5.0, help="seconds per call (default 5)")
    top.add_argument("--token-file", help="file holding the server's token")
    add_tls_arguments(top)

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
    demo.add_argument(
        "--ray-address",
        help="run the workers as actors of this Ray cluster (HOST:PORT of its head), one CPU "
        "each (needs the ray extra)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "check-config":
        return _check_config(args.file)
    if args.command == "health":
        return _health(args.address, args.timeout, args.service, tls_from_args(args))
    if args.command == "top":
        from remote_loader.server.cli.top import run_top

        return run_top(args)
    return run_demo(args.trainers, args.epochs, args.batch_size, args.num_workers, args.ray_address)


def _serve(args: argparse.Namespace) -> int:
    from remote_loader.server.api.server import serve

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

    from remote_loader.server.sharing.host import LoaderHost

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
                f"{_pool_text(spec, settings.ray_address)}, "
                f"sharing {', '.join(spec.parts.sharing.modes)}, "
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
    pool = spec.parts.pool
    if pool.autotune:
        return f"num_workers auto (1 to max_workers {pool.max_workers})"
    return f"num_workers {pool.num_workers}"


def _pool_text(spec: LoaderSpec, ray_address: str | None) -> str:
    pool = spec.parts.pool
    if pool.num_workers == 0:
        return f"pool {pool.backend} (no workers: loads in the server process)"
    if pool.backend == "ray":
        where = f"ray_address {ray_address}" if ray_address else "a local Ray instance"
        return f"pool ray ({where}, ray_num_cpus {pool.ray_num_cpus:g})"
    return f"pool {pool.backend}"


def _health(address: str, timeout: float, service: str, tls: ClientTLS | None = None) -> int:
    """0 if `address` answers SERVING, 1 if it answers anything else, 2 if it does not answer."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        channel = open_channel(address, tls)
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


if __name__ == "__main__":
    sys.exit(main())
