"""LoaderSpec.parts (server/config/parts.py): the spec as each stage reads it, every value
resolved to the type it holds after construction; TOML, flags and fingerprint unchanged."""

from __future__ import annotations

import dataclasses
import pickle

from remote_loader.server.config.file import spec_from_table
from remote_loader.server.config.spec import LoaderSpec


def test_unset_values_are_resolved_to_what_holds() -> None:
    spec = LoaderSpec(name="a", dataset="tests.datasets:Squares", num_workers=2)
    pool, timeouts = spec.parts.pool, spec.parts.timeouts
    assert spec.prefetch_factor is None and pool.prefetch_factor == 2  # torch's default
    assert pool.max_workers == 2 and not pool.autotune
    assert pool.ray_runtime_env == {} and pool.backend == "local"
    # The sharing waits were all detach_timeout once; unset, they still are.
    assert (timeouts.detach, timeouts.group, timeouts.workers, timeouts.handback) == (30.0,) * 4
    assert timeouts.batch == 0
    assert spec.parts.batching.shuffle is False  # torch's shuffle=None
    assert spec.parts.sharing.modes == ("partition", "broadcast", "dynamic")


def test_auto_is_resolved_to_counts_and_flags() -> None:
    spec = spec_from_table(
        "auto",
        {
            "dataset": "tests.datasets:Squares",
            "num_workers": "auto",
            "max_workers": 3,
            "prefetch_factor": "auto",
            "seeding": "per_batch",
            "group_timeout": 4,
        },
    )
    pool = spec.parts.pool
    assert (pool.num_workers, pool.max_workers, pool.prefetch_factor) == (1, 3, 2)
    assert pool.autotune and pool.autotune_prefetch
    assert spec.parts.timeouts.group == 4 and spec.parts.timeouts.handback == 30.0


def test_parts_travel_with_the_spec_and_change_nothing_it_is_compared_by() -> None:
    spec = LoaderSpec(name="a", dataset="tests.datasets:Squares", detach_timeout=5)
    again = pickle.loads(pickle.dumps(spec))  # to worker processes and Ray actors
    assert again == spec and again.parts == spec.parts
    assert "parts" not in spec.to_json() and "_parts" not in repr(spec)
    renamed = dataclasses.replace(spec, name="b", broadcast_window=3)
    assert renamed.parts.sharing.broadcast_window == 3 and renamed.parts.timeouts.group == 5
    assert renamed.fingerprint() == spec.fingerprint()
