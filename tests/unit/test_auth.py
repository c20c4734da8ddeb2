"""TLS options without a server: the client checks its TLS arguments, and the server's
settings read and check the certificate files (made by the `pki` fixture, tests/conftest.py).

The tests that start a server, a process or Ray: tests/integration/test_auth.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from remote_loader.client import TLS, RemoteLoader
from remote_loader.server.api.settings import resolve_settings
from remote_loader.server.config.spec import ConfigError
from tests.helpers import (
    PKI,
)

# RemoteLoader reads REMOTE_LOADER_TOKEN when token= is not given; these tests set it themselves.
pytestmark = pytest.mark.usefixtures("no_token_in_the_environment")


def test_tls_options_are_checked_on_the_client(pki: PKI, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="TLS cert and key go together"):
        TLS(cert=pki.client_cert)
    with pytest.raises(ValueError, match=r"TLS ca: cannot read '.*nope\.pem': No such file"):
        RemoteLoader("127.0.0.1:1", tls=TLS(ca=tmp_path / "nope.pem"))
    with pytest.raises(TypeError, match="tls must be None, a bool or a TLS"):
        RemoteLoader("127.0.0.1:1", tls="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token must be printable ASCII without spaces"):
        RemoteLoader("127.0.0.1:1", token="two words")


def test_tls_settings_read_and_check_the_files(pki: PKI) -> None:
    table = {
        "tls_cert": str(pki.server_cert),
        "tls_key": str(pki.server_key),
        "tls_client_ca": str(pki.ca),
    }
    assert resolve_settings(table, {}).server_tls() == pki.server_tls(mutual=True)
    # A key of another certificate is caught at start-up, not as grpc's "Failed to bind".
    with pytest.raises(ConfigError, match=r"tls_key '.*client\.key' are not a PEM certificate"):
        resolve_settings({**table, "tls_key": str(pki.client_key)}, {})
    with pytest.raises(ConfigError, match=r"tls_cert '.*server\.key' and tls_key"):
        resolve_settings({**table, "tls_cert": str(pki.server_key)}, {})
