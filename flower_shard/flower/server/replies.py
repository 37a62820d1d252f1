"""Every reply the server reads, checked in one place before any of its values is used.

A group's reply is a Flower Message from its ClientApp: a ``metrics`` record (what the group
measured) and, with the flower transport, an ``arrays`` record (its weights or its compressed
pseudo-gradient). Nothing in it is trusted: a node may run other code, a group may be broken,
a message may be damaged. Each value the server reads is checked here for its type (an integer
count is an ``int``, a measurement a number; never a bool, a string or a list), for being
finite, and for a range the server can justify from what it sent (see :class:`ReplyRules`);
the token count must be exactly what a group of some size K makes in the steps it reports,
with the same K as the node's last valid reply; arrays are checked for their names, shapes,
dtypes and finiteness (:mod:`~flower_shard.flower.server.payloads`). Checking yields typed
values (:class:`TrainReply`); a failed check raises :class:`Rejected` with a one-line reason,
and :func:`check_train_replies` turns any exception of one reply into that reply's rejection,
so a bad reply never stops the round.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from logging import WARNING
from typing import TypeVar

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log

from flower_shard import protocol as P
from flower_shard.flower.server.payloads import Payload, Rejected, array_record, check_arrays
from flower_shard.flower.wire import Spec

MAX_GROUP_RANKS = 1 << 16
"""The most ranks a group (K) can have: bounds the tokens a group can claim per step."""
MAX_LOSS = 1e6
"""Cross-entropy far above any real model's (ln of the vocabulary, about 12 for 150k tokens)."""
MAX_BYTES = float(1 << 53)
"""Bytes a rank can send in one round: 8 PiB, beyond any link (and exact in float64)."""
MAX_PID = 1 << 22
"""Linux's largest pid_max."""


@dataclass(frozen=True)
class ReplyRules:
    """What a valid training reply of one round looks like, from what the server sent."""

    asked: Mapping[str, int]
    """Message id -> the node it was sent to: whom a reply (``reply_to_message_id``) is about.
    Not the reply's sender: the SuperLink answers for a node it lost, as node 1."""
    groups: Mapping[int, int]
    """Node id -> the group index its message carried (a reply must report the same)."""
    max_steps: int
    """The round's T, or max-local-steps when time-budgeted: a group trains at most this."""
    tokens_per_step: int
    """batch-size x seq-len: the tokens one rank processes per step."""
    max_lr: float
    """The configured peak LR: warm-up and cosine never exceed it."""
    max_seconds: float
    """The longest a group can have worked on a round whose reply the server received (the
    strategy allows twice round-timeout)."""
    ranks: Mapping[int, int] = field(default_factory=dict)
    """Node -> the group size K of its valid reply in the previous round (a node without one
    may report any K)."""

    @property
    def max_tokens(self) -> int:
        return self.max_steps * self.tokens_per_step * MAX_GROUP_RANKS


@dataclass(frozen=True)
class Field:
    """One metric the server reads: where it goes, its type and its range."""

    attr: str
    """The :class:`TrainReply` attribute it fills."""
    key: str
    """Its name in the reply (a protocol metric name)."""
    integer: bool
    """A count (must be an ``int``), or a measurement (an ``int`` or a ``float``)."""
    low: float
    high: Callable[[ReplyRules], float]
    required: bool = True


def _seconds(rules: ReplyRules) -> float:
    return rules.max_seconds


