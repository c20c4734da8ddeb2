"""A dataset whose samples say which process imported its module and the main module: the
server's fork server, when it preloaded them (NOTE [ Fork server preload ] in
server/engine/forkserver.py), or each worker itself. Imported by path
("tests.preloaded:WhereImported")."""

from __future__ import annotations

import os
import sys

import torch
from torch.utils.data import Dataset

IMPORTED_BY = os.getpid()  # the process that imported this module


class WhereImported(Dataset[torch.Tensor]):
    """Sample i: [the worker's pid, its parent's, who imported this module, who imported the
    main module (its MAIN_IMPORTED_BY, -1 when it has none)]."""

    def __init__(self, n: int = 8) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        main = getattr(sys.modules["__main__"], "MAIN_IMPORTED_BY", -1)
        return torch.tensor([os.getpid(), os.getppid(), IMPORTED_BY, main])
