"""Loader specs: what a server hosts, read from a TOML file (server/config/file.py) or from
command-line flags (server/config/flags.py).

A spec names code by import path ("module:callable") and holds only plain values, so it can be
fingerprinted, logged and handed to worker processes, which build the dataset themselves.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import multiprocessing.context
import os
import sys
from collections.abc import Mapping
from typing import Any

from remote_loader.server.config.parts import (
    BatchingPart,
    DatasetPart,
    PoolPart,
    SharingPart,
    SpecParts,
    Timeouts,
)
from remote_loader.server.config.types import (
    POOL_BACKENDS,
    SEEDING_MODES,
    SHARING_MODES,
    PoolBackend,
    Seeding,
    Sharing,
)

# num_workers = AUTO: the server sizes the pool itself (LoaderSpec.autotune).
AUTO = "auto"


class ConfigError(ValueError):
    """A config file or flag that cannot be turned into a loader spec."""


# The sharing waits, each in seconds (see LoaderSpec): detach_timeout, and those that were
# detach_timeout until they got names of their own (None: as detach_timeout).
SHARING_TIMEOUTS = ("detach_timeout", "group_timeout", "workers_timeout", "handback_timeout")


@dataclasses.dataclass(frozen=True)
class LoaderSpec:
    """One named loader: a dataset factory and the torch DataLoader options to run it with.

    Option names, defaults and meaning are those of `torch.utils.data.DataLoader`; code-valued
    options are "module:callable" import paths. `sampler` and `batch_sampler` name factories
    called as `factory(dataset, **kwargs)` (plus `generator=` when the factory accepts it, see
    server/config/sampling.py), once per epoch.
    """

    name: str
    dataset: str
    dataset_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    batch_size: int | None = 1
    shuffle: bool | None = None
    sampler: str | None = None
    sampler_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    batch_sampler: str | None = None
    batch_sampler_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    drop_last: bool = False
    collate_fn: str | None = None
    num_workers: int = 0
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    worker_init_fn: str | None = None
    timeout: float = 0
    in_order: bool = True
    # torch's start method for the workers: "fork", "spawn" or "forkserver" (a context object
    # is kept as its name), checked by torch when the loader is built (its messages). Accepted
    # so a DataLoader's keywords carry over; the server starts every loader's workers the same
    # way whatever it says: forked from the server's fork server, a process started before
    # gRPC that holds no gRPC thread (grpc/grpc#16001), never from the server itself. Each
    # worker starts from the loader's one dataset, pickled once in the server (NOTE [ One
    # dataset per loader ] in server/worker/dataset.py), as "spawn" and "forkserver" give it;
    # what "fork" alone would add, the rest of the server process's state, is not inherited (a
    # dataset that cannot be pickled is built by each worker, with a warning).
    multiprocessing_context: str | None = None
    seed: int = 0
    # See config/types.py; "per_batch" makes a batch independent of which worker made it, of the
    # worker count, of respawns and of where an epoch was resumed.
    seeding: Seeding = "worker"
    # Sharing between consumers (not DataLoader options; see server/sharing/runs.py). `sharing`
    # lists the modes clients may ask for. `partition_drop_last` is DistributedSampler's drop_last:
    # false pads the shares to equal length with repeated samples, true drops the tail.
    # `broadcast_window` bounds how many batches the fastest broadcast consumer may be ahead of
    # the slowest; `detach_timeout` is how long a stalled broadcast consumer may hold the
    # others. The three waits after it were all detach_timeout once; None still means that.
    sharing: tuple[Sharing, ...] = SHARING_MODES
    partition_drop_last: bool = False
    broadcast_window: int = 8
    detach_timeout: float = 30.0
    # broadcast with world_size N: how long nothing is retired while the group joins.
    group_timeout: float | None = None
    # how long a new Run waits for the job's persistent workers, held by its previous epoch.
    workers_timeout: float | None = None
    # dynamic, at the end of the epoch: how long a consumer waits for batches a peer holds
    # (and would hand back if it went away) before its stream ends.
    handback_timeout: float | None = None
    # Where the workers run (config/types.py; not DataLoader options): with "ray", each worker is
    # an actor asking `ray_num_cpus` CPUs of the cluster at the server's ray_address.
    pool: PoolBackend = "local"
    ray_num_cpus: float = 1.0
    # The Ray runtime_env of the loader's actors (RAY_RUNTIME_ENV_KEYS): the code and packages
    # they need where the cluster's nodes do not have them (docs/ray.md, "Where the actors find
    # the code").
    ray_runtime_env: dict[str, Any] | None = None
    # num_workers = "auto" (AUTO; given as the string, in a config, a flag or here) sets
    # `autotune`: the pool starts with one worker and the server adds workers, up to
    # `max_workers` (default: this host's CPUs), while they are all busy and the host has idle
    # CPU, and removes them while they idle (server/engine/autotune.py). It needs seeding =
    # "per_batch" (a batch must not depend on which worker made it) and a map-style dataset.
    autotune: bool = False
    max_workers: int | None = None
    # With autotune: no worker is added if the pool's batches in flight (prefetch_factor per
    # worker, each as big as the largest batch seen) would then pass this many bytes of
    # shared memory. None: no bound but max_workers (and max_batch_bytes per batch).
    max_pool_bytes: int | None = None
    # prefetch_factor = "auto" sets this: the pool's tasks in flight per worker start at 2 and
    # move between 2 and 8 (server/engine/autotune.py). Batches do not depend on it.
    autotune_prefetch: bool = False

    def __post_init__(self) -> None:
        where = f"loader {self.name!r}"
        self._check_auto(where)
        context: object = self.multiprocessing_context
        if isinstance(context, multiprocessing.context.BaseContext):
            # What torch accepts from Python; the spec keeps plain values (fingerprint, logs).
            # allow_none: the default context would otherwise fix this process's start method.
            method = context.get_start_method(allow_none=True)
            default = multiprocessing.get_all_start_methods()[0]  # the platform's default
            object.__setattr__(self, "multiprocessing_context", method or default)
        modes = tuple(self.sharing)
        unknown = [m for m in modes if m not in SHARING_MODES]
        if not modes or unknown:
            raise ConfigError(
                f"{where}: sharing must list one or more of {', '.join(SHARING_MODES)}, "
                f"got {list(modes)!r}"
            )
        object.__setattr__(self, "sharing", modes)
        if self.seeding not in SEEDING_MODES:
            raise ConfigError(
                f"{where}: seeding must be one of {', '.join(SEEDING_MODES)}, got {self.seeding!r}"
            )
        if not -(2**63) <= self.seed <= 2**63 - 1:
            # LoaderInfo.seed is an int64: a seed outside it could not be told to clients.
            raise ConfigError(
                f"{where}: seed must be between {-(2**63)} and {2**63 - 1} (int64), got {self.seed}"
            )
        if self.pool not in POOL_BACKENDS:
            raise ConfigError(
                f"{where}: pool must be one of {', '.join(POOL_BACKENDS)}, got {self.pool!r}"
            )
        if self.pool == "ray" and self.num_workers < 1:
            raise ConfigError(
                f'{where}: pool = "ray" runs the workers as Ray actors; it needs '
                f"num_workers >= 1, got {self.num_workers} (0 loads in the server itself)"
            )
        if self.ray_runtime_env is not None:
            check_runtime_env(where, self.pool, self.ray_runtime_env)
        if not self.ray_num_cpus >= 0:
            raise ConfigError(
                f"{where}: ray_num_cpus must be >= 0 (CPUs each Ray worker asks of the "
                f"cluster), got {self.ray_num_cpus}"
            )
        if self.broadcast_window < 1:
            raise ConfigError(
                f"{where}: broadcast_window must be at least 1 batch, got {self.broadcast_window}"
            )
        for key in SHARING_TIMEOUTS:
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ConfigError(
                    f"{where}: {key} must be a positive number of seconds, got {value}"
                )
            if value is None:  # as detach_timeout, which all four were once
                object.__setattr__(self, key, self.detach_timeout)
        # Not a field: eq, repr, asdict and the fingerprint ignore it; pickled with the spec.
        object.__setattr__(self, "_parts", self._resolve())

    @property
    def parts(self) -> SpecParts:
        """The spec resolved, one part per stage (server/config/parts.py)."""
        parts: SpecParts = self.__dict__["_parts"]
        return parts

    def _resolve(self) -> SpecParts:
        prefetch = self.prefetch_factor if self.prefetch_factor is not None else 2
        max_workers = self.max_workers if self.max_workers is not None else self.num_workers
        timeouts = [getattr(self, key) for key in SHARING_TIMEOUTS]
        assert all(t is not None for t in timeouts)  # resolved above
        return SpecParts(
            dataset=DatasetPart(self.dataset, self.dataset_kwargs),
            batching=BatchingPart(
                shuffle=bool(self.shuffle), in_order=self.in_order, seeding=self.seeding
            ),
            pool=PoolPart(
                backend=self.pool,
                num_workers=self.num_workers,
                prefetch_factor=prefetch,
                persistent_workers=self.persistent_workers,
                worker_init_fn=self.worker_init_fn,
                autotune=self.autotune,
                autotune_prefetch=self.autotune_prefetch,
                max_workers=max_workers,
                max_pool_bytes=self.max_pool_bytes,
                ray_num_cpus=self.ray_num_cpus,
                ray_runtime_env=dict(self.ray_runtime_env or {}),
            ),
            sharing=SharingPart(self.sharing, self.partition_drop_last, self.broadcast_window),
            timeouts=Timeouts(self.timeout, *timeouts),
        )

    def _check_auto(self, where: str) -> None:
        if self.num_workers == AUTO:  # type: ignore[comparison-overlap]
            object.__setattr__(self, "num_workers", 1)
            object.__setattr__(self, "autotune", True)
        if self.prefetch_factor == AUTO:  # type: ignore[comparison-overlap]
            object.__setattr__(self, "prefetch_factor", 2)  # torch's default: its checks apply
            object.__setattr__(self, "autotune_prefetch", True)
        if not self.autotune:
            for key in ("max_workers", "max_pool_bytes"):
                if getattr(self, key) is not None:
                    raise ConfigError(f'{where}: {key} goes with num_workers = "auto"')
            return
        if self.seeding != "per_batch":
            raise ConfigError(
                f'{where}: num_workers = "auto" changes the worker count mid-epoch, so a batch '
                'must not depend on which worker made it: set seeding = "per_batch"'
            )
        if self.max_workers is None:
            object.__setattr__(self, "max_workers", os.cpu_count() or 1)
        assert self.max_workers is not None
        if self.max_workers < 1:
            raise ConfigError(f"{where}: max_workers must be at least 1, got {self.max_workers}")
        if self.max_pool_bytes is not None and self.max_pool_bytes < 1:
            raise ConfigError(
                f"{where}: max_pool_bytes must be at least 1 byte, got {self.max_pool_bytes}"
            )

    def to_json(self) -> dict[str, Any]:
        """The spec as plain JSON values (batch_size None stays None)."""
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """A digest of everything that decides which batches an epoch holds.

        The name is left out (renaming a loader does not change its data); num_workers,
        prefetch_factor, persistent_workers, timeout, in_order and multiprocessing_context are
        left out too, since batch contents and order do not depend on them, and so are the
        sharing options that only decide who may attach and how long they may lag, and where
        the workers run.

        Computed once: the spec is frozen, and every stream's request is checked against it.
        """
        cached: str | None = self.__dict__.get("_fingerprint")
        if cached is not None:
            return cached
        decisive = self.to_json()
        for key in (
            "name",
            "num_workers",
            "prefetch_factor",
            "persistent_workers",
            "timeout",
            "in_order",
            "multiprocessing_context",
            "sharing",
            "broadcast_window",
            *SHARING_TIMEOUTS,
            "pool",
            "ray_num_cpus",
            "ray_runtime_env",
            "autotune",
            "autotune_prefetch",
            "max_workers",
            "max_pool_bytes",
        ):
            decisive.pop(key)
        text = json.dumps(decisive, sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        object.__setattr__(self, "_fingerprint", digest)  # not a field: frozen, eq, repr ignore it
        return digest

    def options_text(self) -> dict[str, str]:
        """The options as text, for Describe and logs."""
        return {k: json.dumps(v, sort_keys=True) for k, v in self.to_json().items() if k != "name"}


# The runtime_env keys a loader may give its Ray actors, and what each must be: the code and
# packages they import (Ray's own meaning: docs.ray.io, "Runtime environments").
RAY_RUNTIME_ENV_KEYS = {
    "working_dir": "a path to a local folder or a URI of a zip (str)",
    "py_modules": "a list of local folders, .py/.whl files or URIs (list of str)",
    "pip": "a list of requirements, or a requirements.txt path (list of str, or str)",
    "env_vars": "environment variables (a table of str to str)",
}


def check_runtime_env(where: str, pool: str, env: Mapping[str, Any]) -> None:
    """Raises ConfigError when `env` is not a runtime_env this server passes to Ray."""
    allowed = ", ".join(RAY_RUNTIME_ENV_KEYS)
    if pool != "ray":
        raise ConfigError(f'{where}: ray_runtime_env is for pool = "ray", got pool = {pool!r}')
    if not isinstance(env, Mapping):
        raise ConfigError(f"{where}: ray_runtime_env must be a table of {allowed}, got {env!r}")
    for key, value in env.items():
        if key not in RAY_RUNTIME_ENV_KEYS:
            raise ConfigError(
                f"{where}: ray_runtime_env has an unknown key {key!r}; allowed: {allowed}"
            )
        strings = isinstance(value, list) and all(isinstance(v, str) for v in value)
        ok = {
            "working_dir": isinstance(value, str),
            "py_modules": strings,
            "pip": strings or isinstance(value, str),
            "env_vars": isinstance(value, Mapping)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()),
        }[key]
        if not ok:
            raise ConfigError(
                f"{where}: ray_runtime_env.{key} must be {RAY_RUNTIME_ENV_KEYS[key]}, got {value!r}"
            )


def resolve(path: str, what: str = "object") -> Any:
    """Imports "package.module:attr.sub" and returns the attribute, with a clear error."""
    module_name, sep, attr_path = path.partition(":")
    if not sep or not module_name or not attr_path:
        raise ConfigError(f"{what} {path!r} is not an import path: expected 'module:callable'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{what} {path!r}: cannot import module {module_name!r}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            # Which file was imported: a module of the same name earlier on sys.path (a
            # folder where the server or a Ray actor was started) shadows the one meant.
            module = sys.modules.get(module_name)
            origin = getattr(module, "__file__", None) or list(getattr(module, "__path__", []))
            raise ConfigError(
                f"{what} {path!r}: module {module_name!r} has no attribute {attr_path!r} "
                f"(the module imported is {origin}; is another {module_name!r} earlier on "
                "sys.path?)"
            ) from exc
    if not callable(obj):
        raise ConfigError(f"{what} {path!r} is not callable (got {type(obj).__name__})")
    return obj
