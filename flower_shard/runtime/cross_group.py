"""The reconfigurable process group across groups that live in separate torch jobs.

Each Flower group is its own torchrun world, so the ranks that hold the same shard in different
groups share no process group of torch's own. They meet every round through the ``TCPStore``
that the ServerApp hosts: the server names the round's rendezvous (a prefix) and each live
group's place in it, so a group that died is simply not part of the next round's group.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Membership:
    """Who syncs this round, as the server decided: the round's rendezvous and this group's
    place among the live groups."""

    prefix: str
    """The round's namespace in the store (a new one every round: a new membership starts
    clean, and a late rank of an old round cannot join a new one)."""
    rank: int
    """This group's place among the round's live groups (0 .. size-1)."""
    size: int
    """How many groups sync this round."""


class CrossGroup:
    """A process group of the ranks that hold shard ``shard`` in every live group, rebuilt for
    every round.

    The connection to the store lasts while rounds succeed; each round gets a fresh
    ``PrefixStore`` under :attr:`Membership.prefix` and a fresh gloo group (CPU) or NCCL group
    (CUDA) over it. A round whose peers do not all arrive fails after ``timeout_s`` (the store's
    wait and the group's collectives alike).

    On failure: call :meth:`reset` (the connection may be what broke: a server that restarted
    hosts a new store at the same address); the next :meth:`connect` connects afresh. Nothing
    else holds state across rounds.

    Parameters
    ----------
    address
        ``HOST:PORT`` of the ServerApp's store.
    shard
        This rank's place in its group (the ranks of one shard meet under the same name).
    device
        Where the tensors live: CUDA gets NCCL, anything else gloo.
    timeout_s
        How long a rendezvous or a collective may wait for a peer.
    """

    def __init__(self, address: str, shard: int, device: torch.device, timeout_s: float):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"collective address {address!r} is not HOST:PORT; pass HOST:PORT")
        self.host, self.port = host, int(port)
        self.shard, self.device = shard, device
        self.timeout = timedelta(seconds=timeout_s)
        self._store: dist.TCPStore | None = None

    def connect(self, membership: Membership):
        """This round's process group (it waits up to the timeout for every peer's rank)."""
        if self._store is None:
            self._store = dist.TCPStore(self.host, self.port, is_master=False, timeout=self.timeout)
        store = dist.PrefixStore(f"{membership.prefix}/shard{self.shard}", self._store)
        if self.device.type == "cuda":
            return dist.ProcessGroupNCCL(store, membership.rank, membership.size)
        return dist.ProcessGroupGloo(store, membership.rank, membership.size, self.timeout)

    def reset(self) -> None:
        """Drop the connection to the store: the next :meth:`connect` makes a new one."""
        self._store = None
