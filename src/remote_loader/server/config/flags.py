"""The `serve` flags that define a single loader (`--dataset mypkg.data:make --batch-size 32
...`): the same LoaderSpec a `[loaders.NAME]` table makes, with the same checks."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from remote_loader.server.config.file import BATCH_SIZE_NONE
from remote_loader.server.config.spec import AUTO, SHARING_TIMEOUTS, ConfigError, LoaderSpec
from remote_loader.server.config.types import POOL_BACKENDS, SEEDING_MODES, SHARING_MODES

_FIELDS = {field.name for field in dataclasses.fields(LoaderSpec)}


def _json_table(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _batch_size(text: str) -> int | None:
    if text.lower() == BATCH_SIZE_NONE:
        return None
    try:
        return int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected an integer or {BATCH_SIZE_NONE!r}") from exc


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the flags that define one loader without a config file."""
    g = parser.add_argument_group("a single loader (instead of --config)")
    g.add_argument("--name", default="default", help="loader name (default: %(default)s)")
    g.add_argument("--dataset", help="dataset factory, 'module:callable'")
    g.add_argument("--dataset-kwargs", type=_json_table, default={}, metavar="JSON")
    g.add_argument("--batch-size", type=_batch_size, default=1, metavar="N|none")
    g.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--sampler", metavar="module:callable")
    g.add_argument("--sampler-kwargs", type=_json_table, default={}, metavar="JSON")
    g.add_argument("--batch-sampler", metavar="module:callable")
    g.add_argument("--batch-sampler-kwargs", type=_json_table, default={}, metavar="JSON")
    g.add_argument("--drop-last", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument("--collate-fn", metavar="module:callable")
    g.add_argument(
        "--num-workers",
        type=lambda text: text if text == AUTO else int(text),
        default=0,
        metavar="N|auto",
    )
    g.add_argument("--max-workers", type=int, default=None, metavar="N")
    g.add_argument("--max-pool-bytes", type=int, default=None, metavar="BYTES")
    g.add_argument(
        "--prefetch-factor",
        type=lambda text: text if text == AUTO else int(text),
        default=None,
        metavar="N|auto",
    )
    g.add_argument("--persistent-workers", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument("--worker-init-fn", metavar="module:callable")
    g.add_argument("--timeout", type=float, default=0.0)
    g.add_argument("--in-order", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument(
        "--multiprocessing-context",
        default=None,
        metavar="fork|spawn|forkserver",
        help="accepted as torch's DataLoader accepts it; workers always start from the "
        "server's fork server (see docs/serving.md, Options)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--seeding", choices=SEEDING_MODES, default="worker")
    g.add_argument(
        "--sharing",
        type=lambda text: tuple(m.strip() for m in text.split(",") if m.strip()),
        default=SHARING_MODES,
        metavar="MODE[,MODE]",
        help="sharing modes clients may ask for (default: all of %(default)s)",
    )
    g.add_argument("--partition-drop-last", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument("--broadcast-window", type=int, default=8, metavar="BATCHES")
    g.add_argument("--detach-timeout", type=float, default=30.0, metavar="SECONDS")
    for key in SHARING_TIMEOUTS[1:]:
        g.add_argument(f"--{key.replace('_', '-')}", type=float, default=None, metavar="SECONDS")
    g.add_argument(
        "--pool",
        choices=POOL_BACKENDS,
        default="local",
        help="where the workers run: processes of this server, or actors on a Ray cluster "
        "(see --ray-address; default: %(default)s)",
    )
    g.add_argument("--ray-num-cpus", type=float, default=1.0, metavar="CPUS")


def spec_from_args(args: argparse.Namespace) -> LoaderSpec:
    """The spec defined by add_spec_arguments' flags."""
    if not args.dataset:
        raise ConfigError("no loader given: pass --config FILE, or --dataset module:callable")
    values = {key: getattr(args, key) for key in _FIELDS if hasattr(args, key)}
    return LoaderSpec(**values)
