"""A round's statistics as the ServerApp records them: one typed value per metrics.jsonl field.

:class:`RoundStats` is filled once, at the end of a round, from what the round produced (the
valid replies, the training exchange's times, the aggregation's sync figures, the evaluation);
:meth:`RoundStats.record` gives the line of ``metrics.jsonl`` under the protocol's names.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MessageType, MetricRecord

from flower_shard import protocol as P
from flower_shard.flower.server import replies as R
from flower_shard.flower.server.exchange import Times
from flower_shard.flower.server.replies import TrainReply
from flower_shard.flower.server.schedule import RoundPlan
from flower_shard.flower.server.transports.base import Aggregate
from flower_shard.runtime.evaluation import perplexity


@dataclass(frozen=True)
class TrainOutcome:
    """A round's training replies, checked and aggregated."""

    ok: list[TrainReply]
    """The valid replies that took part in the aggregation."""
    rejected: list[str]
    """One line per other reply (no reply, an error, a failed check, an outlier)."""
    aggregate: Aggregate
    committed: bool
    """At least min-groups valid replies: the aggregate is the new model."""

    @property
    def metrics(self) -> MetricRecord | None:
        """What Flower's ``aggregate_train`` returns: tokens and the token-weighted loss."""
        if not self.committed:
            return None
        figures = GroupFigures.of(self.ok)
        return MetricRecord({P.NUM_TOKENS: figures.round_tokens, P.TRAIN_LOSS: figures.train_loss})

    @property
    def arrays(self) -> ArrayRecord | None:
        """The new global model as Flower carries it (None: unchanged on the server)."""
        new = self.aggregate.arrays
        return None if new is None else ArrayRecord({k: Array(v) for k, v in new.items()})


@dataclass(frozen=True)
class Evaluation:
    """A round's held-out loss (None: not evaluated, or no valid answer) and the evaluation
    replies rejected."""

    loss: float | None = None
    rejected: list[str] = field(default_factory=list)
    pull_s: float = 0.0
    """The slowest group's pull of the evaluated model (streaming: the round's download)."""


@dataclass(frozen=True)
class GroupShare:
    """One valid group's part of a round (they differ with round-seconds or K)."""

    group: int
    steps: int
    tokens: int
    compute_s: float
    clientapp_pid: int

    def record(self) -> dict:
        return {
            P.GROUP: self.group,
            P.STEPS: self.steps,
            P.TOKENS: self.tokens,
            P.COMPUTE_S: self.compute_s,
            P.CLIENTAPP_PID: self.clientapp_pid,
        }


@dataclass(frozen=True)
class Timing:
    """Where a round's wall time went, as the server measured it."""

    round_s: float
    train: Times = field(default_factory=Times)
    """The training exchange's own times (whatever exchanges came later in the round)."""
    eval_s: float = 0.0


