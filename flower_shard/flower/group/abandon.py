"""Giving up a dead run's cross-group sync when a newer run's command arrives (collective).

A group serves one command at a time. When a ServerApp dies while its groups sync, a group can
be left waiting for peers that will never come (at the rendezvous of a round whose other groups
never got their message, say) for the whole ``sync-timeout``, and the resumed run's commands
queue behind it, so the resumed run's first sync times out as well.

So rank 0's control service, on a ``Train`` or ``Evaluate`` call of another run than the
command it is running, raises a flag in the group's own store (torchrun's), keyed by the running
command's number; every rank's sync polls it while it waits
(:func:`~flower_shard.runtime.cross_group.wait_or_abandon`), gives up, and the group rolls the
sync back as a whole (:func:`~flower_shard.runtime.commit.sync_or_rollback`) and answers the
dead run with an error; then it serves the new run. A command of the same run never abandons
anything. The flag is a store key: setting and checking it never waits on a peer group.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from flower_shard.runtime.cross_group import Abandoned


class Abandonment:
    """The group's abandon flags, one per command number, in the group's own store.

    Every rank makes one after ``init_process_group``; rank 0's control service raises them
    (from its gRPC threads: the store client serialises its calls), every rank checks them.
    """

    def __init__(self, store: dist.Store | None = None):
        self.store = dist.PrefixStore("flower-shard/abandon", store or _get_default_store())

    def raise_for(self, command: int) -> None:
        """Ask every rank to give up the sync of command number ``command``."""
        self.store.set(str(command), "1")

    def raised(self, command: int) -> bool:
        return self.store.check([str(command)])

    def checker(self, command: int) -> Abandoned:
        """What a sync of command number ``command`` polls while it waits."""
        return lambda: self.raised(command)
