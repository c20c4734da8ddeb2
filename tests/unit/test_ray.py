"""The Ray pool's configuration, without a cluster: `pool = "ray"` checked in the spec, and the
compose file's Ray config read as a Ray pool.

The tests that start a server, a process or Ray: tests/integration/test_ray.py.
"""

from __future__ import annotations

import pytest

from remote_loader.server.api.settings import resolve_settings
from remote_loader.server.config.file import read_config
from remote_loader.server.config.spec import ConfigError, LoaderSpec


def test_pool_ray_is_checked_in_the_spec() -> None:
    with pytest.raises(ConfigError, match="pool must be one of local, ray"):
        # A typo is a type error (config/types.py), and at run time this ConfigError.
        LoaderSpec(name="x", dataset="tests.datasets:Squares", pool="slurm")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="needs num_workers >= 1"):
        LoaderSpec(name="x", dataset="tests.datasets:Squares", pool="ray")


def test_the_compose_ray_config_serves_a_ray_pool() -> None:
    specs, table = read_config("docker/loaders-ray.toml")
    assert {spec.pool for spec in specs.values()} == {"ray"}
    assert resolve_settings(table, {}).ray_address == "auto"
