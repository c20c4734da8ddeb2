"""The server of benchmarks/ray_hosts.py in the coord namespace (benchmarks/ray_cluster.py), and
the local torch epoch its batches are compared with."""

from __future__ import annotations

import argparse
import os
import select
import subprocess
import sys
import tempfile
from typing import Any

import torch
from torch.utils.data import DataLoader

from benchmarks.ray_cluster import Hosts, ip
from benchmarks.workloads import Heavy, Images
from remote_loader.server.cli.demo import SERVE_START_TIMEOUT

WORKLOADS = {"images": Images, "heavy": Heavy}
# Where a server started with `metrics=True` serves Prometheus metrics: a port of coord's own
# namespace, so no other process of the machine can hold it.
METRICS_PORT = 9464


def serve(
    hosts: Hosts,
    args: argparse.Namespace,
    ray_address: str,
    nodes: int,
    env: dict[str, str],
    log: Any,
    metrics: bool = False,
) -> tuple[subprocess.Popen[str], str]:
    """The server in coord, logging at INFO into the file `log` (a pipe nobody reads while the
    epochs run would fill and stop it); with `metrics`, its /metrics on METRICS_PORT (the fault
    rows read the pool's size there, as an operator would)."""
    scraped = f'metrics_address = "{ip("coord")}:{METRICS_PORT}"' if metrics else ""
    text = f"""
[server]
ray_address = "{ray_address}"
ray_direct = {"false" if args.through_store else "true"}
ray_node_fetch = {"false" if args.through_server else "true"}
{scraped}
[loaders.bench]
dataset = "benchmarks.workloads:{WORKLOADS[args.workload].__name__}"
dataset_kwargs = {{ n = {args.batches * args.batch_size} }}
batch_size = {args.batch_size}
num_workers = {2 * nodes}
persistent_workers = true
pool = "ray"
ray_num_cpus = 1
"""
    # In the cluster's session folder, which the run deletes at its end.
    fd, path = tempfile.mkstemp(suffix=".toml", prefix="ray-hosts-", dir=env["RAY_TMPDIR"])
    with os.fdopen(fd, "w") as f:
        f.write(text)
    argv = [
        sys.executable,
        "-m",
        "remote_loader.server.cli.main",
        "serve",
        "--config",
        path,
        "--address",
        f"{ip('coord')}:0",
        "--log-level",
        "INFO",
    ]
    proc = hosts.start(
        "coord", argv, env, own_shm=True, stdout=subprocess.PIPE, stderr=log, text=True
    )
    assert proc.stdout is not None
    # Bounded: a server stuck before it listens must not hang the benchmark.
    ready, _, _ = select.select([proc.stdout], [], [], SERVE_START_TIMEOUT)
    line = proc.stdout.readline() if ready else ""  # "remote-loader: serving ... on port N"
    if "port" not in line:
        proc.kill()
        log.seek(0)
        raise RuntimeError(f"the server did not start: {log.read()}")
    return proc, f"{ip('coord')}:{line.strip().rsplit(' ', 1)[-1]}"


def expected(args: argparse.Namespace) -> list[Any]:
    # Map-style by protocol, not class.
    dataset: Any = WORKLOADS[args.workload](args.batches * args.batch_size)
    return list(DataLoader(dataset, batch_size=args.batch_size))


def same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and torch.equal(got, want)
    if isinstance(want, list | tuple):
        return len(got) == len(want) and all(same(a, b) for a, b in zip(got, want, strict=True))
    return bool(got == want)
