"""metrics_max_consumers, the bound on the consumers the metrics name, as a setting.

The tests that start a server, a process or Ray: tests/integration/test_observability.py.
"""

from __future__ import annotations

import pytest

from remote_loader.server.api.settings import ServerSettings, resolve_settings
from remote_loader.server.config.spec import ConfigError


def test_metrics_max_consumers_is_a_setting() -> None:
    env = {"REMOTE_LOADER_METRICS_MAX_CONSUMERS": "8"}
    assert resolve_settings({"metrics_max_consumers": 4}, env).metrics_max_consumers == 8
    with pytest.raises(ConfigError, match=r"metrics_max_consumers must be >= 0 .*got -1"):
        ServerSettings(metrics_max_consumers=-1)
