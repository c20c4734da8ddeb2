"""`remote-loader top`'s sparkline: the mean of each share, scaled to the top.

The tests that start a server, a process or Ray: tests/integration/test_top.py.
"""

from __future__ import annotations

from remote_loader.server.cli.top import ASCII_SPARKS, SPARKS, sparkline


def test_a_sparkline_is_the_mean_of_each_share_scaled_to_the_top() -> None:
    assert sparkline([0.0, 1.0], 1.0, 10) == SPARKS[0] + SPARKS[-1]
    assert sparkline([0.0, 0.0, 1.0, 1.0], 1.0, 2) == SPARKS[0] + SPARKS[-1]
    assert sparkline([2.0, 4.0], 0.0, 5, ASCII_SPARKS) == ASCII_SPARKS[4] + ASCII_SPARKS[-1]
    assert sparkline([], 1.0, 5) == ""
