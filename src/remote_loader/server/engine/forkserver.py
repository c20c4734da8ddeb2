"""How worker processes start: from a fork server, started before any gRPC server, that has
imported what every worker needs (NOTE [ Fork server preload ]); and the main-module guard
(NOTE [ Main module guard ]).

Forking a process that runs gRPC threads is unsafe (grpc/grpc#16001), and workers are started
while the server runs (non-persistent pools, replacements). The fork server is a fresh
interpreter, started before any gRPC server, that forks the workers for us.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.context
import os
import sys
from collections.abc import Collection, Iterable
from multiprocessing import forkserver, spawn

# Modules the fork server imports first, whatever the loaders are.
FORKSERVER_PRELOAD = ["torch", "numpy", "remote_loader.server.worker.loop"]
# The module whose import, last in the fork server, imports the rest (remote_loader.server
# .preload), and the environment variable that hands it the list.
PRELOADER = "remote_loader.server.engine.preload"
PRELOAD_ENV = "REMOTE_LOADER_FORKSERVER_PRELOAD"
# What of a child's preparation data (multiprocessing.spawn) the fork server prepares the main
# module with.
MAIN_PREPARATION = ("init_main_from_name", "init_main_from_path", "sys_argv", "dir", "orig_dir")
# At most this many bytes of module names go in it (Linux caps one variable at 128 KiB): a
# module left out is imported by each worker that needs it, which costs time, not correctness.
MAX_PRELOAD_BYTES = 64 << 10

# NOTE [ Fork server preload ]
#
# A worker is forked from the fork server, so it starts with what the fork server imported and
# imports the rest itself: every worker, and without persistent_workers every epoch's new ones
# (torch's workers, forked from the trainer, start with all it imported). Measured on a JPEG
# folder whose module imports pandas (benchmarks/fresh_epochs.py), a new worker took 0.4-0.5 s
# to be ready, against milliseconds for a local DataLoader's. So the fork server imports, once,
# before it forks anything:
#   - torch, numpy and the worker module (FORKSERVER_PRELOAD);
#   - the server's main module, prepared as multiprocessing prepares it in each child (a script
#     by its path, `python -m X` by name), so a worker does not import it again (each one did:
#     `remote-loader serve`'s main module imports the server's settings, PIL and gRPC);
#   - the modules the server imported while it built the loaders' datasets (sys.modules before
#     and after), and each dataset's class's module: what unpickling a dataset and making its
#     samples import (torchvision, datasets, pandas, PIL's plugins).
# build_hosts (server/api/server.py) therefore builds the loaders first and starts the fork server
# after, still before the gRPC server. multiprocessing's own preload ends the fork server on
# any error but ImportError, so the list goes in PRELOAD_ENV to remote_loader.server.engine.preload,
# which imports each module and the main module catching everything: what fails there a worker
# imports (or fails to) itself, as before. A process whose fork server already runs (a second
# Server in one process: the tests) keeps it and its preload; a worker imports what it lacks.
#
# Costs: the fork server holds these modules (shared copy-on-write with its workers) and takes
# their import time once, at start-up. A script's top level runs once there (with the server's
# argv and folder, as a child's would), not once in each worker. A module that started a
# thread at import would leave the fork server forking with a thread running, the hazard fork
# always has; torch, numpy and the usual dataset libraries start none. The main module of
# `remote-loader serve` imports the gRPC module, as every worker did before; the fork server
# never makes a channel or a server, and gRPC's threads, which make fork unsafe, start only
# with those.


# Never preloaded, though a loader's start-up imports them: Ray (require_backend checks that it
# imports) reads its settings from the environment when it is imported, and the Ray bridge, a
# child of the fork server, sets them first (RAY_AUTH_MODE for a local instance: imported
# before, the bridge's client and the GCS it started disagreed on token authentication and the
# GCS never came up). Local workers do not need it.
NOT_PRELOADED = frozenset({"ray"})


def imported_since(before: Collection[str], objects: Iterable[object] = ()) -> list[str]:
    """The modules imported since `before` (a snapshot of sys.modules), in the order they were,
    and the modules of `objects`' classes, for the fork server to preload."""
    names = [name for name in sys.modules if name not in before]
    names += [type(obj).__module__ for obj in objects]
    # Not importable by name: the main module (prepared apart) and interpreter internals.
    skip = ("__main__", "__mp_main__", "builtins")
    return list(
        dict.fromkeys(
            n
            for n in names
            if n not in skip
            and not n.startswith("_frozen")
            and n.split(".")[0] not in NOT_PRELOADED
        )
    )