TRAIN_FIELDS = (
    Field("group", P.GROUP, True, 0, lambda r: max(r.groups.values(), default=0)),
    Field("steps", P.STEPS, True, 1, lambda r: r.max_steps),
    Field("num_tokens", P.NUM_TOKENS, True, 1, lambda r: r.max_tokens),
    Field("train_loss", P.TRAIN_LOSS, False, 0.0, lambda r: MAX_LOSS),
    Field("lr", P.LR, False, 0.0, lambda r: r.max_lr),
    Field("compute_s", P.COMPUTE_S, False, 0.0, _seconds),
    Field("intra_comm_s", P.INTRA_COMM_S, False, 0.0, _seconds),
    Field("intra_bytes", P.INTRA_BYTES, False, 0.0, lambda r: MAX_BYTES),
    Field("group_round_s", P.GROUP_ROUND_S, False, 0.0, _seconds),
    Field("clientapp_pid", P.CLIENTAPP_PID, True, 0, lambda r: MAX_PID, required=False),
)
"""What every training reply carries (the group's train call and its ClientApp)."""
SYNC_FIELDS = (
    Field("outer_sync_s", P.OUTER_SYNC_S, False, 0.0, _seconds),
    Field("outer_sync_bytes", P.OUTER_SYNC_BYTES, False, 0.0, lambda r: MAX_BYTES),
)
"""What a group reports of a cross-group sync it ran itself (the collective transport)."""
HELD_BACK_FIELD = Field("held_back", P.HELD_BACK, True, 0, lambda r: 1, required=False)
"""Overlapped streaming: the group streamed no update this round (it goes out next round)."""
EVAL_FIELD = Field("eval_loss", P.EVAL_LOSS, False, 0.0, lambda r: MAX_LOSS)
EVAL_PULL_FIELD = Field(
    "eval_pull_s", P.EVAL_PULL_S, False, 0.0, lambda r: MAX_EVAL_PULL_S, required=False
)
MAX_EVAL_PULL_S = 7 * 86400.0  # no rules at evaluation: a week bounds any honest download


@dataclass(frozen=True)
class TrainReply:
    """A checked training reply: every value the server reads, typed and in range."""

    node: int
    group: int
    steps: int
    num_tokens: int
    train_loss: float
    lr: float
    compute_s: float
    intra_comm_s: float
    intra_bytes: float
    group_round_s: float
    clientapp_pid: int = 0
    ranks: int = 0
    """The group's size K, from its token count (``steps x batch x seq x K``); 0: not derived."""
    outer_sync_s: float = 0.0
    outer_sync_bytes: float = 0.0
    held_back: int = 0
    payload: Payload | None = None


PayloadCheck = Callable[[RecordDict], Payload]
T = TypeVar("T")


def check_train_reply(
    msg: Message,
    rules: ReplyRules,
    fields: tuple[Field, ...] = TRAIN_FIELDS,
    payload: PayloadCheck | None = None,
) -> TrainReply:
    """The checked values of one training reply; raises :class:`Rejected` with the reason.

    ``fields``: the metrics to read (:data:`TRAIN_FIELDS` plus the transport's own);
    ``payload``: the transport's check of the arrays, if its replies carry any.
    """
    node = rules.asked.get(msg.metadata.reply_to_message_id)
    if node is None:
        raise Rejected("a reply to no message of this round")
    content = reply_content(msg)
    if msg.metadata.src_node_id != node:
        raise Rejected(f"a reply from node {msg.metadata.src_node_id} to node {node}'s message")
    values = check_metrics(metric_record(content), fields, rules)
    if values["group"] != rules.groups[node]:
        raise Rejected(
            f"metric {P.GROUP!r} is {values['group']}, but the node was sent group "
            f"{rules.groups[node]}"
        )
    ranks = group_ranks(values["num_tokens"], values["steps"], rules.tokens_per_step)
    before = rules.ranks.get(node)
    if before is not None and ranks != before:
        raise Rejected(
            f"the group reports K = {ranks} ranks ({P.NUM_TOKENS}), K = {before} last round: a "
            "group changes size only across a restart (it is taken again from the next round)"
        )
    content_payload = payload(content) if payload else None
    return TrainReply(node=node, **values, ranks=ranks, payload=content_payload)


