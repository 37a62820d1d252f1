"""The outer synchronisation between groups, once per round (every T inner steps).

The math lives in :class:`OuterOptimizer`, which works on one flat float32 tensor: the same code
runs on a rank's local shards here and on full arrays on a Flower server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flower_shard.runtime import compression as Z


def local_view(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a (maybe sharded) tensor that this rank holds, as a view: writes go through."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def pseudo_gradient(global_weights: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """DiLoCo's outer gradient: how far the groups' mean moved from the last global weights."""
    return global_weights - mean


class OuterOptimizer:
    """Turns the groups' average into the next global weights.

    ``fedavg``: the average replaces the weights (no state).

    ``nesterov`` (DiLoCo): keeps the last global weights ``w``; with the groups' mean ``m``,
    the pseudo-gradient ``w - m`` is fed to ``torch.optim.SGD(lr, momentum, nesterov=True)``
    stepping ``w``. With lr 1 and momentum 0 it reduces to fedavg (up to rounding).

    Parameters
    ----------
    initial
        Flat float32 tensor of the weights at the start (the first global weights). Copied.
    kind
        ``fedavg`` or ``nesterov``.
    lr, momentum
        Outer learning rate and momentum (nesterov only).
    track_weights
        fedavg: keep the global weights too, so that :meth:`apply` can take a pseudo-gradient
        (nesterov always keeps them).
    """

    def __init__(
        self,
        initial: torch.Tensor,
        kind: str = "fedavg",
        lr: float = 0.7,
        momentum: float = 0.9,
        track_weights: bool = False,
    ):
        if kind not in ("fedavg", "nesterov"):
            raise ValueError(f"outer optimizer {kind!r} is unknown; choose fedavg or nesterov")
        self.kind = kind
        self._sgd = None
        self.weights = None
        if kind == "nesterov":
            self.weights = nn.Parameter(initial.detach().clone().float())
            # torch refuses nesterov without momentum; momentum 0 is plain SGD (the same update).
            self._sgd = torch.optim.SGD(
                [self.weights], lr=lr, momentum=momentum, nesterov=momentum > 0
            )
        elif track_weights:  # fedavg from pseudo-gradients needs the last global weights
            self.weights = initial.detach().clone().float()

    def step(self, mean: torch.Tensor) -> torch.Tensor:
        """Return the new global weights given the groups' mean (a flat tensor, not modified)."""
        if self._sgd is None:
            if self.weights is not None:
                self.weights.copy_(mean)
            return mean
        return self.apply(pseudo_gradient(self.weights.detach(), mean))

    @torch.no_grad()
    def apply(self, pseudo_grad: torch.Tensor) -> torch.Tensor:
        """Return the new global weights given the groups' mean pseudo-gradient ``w - mean``
        (what a compressed exchange delivers); needs the tracked weights.

        fedavg: ``w - pseudo_grad``; nesterov: an SGD step with ``pseudo_grad`` as gradient.
        """
        if self.weights is None:
            raise RuntimeError("OuterOptimizer(track_weights=True) is needed to apply deltas")
        if self._sgd is None:
            self.weights.sub_(pseudo_grad)
            return self.weights
        self.weights.grad = pseudo_grad
        self._sgd.step()
        self.weights.grad = None
        return self.weights.detach()

    def buffers(self) -> dict[str, torch.Tensor]:
        """The flat state tensors themselves (global weights, nesterov's momentum), to load in
        place; empty for fedavg without tracked weights.

        Before the first step the momentum is created as zeros, which gives the same first
        update as torch's lazily created buffer (a copy of the first gradient).
        """
        if self.weights is None:
            return {}
        if self._sgd is None:
            return {"weights": self.weights}
        state = self._sgd.state[self.weights]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(self.weights.data)
        return {"weights": self.weights.data, "momentum": state["momentum_buffer"]}

    def state_dict(self) -> dict:
        if self.weights is None:
            return {}
        out = {"weights": self.weights.detach().clone()}
        if self._sgd is not None:
            out["sgd"] = self._sgd.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        if self.weights is not None:
            with torch.no_grad():
                self.weights.copy_(state["weights"])
        if self._sgd is not None:
            self._sgd.load_state_dict(state["sgd"])


@dataclass
class SyncStats:
    seconds: float
    """Wall time of the sync, all-reduce and outer step included."""
    payload_bytes: int
    """Size of the flat buffer each rank contributes."""
    sent_bytes: int
    """Bytes each rank sends to other groups: 2 (G-1)/G x what it all-reduces (the payload, or
    its 1/R stripe of it when HSDP replicas stripe the exchange)."""
    replicate_bytes: int = 0
    """Bytes each rank sends to its own group's replicas (the striped exchange's all-gather:
    (R-1) x stripe), which stay inside the group."""


