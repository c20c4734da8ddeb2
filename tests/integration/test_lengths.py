"""A loader's length: a map-style dataset whose __len__ raises (or that has none) is refused
at start-up and by check-config with its own words, never taken for an IterableDataset.

The unit tests (no server, no process, no Ray): tests/unit/test_lengths.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from remote_loader.client import RemoteLoader
from remote_loader.server.cli.main import serve_command
from remote_loader.server.config.spec import LoaderSpec
from tests.helpers import StartServer, subprocess_env

BROKEN_LEN = (
    "its map-style dataset BrokenLen has __len__, but len(dataset) raised TypeError: "
    "object of type 'NoneType' has no len()"
)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*args], capture_output=True, text=True, timeout=90, env=subprocess_env())


def _config(tmp_path: Path, body: str) -> str:
    path = tmp_path / "c.toml"
    path.write_text(f"[loaders.a]\n{body}\n")
    return str(path)


def test_check_config_reports_the_exception_of_a_broken_len(tmp_path: Path) -> None:
    config = _config(tmp_path, 'dataset = "tests.lengths:BrokenLen"')
    result = _run(sys.executable, "-m", "remote_loader.server.cli.main", "check-config", config)
    assert result.returncode == 2, result.stdout
    assert f"loader 'a': {BROKEN_LEN}" in result.stderr
    assert "IterableDataset" not in result.stdout + result.stderr


def test_serve_refuses_a_broken_len_at_start(tmp_path: Path) -> None:
    config = _config(tmp_path, 'dataset = "tests.lengths:BrokenLen"\nnum_workers = 1')
    result = _run(*serve_command(["--config", config]))
    assert result.returncode == 2, result.stdout
    assert BROKEN_LEN in result.stderr
    assert "serving" not in result.stdout


def test_map_style_without_len_is_not_called_iterable(
    tmp_path: Path, start_server: StartServer
) -> None:
    body = 'dataset = "tests.lengths:NoLen"\nsampler = "tests.lengths:FirstTen"'
    result = _run(
        sys.executable,
        "-m",
        "remote_loader.server.cli.main",
        "check-config",
        _config(tmp_path, body),
    )
    assert result.returncode == 0, result.stderr
    assert "a: tests.lengths:NoLen, map dataset, batch_size 1, length unknown (map-style, but " in (
        result.stdout
    )
    assert "IterableDataset" not in result.stdout

    spec = LoaderSpec(name="a", dataset="tests.lengths:NoLen", sampler="tests.lengths:FirstTen")
    with RemoteLoader(start_server(spec), "a") as loader:
        with pytest.raises(TypeError, match="map-style, but its sampler or batch_sampler"):
            len(loader)
        assert [int(b) for b in loader] == list(range(10))
