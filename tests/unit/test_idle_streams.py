"""idle_stream_timeout (NOTE [ Idle streams ] in server/api/admission.py) as a setting of
seconds.

The tests that start a server, a process or Ray: tests/integration/test_idle_streams.py.
"""

from __future__ import annotations

import pytest

from remote_loader.server.api.settings import ServerSettings, resolve_settings
from remote_loader.server.config.spec import ConfigError


def test_idle_stream_timeout_is_a_setting_of_seconds() -> None:
    env = {"REMOTE_LOADER_IDLE_STREAM_TIMEOUT": "2.5"}
    assert resolve_settings({"idle_stream_timeout": 5}, env).idle_stream_timeout == 2.5
    assert resolve_settings({"idle_stream_timeout": 0}, {}).idle_stream_timeout == 0
    with pytest.raises(ConfigError, match=r"idle_stream_timeout must be >= 0 seconds .*got -1"):
        ServerSettings(idle_stream_timeout=-1)
