"""What the server said of a loader to its consumer (Describe): asked once per membership, as
LoaderInfo.length is the consumer's and its rank may be known only at its first stream."""

from __future__ import annotations

from remote_loader.client import state as state_module
from remote_loader.client.link import ServerLink
from remote_loader.client.options import JobRank, LoaderOptions
from remote_loader.protos import loader_pb2 as pb


class Descriptions:
    """Describe's answers for loader `name` by this consumer's (rank, world_size), which
    `members` reads from the job until the first stream fixes them. A consumer whose rank is
    not known yet is described as rank 0 of 1 for what does not depend on it; its first stream
    describes it again. Describes it once now: a loader that is not there fails here."""

    def __init__(
        self, link: ServerLink, name: str, options: LoaderOptions, members: JobRank
    ) -> None:
        self._link = link
        self._name = name
        self._options = options
        self.members = members
        self._infos: dict[tuple[int, int], pb.LoaderInfo] = {}
        self._first = members.known() or (0, 1)
        self.of(self._first)

    def consumer(self, members: tuple[int, int]) -> pb.Consumer:
        """The consumer as a request names it, as (rank, world_size) `members`."""
        rank, world_size = members
        options = self._options
        return pb.Consumer(
            sharing=options.sharing, job=options.job, rank=rank, world_size=world_size
        )

    def of(self, members: tuple[int, int]) -> pb.LoaderInfo:
        """Describe's answer to the consumer as (rank, world_size) `members`."""
        info = self._infos.get(members)
        if info is None:
            request = pb.DescribeRequest(loader=self._name, consumer=self.consumer(members))
            info = self._infos[members] = self._link.describe(request, "describing the loader")
        return info

    @property
    def info(self) -> pb.LoaderInfo:
        """The answer to this consumer once its first stream has fixed its rank, before then
        the first one."""
        return self._infos[self.members.fixed or self._first]

    def resumed_length(self, point: state_module.ResumePoint, members: tuple[int, int]) -> int:
        """Asks the server to check a resume onto another world size now (a refusal says why
        here, not at the next `iter()`); the batches of the epoch's rest in this rank's share,
        for len(). 0 for a resume on the world size it was saved at: nothing to check."""
        if point.reshard is None:
            return 0
        asked = pb.DescribeRequest(
            loader=self._name,
            consumer=self.consumer(members),
            epoch=point.epoch,
            seed=point.seed,
            reshard=state_module.reshard_message(point.reshard),
        )
        return int(self._link.describe(asked, "resuming").length)
