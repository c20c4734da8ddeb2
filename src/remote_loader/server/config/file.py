"""The config file: the `[loaders.NAME]` tables of a TOML file, each option's value checked
against its type and made into a LoaderSpec, and its `[server]` table handed on to the server's
settings (server/api/settings.py).
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from remote_loader.server.config.spec import AUTO, SHARING_TIMEOUTS, ConfigError, LoaderSpec
from remote_loader.server.config.types import POOL_BACKENDS, SEEDING_MODES, SHARING_MODES

# TOML has no null. `batch_size = "none"` (any case) spells torch's batch_size=None: no
# automatic batching, each sample is converted (default_convert) and sent as its own batch.
BATCH_SIZE_NONE = "none"

_FIELDS = {f.name: f for f in dataclasses.fields(LoaderSpec)}
_IMPORT_PATH_KEYS = ("dataset", "sampler", "batch_sampler", "collate_fn", "worker_init_fn")
_KWARGS_KEYS = ("dataset_kwargs", "sampler_kwargs", "batch_sampler_kwargs")


def _check_type(name: str, key: str, value: Any) -> Any:
    """Checks one TOML value against the field's type; returns it normalised."""
    where = f"loader {name!r}: option {key!r}"
    if key == "batch_size":
        if isinstance(value, str):
            if value.lower() != BATCH_SIZE_NONE:
                raise ConfigError(
                    f"{where} must be an integer or {BATCH_SIZE_NONE!r}, got {value!r}"
                )
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{where} must be an integer or {BATCH_SIZE_NONE!r}, got {value!r}")
        return value
    if key in _IMPORT_PATH_KEYS:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be an import path 'module:callable', got {value!r}")
        return value
    if key in _KWARGS_KEYS:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a table of keyword arguments, got {value!r}")
        return dict(value)
    if key == "sharing":
        if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
            raise ConfigError(
                f"{where} must be a list of modes ({', '.join(SHARING_MODES)}), got {value!r}"
            )
        return tuple(value)
    if key == "multiprocessing_context":
        if not isinstance(value, str):
            # torch's own check (server/config/sampling.py) judges the name, with its message.
            raise ConfigError(
                f"{where} must be a start method's name (fork, spawn, forkserver), got {value!r}"
            )
        return value
    if key in ("seeding", "pool"):
        modes = SEEDING_MODES if key == "seeding" else POOL_BACKENDS
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be one of {', '.join(modes)}, got {value!r}")
        return value
    if key in ("shuffle", "drop_last", "persistent_workers", "in_order", "partition_drop_last"):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if key in ("num_workers", "prefetch_factor") and value == AUTO:
        return value
    if key in ("max_workers", "max_pool_bytes"):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if key in ("autotune", "autotune_prefetch"):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if key in ("num_workers", "prefetch_factor", "seed", "broadcast_window"):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if key == "timeout" or key in SHARING_TIMEOUTS:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConfigError(f"{where} must be a number of seconds, got {value!r}")
        return float(value)
    if key == "ray_num_cpus":
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConfigError(f"{where} must be a number of CPUs, got {value!r}")
        return float(value)
    if key == "ray_runtime_env":
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a table (Ray's runtime_env), got {value!r}")
        return dict(value)
    raise AssertionError(key)  # every field is handled above


def spec_from_table(name: str, table: Mapping[str, Any]) -> LoaderSpec:
    """Builds a spec from one `[loaders.NAME]` table, checking names and types (not conflicts)."""
    unknown = sorted(set(table) - (set(_FIELDS) - {"name"}))
    if unknown:
        allowed = ", ".join(sorted(set(_FIELDS) - {"name"}))
        raise ConfigError(
            f"loader {name!r}: unknown option(s) {', '.join(unknown)}; allowed: {allowed}"
        )
    if "dataset" not in table:
        raise ConfigError(
            f"loader {name!r}: 'dataset' is required (an import path "
            "'module:callable' that returns the dataset)"
        )
    values = {key: _check_type(name, key, value) for key, value in table.items()}
    return LoaderSpec(name=name, **values)


def read_config(path: str | Path) -> tuple[dict[str, LoaderSpec], dict[str, Any] | None]:
    """The `[loaders.NAME]` specs of a TOML config file, and its `[server]` table (if any)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {str(path)!r} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from exc
    loaders = doc.get("loaders")
    if not isinstance(loaders, dict) or not loaders:
        raise ConfigError(
            f"config file {str(path)!r} defines no loader: add a [loaders.NAME] "
            'table with at least `dataset = "module:callable"`'
        )
    unknown = sorted(set(doc) - {"loaders", "server"})
    if unknown:
        raise ConfigError(
            f"config file {str(path)!r}: unknown table(s) {', '.join(unknown)}; "
            "allowed: [server] and [loaders.NAME]"
        )
    server = doc.get("server")
    if server is not None and not isinstance(server, dict):
        raise ConfigError(f"config file {str(path)!r}: server must be a table")
    specs = {}
    for name, table in loaders.items():
        if not isinstance(table, dict):
            raise ConfigError(f"config file {str(path)!r}: loaders.{name} must be a table")
        specs[name] = spec_from_table(name, table)
    return specs, server


def load_config(path: str | Path) -> dict[str, LoaderSpec]:
    """Reads the `[loaders.NAME]` tables of a TOML config file."""
    return read_config(path)[0]
