"""Admission: how one consumer takes part in a loader's epochs (sharing mode, job, rank, world
size), and which memberships every sharing mode refuses (see docs/sharing.md; what one
mode refuses besides is its policy's, policies.admit)."""

from __future__ import annotations

import dataclasses

from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.config.types import SHARING_MODES
from remote_loader.server.errors import SharingRefused, clip

DEFAULT_JOB = "default"
# Ranks in one job. DistributedSampler pads every rank's share to world_size * ceil(n /
# world_size) indices: a request naming 2**32 - 1 ranks would build billions of them.
MAX_WORLD_SIZE = 1 << 20


@dataclasses.dataclass(frozen=True)
class Membership:
    """How one consumer takes part: sharing mode, job, rank and world size."""

    sharing: str = "partition"
    job: str = DEFAULT_JOB
    rank: int = 0
    world_size: int = 1

    def check(self, spec: LoaderSpec, is_iterable: bool) -> None:
        """Raises SharingRefused, saying what is allowed, for a membership no sharing mode of
        the loader takes (policies.admit adds what the mode's own policy refuses)."""
        if self.sharing not in SHARING_MODES:
            raise SharingRefused(
                f"unknown sharing mode {clip(self.sharing)!r}; the modes are "
                f"{', '.join(SHARING_MODES)}"
            )
        if self.sharing not in spec.parts.sharing.modes:
            raise SharingRefused(
                f"loader {spec.name!r} does not allow sharing={self.sharing!r}; it allows "
                f"{', '.join(spec.parts.sharing.modes)} (the server's `sharing` option)"
            )
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise SharingRefused(
                f"world_size must be between 1 and {MAX_WORLD_SIZE}, got {self.world_size}"
            )
        if not 0 <= self.rank < self.world_size:
            raise SharingRefused(
                f"rank {self.rank} is out of range for world_size {self.world_size}: "
                f"it must be in [0, {self.world_size - 1}]"
            )
