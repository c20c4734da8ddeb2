"""Imported by the fork server only, last of its preload list: prepares the server's main module
and imports the modules the server listed for its workers, each allowed to fail (NOTE [ Fork
server preload ] in server/engine/forkserver.py). Anywhere else it does nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import os
import sys
from multiprocessing import spawn

from remote_loader.server.engine.forkserver import PRELOAD_ENV


def _preload() -> None:
    # Taken out, so that the workers forked from here do not see it.
    text = os.environ.pop(PRELOAD_ENV, None)
    if text is None:
        return
    wanted = json.loads(text)
    sys.path[:] = wanted["sys_path"]  # the server's, not `python -c`'s working directory first
    if wanted["main"]:
        # As multiprocessing prepares a child's main module (and as its own preload of
        # "__main__" does): a script without its `__main__` guard fails here as it would there
        # (NOTE [ Main module guard ]), and each worker then imports it, and fails, itself.
        process = multiprocessing.current_process()
        process._inheriting = True  # type: ignore[attr-defined]
        try:
            with contextlib.suppress(BaseException):
                spawn.prepare(wanted["main"])
        finally:
            del process._inheriting  # type: ignore[attr-defined]
    for name in wanted["modules"]:
        # Anything, SystemExit included: what fails here, a worker imports (or fails to) itself.
        with contextlib.suppress(BaseException):
            importlib.import_module(name)


_preload()
