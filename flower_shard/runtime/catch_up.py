"""A group (re)joining the collective transport mid-run takes the global model from the others.

In the collective transport the model lives only in the groups. A group that was dropped and
comes back, or a node that joins mid-run, holds a stale model (or the initial one); trained and
averaged as it is, it would drag the others' weights back. So in a round where the server
names joiners (``sync-joiners``: their sync ranks), every member group meets the others before
its inner steps, under the round's prefix + ``/catch-up``, and each rank broadcasts from the
lowest-ranked group that is not joining what makes the model global: its shard of the weights
and of the outer optimizer's state (Nesterov's momentum; the last global weights of compressed
syncs). Rank s of every group holds shard s, so each rank moves one shard and nothing is
gathered (groups of the collective transport have the same K and layout). The joiner keeps its
own AdamW state, LR schedule and data position (from its last checkpoint where it has one) and
its error-feedback residual (per group by design).

All or nothing, like the sync (:mod:`~flower_shard.runtime.commit`): the broadcast lands in a
separate buffer, the group's ranks vote over their own control group, and only if every rank
received its shard does a joiner copy it in. On failure a joiner keeps nothing of a half-received
model and must not train the round (the server leaves it out and probes it again next round);
the other members hold the model they had and go on.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from flower_shard.runtime.commit import should_commit
from flower_shard.runtime.cross_group import Abandoned, CrossGroup, Membership, wait_or_abandon
from flower_shard.runtime.outer_sync import OuterSync, _flatten, _unflatten_into

log = logging.getLogger(__name__)

SUFFIX = "/catch-up"
"""Added to the round's rendezvous prefix: the catch-up's group is not the sync's."""


def parse_joiners(value: str | None) -> list[int]:
    """The sync ranks in a ``sync-joiners`` value ("1,3"; empty or None: none)."""
    return sorted({int(v) for v in str(value or "").split(",") if v.strip()})


def source_of(joiners: list[int], size: int) -> int | None:
    """The group every joiner copies: the lowest sync rank not joining (None: all join)."""
    return next((r for r in range(size) if r not in joiners), None)


def global_state(outer: OuterSync) -> list[torch.Tensor]:
    """What every group holds alike between rounds: this rank's weight shards and the outer
    optimizer's buffers (views: copying into them updates the model in place)."""
    return outer.params + list(outer.outer.buffers().values())


@torch.no_grad()
def catch_up(
    outer: OuterSync,
    cross: CrossGroup,
    membership: Membership,
    joiners: list[int],
    *,
    vote_pg,
    abandoned: Abandoned | None = None,
) -> str | None:
    """Every rank of every member group, in a round with ``joiners`` (see the module): the
    joiners take the source group's weights and outer state. Returns None, or why this group's
    part failed (the joiner then holds what it had; the others need nothing)."""
    src = source_of(joiners, membership.size)
    if src is None:  # nobody holds the global model apart from the joiners: nothing to take
        return None
    state = global_state(outer)
    flat = _flatten(state)  # a copy: a half-received broadcast touches nothing
    error = None
    try:
        pg = cross.connect(replace(membership, prefix=membership.prefix + SUFFIX), abandoned)
        wait_or_abandon(pg.broadcast(flat, src), abandoned)
    except Exception as exc:  # noqa: BLE001 - a timeout, a closed connection: DistError and kin
        error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
    if not should_commit(error is None, vote_pg):
        cross.reset()
        log.warning("catch-up from group %d failed: %s", src, error or "another rank failed")
        return error or "another rank of this group failed its part of the catch-up"
    if membership.rank in joiners:
        _unflatten_into(flat, state)
        log.info("caught up: the global model and outer state of group %d (sync rank)", src)
    return None
