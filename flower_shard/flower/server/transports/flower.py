"""The flower transport: the weights travel inside Flower Messages; the server aggregates them."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from logging import WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.common.logger import log

from flower_shard import protocol as P
from flower_shard.config.choices import NO_COMPRESSION, TRIMMED_MEAN
from flower_shard.config.federation import FederationConfig
from flower_shard.flower.server import payloads as D
from flower_shard.flower.server import replies as R
from flower_shard.flower.server.aggregation import (
    LazyArrays,
    Norms,
    clip_delta,
    clip_update,
    delta_norms,
    trimmed_mean_flat,
    update_norms,
    weighted_mean_flat,
)
from flower_shard.flower.server.downlink import Downlink
from flower_shard.flower.server.exchange import Messenger
from flower_shard.flower.server.reply_spool import ReplySpool
from flower_shard.flower.server.robust import RobustRules, Update
from flower_shard.flower.server.transports.base import Aggregate, Transport
from flower_shard.flower.wire import flatten, pack, unflatten, unflatten_flat


@dataclass(frozen=True)
class Share:
    """How one accepted reply enters the mean (:class:`~..robust.Decision`'s entry for it)."""

    weight: float
    """Its token count, or its cap."""
    scale: float = 1.0
    """Clip: the factor on its update."""
    bound: float | None = None
    """Clip: the bound on each coordinate of its update."""


class FlowerTransport(Transport):
    """Weights in Flower Messages: any stock Flower deployment (TLS, SuperNode authentication).

    Each round every member gets the global weights packed into one flat float32 Array
    (:func:`~flower_shard.flower.wire.pack`) and replies with its trained weights in the same
    format, or, with ``compression``, with its compressed pseudo-gradient ``global - trained``
    (error feedback stays in the group). Each reply is checked (names, shapes, dtypes,
    finiteness; :mod:`~flower_shard.flower.server.replies`); then the robust rules
    (:mod:`~flower_shard.flower.server.robust`, ``outlier-factor``) cap each token weight,
    leave out free riders, and reject (or with ``clip-outliers`` clip) updates whose weighted
    norm or largest coordinate is beyond its bound. The weighted mean of the rest (or the
    weighted trimmed mean: ``aggregation``) goes through the outer optimizer (``fedavg`` or
    DiLoCo's ``nesterov``: the group runtime's own
    :class:`~flower_shard.runtime.outer_optimizer.OuterOptimizer`) to give the next global
    weights. With fewer than ``min-groups`` valid replies the global weights stay as they were.
    The ServerApp holds the model: it evaluates it and saves it at the end.

    Memory: each reply is checked as it arrives and its arrays go to disk
    (:meth:`keep`, :mod:`~flower_shard.flower.server.reply_spool`), and the mean reads them
    back array by array in group order, so the ServerApp holds one reply at a time whatever G
    (the trimmed mean holds G slices of 2**20 values). Resident for the run: the global model,
    plus the outer optimizer's state (nesterov: weights and momentum; fedavg from compressed
    replies or with the compressed downlink: the weights) and the downlink's copy; during a
    round, the packed model being pushed, one reply, and the new model.
    """

    name = P.FLOWER

    def __init__(self, fed: FederationConfig, initial: dict[str, np.ndarray]):
        from flower_shard.runtime.outer_optimizer import OuterOptimizer

        super().__init__(fed, initial)
        t = fed.train
        self.outer = OuterOptimizer(
            flatten(initial, self.order),
            t.outer,
            t.outer_lr,
            t.outer_momentum,
            # Pseudo-gradients (compressed replies, or measured from what the groups hold).
            track_weights=self.compressed or fed.downlink_compression != NO_COMPRESSION,
        )
        self.downlink = (
            Downlink(fed.downlink_compression, t.compression_chunk, initial)
            if fed.downlink_compression != NO_COMPRESSION
            else None
        )
        """The compressed downlink (``downlink-compression``): what the groups hold."""
        self.rules = RobustRules(fed.outlier_factor, clip=fed.clip_outliers)
        """The robust rules, with the history of the updates they accepted."""
        self.spool = ReplySpool()
        """The round's valid replies, on disk from arrival to aggregation."""
        self.shares: dict[int, Share] = {}
        """Node -> how its reply enters this round's mean (set by :meth:`screen`)."""

    @property
    def compressed(self) -> bool:
        return self.fed.train.compression != NO_COMPRESSION

    def begin_round(self, server_round: int) -> None:
        if self.downlink is not None:
            self.downlink.advance(self.global_arrays)

    def open(self) -> None:
        self.spool.open()

    def close(self) -> None:
        self.spool.close()

    def train_records(self) -> dict[str, ArrayRecord | ConfigRecord]:
        if self.downlink is not None:  # per node: see node_records
            return {}
        return {P.ARRAYS: ArrayRecord({P.PACKED: Array(pack(self.global_arrays))})}

    def node_records(self, node: int) -> tuple[dict[str, ArrayRecord], dict]:
        """Compressed downlink: the change of the model the node holds, or a snapshot."""
        if self.downlink is None:
            return {}, {}
        record, keys = self.downlink.records(node)
        return {P.ARRAYS: record}, keys

    def reference(self) -> dict[str, np.ndarray]:
        """Where the groups started this round: the global weights, or what the compressed
        downlink gave them."""
        return self.downlink.reference() if self.downlink is not None else self.global_arrays

    def check_payload(self, content: RecordDict) -> D.Payload:
        t = self.fed.train
        if self.compressed:
            return D.compressed_delta(content, self.spec, t.compression, t.compression_chunk)
        return D.packed_weights(content, self.spec)

    def keep(self, reply: R.TrainReply) -> R.TrainReply:
        """The reply's size taken now, its arrays written to the round's spool (the message
        and its arrays are then dropped)."""
        payload = reply.payload
        norms = self._norms(payload.arrays)
        spooled = self.spool.keep(f"node-{reply.node}", payload.arrays)
        return replace(reply, payload=replace(payload, arrays=spooled, norms=norms))

    def screen(self, ok: list[R.TrainReply]) -> dict[int, str]:
        """The robust rules on the valid replies: the ones they leave out, with the reason;
        the weight (capped) and clipping of the others are kept for :meth:`aggregate`."""
        if self.downlink is not None:
            self.downlink.acknowledge(r.node for r in ok)
        norms = [r.payload.norms or self._norms(r.payload.arrays) for r in ok]
        updates = [Update(float(r.num_tokens), r.steps, n.l2, n.linf) for r, n in zip(ok, norms)]
        decision = self.rules.judge(updates)
        for i, note in decision.notes.items():
            log(WARNING, "group %s (node %s): %s", ok[i].group, ok[i].node, note)
        self.shares = {
            r.node: Share(decision.weights[i], decision.scales[i], decision.bounds[i])
            for i, r in enumerate(ok)
            if i not in decision.rejected
        }
        return decision.rejected

    def aggregate(self, server_round: int, ok: list[R.TrainReply], commit: bool) -> Aggregate:
        """The next global weights; ``outer_sync_s`` is the server's work on the replies
        (checking, decoding, the mean and the outer step), ``outer_sync_bytes`` one reply's
        size on the wire."""
        received = sum(r.payload.nbytes for r in ok)
        nbytes = received // len(ok) if ok else 0
        if not commit:
            return Aggregate(None, 0.0, nbytes)
        import torch

        start = time.perf_counter()
        shares = [self.shares.get(r.node) or Share(float(r.num_tokens)) for r in ok]
        models = [self._clipped(r, s) for r, s in zip(ok, shares)]
        weights = [s.weight for s in shares]
        order = [D.DELTA] if self.compressed else self.order
        if self.fed.aggregation == TRIMMED_MEAN:
            flat = trimmed_mean_flat(models, weights, self.fed.trim_fraction, order)
        else:
            flat = weighted_mean_flat(models, weights, order)
        del models
        self.spool.clear()
        if self.compressed:
            # The wire order is sorted by name; the outer optimizer's flat order is self.order.
            delta = flatten(D.delta_arrays(flat, self.spec), self.order)
            new = unflatten(self.outer.apply(delta), self.global_arrays, self.order)
        elif self.downlink is not None:  # the groups started from the model they hold
            delta = flatten(self.reference(), self.order) - torch.from_numpy(flat)
            new = unflatten(self.outer.apply(delta), self.global_arrays, self.order)
        else:
            mean = torch.from_numpy(flat)
            stepped = self.outer.step(mean)
            # fedavg gives the mean itself back: the new model is views of it, not a copy
            new = (
                unflatten_flat(flat, self.spec, self.order)
                if stepped is mean
                else unflatten(stepped, self.global_arrays, self.order)
            )
        self.global_arrays = new
        decode_s = sum(r.payload.decode_s for r in ok)
        return Aggregate(new, decode_s + time.perf_counter() - start, nbytes)

    def _clipped(self, reply: R.TrainReply, share: Share) -> Mapping[str, np.ndarray]:
        """The reply's arrays, with its update clipped where the rules said so (computed as
        the mean reads them)."""
        arrays = reply.payload.arrays
        if share.scale == 1.0 and share.bound is None:
            return arrays
        if self.compressed:
            return LazyArrays([D.DELTA], lambda k: clip_delta(arrays[k], share.scale, share.bound))
        return clip_update(arrays, self.reference(), share.scale, share.bound)

    def _norms(self, arrays: Mapping[str, np.ndarray]) -> Norms:
        if self.compressed:
            return delta_norms(arrays[D.DELTA])
        return update_norms([arrays], self.reference())[0]

    def final_weights(self, messenger: Messenger) -> dict[str, np.ndarray] | None:
        """The server's own global weights."""
        return self.global_arrays

    def state_dict(self) -> dict:
        downlink = self.downlink.state_dict() if self.downlink is not None else {}
        return self.outer.state_dict() | downlink

    def load_state_dict(self, state: dict) -> None:
        if self.downlink is not None:
            self.downlink.load_state_dict(state)
        self.outer.load_state_dict(state)