class OuterSync:
    """Averages the G groups' models with ONE flat all-reduce of each rank's local shards.

    Rank ``(g, s)`` holds shard ``s`` of group ``g``'s model, and ranks at the same mesh
    coordinates in other groups hold the same shard; so averaging the models is an all-reduce of
    the local shards over the ``group`` mesh dimension. Nothing is ever gathered: each rank moves
    ``|model| / S`` values. All local shards (and, with ``sync_optimizer_state``, AdamW's two
    moments) are packed into one flat float32 buffer, all-reduced (SUM) and divided by G, which
    for G = 2 is bit-exactly the mean. The outer optimizer then maps the mean of the weights to
    the new global weights, which are copied back into the shards in place.

    Compressed (``compression`` = ``bf16`` or ``int8``, see
    :mod:`flower_shard.runtime.compression`): each rank compresses its shard of the pseudo-gradient
    ``w - x`` (with error feedback), the ranks ALL-GATHER the payloads (a sum of int8 values would
    overflow), and every rank decompresses the G payloads and adds them up in group order, so all
    groups compute the same mean bit for bit; the outer optimizer then steps from that mean
    pseudo-gradient. A ring all-gather sends (G-1) x payload per rank, against 2 (G-1)/G x 4 bytes
    per value for the float32 all-reduce: int8 moves 4x less for G = 2 and wins up to G = 8.

    HSDP (``replicate_pg``, the R replicas of this rank's shard inside its group, which hold
    it bit-identically): without care all R replicas would send the same shard to the other
    groups, R x the bytes across the slow tier. Instead the exchange is striped: replica r
    all-reduces only the r-th 1/R of the flat buffer across groups, then the replicas
    all-gather the averaged stripes over the fast intra-group tier, and every replica runs the
    same outer step on the same mean. A group's inter-group traffic drops from R x |model| to
    |model|, spread over all of its R x S ranks. (Compressed syncs are not striped.)

    On failure: a dead or hung peer makes the all-reduce raise after the process group's
    timeout; the exception propagates and the round is lost (the weights are untouched until
    the all-reduce has returned).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        group_pg=None,
        kind: str = "fedavg",
        lr: float = 0.7,
        momentum: float = 0.9,
        sync_optimizer_state: bool = False,
        compression: str = "none",
        chunk: int = 2048,
        error_feedback: bool = True,
        replicate_pg=None,
    ):
        self.params = [local_view(p) for p in model.parameters()]
        self.optimizer = optimizer
        self.group_pg = group_pg
        striped = replicate_pg is not None and replicate_pg.size() > 1
        self.replicate_pg = replicate_pg if striped else None
        self.sync_optimizer_state = sync_optimizer_state
        self.param_numel = sum(t.numel() for t in self.params)
        self.compression, self.chunk = compression, chunk
        compressed = compression != "none"
        if compressed and sync_optimizer_state:
            raise ValueError("compression does not cover the optimizer state; drop one of them")
        with torch.no_grad():
            keep = kind == "nesterov" or compressed
            initial = _flatten(self.params) if keep else torch.empty(0)
        self.outer = OuterOptimizer(initial, kind, lr, momentum, track_weights=compressed)
        self.feedback = None
        if compressed:
            device = self.params[0].device if self.params else None
            self.feedback = Z.ErrorFeedback(
                compression, chunk, self.param_numel, error_feedback, device
            )

    def _moments(self) -> list[torch.Tensor]:
        """AdamW's first and second moments, as local views (empty before the first step)."""
        out = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p, {})
                out += [local_view(state[k]) for k in ("exp_avg", "exp_avg_sq") if k in state]
        return out

    @torch.no_grad()
    def sync(self, group_pg=None, weight: float | None = None) -> SyncStats:
        """Average over ``group_pg`` (default: the one given at construction) and step.

        ``weight`` (e.g. the tokens this group processed) makes it a weighted average
        ``sum_g w_g x_g / sum_g w_g``; when every group has the same weight (the usual case)
        it is the plain mean, computed as SUM / G so that G = 2 stays bit-exact.
        """
        pg = self.group_pg if group_pg is None else group_pg
        groups = pg.size()
        start = time.perf_counter()
        tensors = self.params + (self._moments() if self.sync_optimizer_state else [])
        flat = _flatten(tensors)
        shares = self._shares(pg, weight, flat.device) if weight is not None else None
        if self.feedback is not None:
            return self._sync_compressed(pg, flat, shares, start)
        scale = None if shares is None else shares[pg.rank()]
        if scale is not None:
            flat.mul_(scale)
        if self.replicate_pg is None:
            pg.allreduce([flat]).wait()  # SUM
            reduced, replicate_bytes = flat.numel(), 0
        else:
            reduced, replicate_bytes = self._striped_allreduce(pg, flat)
        if scale is None:
            flat.div_(groups)
        new_weights = self.outer.step(flat[: self.param_numel])
        _unflatten_into(new_weights, self.params)
        if len(tensors) > len(self.params):
            _unflatten_into(flat[self.param_numel :], tensors[len(self.params) :])
        if flat.is_cuda:
            torch.cuda.synchronize(flat.device)
        payload = flat.numel() * flat.element_size()
        return SyncStats(
            seconds=time.perf_counter() - start,
            payload_bytes=payload,
            sent_bytes=2 * (groups - 1) * reduced * flat.element_size() // groups,
            replicate_bytes=replicate_bytes,
        )

    def _striped_allreduce(self, pg, flat: torch.Tensor) -> tuple[int, int]:
        """SUM-all-reduce ``flat`` across groups in place, this replica doing its 1/R stripe
        (zero-padded to equal stripes) and the replicas all-gathering the rest. Returns the
        values this rank all-reduced and the bytes it sent to its replicas."""
        r, replicas = self.replicate_pg.rank(), self.replicate_pg.size()
        stripe = -(-flat.numel() // replicas)
        padded = flat.new_zeros(stripe * replicas)
        padded[: flat.numel()] = flat
        mine = padded[r * stripe : (r + 1) * stripe].clone()
        failed = None
        try:
            pg.allreduce([mine]).wait()
        except Exception as exc:  # noqa: BLE001 - re-raised below
            failed = exc  # still join the all-gather: the other replicas would hang in it
        stripes = list(padded.split(stripe))
        self.replicate_pg.allgather([stripes], [mine]).wait()
        if failed is not None:
            raise failed
        flat.copy_(padded[: flat.numel()])
        return stripe, (replicas - 1) * stripe * flat.element_size()

    @staticmethod
    def _shares(pg, weight: float, device) -> list[float] | None:
        """Every group's ``w_g / sum w``, or None when all weights are equal (plain mean)."""
        mine = torch.tensor([float(weight)], dtype=torch.float64, device=device)
        weights = [torch.zeros_like(mine) for _ in range(pg.size())]
        # The raw ProcessGroup API also serves groups that torch.distributed has not
        # registered (the cross-world groups of the collective transport).
        pg.allgather([weights], [mine]).wait()
        weights = [w.item() for w in weights]
        if min(weights) <= 0:
            raise ValueError(f"outer sync weights must be > 0, got {weights}")
        if len(set(weights)) == 1:
            return None
        return [w / sum(weights) for w in weights]

    def _sync_compressed(self, pg, flat: torch.Tensor, shares, start: float) -> SyncStats:
        """All-gather the compressed pseudo-gradients; every rank sums them in group order."""
        groups = pg.size()
        delta = pseudo_gradient(self.outer.weights.detach(), flat)
        mine = Z.to_bytes(self.feedback.compress(delta))
        gathered = [torch.empty_like(mine) for _ in range(groups)]
        pg.allgather([gathered], [mine]).wait()
        mean = torch.zeros_like(flat)
        for g, raw in enumerate(gathered):
            decoded = Z.decompress(
                Z.from_bytes(raw, self.compression, flat.numel(), self.chunk),
                self.compression,
                self.chunk,
            )
            mean.add_(decoded if shares is None else decoded * shares[g])
        if shares is None:
            mean.div_(groups)
        _unflatten_into(self.outer.apply(mean), self.params)
        if flat.is_cuda:
            torch.cuda.synchronize(flat.device)
        payload = mine.numel()
        return SyncStats(
            seconds=time.perf_counter() - start,
            payload_bytes=payload,
            sent_bytes=(groups - 1) * payload,
        )

    def _touched(self) -> list[torch.Tensor]:
        moments = self._moments() if self.sync_optimizer_state else []
        residual = [self.feedback.residual] if self.feedback is not None else []
        return self.params + moments + list(self.outer.buffers().values()) + residual

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of everything :meth:`sync` changes (this rank's shards, the synced moments,
        the outer state): :meth:`restore` them when a sync fails half-way."""
        return [t.detach().clone() for t in self._touched()]

    @torch.no_grad()
    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip(self._touched(), saved, strict=True):
            t.copy_(s)

    def flat_state(self) -> dict[str, torch.Tensor]:
        """The flat per-rank state a checkpoint must keep: the outer optimizer's buffers and,
        when compressing with error feedback, the residual."""
        out = dict(self.outer.buffers())
        if self.feedback is not None and self.feedback.enabled:
            out["residual"] = self.feedback.residual
        return out

    def state_dict(self) -> dict:
        return {"outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.outer.load_state_dict(state["outer"])

    def sharded_state(self, model: torch.nn.Module) -> dict:
        """The outer state as DTensors shaped like ``model``'s parameters (for DCP).

        The flat buffers hold this rank's shards in parameter order; cut back into
        per-parameter DTensors with the parameters' placements they can be saved and loaded
        onto a different number of ranks. The DTensors are views: DCP loads in place.
        """
        out = {}
        for name, flat in self.flat_state().items():
            offset = 0
            for key, p in model.named_parameters():
                local = local_view(p)
                piece = flat[offset : offset + local.numel()].view_as(local)
                offset += local.numel()
                if isinstance(p, DTensor):
                    piece = DTensor.from_local(
                        piece, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                    )
                out[f"{name}.{key}"] = piece
        return out


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).float() for t in tensors])


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
