"""The interface of a transport: how the groups' weights move, and what the server does with them.

The strategy runs every round the same way (:mod:`flower_shard.flower.server.strategy`); what
differs between transports is answered here, once per question:

==============================  =============================================================
what a round's message carries  :meth:`Transport.train_records`, :meth:`Transport.node_config`
who takes part                  :meth:`Transport.members` (and :meth:`Transport.observe`)
how a reply is checked          :attr:`Transport.reply_fields`, :meth:`Transport.check_payload`
                                (the checks themselves: :mod:`~flower_shard.flower.server.replies`)
what is kept of it on arrival   :meth:`Transport.keep`
how replies are aggregated      :meth:`Transport.screen`, :meth:`Transport.aggregate`
how the model is evaluated      :attr:`Transport.groups_hold_model`: the groups evaluate their
                                model, or the ServerApp evaluates the global one
how it is fetched at the end    :meth:`Transport.final_weights`
what the server checkpoints     :attr:`Transport.global_arrays`, :meth:`Transport.state_dict`
==============================  =============================================================

A transport is also a context manager: what it hosts for the groups (a rendezvous store,
aggregator processes) lives from :meth:`Transport.open` to :meth:`Transport.close`, which
the strategy calls around the whole run, also when it fails.

The streaming data plane fits the same questions: :meth:`~Transport.open` starts the
aggregators, :meth:`~Transport.node_config` hands each group the round's ticket, a reply
declares its token weight (``num_tokens``, checked like every reply) and carries no arrays,
:meth:`~Transport.aggregate` has the aggregators commit their accumulators with those weights
(or drop them below min-groups), and :meth:`~Transport.final_weights` fetches the result.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from flower_shard.config.federation import FederationConfig
from flower_shard.flower.server.exchange import Messenger
from flower_shard.flower.server.replies import Field, Payload, TrainReply
from flower_shard.flower.wire import describe


@dataclass(frozen=True)
class Aggregate:
    """What a round's aggregation produced."""

    arrays: dict[str, np.ndarray] | None
    """The next global weights; None: unchanged on the server (too few valid replies, or the
    groups hold the model)."""
    outer_sync_s: float
    """The exchange between groups as the transport measures it (server-side aggregation, or
    the slowest group's own sync)."""
    outer_sync_bytes: int
    """Bytes one rank (or group) sent to the others this round."""


class Transport(ABC):
    """One way of exchanging the groups' weights; subclasses answer the questions above.

    Parameters
    ----------
    fed
        The run's settings.
    initial
        The first global weights (name -> float32 array, in the model's order): what every
        reply's arrays must match, and the server's global model where it keeps one.
    """

    name: ClassVar[str]
    """The transport's name in the run config (:data:`flower_shard.protocol.TRANSPORTS`)."""
    groups_hold_model: ClassVar[bool] = False
    """True: the groups hold the (identical) model after each round and evaluate it on the
    server's request; resuming needs their checkpoints. False: the ServerApp holds the global
    model and evaluates it itself."""
    reply_fields: ClassVar[tuple[Field, ...]] = ()
    """Metrics this transport's training replies carry besides the common ones."""
    needs_initial_arrays: ClassVar[bool] = True
    """False: the ServerApp never builds the whole model (the weights live elsewhere: the
    streaming transport's aggregators); ``initial`` is then empty."""

    def __init__(self, fed: FederationConfig, initial: dict[str, np.ndarray]):
        self.fed = fed
        self.spec = describe(initial)
        self.order = list(initial)
        self.global_arrays = initial
        """The server's global weights (with ``groups_hold_model``: the initial ones)."""
        self.dropped: set[int] = set()
        """Nodes left out of the rounds (see :meth:`observe`)."""

    # -- lifetime ------------------------------------------------------------------------------

    def open(self) -> None:
        """Start what the groups need from the server for this run (default: nothing)."""
        return None

    def close(self) -> None:
        """Stop what :meth:`open` started."""
        return None

    def __enter__(self) -> Transport:
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the round's messages ------------------------------------------------------------------

    def begin_round(self, server_round: int) -> None:
        """A round starts: its messages are about to be built (default: nothing)."""
        return None

    def admit(self, messenger: Messenger) -> None:
        """Before a round's messages: bring back the dropped groups that can rejoin (default:
        none does)."""
        return None

    def sending(self, server_round: int, messages: list[Message]) -> None:
        """The round's train messages, built and about to be sent (default: nothing to note)."""
        return None

    def update_steps(self, steps: int) -> int:
        """The most inner steps a reply's update can cover in a round of ``steps`` (default:
        that round's; overlapped streaming also the round before's)."""
        return steps

    def seat(self, members: list[int]) -> None:
        """The round's members, in the order of their messages (default: nothing to note)."""
        return None

    def members(self, node_ids: list[int]) -> list[int]:
        """The connected nodes that take part in the next round (sorted)."""
        return [n for n in node_ids if n not in self.dropped]

    def node_config(
        self, server_round: int, run_id: int, rank: int, size: int, group: int = 0
    ) -> dict:
        """Config keys of this transport for the member at ``rank`` of ``size`` (its group
        index ``group``)."""
        return {}

    def train_records(self) -> dict[str, ArrayRecord | ConfigRecord]:
        """Records every training message carries besides its config (default: none)."""
        return {}

    def node_records(self, node: int) -> tuple[dict[str, ArrayRecord], dict]:
        """Records and config keys of one node's training message only (default: none)."""
        return {}, {}

    # -- replies -------------------------------------------------------------------------------

    def check_payload(self, content: RecordDict) -> Payload | None:
        """The checked arrays of a training reply (raises ``Rejected``); None: it has none."""
        return None

    def keep(self, reply: TrainReply) -> TrainReply:
        """A valid training reply as it arrives, before its message is dropped: what of it the
        aggregation will read (default: the reply as is)."""
        return reply

    def screen(self, ok: list[TrainReply]) -> dict[int, str]:
        """Index in ``ok`` -> why that valid reply is left out of the aggregation anyway."""
        return {}

    def observe(
        self, server_round: int, asked: Iterable[int], answered: Mapping[int, Message]
    ) -> None:
        """Learn from a round's replies (node -> its reply) who is still there (default:
        everyone stays)."""
        return None

    # -- aggregation, evaluation, the end ------------------------------------------------------

    @abstractmethod
    def aggregate(self, server_round: int, ok: list[TrainReply], commit: bool) -> Aggregate:
        """Combine the valid replies; ``commit`` False (fewer than min-groups): keep the model."""

    @abstractmethod
    def final_weights(self, messenger: Messenger) -> dict[str, np.ndarray] | None:
        """The model after the last round, checked; None (reason logged) if none is to be had."""

    def state_dict(self) -> dict:
        """Server-side optimizer state for the server checkpoint (default: none)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`'s output (a resumed run)."""
        return None

    def save_files(self, directory) -> None:
        """Write state that lives outside the ServerApp into the server checkpoint's staging
        ``directory`` (it is committed with the rest; default: nothing)."""
        return None

    def load_files(self, directory) -> None:
        """Load what :meth:`save_files` wrote, once :meth:`open` ran (a resumed run)."""
        return None
