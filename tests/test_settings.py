"""Server settings: the [server] table, REMOTE_LOADER_* variables and flags, in that order."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from remote_loader.client import RemoteLoader
from remote_loader.server.settings import ServerSettings, resolve_settings
from remote_loader.server.spec import ConfigError, read_config
from tests.conftest import ROOT

LOADER = '[loaders.a]\ndataset = "tests.datasets:Squares"\n'


def test_precedence_flag_then_environment_then_file_then_default() -> None:
    assert resolve_settings(None, {}) == ServerSettings()
    table = {"max_streams": 8, "grace": 2, "address": "127.0.0.1:7000"}
    from_file = resolve_settings(table, {})
    assert (from_file.max_streams, from_file.grace, from_file.address) == (8, 2.0, "127.0.0.1:7000")
    env = {"REMOTE_LOADER_MAX_STREAMS": "4", "REMOTE_LOADER_LOG_LEVEL": "debug"}
    from_env = resolve_settings(table, env)
    assert (from_env.max_streams, from_env.log_level, from_env.grace) == (4, "DEBUG", 2.0)
    flagged = resolve_settings(table, env, {"max_streams": 2, "grace": None})
    assert (flagged.max_streams, flagged.grace) == (2, 2.0)  # None: the flag was not given


@pytest.mark.parametrize(
    ("table", "env", "message"),
    [
        ({"max_streams": 0}, {}, "max_streams must be at least 1, got 0"),
        ({"max_streams": "8"}, {}, r"\[server\] max_streams must be an integer, got '8'"),
        ({"colour": "red"}, {}, r"unknown setting\(s\) colour; allowed: address, max_streams"),
        ({"address": "localhost"}, {}, "address must be HOST:PORT"),
        ({"chunk_size": 1 << 30}, {}, "chunk_size must be between 1 and 67108864 bytes"),
        ({"grace": -1}, {}, "grace must be >= 0 seconds"),
        ({}, {"REMOTE_LOADER_GRACE": "soon"}, "REMOTE_LOADER_GRACE='soon' must be a number"),
        ({}, {"REMOTE_LOADER_LOG_LEVEL": "LOUD"}, "log_level must be DEBUG, INFO"),
    ],
)
def test_bad_settings_say_what_is_wrong(
    table: dict[str, object], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_settings(table, env)


def test_config_file_tables(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[server]\naddress = "127.0.0.1:0"\nmax_streams = 3\n\n' + LOADER)
    specs, server = read_config(path)
    assert list(specs) == ["a"] and server == {"address": "127.0.0.1:0", "max_streams": 3}
    path.write_text(LOADER + "\n[metrics]\nport = 9000\n")
    with pytest.raises(ConfigError, match=r"unknown table\(s\) metrics"):
        read_config(path)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "remote_loader.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def test_check_config_shows_the_resolved_settings(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[server]\nmax_streams = 3\ngrace = 1.5\n\n" + LOADER)
    result = _cli("check-config", str(path), env={"REMOTE_LOADER_MAX_STREAMS": "6"})
    assert result.returncode == 0, result.stderr
    assert "server: address 0.0.0.0:50051, max_streams 6, chunk_size 4194304, grace 1.5" in (
        result.stdout
    )
    path.write_text("[server]\nmax_streams = 0\n\n" + LOADER)
    result = _cli("check-config", str(path))
    assert result.returncode == 2 and "max_streams must be at least 1" in result.stderr


def test_serve_listens_where_the_server_table_says(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[server]\naddress = "127.0.0.1:0"\n\n' + LOADER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "remote_loader.server.cli", "serve", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()  # "remote-loader: serving a on port N"
        port = int(banner.rsplit(" ", 1)[1])
        with RemoteLoader(f"127.0.0.1:{port}") as loader:
            assert len(list(loader)) == 50
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert proc.returncode == 0
