"""Who may call a server: the bearer token (checked before any handler runs), the open health
service, reflection, TLS and mutual TLS, over real gRPC with certificates made here.

The unit tests (no server, no process, no Ray): tests/unit/test_auth.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from remote_loader.client import TLS, AuthenticationError, ConnectionLostError, RemoteLoader
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import wire
from remote_loader.server.config.spec import LoaderSpec
from tests.datasets import read_counts
from tests.helpers import (
    PKI,
    TOKEN,
    CuttingProxy,
    ServeLoaders,
    health_status,
    serve_process,
    stop_process,
    subprocess_env,
)

# RemoteLoader reads REMOTE_LOADER_TOKEN when token= is not given; these tests set it themselves.
pytestmark = pytest.mark.usefixtures("no_token_in_the_environment")

WRONG = "wrong-Token_9876543210"


def counted(log: Path, n: int = 48, **options: Any) -> LoaderSpec:
    return LoaderSpec(
        name="counted",
        dataset="tests.datasets:Counted",
        dataset_kwargs={"log": str(log), "n": n},
        batch_size=8,
        **options,
    )


def indices(loader: RemoteLoader) -> list[int]:
    return torch.cat([b["index"] for b in loader]).tolist()


def raw_stream(address: str, metadata: list[tuple[str, str]]) -> grpc.RpcError:
    """The error of a Stream call made with `metadata` (and no client library in between)."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(
            wire.STREAM_METHOD,
            request_serializer=pb.StreamRequest.SerializeToString,
            response_deserializer=pb.Frame.FromString,
        )
        with pytest.raises(grpc.RpcError) as info:
            list(call(pb.StreamRequest(loader="counted"), metadata=tuple(metadata), timeout=10))
    return info.value


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "remote_loader.server.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=subprocess_env(),
    )


# --- the token ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "client_token", "message"),
    [
        ([], "", "this server requires a token: send the metadata 'authorization: Bearer"),
        ([("authorization", f"Bearer {WRONG}")], WRONG, "the token sent is not this server's"),
        ([("authorization", f"Basic {TOKEN}")], None, "must be exactly one 'Bearer <token>'"),
    ],
)
def test_a_call_without_the_right_token_is_refused_before_any_work(
    serve_loaders: ServeLoaders,
    tmp_path: Path,
    metadata: list[tuple[str, str]],
    client_token: str | None,
    message: str,
) -> None:
    log = tmp_path / "reads"
    served = serve_loaders(counted(log), token=TOKEN)
    assert read_counts(str(log)) == {}  # starting the loader read nothing
    error = raw_stream(served.address, metadata)
    assert isinstance(error, grpc.Call)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    details = error.details() or ""
    assert message in details
    assert TOKEN not in details and WRONG not in details  # never echoed, right or wrong
    if client_token is not None:  # the client library raises its typed error
        for name in (None, "counted"):  # ListLoaders first, or Describe
            with pytest.raises(AuthenticationError, match=message):
                RemoteLoader(served.address, name, token=client_token)
    # No handler ran: no sample was read and no stream was counted.
    assert read_counts(str(log)) == {}
    assert served.server.service.wait_streams(0)


def test_the_right_token_streams_every_batch(
    serve_loaders: ServeLoaders, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "reads"
    served = serve_loaders(counted(log, num_workers=2), token=TOKEN)
    with RemoteLoader(served.address, token=TOKEN) as loader:
        assert len(loader) == 6
        assert indices(loader) == list(range(48))
    monkeypatch.setenv("REMOTE_LOADER_TOKEN", TOKEN)  # the default when token= is not given
    with RemoteLoader(served.address) as loader:
        assert indices(loader) == list(range(48))
    assert read_counts(str(log)) == {i: 2 for i in range(48)}
    # token="" sends none, even with the variable set.
    with pytest.raises(AuthenticationError, match="requires a token"):
        RemoteLoader(served.address, token="")


def test_resumed_streams_carry_the_token(serve_loaders: ServeLoaders, tmp_path: Path) -> None:
    # Each resume after a cut connection is a new Stream call: it must be authenticated too.
    spec = LoaderSpec(
        name="slow",
        dataset="tests.datasets:Slow",
        dataset_kwargs={"n": 60, "seconds": 0.01},
        batch_size=2,
        num_workers=2,
    )
    served = serve_loaders(spec, token=TOKEN)
    middle = CuttingProxy(served.address)
    try:
        got = []
        with RemoteLoader(middle.address, token=TOKEN, prefetch=1, backoff=0.05) as loader:
            for i, batch in enumerate(loader):
                got += batch.tolist()
                if i in (3, 12):
                    middle.cut()
            assert loader.stats().reconnects >= 1
    finally:
        middle.close()
    assert got == list(range(60))


def test_health_answers_without_a_token(serve_loaders: ServeLoaders, tmp_path: Path) -> None:
    served = serve_loaders(counted(tmp_path / "reads"), token=TOKEN)
    with grpc.insecure_channel(served.address) as channel:
        assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
    result = _cli("health", served.address)  # as a container's HEALTHCHECK runs it
    assert (result.returncode, result.stdout.strip()) == (0, f"{served.address}: SERVING")


def list_services(address: str, metadata: list[tuple[str, str]]) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
            metadata=metadata,
            timeout=10,
        )
        return [s.name for r in replies for s in r.list_services_response.service]


