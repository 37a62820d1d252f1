"""A cross-group sync that a group commits as a whole or not at all (torchft's commit vote).

Each rank of a group syncs its own shard with its own cross-group process group, so one rank
can succeed while another fails (its peer died, its rendezvous timed out). A group whose ranks
disagreed would hold a model made of averaged and unaveraged shards. So every sync is
snapshot, try, vote, and on any failure roll back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flower_shard.runtime.cross_group import Abandoned, CrossGroup, Membership
from flower_shard.runtime.outer_sync import OuterSync, SyncStats

log = logging.getLogger(__name__)

ANOTHER_RANK_FAILED = "another rank of this group failed its part of the sync"


@dataclass(frozen=True)
class SyncOutcome:
    """What a group's sync came to: the stats of a committed sync, or why it was rolled back."""

    stats: SyncStats | None = None
    failure: str | None = None
    """None when committed; else this rank's own error, or :data:`ANOTHER_RANK_FAILED`."""

    @property
    def committed(self) -> bool:
        return self.failure is None


def should_commit(ok: bool, vote_pg) -> bool:
    """Every rank of the group says whether its part succeeded; True only if all did.

    ``vote_pg`` is the group's own (gloo) control group, which the failed cross-group group
    does not touch, so the vote itself does not wait on a dead peer.
    """
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=vote_pg)
    return bool(flag.item())


def sync_or_rollback(
    outer: OuterSync,
    cross: CrossGroup,
    membership: Membership,
    *,
    vote_pg,
    weight: float | None = None,
    abandoned: Abandoned | None = None,
) -> SyncOutcome:
    """The cross-group sync of every rank of the group, or, if any rank's part fails, none.

    Every rank: snapshot what the sync changes (its shards, the synced AdamW moments, the outer
    optimizer's state, the error-feedback residual), connect to the round's cross-group group
    and sync (:meth:`OuterSync.sync`, weighted by ``weight``), then vote over ``vote_pg``. If any
    rank failed, all restore their snapshot bit for bit and drop the store connection
    (:meth:`CrossGroup.reset`), since the rendezvous may be what broke. Must be called by every
    rank of the group. ``abandoned``: the rendezvous and every wait give up as soon as it returns
    True (:class:`~flower_shard.runtime.cross_group.SyncAbandoned`), and the group rolls back.

    Returns
    -------
    SyncOutcome
        ``committed`` with the stats, or the reason it was rolled back: this rank's own error
        (one line), or :data:`ANOTHER_RANK_FAILED`.
    """
    saved = outer.snapshot()
    stats, error = None, None
    outer.abandoned = abandoned
    try:
        stats = outer.sync(cross.connect(membership, abandoned), weight=weight)
    except Exception as exc:  # noqa: BLE001 - a timeout, a closed connection: DistError and kin
        error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
    finally:
        outer.abandoned = None
    if should_commit(error is None, vote_pg):
        return SyncOutcome(stats=stats)
    outer.restore(saved)
    cross.reset()
    if error is not None:  # the ranks that only followed the vote have nothing to add
        log.warning("cross-group sync rolled back: %s", error)
    return SyncOutcome(failure=error or ANOTHER_RANK_FAILED)
