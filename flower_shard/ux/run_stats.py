"""A run's figures from its rounds: pure functions, ``metrics.jsonl`` records in, numbers out.

Reads both kinds of round record: the one-torch-job trainer's (``flower-shard train``) and the
Flower ServerApp's (which adds ``groups_ok``, ``exchange_bytes``, ``eval_s``,
``control_overhead_s``, ...). :mod:`flower_shard.ux.report` writes these figures as a table and
:mod:`flower_shard.ux.plots` draws the :class:`Series`; neither computes anything itself.

One time basis for every figure but the recorded tokens/s, **training time**: a round's
``round_s`` without evaluation and without start-up. A trainer's ``round_s`` is that already
(the model is built and evaluated outside it). A Flower round's ``round_s`` runs from the first
push to the end of the server-side evaluation, so ``eval_s`` is taken out; and the first round
also carries the groups' start-up (ClientApps starting, groups building their models), which
shows as control overhead: the part of round 1's ``control_overhead_s`` above the median of
the later rounds' is taken out as start-up (with one round it cannot be told apart and stays).

Communication: inside groups, the time in FSDP/HSDP's collectives (``intra_comm_s``, recorded
by both kinds of run, a part of ``compute_s``); between groups, the trainer's outer sync
(``outer_sync_s``) or, for a Flower round, all its training time outside the groups' compute
(messages, gathering and loading weights, aggregation, polling).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from flower_shard import protocol as P


def is_flower(records: list[dict]) -> bool:
    """Written by the Flower ServerApp (its rounds carry ``exchange_bytes``)."""
    return any(P.EXCHANGE_BYTES in r for r in records)


def eval_seconds(record: dict) -> float:
    """The evaluation inside a Flower round's ``round_s`` (0 for trainer rounds, whose
    evaluation is outside it). Records from before ``eval_s`` existed: what is left of the
    round after the groups and the control overhead."""
    if P.CONTROL_OVERHEAD_S not in record:
        return 0.0
    if P.EVAL_S in record:
        return min(record[P.EVAL_S] or 0.0, record[P.ROUND_S])
    busy = record.get(P.GROUP_ROUND_S)
    if busy is None:
        return 0.0
    return max(0.0, record[P.ROUND_S] - busy - record[P.CONTROL_OVERHEAD_S])


def startup_seconds(records: list[dict]) -> float:
    """A Flower run's start-up inside its first round: round 1's control overhead above the
    median of the later rounds' (0 for trainer runs, or with a single round)."""
    overheads = [r.get(P.CONTROL_OVERHEAD_S) for r in records]
    if len(records) < 2 or any(o is None for o in overheads):
        return 0.0
    return max(0.0, overheads[0] - statistics.median(overheads[1:]))


@dataclass(frozen=True)
class RoundTimes:
    """One round's seconds on the training-time basis (see the module docstring)."""

    train_s: float
    """Without evaluation and start-up."""
    intra_comm_s: float
    """In FSDP/HSDP's collectives inside the groups."""
    inter_comm_s: float
    """Between groups: the outer sync, or a Flower round's time outside the groups' compute."""

    @property
    def comm_s(self) -> float:
        return self.intra_comm_s + self.inter_comm_s


def round_times(record: dict, startup_s: float = 0.0) -> RoundTimes:
    """The :class:`RoundTimes` of one round; ``startup_s`` is taken out of it (round 1)."""
    train_s = max(0.0, record[P.ROUND_S] - eval_seconds(record) - startup_s)
    intra = min(record.get(P.INTRA_COMM_S) or 0.0, train_s)
    if P.CONTROL_OVERHEAD_S in record:
        inter = max(0.0, train_s - (record.get(P.COMPUTE_S) or 0.0))
    else:
        inter = min(record[P.OUTER_SYNC_S], train_s)
    return RoundTimes(train_s, intra, min(inter, train_s - intra))


@dataclass
class Series:
    """Per-round curves of a run, in round order (one entry per round, except the ``eval_*``
    curves: one per round that evaluated)."""

    round: list[int] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    """Cumulative training time at the end of each round."""
    tokens: list[int] = field(default_factory=list)
    """Cumulative tokens."""
    round_tokens: list[int] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    """``tokens_per_s`` as metrics.jsonl records it (and the console shows it)."""
    train_loss: list[float | None] = field(default_factory=list)
    """None where no group trained."""
    comm_s: list[float] = field(default_factory=list)
    comm_share: list[float] = field(default_factory=list)
    """(inside + between groups) / training time, per round."""
    intra_share: list[float] = field(default_factory=list)
    """Inside groups / training time, per round."""
    eval_wall_s: list[float] = field(default_factory=list)
    eval_tokens: list[int] = field(default_factory=list)
    eval_ppl: list[float] = field(default_factory=list)