def start_fork_server(
    ctx: multiprocessing.context.BaseContext, modules: Iterable[str] = ()
) -> None:
    """Starts this process's fork server with `modules` preloaded after FORKSERVER_PRELOAD and
    the main module (NOTE [ Fork server preload ]), unless one runs already; then starts one
    process from it, so that the imports are paid at start-up, not by the first stream.

    Raises RuntimeError naming the `__main__` guard when that process dies starting (NOTE
    [ Main module guard ])."""
    names, size = [], 0
    for name in modules:
        size += len(name) + 1
        if size > MAX_PRELOAD_BYTES:
            break
        names.append(name)
    # What a child's main module is prepared from, with the argv and folder it sees then (a
    # script may read them at its top level); none when there is no main module to import.
    prepare = spawn.get_preparation_data("remote-loader-fork-server")
    main = {k: v for k, v in prepare.items() if k in MAIN_PREPARATION}
    if not main.keys() & {"init_main_from_name", "init_main_from_path"}:
        main = {}
    ctx.set_forkserver_preload([*FORKSERVER_PRELOAD, PRELOADER])
    # Read by the fork server when it starts (it inherits this environment); taken out after,
    # so that no other child sees it. The server's sys.path with it: the fork server runs as
    # `python -c`, whose sys.path starts with the working directory, and Python's forkserver
    # main() does not apply the sys_path it is handed (3.11), so a `tests/` or `mydata/` beside
    # where the server was started would shadow the module the server imported, in the fork
    # server and in every worker and Ray bridge forked from it.
    os.environ[PRELOAD_ENV] = json.dumps(
        {"main": main, "modules": names, "sys_path": prepare["sys_path"]}
    )
    try:
        forkserver.ensure_running()
    finally:
        del os.environ[PRELOAD_ENV]
    warmup = ctx.Process(target=_noop, name="remote-loader-warmup")  # type: ignore[attr-defined]
    warmup.start()
    warmup.join()
    if warmup.exitcode != 0:
        # _noop cannot fail: the process died while it bootstrapped, i.e. while it imported
        # the main module again. See NOTE [ Main module guard ].
        raise RuntimeError(
            f"the server's worker processes cannot start: one exited with code "
            f"{warmup.exitcode} before it ran anything. {_guard_advice()}"
        )


def _noop() -> None:
    pass


# NOTE [ Main module guard ]
#
# Workers are started by multiprocessing's forkserver (see start_fork_server), and every process
# it starts first imports the parent's main module again, as `__mp_main__`, so that what the
# script defines can be unpickled there (the fork server does it once for all of them, when it
# can: NOTE [ Fork server preload ]). A script that builds a Server at its top level, with no
# `if __name__ == "__main__":` guard, builds one again in each of them, while that process is
# still bootstrapping: multiprocessing refuses to start a process then ("An attempt has been
# made to start a new process before the current process has finished its bootstrapping
# phase"), the child exits 1, and the pool would see its workers die at start, 7 times in a
# row. Two checks name the guard instead:
#
#   child:  Server() while current_process()._inheriting (set by multiprocessing.spawn for
#           exactly that import)  -> RuntimeError naming the guard, on the child's stderr (the
#           fork server's own import of the script fails the same way, and is let go)
#   parent: start_fork_server's warm-up process (a no-op) exits non-zero -> it died importing
#           the main module -> RuntimeError naming the guard, raised by Server()


def _guard_advice() -> str:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    script = f" ({path})" if path else ""
    return (
        f"Each worker process imports the main module{script} again, as multiprocessing's "
        "forkserver and spawn start methods do, and that import failed there: a script that "
        'builds a Server must do so under `if __name__ == "__main__":` (NOTE [ Main module '
        "guard ] in remote_loader.server.engine.forkserver); the worker's own error is above."
    )


def refuse_while_bootstrapping() -> None:
    """Raises RuntimeError naming the `if __name__ == "__main__":` guard when called while this
    process, a child of multiprocessing, imports its parent's main module (NOTE [ Main
    module guard ])."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(
            "a Server is being built while a worker process imports the main module again "
            "(multiprocessing's bootstrapping phase), which would start a server in every "
            'worker: build it under `if __name__ == "__main__":` in your script'
        )
