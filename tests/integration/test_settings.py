"""Server settings: the [server] table, REMOTE_LOADER_* variables and flags, in that order.

The unit tests (no server, no process, no Ray): tests/unit/test_settings.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from remote_loader.client import RemoteLoader
from tests.helpers import LOADER, TOKEN, subprocess_env


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "remote_loader.server.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=subprocess_env(**(env or {})),
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
    env = subprocess_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "remote_loader.server.cli.main", "serve", "--config", str(path)],
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


def test_check_config_shows_the_new_settings_but_not_the_token(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[server]\nmax_request_bytes = 4096\n\n" + LOADER)
    result = _cli("check-config", str(path), env={"REMOTE_LOADER_TOKEN": TOKEN})
    assert result.returncode == 0, result.stderr
    assert "max_request_bytes 4096" in result.stdout and "reflection False" in result.stdout
    assert "token set" in result.stdout and TOKEN not in result.stdout + result.stderr
