"""Errors keep their kind on the wire (NOTE [ Error reasons ], protos/reasons.py): the table both
ways, every server error class with a reason of its own and every reason with a client
exception.

The tests that start a server, a process or Ray: tests/integration/test_errors.py.
"""

from __future__ import annotations

import grpc

from remote_loader.client import (
    RemoteLoaderError,
)
from remote_loader.client import errors as client_errors
from remote_loader.protos import reasons
from remote_loader.server import errors as server_errors
from tests.helpers import SERVER_CLASSES

# --- the table (no server) --------------------------------------------------------------------


def test_every_server_error_has_a_reason_of_its_own() -> None:
    assert len(SERVER_CLASSES) >= 13  # the whole tree was walked
    named = {cls: cls.__dict__.get("reason") for cls in SERVER_CLASSES}
    unnamed = [cls.__name__ for cls, reason in named.items() if reason is None]
    assert not unnamed, f"server errors that inherit their parent's reason: {unnamed}"
    assert all(reason in reasons.REASONS for reason in named.values()), named
    assert len(set(named.values())) == len(named), "two server errors share a reason"
    for cls in SERVER_CLASSES:
        assert cls.status in grpc.StatusCode.__members__, cls


def test_every_server_error_is_named_for_its_reason() -> None:
    # server/errors.py: `loader-broken` is LoaderBroken; no client class has a server's name.
    for cls in SERVER_CLASSES:
        if cls is not server_errors.CallFailed:
            camel = "".join(word.capitalize() for word in cls.reason.split("-"))
            assert cls.__name__ == camel, (cls, cls.reason)
    client_names = {
        name for name in dir(client_errors) if isinstance(getattr(client_errors, name), type)
    }
    assert not client_names & {cls.__name__ for cls in SERVER_CLASSES}


def test_every_reason_maps_to_a_client_error() -> None:
    assert set(client_errors.REASON_ERRORS) == reasons.REASONS
    for reason, cls in client_errors.REASON_ERRORS.items():
        assert issubclass(cls, RemoteLoaderError), reason
    # Every reason is a word the metadata can carry and the client reads back.
    for reason in reasons.REASONS:
        assert len(reason) <= reasons.REASON_LIMIT and reason == reason.lower(), reason
        assert reasons.reason_of(reasons.metadata(reason)) == reason
    # A reason this side does not know (a newer server's) is no reason: the code decides.
    assert reasons.reason_of([(reasons.REASON_KEY, "from-the-future")]) is None
    assert reasons.reason_of([(reasons.REASON_KEY, b"spec-changed")]) == reasons.SPEC_CHANGED
    assert reasons.reason_of(None) is None