def group_ranks(num_tokens: int, steps: int, tokens_per_step: int) -> int:
    """The group size K for which ``num_tokens = steps x tokens_per_step x K`` exactly, as a
    group counts its tokens (every rank of the group processes one batch per step); raises
    :class:`Rejected` if there is no such K in [1, :data:`MAX_GROUP_RANKS`]."""
    per_rank = steps * tokens_per_step
    ranks, rest = divmod(num_tokens, per_rank)
    if rest or not 1 <= ranks <= MAX_GROUP_RANKS:
        raise Rejected(
            f"metric {P.NUM_TOKENS!r} is {num_tokens}, not steps x batch-size x seq-len x K "
            f"({steps} x {tokens_per_step} x K) for a whole K in [1, {MAX_GROUP_RANKS}]"
        )
    return ranks


def check_train_replies(
    server_round: int,
    replies: Iterable[Message],
    rules: ReplyRules,
    fields: tuple[Field, ...] = TRAIN_FIELDS,
    payload: PayloadCheck | None = None,
) -> tuple[list[TrainReply], list[str]]:
    """The round's valid training replies and, for each other one, ``node N: reason``
    (:class:`Intake` on a list)."""
    intake = Intake(server_round, rules, fields, payload)
    for msg in replies:
        intake.take(msg)
    return intake.ok, intake.rejected


class Intake:
    """A round's training replies, checked one at a time as they arrive.

    :meth:`take` checks a reply (:func:`check_train_reply`; a node's second valid reply in one
    round is rejected: its weight would count twice), passes a valid one through ``keep`` (the
    transport's: the flower transport writes its arrays to disk) and removes the message's
    arrays, so nothing of a reply's size stays in memory after it. Whatever one reply makes the
    check raise rejects that reply only (logged, and a line in :attr:`rejected`).
    """

    def __init__(
        self,
        server_round: int,
        rules: ReplyRules,
        fields: tuple[Field, ...] = TRAIN_FIELDS,
        payload: PayloadCheck | None = None,
        keep: Callable[[TrainReply], TrainReply] | None = None,
    ):
        self.server_round, self.rules, self.fields = server_round, rules, fields
        self.payload, self.keep = payload, keep
        self.ok: list[TrainReply] = []
        """The valid replies, in the order they came."""
        self.rejected: list[str] = []
        """``node N: reason`` for every other one."""
        self._seen: set[int] = set()

    def take(self, msg: Message) -> Message:
        """Check and keep one reply; returns the message without its arrays."""
        reply, reason = attempt(self._check, msg)
        if reason is None:
            self.ok.append(reply)
        else:
            node = addressee(msg, self.rules.asked)
            self.rejected.append(reject(self.server_round, MessageType.TRAIN, node, reason))
        _drop_arrays(msg)
        return msg

    def _check(self, msg: Message) -> TrainReply:
        reply = check_train_reply(msg, self.rules, self.fields, self.payload)
        if reply.node in self._seen:
            raise Rejected("a second reply to the same message")
        self._seen.add(reply.node)
        return self.keep(reply) if self.keep else reply


def _drop_arrays(msg: object) -> None:
    try:
        if not msg.has_error() and P.ARRAYS in msg.content:
            del msg.content[P.ARRAYS]
    except Exception:  # not a Message, or one without content: nothing held
        pass


def check_eval_reply(msg: Message) -> tuple[float, float]:
    """(held-out loss, seconds spent pulling the model: 0 when not said) of a group's
    evaluation reply; raises :class:`Rejected`."""
    value = check_metrics(metric_record(reply_content(msg)), (EVAL_FIELD, EVAL_PULL_FIELD), None)
    return float(value[EVAL_FIELD.attr]), float(value.get(EVAL_PULL_FIELD.attr, 0.0))


def check_eval_replies(
    server_round: int, replies: Iterable[Message], asked: Mapping[str, int]
) -> tuple[list[tuple[float, float]], list[str]]:
    """(loss, pull seconds) of the valid evaluation replies, and a line per other one."""
    return screen(server_round, MessageType.EVALUATE, replies, check_eval_reply, asked)