def test_reflection_is_off_by_default_and_needs_the_token(
    serve_loaders: ServeLoaders, tmp_path: Path
) -> None:
    plain = serve_loaders(counted(tmp_path / "a"))
    with pytest.raises(grpc.RpcError) as info:
        list_services(plain.address, [])
    assert isinstance(info.value, grpc.Call)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    reflecting = serve_loaders(counted(tmp_path / "b"), token=TOKEN, reflection=True)
    with pytest.raises(grpc.RpcError) as info:
        list_services(reflecting.address, [])
    assert isinstance(info.value, grpc.Call)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    names = list_services(reflecting.address, [("authorization", f"Bearer {TOKEN}")])
    assert {wire.SERVICE_NAME, "grpc.health.v1.Health"} <= set(names)


# --- TLS and mutual TLS ---------------------------------------------------------------------


def test_tls_round_trip(serve_loaders: ServeLoaders, tmp_path: Path, pki: PKI) -> None:
    served = serve_loaders(counted(tmp_path / "reads"), **pki.server_settings())
    port = served.address.rsplit(":", 1)[1]
    for address in (served.address, f"localhost:{port}"):  # the certificate names both
        with RemoteLoader(address, tls=TLS(ca=pki.ca)) as loader:
            assert indices(loader) == list(range(48))
    # A plaintext client cannot connect (the server speaks TLS only) and says so in time.
    with pytest.raises(ConnectionLostError, match=r"cannot reach .*this client speaks plaintext"):
        RemoteLoader(served.address, connect_timeout=1.0, retries=1, backoff=0.1)
    # `remote-loader health` probes it with the CA, and fails cleanly without.
    result = _cli("health", served.address, "--tls-ca", str(pki.ca))
    assert (result.returncode, result.stdout.strip()) == (0, f"{served.address}: SERVING")
    assert _cli("health", served.address, "--timeout", "1").returncode == 2


def test_mutual_tls_needs_a_client_certificate(
    serve_loaders: ServeLoaders, tmp_path: Path, pki: PKI
) -> None:
    served = serve_loaders(
        counted(tmp_path / "reads"), **pki.server_settings(mutual=True), token=TOKEN
    )
    mutual = TLS(ca=pki.ca, cert=pki.client_cert, key=pki.client_key, server_name="localhost")
    with RemoteLoader(served.address, token=TOKEN, tls=mutual) as loader:
        assert indices(loader) == list(range(48))
    with pytest.raises(ConnectionLostError):
        RemoteLoader(served.address, token=TOKEN, tls=TLS(ca=pki.ca), retries=0)
    args = ("health", served.address, "--tls-ca", str(pki.ca))
    assert _cli(*args, "--timeout", "1").returncode == 2
    client = ("--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key))
    assert _cli(*args, *client).returncode == 0


@pytest.fixture
def served_process() -> Iterator[list[Any]]:
    procs: list[Any] = []
    yield procs
    for proc in procs:
        stop_process(proc)


def test_serve_with_tls_and_a_token_file(
    pki: PKI, tmp_path: Path, served_process: list[Any]
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")  # surrounding whitespace is not part of the token
    proc, address = serve_process(
        "--dataset",
        "tests.datasets:Squares",
        "--batch-size",
        "10",
        "--token-file",
        str(token_file),
        "--tls-cert",
        str(pki.server_cert),
        "--tls-key",
        str(pki.server_key),
    )
    served_process.append(proc)
    with RemoteLoader(address, token=TOKEN, tls=TLS(ca=pki.ca)) as loader:
        assert indices(loader) == list(range(50))
    with pytest.raises(AuthenticationError, match="not this server's"):
        RemoteLoader(address, token=WRONG, tls=TLS(ca=pki.ca))
