"""A RemoteLoader pointed at an address where no server listens fails at once, saying so.

The tests that start a server, a process or Ray: tests/integration/test_service.py.
"""

from __future__ import annotations

import pytest

from remote_loader.client import (
    ConnectionLostError,
    RemoteLoader,
)


def test_unreachable_server_fails_clearly() -> None:
    # Refused at once: no retries, no wait (tests/integration/test_connect.py times the retries).
    with pytest.raises(
        ConnectionLostError, match=r"cannot reach 127\.0\.0\.1:1 \(1 attempt .*Connection refused"
    ):
        RemoteLoader("127.0.0.1:1", retries=0)
