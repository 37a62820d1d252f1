"""The flower transport: the weights travel inside Flower Messages; the server aggregates them."""

from __future__ import annotations

import time

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from flower_shard import protocol as P
from flower_shard.config.choices import NO_COMPRESSION, TRIMMED_MEAN
from flower_shard.config.federation import FederationConfig
from flower_shard.flower.server import replies as R
from flower_shard.flower.server.aggregation import (
    norm_outliers,
    trimmed_mean,
    update_norms,
    weighted_mean,
)
from flower_shard.flower.server.exchange import Messenger
from flower_shard.flower.server.transports.base import Aggregate, Transport
from flower_shard.flower.wire import flatten, pack, unflatten


class FlowerTransport(Transport):
    """Weights in Flower Messages: any stock Flower deployment (TLS, SuperNode authentication).

    Each round every member gets the global weights packed into one flat float32 Array
    (:func:`~flower_shard.flower.wire.pack`) and replies with its trained weights in the same
    format, or, with ``compression``, with its compressed pseudo-gradient ``global - trained``
    (error feedback stays in the group). Each reply is checked (names, shapes, dtypes,
    finiteness; :mod:`~flower_shard.flower.server.replies`); a valid update whose norm is more
    than ``outlier-factor`` x the median of the others' is left out too. The token-weighted (or
    trimmed) mean of the rest goes through the outer optimizer (``fedavg`` or DiLoCo's
    ``nesterov``: the group runtime's own
    :class:`~flower_shard.runtime.outer_optimizer.OuterOptimizer`) to give the next global
    weights. With fewer than ``min-groups`` valid replies the global weights stay as they were.
    The ServerApp holds the model: it evaluates it and saves it at the end.
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
            track_weights=self.compressed,
        )

    @property
    def compressed(self) -> bool:
        return self.fed.train.compression != NO_COMPRESSION

    def train_records(self, arrays: ArrayRecord) -> dict[str, ArrayRecord | ConfigRecord]:
        flat = pack({k: v.numpy() for k, v in arrays.items()})
        return {P.ARRAYS: ArrayRecord({P.PACKED: Array(flat)})}

    def check_payload(self, content: RecordDict) -> R.Payload:
        t = self.fed.train
        if self.compressed:
            return R.compressed_delta(content, self.spec, t.compression, t.compression_chunk)
        return R.packed_weights(content, self.spec)

    def screen(self, ok: list[R.TrainReply]) -> dict[int, str]:
        """Updates far larger than the others' (see :func:`aggregation.norm_outliers`)."""
        if len(ok) < 2:
            return {}
        if self.compressed:
            deltas = [r.payload.arrays[R.DELTA].astype(np.float64) for r in ok]
            norms = [float(np.linalg.norm(d)) for d in deltas]
        else:
            norms = update_norms([r.payload.arrays for r in ok], self.global_arrays)
        return norm_outliers(norms, self.fed.outlier_factor)

    def aggregate(self, server_round: int, ok: list[R.TrainReply], commit: bool) -> Aggregate:
        """The next global weights; ``outer_sync_s`` is the server's work on the replies
        (checking, decoding, the mean and the outer step), ``outer_sync_bytes`` one reply's
        size on the wire."""
        received = sum(r.payload.nbytes for r in ok)
        nbytes = received // len(ok) if ok else 0
        if not commit:
            return Aggregate(None, 0.0, nbytes)
        start = time.perf_counter()
        weights = [r.num_tokens for r in ok]
        models = [r.payload.arrays for r in ok]
        if self.fed.aggregation == TRIMMED_MEAN:
            mean = trimmed_mean(models, self.fed.trim_fraction)
        else:
            mean = weighted_mean(models, weights)
        if self.compressed:
            # The wire order is sorted by name; the outer optimizer's flat order is self.order.
            delta = flatten(R.delta_arrays(mean[R.DELTA], self.spec), self.order)
            new = unflatten(self.outer.apply(delta), self.global_arrays, self.order)
        else:
            new = unflatten(self.outer.step(flatten(mean, self.order)), mean, self.order)
        self.global_arrays = new
        decode_s = sum(r.payload.decode_s for r in ok)
        return Aggregate(new, decode_s + time.perf_counter() - start, nbytes)

    def final_weights(self, messenger: Messenger) -> dict[str, np.ndarray] | None:
        """The server's own global weights."""
        return self.global_arrays

    def state_dict(self) -> dict:
        return self.outer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.outer.load_state_dict(state)