@dataclass(frozen=True)
class RoundStats:
    """What one round did: the metrics.jsonl record of the ServerApp, typed."""

    round: int
    step: int
    """Inner steps so far."""
    local_steps: int
    """T of this round (the most steps a group trained, with round-seconds)."""
    tokens: int
    """Tokens so far."""
    round_tokens: int
    train_loss: float
    """Token-weighted mean of the valid groups' losses (NaN without one)."""
    lr: float
    compute_s: float
    intra_bytes: float
    intra_comm_s: float
    outer_sync_s: float
    outer_sync_bytes: int
    groups_ok: int
    groups_rejected: int
    """Training replies rejected (no reply, an error, a failed check, an outlier)."""
    groups_dropped: int
    rejected: list[str]
    """One line per rejected reply: training first, then evaluation."""
    exchange_bytes: int
    """Bytes of arrays in this round's Flower messages, both ways."""
    group_round_s: float
    timing: Timing
    groups: list[GroupShare] = field(default_factory=list)
    eval_loss: float | None = None
    eval_pull_s: float = 0.0
    """Streaming: the round's download, made when the groups pulled the model to evaluate it
    (then not in the next round's time: count it as this round's exchange)."""

    @classmethod
    def collect(
        cls,
        plan: RoundPlan,
        local_steps: int,
        outcome: TrainOutcome,
        sent_bytes: int,
        dropped: int,
        timing: Timing,
        evaluation: Evaluation,
    ) -> RoundStats:
        """The statistics of a finished round; ``sent_bytes``: the arrays in its messages."""
        figures = GroupFigures.of(outcome.ok)
        received = sum(r.payload.nbytes for r in outcome.ok if r.payload is not None)
        return cls(
            round=plan.round,
            step=plan.step_before + local_steps,
            local_steps=local_steps,
            tokens=plan.tokens_before + figures.round_tokens,
            round_tokens=figures.round_tokens,
            train_loss=figures.train_loss,
            lr=figures.lr,
            compute_s=figures.compute_s,
            intra_bytes=figures.intra_bytes,
            intra_comm_s=figures.intra_comm_s,
            outer_sync_s=outcome.aggregate.outer_sync_s,
            outer_sync_bytes=outcome.aggregate.outer_sync_bytes,
            groups_ok=len(outcome.ok),
            groups_rejected=len(outcome.rejected),
            groups_dropped=dropped,
            rejected=outcome.rejected + evaluation.rejected,
            exchange_bytes=sent_bytes + received,
            group_round_s=figures.group_round_s,
            timing=timing,
            groups=figures.groups,
            eval_loss=evaluation.loss,
            eval_pull_s=evaluation.pull_s,
        )

    @property
    def control_overhead_s(self) -> float:
        """The round without the slowest group's own time and the evaluation."""
        return max(0.0, self.timing.round_s - self.group_round_s - self.timing.eval_s)

    def record(self) -> dict:
        """The metrics.jsonl line (the protocol's metric names)."""
        t = self.timing
        record = {
            P.ROUND: self.round,
            P.TOKENS: self.tokens,
            P.TOKENS_PER_S: self.round_tokens / t.round_s if t.round_s > 0 else 0.0,
            P.TRAIN_LOSS: self.train_loss,
            P.LR: self.lr,
            P.ROUND_S: t.round_s,
            P.COMPUTE_S: self.compute_s,
            P.INTRA_BYTES: self.intra_bytes,
            P.INTRA_COMM_S: self.intra_comm_s,
            P.OUTER_SYNC_S: self.outer_sync_s,
            P.OUTER_SYNC_BYTES: self.outer_sync_bytes,
            P.GROUPS_OK: self.groups_ok,
            P.GROUPS_REJECTED: self.groups_rejected,
            P.GROUPS_DROPPED: self.groups_dropped,
            P.REJECTED: list(self.rejected),
            P.EXCHANGE_BYTES: self.exchange_bytes,
            P.PUSH_S: t.train.push_s,
            P.REPLY_WAIT_S: t.train.reply_wait_s,
            P.EVAL_S: t.eval_s,
            P.EVAL_PULL_S: self.eval_pull_s,
            P.GROUP_ROUND_S: self.group_round_s,
            P.CONTROL_OVERHEAD_S: self.control_overhead_s,
            P.GROUPS: [g.record() for g in self.groups],
        }
        if self.eval_loss is not None:
            record[P.EVAL_LOSS] = self.eval_loss
            record[P.EVAL_PPL] = perplexity(self.eval_loss)
        return record | {P.STEP: self.step, P.ROUND_LOCAL_STEPS: self.local_steps}


@dataclass(frozen=True)
class GroupFigures:
    """The valid replies of a round, summed up: what RoundStats takes from the groups."""

    round_tokens: int = 0
    train_loss: float = math.nan
    lr: float = 0.0
    compute_s: float = 0.0
    intra_bytes: float = 0.0
    intra_comm_s: float = 0.0
    group_round_s: float = 0.0
    most_steps: int = 0
    groups: list[GroupShare] = field(default_factory=list)

    @classmethod
    def of(cls, ok: list[TrainReply]) -> GroupFigures:
        """Tokens summed, the loss token-weighted, the LR averaged, times and bytes the
        slowest (largest) group's. Overlapped streaming: the tokens of the updates folded (a
        group's held-back steps count in the round that folds them)."""
        if not ok:
            return cls()
        tokens = [r.num_tokens for r in ok]
        shares = [
            GroupShare(r.group, r.steps, r.num_tokens, r.compute_s, r.clientapp_pid) for r in ok
        ]
        return cls(
            round_tokens=int(sum(r.num_tokens for r in ok if not r.held_back)),
            train_loss=float(np.average([r.train_loss for r in ok], weights=tokens)),
            lr=float(np.mean([r.lr for r in ok])),
            compute_s=max(r.compute_s for r in ok),
            intra_bytes=max(r.intra_bytes for r in ok),
            intra_comm_s=max(r.intra_comm_s for r in ok),
            group_round_s=max(r.group_round_s for r in ok),
            most_steps=max(r.steps for r in ok),
            groups=sorted(shares, key=lambda g: g.group),
        )


def evaluated(
    server_round: int, replies: Iterable[Message], messages: Iterable[Message] = ()
) -> tuple[MetricRecord | None, list[str]]:
    """The mean held-out loss of the valid evaluation replies to ``messages`` (with the slowest
    group's pull of the model, where groups pulled it), and a line per other one (without
    ``messages``: no reply is missing, none can be named)."""
    replies = list(replies)
    asked = R.asked_nodes(messages)
    answered = {r.metadata.reply_to_message_id for r in replies}
    rejected = [
        R.reject(server_round, MessageType.EVALUATE, node, "no reply within round-timeout")
        for mid, node in asked.items()
        if mid not in answered
    ]
    checked, bad = R.check_eval_replies(server_round, replies, asked)
    if not checked:
        return None, rejected + bad
    losses, pulls = zip(*checked)
    metrics = {P.EVAL_LOSS: sum(losses) / len(losses)}
    if any(pulls):
        metrics[P.EVAL_PULL_S] = max(pulls)
    return MetricRecord(metrics), rejected + bad
