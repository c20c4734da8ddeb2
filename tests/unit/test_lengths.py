"""A loader's length: a map-style dataset without __len__ needs a sampler, said in the spec's
own words.

The tests that start a server, a process or Ray: tests/integration/test_lengths.py.
"""

from __future__ import annotations

import multiprocessing

import pytest

from remote_loader.server.config.spec import ConfigError, LoaderSpec
from remote_loader.server.sharing.host import LoaderHost


def test_map_style_without_len_needs_a_sampler() -> None:
    ctx = multiprocessing.get_context("forkserver")  # only stored: no worker starts
    spec = LoaderSpec(name="a", dataset="tests.lengths:NoLen")
    with pytest.raises(ConfigError, match="map-style dataset NoLen has no __len__, and torch's"):
        LoaderHost(spec, ctx)
