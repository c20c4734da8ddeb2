"""How the Ray bridge (server/engine/ray/bridge.py) joins a cluster, and how it ends with the
server.

NOTE [ Ray bridge lifecycle ]

The bridge must end with the server whatever Ray's client is doing: `ray.init` to an address
that accepts connections but is no Ray retries inside Ray's C++ client for minutes, and a
driver whose cluster went away spins reconnecting for `gcs_rpc_server_reconnect_timeout_s`
(60 s by default). Neither can be interrupted from Python, so the bridge never waits on them:

  server   holds the writing end of the bridge's command pipe, nothing else does; on stop it
           sends None, waits BRIDGE_JOIN_TIMEOUT, then SIGKILLs the bridge.
  watcher  (a thread of the bridge, started before Ray is imported) reads that pipe: EOF means
           the server is gone (killed, crashed) -> os._exit at once; None before the bridge
           is connected -> os._exit at once.
  deadline (a thread, while connecting): no Ray answered within CONNECT_TIMEOUT -> StartFailed
           naming ray_address, then os._exit.
  kernel   PR_SET_PDEATHSIG(SIGKILL): when its parent (the fork server) ends, so does the
           bridge; the bridge lets go of the fork server's liveness pipe so that the fork
           server can end with the server. The processes a local Ray instance starts are
           Ray's own and share their driver's fate (Ray starts them with PR_SET_PDEATHSIG
           and a reaper).
  Ray      a driver ends when its cluster is gone for RAY_gcs_rpc_server_reconnect_timeout_s,
           which the bridge sets to GCS_RECONNECT_TIMEOUT (unless the environment sets it):
           the server then sees its child exit (NOTE [ Ray bridge ]).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

# How long the bridge tries to open a TCP connection, then a gRPC one, to ray_address before
# calling ray.init, which, when nothing (or something that is not Ray) answers there, retries
# for minutes.
PROBE_TIMEOUT = 5.0
# How long ray.init may take against a cluster that did answer the probe.
CONNECT_TIMEOUT = 20.0
# What the probe asks a GCS: cheap, and in every Ray this project supports (2.40 and later).
GCS_PROBE_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"
# How long the bridge waits for the CPUs its actors ask to be free before it says which are
# missing (a cluster may be finishing other work, or an autoscaler adding a node).
CAPACITY_TIMEOUT = 10.0
# How long a driver keeps trying to reach a control store that went away before Ray ends it
# (Ray's default is 60 s, a trainer's minute of nothing while a core spins).
GCS_RECONNECT_TIMEOUT = 5


def die_with_parent() -> None:
    """PR_SET_PDEATHSIG(SIGKILL) on Linux, and lets go of the fork server's liveness pipe (See
    NOTE [ Ray bridge lifecycle ])."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig, sigkill = 1, 9
        libc.prctl(pr_set_pdeathsig, sigkill, 0, 0, 0)
    # A child of multiprocessing's fork server holds the writing end of the pipe whose EOF
    # tells the fork server that the server is gone: while this process lives, the fork server
    # would too. The bridge starts no process through multiprocessing, so it does not need it.
    from multiprocessing import forkserver

    fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if isinstance(fd, int):
        with contextlib.suppress(OSError):
            os.close(fd)
        forkserver._forkserver._forkserver_alive_fd = None  # type: ignore[attr-defined]


def watch_server(commands: Any, connected: threading.Event, put: Callable[[Any], None]) -> None:
    """The watcher thread: hands the server's commands to `put`; ends this process when the
    server is gone, or stops it before `connected`. See NOTE [ Ray bridge lifecycle ]."""
    while True:
        try:
            command = commands.recv()
        except (EOFError, OSError):
            os._exit(0)  # the server is gone: nobody reads what this process makes
        if command is None and not connected.is_set():
            os._exit(0)  # stopped while Ray's client may be stuck connecting
        put(command)
        if command is None:
            return


