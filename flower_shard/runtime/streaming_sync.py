"""Fragmented and overlapped outer sync (Streaming DiLoCo's schedule) on the collective path.

The synchronous sync (:meth:`~flower_shard.runtime.outer_sync.OuterSync.sync`) stops every group
at the end of each round while the shards cross the slow link. Two options, alone or together,
spread that cost and hide it behind the next steps:

**Fragments** (F; Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512): the parameters
are cut into F fragments of consecutive whole parameters with about equal numbers of values
(the cut is made from the full shapes, so every rank of every group makes the same one).
Fragment f syncs after inner step ``(f + 1) * T // F`` of each round, so each sync moves 1/F
of the model (each burst on the link is F-fold shorter; its rate is still the link's unless
paced, below); the last fragment syncs at the end of the round. Every fragment still syncs
once per round, with the same outer optimizer.

**Overlap** (one sync of delay: Streaming DiLoCo's overlapped communication with mixing
alpha = 0, and the delayed outer gradients of Kale et al. 2025, arXiv 2502.12996): at a
fragment's sync point the group sends its weights ``sent`` (an asynchronous all-reduce) and
keeps training from them. At the fragment's next sync point, one round later, the result
``x = Outer(mean_g sent_g)`` is there, and the group moves the fragment by what the global
model gained over what it sent::

    theta_g <- theta_g + (x - sent_g)

This keeps the group's own progress of the overlapped round (``theta_g - sent_g``) on top of
the new global weights, as if the round had started from ``x`` (its gradients were taken one
round stale). The rebased ``theta_g`` is what the group sends next; its mean over the groups
minus ``x`` is the mean progress of one round, the pseudo-gradient of synchronous DiLoCo, so
the outer optimizer (fedavg or nesterov) steps as it does there. With one group and fedavg,
``x == sent`` exactly, the correction is exactly zero and the run is bit for bit training with
no outer sync at all.

**Pacing** (with overlap; :mod:`.pacing`): a fragment's exchange goes out in pieces that a
background thread issues evenly over the time until the next fragment's sync point (from the
measured step time, with a margin), so the slow link carries each fragment over its own slice
of the round instead of at once, and its peak rate falls toward the round's average. The
thread has a process group of its own: on a group shared with the main thread's collectives
its pieces would interleave with them in another order on each rank. The values are the same
(a piece of a sum is the sum of the piece). Until a step time is known (the run's first
sync), the exchange goes out whole.

**Draining**: at the end of the run, and before each checkpoint and the evaluation of the last
round, every fragment's pending result is applied and one synchronous sync follows, so all
groups hold the same global model and a checkpoint holds nothing in flight (drain before
checkpoint: a run resumes bit-exactly from any of its checkpoints, and pays one exchange that
is not hidden per checkpoint). The evaluations of other rounds measure the groups' own models,
which run one round ahead of the global one.

**Exchange**: the outer sync's own. Float32 weights are SUM-all-reduced over the groups (with
HSDP each replica all-reduces its 1/R stripe of the fragment and the replicas all-gather the
rest when the result is applied, so the slow tier carries each fragment once per group).
Compressed (bf16/int8), a group sends its fragment's pseudo-gradient ``x - sent_g`` against
the fragment's last global weights ``x``, with error feedback on the fragment's slice of the
residual, and the payloads are all-gathered and decoded in group order; the outer optimizer
then steps from their mean, so the result ``x'`` and the rebase ``theta_g += x' - sent_g`` are
as above (``sent_g`` is the group's exact weights, not their compressed image). With one
group the compression error makes ``x' != sent``: only the uncompressed sync is exactly
training without an outer sync.

Memory: two flat float32 copies of this rank's fragment shards while a sync is in flight (what
it sent, and the buffer being reduced; with int8, the sent weights and G payloads of a quarter
of their size), 2 M / K per rank at most, beside the outer optimizer's state.

On failure: as :class:`~flower_shard.runtime.outer_sync.OuterSync`: a failed all-reduce raises
when it is waited for, and in one torch job that ends the job (torchrun stops the world).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from flower_shard.runtime import compression as Z
from flower_shard.runtime.outer_optimizer import pseudo_gradient
from flower_shard.runtime.outer_sync import (
    OuterSync,
    StripedAllreduce,
    SyncStats,
    _flatten,
    _unflatten_into,
    local_view,
)
from flower_shard.runtime.pacing import WINDOW_SHARE, PacedCollective, Pacer


@dataclass(frozen=True)
class Fragment:
    """Consecutive whole parameters that sync together."""

    index: int
    names: tuple[str, ...]
    """The parameters' names, in the model's order."""
    first: int
    """Index of the first parameter in ``model.parameters()``."""
    start: int
    stop: int
    """The fragment's range of this rank's flat buffer of local shards."""


def plan_fragments(model: nn.Module, fragments: int) -> list[Fragment]:
    """Cut ``model``'s parameters into ``fragments`` runs of about equal full size.

    Each cut falls at the parameter boundary nearest to ``total * f / fragments`` values, with at
    least one parameter per fragment; made from full shapes, it is the same on every rank.
    """
    named = list(model.named_parameters())
    if not 1 <= fragments <= len(named):
        raise ValueError(
            f"outer fragments must be between 1 and the model's {len(named)} parameters, "
            f"got {fragments}"
        )
    full = [p.numel() for _, p in named]  # a DTensor's numel is its full size
    cum = [0]
    for n in full:
        cum.append(cum[-1] + n)
    cuts = [0]
    for f in range(1, fragments):
        target = cum[-1] * f / fragments
        low, high = cuts[-1] + 1, len(named) - (fragments - f)
        cuts.append(min(range(low, high + 1), key=lambda j: abs(cum[j] - target)))
    cuts.append(len(named))
    local = [0]
    for _, p in named:
        local.append(local[-1] + local_view(p).numel())
    return [
        Fragment(f, tuple(n for n, _ in named[a:b]), a, local[a], local[b])
        for f, (a, b) in enumerate(zip(cuts, cuts[1:]))
    ]


def own_group(pg):
    """A new process group of ``pg``'s ranks and backend, for one thread's collectives.

    Every rank of the world calls it at the same point (``new_group`` is collective over the
    world): the ranks' groups are gathered and each distinct one is made, in one order.
    """
    import torch.distributed as dist

    mine = dist.get_process_group_ranks(pg)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    groups = sorted({tuple(r) for r in every})
    made = {g: dist.new_group(list(g), backend=dist.get_backend(pg)) for g in groups}
    return made[tuple(mine)]


def due_step(index: int, fragments: int, steps: int) -> int:
    """The inner step of a round of ``steps`` after which fragment ``index`` of ``fragments``
    syncs."""
    return max(1, (index + 1) * steps // fragments)


def window_steps(index: int, fragments: int, steps: int) -> int:
    """The inner steps from fragment ``index``'s sync point to the next fragment's (the first
    fragment's in the next round, for the last): the window its paced exchange gets."""
    gap = due_step((index + 1) % fragments, fragments, steps) - due_step(index, fragments, steps)
    return gap if gap > 0 else gap + steps


@dataclass
class _InFlight:
    sent: torch.Tensor
    """The fragment's weights as sent (the base of the rebase)."""
    finish: Callable[[], torch.Tensor]
    """Waits for the exchange; returns the fragment's new global weights."""
    paced: PacedCollective
    """The exchange's pieces (:mod:`.pacing`)."""


class StreamingSync:
    """Drives an :class:`~flower_shard.runtime.outer_sync.OuterSync` fragment by fragment, each
    sync blocking or overlapped with the next round (the algorithm: the module docstring).

    The driver calls :meth:`after_step` after every inner step, :meth:`end_round` at the end of
    each round (the round's statistics), and :meth:`drain` before a checkpoint, the last
    evaluation and the end of the run. The exchange is the outer sync's: float32 all-reduce
    (striped over HSDP's replicas), or bf16/int8 pseudo-gradients with error feedback, each
    fragment keeping its own slice of the residual; equal group weights (the one-job collective
    driver).

    Parameters
    ----------
    sync
        The outer sync whose process groups, outer optimizer, compression and shards are used.
    model
        The sharded model (for the fragment plan).
    fragments
        F: the number of fragments.
    overlap
        Send and go on; apply the result one round later.
    pace
        With ``overlap``: spread each exchange over the time until the next fragment's sync
        point (:mod:`.pacing`) instead of sending it whole. :meth:`close` stops its thread.
    """

    PIECES_PER_STEP = 8
    """How finely a paced exchange is cut: pieces per step of its window."""

    def __init__(
        self,
        sync: OuterSync,
        model: nn.Module,
        fragments: int = 1,
        overlap: bool = False,
        pace: bool = False,
    ):
        if sync.sync_optimizer_state:
            raise ValueError("a fragmented or overlapped sync moves weights, not AdamW's moments")
        if pace and not overlap:
            raise ValueError("pacing spreads an overlapped sync over the round: set overlap")
        self.sync, self.overlap = sync, overlap
        self.pacer = Pacer(sync.params[0].device) if pace else None
        self._paced_pg = own_group(sync.group_pg) if pace else None
        self._step_s: float | None = None  # measured between steps (pacing's windows)
        self._last_step: float | None = None
        self.fragments = plan_fragments(model, fragments)
        self._in_flight: dict[int, _InFlight] = {}
        self._synced: set[int] = set()
        self._stats = SyncStats(0.0, 0, 0)

    @property
    def groups(self) -> int:
        return self.sync.group_pg.size()

    def due(self, fragment: Fragment, steps: int) -> int:
        """The inner step of a round of ``steps`` after which ``fragment`` syncs."""
        return due_step(fragment.index, len(self.fragments), steps)

    def after_step(self, done: int, steps: int) -> None:
        """After inner step ``done`` of a round of ``steps``: sync the fragments due by now."""
        now = time.perf_counter()
        if self._last_step is not None:  # a step's time (smoothed), not one across rounds
            last = now - self._last_step
            self._step_s = last if self._step_s is None else 0.5 * (self._step_s + last)
        for fragment in self.fragments:
            if fragment.index not in self._synced and done >= self.due(fragment, steps):
                self._sync(fragment, steps)
        self._last_step = time.perf_counter()

    def _pg(self, pace: dict):
        """The process group an exchange runs on: the pacer's own when paced (its thread must
        not interleave with the main thread's collectives on a shared group)."""
        return self._paced_pg if pace.get("pacer") is not None else self.sync.group_pg

    def close(self) -> None:
        """Stop the pacer's thread (after :meth:`drain`: nothing is held)."""
        if self.pacer is not None:
            self.pacer.close()

    def end_round(self) -> SyncStats:
        """Sync the fragments not reached (a round that ended early); the round's statistics:
        the seconds the steps were held up and the bytes this rank sent."""
        for fragment in self.fragments:
            if fragment.index not in self._synced:
                self._sync(fragment, 1)
        self._synced.clear()
        self._last_step = None
        stats, self._stats = self._stats, SyncStats(0.0, 0, 0)
        return stats

    def drain(self) -> SyncStats:
        """Apply every pending result, then one synchronous sync: all groups hold the global
        model and nothing is in flight. Returns the drain's statistics."""
        start = time.perf_counter()
        for fragment in self.fragments:
            if fragment.index in self._in_flight:
                self._receive(fragment)
        for fragment in self.fragments:
            self._blocking(fragment)
        stats, self._stats = self._stats, SyncStats(0.0, 0, 0)
        stats.seconds = time.perf_counter() - start
        return stats

    def unsent_pieces(self) -> int:
        """Pieces of the exchanges in flight not sent yet (0 unless paced)."""
        return sum(f.paced.left for f in self._in_flight.values())

    def _sync(self, fragment: Fragment, steps: int) -> None:
        self._synced.add(fragment.index)
        start = time.perf_counter()
        if not self.overlap:
            self._blocking(fragment)
        else:
            if fragment.index in self._in_flight:
                self._receive(fragment)
            self._send(fragment, steps)
        self._stats.seconds += time.perf_counter() - start

    def _params(self, fragment: Fragment) -> list[torch.Tensor]:
        return self.sync.params[fragment.first : fragment.first + len(fragment.names)]

    def _count(self, payload: int, sent: int, replicate: int = 0) -> None:
        self._stats.payload_bytes += payload
        self._stats.sent_bytes += sent
        self._stats.replicate_bytes += replicate

    @torch.no_grad()
    def _blocking(self, fragment: Fragment) -> None:
        if len(self.fragments) == 1:  # exactly the synchronous sync
            stats = self.sync.sync()
            self._count(stats.payload_bytes, stats.sent_bytes, stats.replicate_bytes)
            return
        params = self._params(fragment)
        finish, _ = self._start(fragment, _flatten(params))
        _unflatten_into(finish(), params)

    @torch.no_grad()
    def _send(self, fragment: Fragment, steps: int) -> None:
        sent = _flatten(self._params(fragment))
        pace = {}
        if self.pacer is not None:
            window = window_steps(fragment.index, len(self.fragments), steps)
            seconds = WINDOW_SHARE * window * (self._step_s or 0.0)
            pace = dict(pieces=self.PIECES_PER_STEP * window, pacer=self.pacer, window_s=seconds)
        self._in_flight[fragment.index] = _InFlight(sent, *self._start(fragment, sent, **pace))

    @torch.no_grad()
    def _receive(self, fragment: Fragment) -> None:
        flight = self._in_flight.pop(fragment.index)
        x = flight.finish()
        offset = 0
        for p in self._params(fragment):
            n = p.numel()
            p.add_((x[offset : offset + n] - flight.sent[offset : offset + n]).view_as(p))
            offset += n

    def _start(self, fragment: Fragment, flat: torch.Tensor, **pace) -> tuple:
        """Start the exchange of ``flat`` (the fragment's weights; not modified) in the
        background, paced by ``pace`` (:class:`~.pacing.PacedCollective`'s ``pieces``,
        ``pacer``, ``window_s``; none: whole): ``(finish, paced)``; ``finish()`` waits for it
        and returns the new global weights."""
        sync, g = self.sync, self.groups
        width = flat.element_size()
        if sync.feedback is not None:
            return self._start_compressed(fragment, flat, **pace)
        if sync.replicate_pg is not None:
            striped = StripedAllreduce(self._pg(pace), sync.replicate_pg, flat, **pace)
            sent = 2 * (g - 1) * striped.stripe * width // g
            self._count(flat.numel() * width, sent, striped.replicate_bytes)
            return (
                lambda: self._outer_step(fragment, striped.finish(sync.wait).div_(g)),
                striped.paced,
            )
        reduced = flat.clone()
        paced = PacedCollective(  # SUM
            lambda a, b: self._pg(pace).allreduce([reduced[a:b]]), reduced.numel(), **pace
        )
        self._count(flat.numel() * width, 2 * (g - 1) * flat.numel() * width // g)

        def finish() -> torch.Tensor:
            _raise(paced.finish(sync.wait))
            return self._outer_step(fragment, reduced.div_(g))

        return finish, paced

    def _start_compressed(self, fragment: Fragment, flat: torch.Tensor, **pace) -> tuple:
        """The pseudo-gradient against the fragment's last global weights, compressed with the
        fragment's slice of the residual, all-gathered (not striped, as the sync's); paced
        by ranges of the payload's bytes."""
        sync, g = self.sync, self.groups
        start, stop = fragment.start, fragment.stop
        delta = pseudo_gradient(sync.outer.weights.detach()[start:stop], flat)
        mine = Z.to_bytes(sync.feedback.compress(delta, start))
        gathered = [torch.empty_like(mine) for _ in range(g)]
        paced = PacedCollective(
            lambda a, b: self._pg(pace).allgather([[x[a:b] for x in gathered]], [mine[a:b]]),
            mine.numel(),
            **pace,
        )
        self._count(mine.numel(), (g - 1) * mine.numel())

        def finish() -> torch.Tensor:
            _raise(paced.finish(sync.wait))
            mean = Z.mean_of(gathered, sync.compression, flat.numel(), sync.chunk)
            return sync.outer.apply_part(mean, start, stop)

        return finish, paced

    def _outer_step(self, fragment: Fragment, mean: torch.Tensor) -> torch.Tensor:
        if len(self.fragments) == 1:
            return self.sync.outer.step(mean)
        return self.sync.outer.step_part(mean, fragment.start, fragment.stop)


def _raise(failed: Exception | None) -> None:
    if failed is not None:
        raise failed
