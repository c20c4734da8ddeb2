"""Client arguments checked before any connection is made.

The tests that start a server, a process or Ray: tests/integration/test_client.py.
"""

from __future__ import annotations

import pytest

from remote_loader.client import RemoteLoader


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"prefetch": 0}, ValueError, "prefetch must be a positive integer"),
        ({"timeout": 0}, ValueError, "timeout must be positive"),
        ({"seed": "1"}, TypeError, "seed must be an int"),
        ({"device": "meta"}, ValueError, "device must be 'cpu' or a CUDA device"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        RemoteLoader("127.0.0.1:1", **kwargs)  # type: ignore[arg-type]
