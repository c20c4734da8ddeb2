"""The `unit` mark's guard (tests/unit_guard.py) leaves a test without the mark alone: nothing it
may call is replaced. An inner pytest session in this process (pytester) runs a small test file
with the guard as its plugin.

The unit tests (no server, no process, no Ray): tests/unit/test_unit_guard.py.
"""

from __future__ import annotations

import pytest

from tests.helpers import UNIT_MARKER_INI

pytest_plugins = ["pytester"]


# Outside tests/unit/, so not marked unit (though it starts nothing): inside a unit test the inner
# test would see the outer guard's replacements.
def test_an_unmarked_test_is_left_alone(pytester: pytest.Pytester) -> None:
    pytester.makeini(UNIT_MARKER_INI)
    pytester.makeconftest('pytest_plugins = ["tests.unit_guard"]')
    pytester.makepyfile(
        test_inner="""
        import os
        import subprocess
        import grpc
        from remote_loader.server.api import server
        def test_nothing_is_replaced():
            for owner, name in [(server.Server, "__init__"), (server, "create_server"),
                                (grpc, "server"), (subprocess.Popen, "__init__"), (os, "fork")]:
                assert getattr(owner, name).__name__ != "refused", (owner, name)
        """
    )
    reprec = pytester.inline_run("-p", "no:cacheprovider", "--assert=plain")
    reprec.assertoutcome(passed=1)
