"""The group's side of the weights in Flower messages (the flower transport).

In: the server's global weights (named arrays, or ``packed``: one flat vector in sorted-name
order) are loaded into the sharded model from rank 0. Out: the trained weights are gathered to
rank 0 and sent packed, or, with compression, as the compressed pseudo-gradient
``global - trained`` with this group's error feedback. Formats: :mod:`flower_shard.flower.wire`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from flower_shard import protocol as P
from flower_shard.config import TrainConfig
from flower_shard.config.choices import NO_COMPRESSION
from flower_shard.flower.group.faults import (
    FORMAT_FAULTS,
    VALUE_FAULTS,
    inject_fault,
    inject_update_fault,
)
from flower_shard.flower.wire import flatten, pack, unflatten_flat, unpack
from flower_shard.runtime import compression as Z
from flower_shard.runtime.weights import full_state, load_full_state

ERROR_FEEDBACK = "error_feedback"  # the residual's name in a group checkpoint's ``extra``


def full_weights(model: nn.Module) -> dict[str, np.ndarray]:
    """Every rank: the full weights gathered to rank 0 as float32 arrays (empty elsewhere)."""
    return {k: v.detach().float().numpy() for k, v in full_state(model).items()}


def model_shapes(model: nn.Module) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (full shape, "") of the model's weights: what the server's arrays must fit."""
    return {k: (tuple(v.shape), "") for k, v in model.state_dict().items()}


def load_weights(
    model: nn.Module, arrays: dict[str, np.ndarray], device: torch.device
) -> dict[str, np.ndarray]:
    """Every rank: load the full float32 arrays by name that rank 0 has (from
    :meth:`FlowerExchange.receive`, which checks them against the model) into the sharded
    model; returns them (rank 0; empty elsewhere)."""
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
    if device.type == "cuda":
        state = {k: v.to(device) for k, v in state.items()}
    load_full_state(model, state)
    return arrays


class FlowerExchange:
    """Rank 0's part of the flower transport's reply, and the state compression keeps.

    Without compression the reply is the trained weights, packed. With compression it is the
    pseudo-gradient ``global - trained`` over all weights (flattened in sorted name order, as
    the server reads it), compressed with error feedback: the residual of what compression lost
    is carried into the next round and into the group's checkpoints (:meth:`extra`).

    On failure: nothing here is collective; an exception fails the round's reply only.
    """

    def __init__(self, cfg: TrainConfig, rank: int, fault_file: str | None = None):
        self.cfg, self.rank, self.fault_file = cfg, rank, fault_file
        self.compressed = cfg.compression != NO_COMPRESSION
        self.feedback: Z.ErrorFeedback | None = None
        self.global_arrays: dict[str, np.ndarray] | None = None
        self.held: np.ndarray | None = None
        """Compressed downlink (rank 0): the model this group holds, flat float32 in sorted
        name order, as the server's :class:`~flower_shard.flower.server.downlink.Downlink`
        has it; None: none yet (a snapshot comes first)."""
        self.held_version: int | None = None

    def refusal(self, config: dict) -> str | None:
        """Rank 0, before any rank acts: why this message's compressed downlink cannot be
        applied here (the delta is from a version this group does not hold), or None."""
        if P.DOWNLINK not in config:
            return None
        base = int(config[P.DOWNLINK_BASE])
        if self.held is None or self.held_version != base:
            return (
                f"downlink: the delta applies to version {base} of the model but this group "
                f"holds {self.held_version}; the server sends a snapshot next round"
            )
        return None

    def receive(
        self, arrays: dict[str, np.ndarray], config: dict, shapes: dict
    ) -> dict[str, np.ndarray]:
        """Rank 0: the global weights by name that a message's arrays stand for: a packed
        snapshot, or, with the compressed downlink, the change of the model this group holds
        (kept for the next). ``shapes``: name -> (shape, dtype) of this group's model.

        Raises
        ------
        ValueError
            Arrays that do not fit this model, or a payload that is not one.
        """
        version = config.get(P.DOWNLINK_VERSION)
        if P.DOWNLINK in config:
            reason = self.refusal(config)
            payload = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
            kind = str(config[P.DOWNLINK])
            reason = reason or Z.check_payload(
                payload, kind, self.held.size, self.cfg.compression_chunk
            )
            if reason:
                raise ValueError(f"the server's downlink cannot be used: {reason}")
            self.held += Z.decompress(payload, kind, self.cfg.compression_chunk).numpy()
        else:
            reason, named = unpack(arrays, shapes)
            if reason:
                raise ValueError(f"the server's weights do not fit this group's model: {reason}")
            if version is None:
                return named
            self.held = np.array(arrays[P.PACKED], dtype=np.float32)  # ours: it changes in place
        self.held_version = int(version)
        return unflatten_flat(self.held, shapes, sorted(shapes))

    def set_global(self, arrays: dict[str, np.ndarray]) -> None:
        """The round's global weights (rank 0): the reference of the compressed delta, and of
        the faults that fake an update (kept only then: a whole model more on rank 0)."""
        keep = self.compressed or self.fault_file is not None
        self.global_arrays = arrays if keep else None

    def reply(self, trained: dict[str, np.ndarray], rnd: int) -> dict[str, np.ndarray]:
        """The arrays of the reply (rank 0; empty elsewhere), faults injected where the fault
        file says (:mod:`~flower_shard.flower.group.faults`)."""
        fault_file = self.fault_file
        trained = inject_update_fault(fault_file, rnd, trained, self.global_arrays)
        arrays = inject_fault(fault_file, rnd, trained, only=VALUE_FAULTS)
        if self.compressed and arrays:
            arrays = self.compressed_update(arrays)
        elif arrays:  # rank 0: the wire format of the flower transport
            arrays = {P.PACKED: pack(arrays)}
        return inject_fault(fault_file, rnd, arrays, only=FORMAT_FAULTS)

    def compressed_update(self, trained: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The compressed pseudo-gradient ``global - trained``, as the arrays of the reply."""
        if self.global_arrays is None:
            raise RuntimeError("compression needs the round's global weights; none were sent")
        order = sorted(trained)
        delta = flatten(self.global_arrays, order) - flatten(trained, order)
        if self.feedback is None:  # the first round of the run (or after a restart)
            self.feedback = self._feedback(delta.numel())
        payload = self.feedback.compress(delta)
        return {k: v.numpy() for k, v in payload.items()}

    def extra(self) -> dict | None:
        """What a group checkpoint keeps of this (rank 0's residual), or None."""
        return {ERROR_FEEDBACK: self.feedback.residual} if self.feedback is not None else None

    def restore(self, extra: dict) -> None:
        """Take the residual back from a loaded checkpoint's ``extra`` (rank 0)."""
        residual = extra.get(ERROR_FEEDBACK)
        if residual is not None and self.rank == 0:
            self.feedback = self._feedback(residual.numel())
            self.feedback.residual.copy_(residual)

    def _feedback(self, numel: int) -> Z.ErrorFeedback:
        cfg = self.cfg
        return Z.ErrorFeedback(cfg.compression, cfg.compression_chunk, numel, cfg.error_feedback)