def probe(address: str) -> None:
    """Raises ConnectionError, saying which, when nothing accepts connections at HOST:PORT or
    what does is no gRPC server (a Ray GCS is one)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", or a form ray.init understands and we do not: let it say
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT).close()
    except OSError as exc:
        raise ConnectionError(
            f"nothing accepts connections at {address} ({exc.strerror or exc}); is the Ray "
            "head running (`ray start --head`) and is this its GCS address?"
        ) from None
    if os.environ.get("RAY_USE_TLS", "0") not in ("0", ""):
        return  # a TLS GCS would need Ray's certificates to answer
    import grpc

    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=PROBE_TIMEOUT)
        # A Ray GCS knows Ray's node service; any other gRPC server answers UNIMPLEMENTED,
        # which ray.init would find only by retrying for minutes (CONNECT_TIMEOUT cuts that at
        # 20 s). The request is an empty message; any other answer (a token refused, a slow
        # GCS) is ray.init's to judge.
        channel.unary_unary(GCS_PROBE_METHOD, None, None)(b"", timeout=PROBE_TIMEOUT)
    except grpc.FutureTimeoutError:
        raise ConnectionError(
            f"something accepts connections at {address} but does not answer as a Ray cluster "
            f"(no gRPC handshake within {PROBE_TIMEOUT:g} s); ray_address must be the head's "
            "GCS address (`ray start --head` prints it; port 6379 by default)"
        ) from None
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            raise ConnectionError(
                f"a gRPC server answers at {address}, but it is not a Ray cluster's GCS (it "
                f"does not know {GCS_PROBE_METHOD}); ray_address must be the head's GCS "
                "address (`ray start --head` prints it; port 6379 by default)"
            ) from None
    finally:
        channel.close()


def _neutral_directory() -> str:
    """An empty directory for the bridge to run in: Ray puts its driver's working directory
    on every actor's sys.path, and the server's would shadow the modules the actors should
    import (a `mydata/` beside where the server was started). One per user, kept: the
    processes of a local Ray instance run in it."""
    path = os.path.join(tempfile.gettempdir(), f"remote-loader-ray-cwd-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def import_roots(paths: list[str]) -> list[str]:
    """The sys.path entries this process finds the top-level modules of `paths` ("module:attr"
    import paths) in: given to the actors in place of the working directory, so that they
    import what the server imported (where the nodes share its file layout, as Ray assumes)."""
    roots: list[str] = []
    for path in paths:
        top = path.partition(":")[0].split(".")[0]
        try:
            found = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            continue
        if found is None:
            continue
        if found.origin and found.origin not in ("built-in", "frozen"):
            root = os.path.dirname(found.origin)
            roots.append(os.path.dirname(root) if found.submodule_search_locations else root)
        else:  # a namespace package
            roots.extend(os.path.dirname(p) for p in found.submodule_search_locations or ())
    return list(dict.fromkeys(roots))


def connect(
    address: str | None,
    runtime_env: Mapping[str, Any],
    code: list[str],
    failed: Callable[[str], None],
) -> None:
    """ray.init for the bridge: the cluster at `address`, or a local instance, whose actors
    find the modules of `code` (import paths) where this process does. When no Ray has
    answered within CONNECT_TIMEOUT, calls `failed` with why and ends the process."""
    os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", str(GCS_RECONNECT_TIMEOUT))
    if address is None:
        # A local instance is started for this server: token authentication is Ray's default
        # for it, said explicitly so that Ray does not warn about it at each start.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.chdir(_neutral_directory())
    if address is not None:
        probe(address)
    _init_within(address, runtime_env, import_roots(code), failed)


def _init_within(
    address: str | None,
    runtime_env: Mapping[str, Any],
    roots: list[str],
    failed: Callable[[str], None],
) -> None:
    import ray

    done = threading.Event()
    lock = threading.Lock()

    def expire() -> None:
        if done.wait(CONNECT_TIMEOUT):
            return
        with lock:
            if done.is_set():
                return
            failed(
                f"no Ray cluster answered ray.init within {CONNECT_TIMEOUT:g} s (something "
                "accepts connections there: is it the head's GCS address, and is the head "
                "healthy? `ray status --address ...` tells)"
            )
            os._exit(1)

    options: dict[str, Any] = {
        "logging_level": "WARNING",
        "log_to_driver": False,
        "configure_logging": False,
        "runtime_env": dict(runtime_env) or None,
        # Ray adds the driver's working directory (here an empty one) to these itself.
        "job_config": ray.job_config.JobConfig(_py_driver_sys_path=roots),
    }
    if address is None:
        # A new local instance ("local": not a cluster that happens to run on this host),
        # this host's CPUs, on loopback only. Starting its processes is not bounded here: Ray
        # bounds it itself, and nothing else could answer in its place.
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, **options)
        return
    threading.Thread(target=expire, name="rl-ray-connect-deadline", daemon=True).start()
    try:
        ray.init(address=address, **options)
    finally:
        with lock:
            done.set()


def capacity(ray: Any) -> tuple[float, float]:
    """(CPUs free, CPUs in all) of the cluster, as Ray's resource view has them now."""
    free = float(ray.available_resources().get("CPU", 0.0))
    total = float(ray.cluster_resources().get("CPU", 0.0))
    return free, total


def wait_for_capacity(ray: Any, workers: int, cpus_each: float) -> None:
    """Waits up to CAPACITY_TIMEOUT for `workers` * `cpus_each` CPUs to be free; RuntimeError
    saying what is asked and what there is when they are not."""
    asked = workers * cpus_each
    deadline = time.monotonic() + CAPACITY_TIMEOUT
    while True:
        free, total = capacity(ray)
        if free + 1e-6 >= asked:
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"the cluster cannot place the loader's actors: num_workers={workers} x "
                f"ray_num_cpus={cpus_each:g} = {asked:g} CPUs asked, {free:g} free of "
                f"{total:g} in the cluster after {CAPACITY_TIMEOUT:g} s (`ray status` shows "
                "them); add a node or CPUs, or lower ray_num_cpus or num_workers"
            )
        time.sleep(0.5)
