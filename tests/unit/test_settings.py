"""Server settings: the [server] table, REMOTE_LOADER_* variables and flags, in that order.

The tests that start a server, a process or Ray: tests/integration/test_settings.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from remote_loader.server.api.settings import ServerSettings, resolve_settings
from remote_loader.server.config.file import read_config
from remote_loader.server.config.spec import ConfigError
from tests.helpers import LOADER, TOKEN


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


def test_metrics_address_and_max_batch_bytes() -> None:
    from remote_loader.server.cli.main import DEFAULTS, _parser

    defaults = ServerSettings()
    assert (defaults.metrics_address, defaults.max_batch_bytes) == ("", 2 << 30)  # off, 2 GiB
    table = {"metrics_address": "0.0.0.0:9090", "max_batch_bytes": 1 << 20}
    assert resolve_settings(table, {}).metrics_address == "0.0.0.0:9090"
    env = {"REMOTE_LOADER_METRICS_ADDRESS": "127.0.0.1:0", "REMOTE_LOADER_MAX_BATCH_BYTES": "4096"}
    from_env = resolve_settings(table, env)
    assert (from_env.metrics_address, from_env.max_batch_bytes) == ("127.0.0.1:0", 4096)
    args = _parser().parse_args(
        ["serve", "--metrics-address", "[::1]:9100", "--max-batch-bytes", "1024"]
    )
    flags = {key: getattr(args, key, None) for key in vars(DEFAULTS)}
    flagged = resolve_settings(table, env, flags)
    assert (flagged.metrics_address, flagged.max_batch_bytes) == ("[::1]:9100", 1024)


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
        ({"metrics_address": "9090"}, {}, "metrics_address must be HOST:PORT .* or empty"),
        ({"metrics_address": 9090}, {}, r"\[server\] metrics_address must be a string"),
        (
            {"address": "0.0.0.0:50051", "metrics_address": "0.0.0.0:50051"},
            {},
            "metrics_address 0.0.0.0:50051 is the gRPC address too",
        ),
        ({"max_batch_bytes": 0}, {}, "max_batch_bytes must be at least 1 byte, got 0"),
        ({"max_ring_bytes": -1}, {}, r"max_ring_bytes must be >= 0 bytes \(0: no shared memory\)"),
        ({"data_address": "50052"}, {}, 'data_address must be "auto", "off" or HOST:PORT'),
        ({}, {"REMOTE_LOADER_DATA_ADDRESS": "on"}, 'data_address must be "auto", "off"'),
        (
            {"address": "0.0.0.0:50051", "data_address": "0.0.0.0:50051"},
            {},
            "data_address 0.0.0.0:50051 is taken by the gRPC or metrics address",
        ),
        (
            {"data_address": "0.0.0.0:50052", "tls_cert": "/no/cert.pem", "tls_key": "/no/key"},
            {},
            # A fixed data_address is fine beside TLS (its connections speak TLS): the files
            # are what is wrong here.
            "server tls_cert: cannot read '/no/cert.pem'",
        ),
        (
            {},
            {"REMOTE_LOADER_MAX_BATCH_BYTES": "2GB"},
            "REMOTE_LOADER_MAX_BATCH_BYTES='2GB' must be an integer",
        ),
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


# --- limits, keepalive, the token, TLS, reflection ---------------------------------------------

PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def test_new_settings_precedence() -> None:
    table = {"max_request_bytes": 4096, "reflection": False, "keepalive_time_ms": 30_000}
    env = {"REMOTE_LOADER_REFLECTION": "true", "REMOTE_LOADER_MAX_REQUEST_BYTES": "8192"}
    settings = resolve_settings(table, env, {"max_request_bytes": 2048, "reflection": None})
    assert (settings.max_request_bytes, settings.reflection) == (2048, True)
    assert (settings.keepalive_time_ms, settings.keepalive_timeout_ms) == (30_000, 10_000)
    assert resolve_settings(table, {"REMOTE_LOADER_REFLECTION": "off"}).reflection is False
    defaults = ServerSettings()
    assert (defaults.max_request_bytes, defaults.reflection, defaults.min_ping_interval_ms) == (
        65536,
        False,
        10_000,
    )
    assert defaults.auth_token() is None and defaults.server_tls() is None


def test_serve_flags_reach_the_settings() -> None:
    from remote_loader.server.cli.main import DEFAULTS, _parser

    args = _parser().parse_args(
        ["serve", "--reflection", "--max-request-bytes", "4096", "--tls-cert", "c.pem"]
    )
    flags = {key: getattr(args, key, None) for key in vars(DEFAULTS)}
    assert (flags["reflection"], flags["max_request_bytes"], flags["tls_cert"]) == (
        True,
        4096,
        "c.pem",
    )
    assert flags["token"] is None and flags["token_file"] is None  # the token has no flag
    no = _parser().parse_args(["serve", "--no-reflection"])
    assert no.reflection is False


def test_the_token_comes_from_the_environment_or_a_file_and_is_never_shown(
    tmp_path: Path,
) -> None:
    from_env = resolve_settings(None, {"REMOTE_LOADER_TOKEN": f" {TOKEN}\n"})
    assert from_env.auth_token() == TOKEN
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    from_file = resolve_settings({"token_file": str(token_file)}, {})
    assert from_file.auth_token() == TOKEN
    for settings in (from_env, from_file):
        assert TOKEN not in settings.describe() and TOKEN not in repr(settings)
        assert settings.describe().endswith(", token set")
    assert ServerSettings().describe().endswith(", no token")


def test_bad_security_files_say_which_setting_and_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pem")
    not_pem = tmp_path / "cert.txt"
    not_pem.write_text("hello")
    pem = tmp_path / "cert.pem"
    pem.write_text(PEM)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    cases: list[tuple[dict[str, object], str]] = [
        ({"tls_cert": str(pem)}, "server tls_cert is set but tls_key is not"),
        ({"tls_key": str(pem)}, "server tls_key is set but tls_cert is not"),
        ({"tls_client_ca": str(pem)}, "tls_client_ca is set without tls_cert and tls_key"),
        (
            {"tls_cert": missing, "tls_key": str(pem)},
            f"server tls_cert: cannot read '{missing}': No such file or directory",
        ),
        ({"tls_cert": str(pem), "tls_key": str(not_pem)}, "server tls_key: .* is not a PEM file"),
        (
            {"tls_cert": str(pem), "tls_key": str(pem), "tls_client_ca": missing},
            "server tls_client_ca: cannot read",
        ),
        ({"token_file": missing}, f"server token_file: cannot read '{missing}'"),
        ({"token_file": str(empty)}, "token_file .* is empty"),
    ]
    for table, message in cases:
        with pytest.raises(ConfigError, match=message):
            resolve_settings(table, {})


@pytest.mark.parametrize(
    ("table", "env", "message"),
    [
        ({"max_request_bytes": 10}, {}, "max_request_bytes must be between 1024 and 67108864"),
        ({"keepalive_time_ms": 0}, {}, "keepalive_time_ms must be at least 1 ms, got 0"),
        ({"min_ping_interval_ms": 30_000}, {}, "min_ping_interval_ms must be at most 20000"),
        ({"reflection": "yes"}, {}, r"\[server\] reflection must be true or false, got 'yes'"),
        ({}, {"REMOTE_LOADER_REFLECTION": "maybe"}, "REFLECTION='maybe' must be true or false"),
        ({"token": TOKEN}, {}, "a token does not belong in the config file"),
        ({}, {"REMOTE_LOADER_TOKEN": "two words"}, "printable ASCII without spaces"),
        (
            {"token_file": "/etc/hostname"},
            {"REMOTE_LOADER_TOKEN": TOKEN},
            "both REMOTE_LOADER_TOKEN and server token_file are set",
        ),
    ],
)
def test_bad_new_settings_say_what_is_wrong(
    table: dict[str, object], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        resolve_settings(table, env)
    assert TOKEN not in str(info.value)


def test_max_ring_bytes_from_file_environment_and_flag() -> None:
    from remote_loader.server.cli.main import DEFAULTS, _parser

    assert ServerSettings().max_ring_bytes == 256 << 20
    table = {"max_ring_bytes": 1 << 20}
    assert resolve_settings(table, {}).max_ring_bytes == 1 << 20
    env = {"REMOTE_LOADER_MAX_RING_BYTES": "0"}
    assert resolve_settings(table, env).max_ring_bytes == 0
    args = _parser().parse_args(["serve", "--max-ring-bytes", "4096"])
    flags = {key: getattr(args, key, None) for key in vars(DEFAULTS)}
    assert resolve_settings(table, env, flags).max_ring_bytes == 4096


def test_data_address_from_file_environment_and_flag() -> None:
    from remote_loader.server.cli.main import DEFAULTS, _parser

    assert ServerSettings().data_address == "auto"
    table = {"data_address": "0.0.0.0:50052"}
    assert resolve_settings(table, {}).data_address == "0.0.0.0:50052"
    env = {"REMOTE_LOADER_DATA_ADDRESS": "off"}
    assert resolve_settings(table, env).data_address == "off"
    args = _parser().parse_args(["serve", "--data-address", "127.0.0.1:0"])
    flags = {key: getattr(args, key, None) for key in vars(DEFAULTS)}
    assert resolve_settings(table, env, flags).data_address == "127.0.0.1:0"