def screen(
    server_round: int,
    phase: str,
    replies: Iterable[Message],
    check: Callable[[Message], T],
    asked: Mapping[str, int],
) -> tuple[list[T], list[str]]:
    """``check`` each reply of a phase (a Flower message type): the values of the valid ones,
    and a line per other one, naming the node it is about (``asked``: message id -> node),
    also logged. Never raises: whatever one reply makes the check raise rejects that reply
    only."""
    ok, rejected = [], []
    for msg in replies:
        value, reason = attempt(check, msg)
        if reason is None:
            ok.append(value)
        else:
            rejected.append(reject(server_round, phase, addressee(msg, asked), reason))
    return ok, rejected


def attempt(check: Callable[[Message], T], msg: Message) -> tuple[T | None, str | None]:
    """(``check(msg)``, None), or (None, why it raised): :class:`Rejected`'s reason, or any other
    exception named (a reply no check foresaw is still only this reply's problem)."""
    try:
        return check(msg), None
    except Rejected as exc:
        return None, str(exc)
    except Exception as exc:
        return None, f"unreadable reply ({type(exc).__name__}: {exc})"


def reject(server_round: int, phase: str, node: object, reason: str) -> str:
    """Log a rejected reply of a phase (a Flower message type); return its line for the round's
    ``rejected`` list: ``node N: reason`` (training), ``node N: evaluate: reason``."""
    log(
        WARNING, "round %s: rejected the %s reply of node %s: %s", server_round, phase, node, reason
    )
    return (
        f"node {node}: {reason}"
        if phase == MessageType.TRAIN
        else f"node {node}: {phase}: {reason}"
    )


def addressee(msg: object, asked: Mapping[str, int]) -> object:
    """The node a reply is about: the one its message went to, else its sender, else ``?``."""
    try:
        return asked.get(msg.metadata.reply_to_message_id, msg.metadata.src_node_id)
    except Exception:  # not a Message at all
        return "?"


def asked_nodes(messages: Iterable[Message]) -> dict[str, int]:
    """Message id -> destination node, for messages the Grid has pushed (it sets the ids)."""
    return {m.metadata.message_id: m.metadata.dst_node_id for m in messages}


# -- records and metrics ------------------------------------------------------------------------


def reply_content(msg: Message) -> RecordDict:
    """A reply's content; an error reply is rejected with the error's reason."""
    if msg.has_error():
        raise Rejected(f"error reply: {msg.error.reason}")
    return msg.content


def metric_record(content: RecordDict) -> Mapping:
    if P.METRICS not in content:
        raise Rejected(f"no {P.METRICS!r} record")
    record = content[P.METRICS]
    # A ConfigRecord is read too (its strings and bools are then refused value by value).
    if not isinstance(record, (MetricRecord, ConfigRecord)):
        raise Rejected(f"{P.METRICS!r} is a {type(record).__name__}, not a MetricRecord")
    return record


def check_metrics(
    record: Mapping, fields: tuple[Field, ...], rules: ReplyRules | None
) -> dict[str, int | float]:
    """Attribute -> checked value for each field present (a missing required one: rejected)."""
    values = {}
    for f in fields:
        if f.key not in record:
            if f.required:
                raise Rejected(f"metric {f.key!r} missing")
            continue
        values[f.attr] = check_number(f.key, record[f.key], f.integer, f.low, f.high(rules))
    return values


def check_number(key: str, value: object, integer: bool, low: float, high: float) -> int | float:
    """``value`` if it is a number of the right kind, finite and in [low, high]."""
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise Rejected(f"metric {key!r} must be {kind}, got {type(value).__name__} {_show(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise Rejected(f"metric {key!r} is {value}")
    if not low <= value <= high:
        raise Rejected(f"metric {key!r} is {_show(value)}, outside [{low:g}, {high:.6g}]")
    return value


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def named_weights(content: RecordDict, expected: Spec) -> dict[str, np.ndarray]:
    """A model's full weights, one Array per tensor (the collective transport's final model)."""
    arrays, _ = array_record(content, "the group sent no weights")
    reason = check_arrays(arrays, expected)
    if reason:
        raise Rejected(reason)
    return arrays