def series(records: list[dict]) -> Series:
    """The :class:`Series` of a run's rounds (see :func:`round_times` for the times)."""
    out = Series()
    wall, previous = 0.0, 0
    startup = startup_seconds(records)
    for i, r in enumerate(records):
        t = round_times(r, startup if i == 0 else 0.0)
        wall += t.train_s
        out.round.append(r[P.ROUND])
        out.wall_s.append(wall)
        out.tokens.append(r[P.TOKENS])
        out.round_tokens.append(r[P.TOKENS] - previous)
        previous = r[P.TOKENS]
        out.tokens_per_s.append(float(r[P.TOKENS_PER_S]))
        out.train_loss.append(_finite(r.get(P.TRAIN_LOSS)))
        out.comm_s.append(t.comm_s)
        out.comm_share.append(t.comm_s / t.train_s if t.train_s > 0 else 0.0)
        out.intra_share.append(t.intra_comm_s / t.train_s if t.train_s > 0 else 0.0)
        ppl = _finite(r.get(P.EVAL_PPL))
        if ppl is not None:
            out.eval_wall_s.append(wall)
            out.eval_tokens.append(r[P.TOKENS])
            out.eval_ppl.append(ppl)
    return out


@dataclass(frozen=True)
class RunSummary:
    """The figures of one run's summary row (see :func:`summarise`)."""

    rounds: int
    steps: int
    tokens: int
    """The last cumulative count."""
    train_s: float
    """Training time: the rounds without evaluation and start-up."""
    startup_s: float
    """Start-up taken out of a Flower run's first round (0 for trainer runs)."""
    final_train_loss: float | None
    """Of the last round that reports one, else None."""
    final_eval_ppl: float | None
    tokens_per_s_median: float
    """Median over rounds of metrics.jsonl's ``tokens_per_s``."""
    intra_comm_s: float
    inter_comm_s: float
    intra_bytes_per_rank: float
    """What one rank sent inside its group over the run (FSDP/HSDP's collectives; a Flower
    run records the slowest group's rank)."""
    inter_bytes_per_rank: float | None
    """What one rank sent to other groups over the run (the outer all-reduce or all-gather);
    None for the flower transport, where no rank sends to another group."""
    message_bytes: float | None
    """Weights in Flower messages over the run, all groups, both ways; None for trainer runs."""
    groups_rejected: int | None
    """Flower runs; None otherwise."""

    @property
    def comm_share(self) -> float:
        """(inside + between groups) / training time: time-weighted, not a mean of shares."""
        total = self.intra_comm_s + self.inter_comm_s
        return total / self.train_s if self.train_s > 0 else 0.0

    @property
    def intra_share(self) -> float:
        return self.intra_comm_s / self.train_s if self.train_s > 0 else 0.0


def summarise(records: list[dict], flower_transport: bool | None = None) -> RunSummary:
    """The summary row of one run.

    Parameters
    ----------
    records
        The run's rounds, as in ``metrics.jsonl`` (at least one).
    flower_transport
        The weights went through Flower messages (default: any round's ``exchange_bytes``
        is non-zero); then there are no per-rank bytes between groups.
    """
    s = series(records)
    startup = startup_seconds(records)
    times = [round_times(r, startup if i == 0 else 0.0) for i, r in enumerate(records)]
    flower = is_flower(records)
    messages = float(sum(r.get(P.EXCHANGE_BYTES) or 0 for r in records))
    if flower_transport is None:
        flower_transport = messages > 0
    losses = [x for x in s.train_loss if x is not None]
    return RunSummary(
        rounds=len(records),
        steps=records[-1][P.STEP],
        tokens=records[-1][P.TOKENS],
        train_s=s.wall_s[-1],
        startup_s=startup,
        final_train_loss=losses[-1] if losses else None,
        final_eval_ppl=s.eval_ppl[-1] if s.eval_ppl else None,
        tokens_per_s_median=statistics.median(s.tokens_per_s),
        intra_comm_s=sum(t.intra_comm_s for t in times),
        inter_comm_s=sum(t.inter_comm_s for t in times),
        intra_bytes_per_rank=float(sum(r.get(P.INTRA_BYTES) or 0 for r in records)),
        inter_bytes_per_rank=None
        if flower_transport
        else float(sum(r[P.OUTER_SYNC_BYTES] or 0 for r in records)),
        message_bytes=messages if flower else None,
        groups_rejected=sum(r.get(P.GROUPS_REJECTED) or 0 for r in records) if flower else None,
    )


def _finite(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None
