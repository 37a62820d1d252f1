"""The reconfigurable process group across groups that live in separate torch jobs.

Each Flower group is its own torchrun world, so the ranks that hold the same shard in different
groups share no process group of torch's own. They meet every round through the ``TCPStore``
that the ServerApp hosts: the server names the round's rendezvous (a prefix) and each live
group's place in it, so a group that died is simply not part of the next round's group.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

Abandoned = Callable[[], bool]
"""Asked while a sync waits: True once the sync should be given up (a newer run's command
arrived at the group: :class:`~flower_shard.flower.group.abandon.Abandonment`)."""

POLL_S = 0.05
"""How often a wait that can be abandoned looks at its flag."""

_LEFT_BEHIND: list = []
"""Process groups and works of abandoned syncs. Kept alive on purpose: destroying a gloo group
joins its worker threads, which would block until the abandoned collective times out; they
end on their own (the group's timeout) and hold only their buffers."""


class SyncAbandoned(RuntimeError):
    """The sync was given up while it waited for its peers (a newer run's command arrived)."""


def wait_or_abandon(work, abandoned: Abandoned | None):
    """Wait for a collective's ``work``; raise :class:`SyncAbandoned` as soon as ``abandoned()``
    is True (checked every :data:`POLL_S` seconds). The collective's own error propagates."""
    if abandoned is None:
        return work.wait()
    while not work.is_completed():
        if abandoned():
            _LEFT_BEHIND.append(work)
            raise SyncAbandoned("a newer run's command arrived while the sync waited for its peers")
        time.sleep(POLL_S)
    return work.wait()


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

    def connect(self, membership: Membership, abandoned: Abandoned | None = None):
        """This round's process group (it waits up to the timeout for every peer's rank, or
        until ``abandoned()``: then :class:`SyncAbandoned`)."""
        if abandoned is None:
            return self._connect(membership)
        box: list = []
        # The rendezvous blocks inside torch; it runs in a thread so that this one can give
        # it up. A thread left behind ends with the rendezvous's own timeout.
        thread = threading.Thread(
            target=lambda: box.append(_outcome(self._connect, membership)), daemon=True
        )
        thread.start()
        while thread.is_alive():
            if abandoned():
                _LEFT_BEHIND.append(box)  # a group it still makes stays referenced
                raise SyncAbandoned("a newer run's command arrived during the rendezvous")
            thread.join(POLL_S)
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def _connect(self, membership: Membership):
        if self._store is None:
            self._store = dist.TCPStore(self.host, self.port, is_master=False, timeout=self.timeout)
        store = dist.PrefixStore(f"{membership.prefix}/shard{self.shard}", self._store)
        if self.device.type == "cuda":
            return dist.ProcessGroupNCCL(store, membership.rank, membership.size)
        return dist.ProcessGroupGloo(store, membership.rank, membership.size, self.timeout)

    def reset(self) -> None:
        """Drop the connection to the store: the next :meth:`connect` makes a new one."""
        self._store = None


def _outcome(fn, *args) -> tuple[bool, object]:
    try:
        return True, fn(*args)
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
        return False, exc
