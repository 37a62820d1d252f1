"""Overlapped outer sync on the streaming transport, group side: a round's update crosses the
slow link while the group trains the next round.

The rule is the one-job driver's (:mod:`flower_shard.runtime.streaming_sync`, one sync of
delay: Streaming DiLoCo's overlapped communication with mixing 0, arXiv 2501.18512, and the
delayed outer gradients of arXiv 2502.12996). At the end of its inner steps a group *sends*
its weights ``s``; it keeps training from them, and when the global model ``X`` computed from
every group's ``s`` comes back, it moves by what the global model gained over what it sent::

    theta <- theta + (X - s)

and ``theta`` is what it sends next. On the streaming transport the group sends ``s`` as the
pseudo-gradient ``V - s`` against the last global model ``V`` it holds (its view), so the
aggregators' outer step is the synchronous one (fedavg gives ``X = mean_g s_g`` up to one
float32 rounding of ``V - (V - s)``: with one group, training without an outer sync to that
rounding, not bit for bit).

The Flower round carries it like this (each TRAIN message, every rank):

1. **Confirm**: the view becomes the last committed global model ``X`` (the group followed
   that round while it pushed: usually the aggregators answer ``current`` and nothing moves;
   if the commit was not the fold it followed, a full snapshot or the delta comes).
2. **Rebase** ``theta += X - s`` with the ``s`` it sent last round, then **snapshot**
   ``s = theta`` (M / K float32 per rank, beside the view).
3. **Push in the background** ``V - s`` with the token count of the steps it holds, and
   follow the round (the new global values come into the view as the aggregators fold them).
4. **Train** the round's inner steps on the shards, from ``s``.
5. **Wait** for the push, vote over the group, and reply: ``steps`` and ``num_tokens`` are
   those of the update it pushed (the previous round's steps); the new steps go out next
   round.

A group's first round, and its first after a drain or a failure, has no update to push yet:
it trains from the global model it pulled and replies with :data:`~flower_shard.protocol.
HELD_BACK` (the server folds no update of it this round; it pushes one next round).

**Drain** (:data:`~flower_shard.protocol.OUTER_DRAIN`: the last round, and each round whose
checkpoint is due): after confirm and rebase, the group trains and pushes ``V - theta``
synchronously with the tokens of both rounds (its pending update and this round's steps, one
outer step for the two), so nothing is in flight afterwards: the checkpoint holds no pending
state, the evaluation loads the global model, and a resumed run starts from it. With fedavg
this is the rule's drain exactly (``X = mean_g theta_g``); with nesterov one outer step covers
the two rounds. The evaluations of other rounds measure the groups' own models (one round
ahead of the global one) and pull nothing.

Memory: the snapshot ``s`` (M / K float32 per rank) besides the view; the view is the
streaming transport's own.

On failure: a confirm or a push that fails on any rank makes the group answer with an error
(the ranks vote); it drops its pending update, cuts off a follow still waiting for the round
(its reply must not wait for the commit), and pulls the global model at its next round, like
a group that rejoins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flower_shard import protocol as P
from flower_shard.flower.group.streaming import StreamExchange
from flower_shard.runtime.group_trainer import StepStats


@dataclass(frozen=True)
class Pending:
    """The steps whose update the group holds and has not streamed yet."""

    steps: int
    tokens: int


def drains(config: dict) -> bool:
    """Whether the message's round ends with a synchronous exchange."""
    return bool(config.get(P.OUTER_DRAIN, False))


class OverlappedRounds:
    """One group's overlapped rounds on every rank (see the module docstring)."""

    def __init__(self, stream: StreamExchange):
        self.stream = stream
        self.pending: Pending | None = None
        self.blocked_s = 0.0

    def skips_pull(self) -> bool:
        """Whether a command's pull of the global model into the shards is left out: with an
        update pending, a TRAIN confirms instead and an EVALUATE measures the group's own
        model (after a drain, or a failure, nothing is pending: both pull)."""
        return self.pending is not None

    def before_steps(self, config: dict, control, on_rebased: Callable[[], None], hook) -> None:
        """TRAIN, before the inner steps: confirm, rebase, snapshot, and start the push."""
        self.blocked_s = 0.0
        if self.pending is None:
            return
        exchange = self.stream.exchange
        self.blocked_s = self.stream.confirm(config, control)
        if exchange.sent:
            exchange.rebase()
        on_rebased()
        if drains(config):  # the push goes after the steps, from the shards themselves
            exchange.sent = {}
            return
        exchange.snapshot()
        self.stream.start_push(config, self.pending.tokens, hook)

    def after_steps(self, config: dict, steps: StepStats, control, hook) -> dict:
        """TRAIN, after the inner steps: the reply's metrics of the update streamed."""
        pending = self.pending
        if drains(config):
            before = pending or Pending(0, 0)
            tokens = before.tokens + steps.tokens
            pushed_s, sent = self.stream.push(config, tokens, control, hook)
            self.pending = None
            return {
                P.STEPS: before.steps + steps.steps,
                P.NUM_TOKENS: tokens,
                P.OUTER_SYNC_S: self.blocked_s + pushed_s,
                P.OUTER_SYNC_BYTES: sent,
            }
        self.pending = Pending(steps.steps, steps.tokens)
        if pending is None:
            return {P.HELD_BACK: 1, P.OUTER_SYNC_S: self.blocked_s, P.OUTER_SYNC_BYTES: 0}
        waited, sent = self.stream.finish_push(control)
        return {
            P.STEPS: pending.steps,
            P.NUM_TOKENS: pending.tokens,
            P.OUTER_SYNC_S: self.blocked_s + waited,
            P.OUTER_SYNC_BYTES: sent,
        }

    def reset(self) -> None:
        """After a failure: nothing pending; the next round pulls the global model."""
        self.pending = None
        self.stream.join_push()
        if self.stream.exchange is not None:
            self.stream.exchange.forget()
