"""The outer synchronisation between groups, once per round (every T inner steps).

:class:`OuterSync` moves this rank's shards between the groups; the math of the outer step
lives in :class:`~flower_shard.runtime.outer_optimizer.OuterOptimizer`. :func:`build_outer_sync`
is the one place where a run's settings become an ``OuterSync`` (both drivers use it); what
makes a sync all-or-nothing for a group is :func:`flower_shard.runtime.commit.sync_or_rollback`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flower_shard.config import TrainConfig
from flower_shard.config.choices import FEDAVG, NESTEROV, NO_COMPRESSION
from flower_shard.runtime import compression as Z
from flower_shard.runtime.cross_group import wait_or_abandon
from flower_shard.runtime.outer_optimizer import OuterOptimizer, pseudo_gradient
from flower_shard.runtime.pacing import PacedCollective


def local_view(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a (maybe sharded) tensor that this rank holds, as a view: writes go through."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


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
    timeout and the exception propagates. This rank's weights are untouched until its
    all-reduce has returned, but each rank syncs only its own shard, so another rank of the
    same group may already have stepped: :meth:`snapshot` and :meth:`restore` cover everything
    a sync changes, and :func:`flower_shard.runtime.commit.sync_or_rollback` uses them to make
    the sync all-or-nothing for the group. Inside one torch job a failure ends the job.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        group_pg=None,
        kind: str = FEDAVG,
        lr: float = 0.7,
        momentum: float = 0.9,
        sync_optimizer_state: bool = False,
        compression: str = NO_COMPRESSION,
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
        compressed = compression != NO_COMPRESSION
        if compressed and sync_optimizer_state:
            raise ValueError("compression does not cover the optimizer state; drop one of them")
        with torch.no_grad():
            keep = kind == NESTEROV or compressed
            initial = _flatten(self.params) if keep else torch.empty(0)
        self.outer = OuterOptimizer(initial, kind, lr, momentum, track_weights=compressed)
        self.abandoned = None
        """While set (a callable), every wait on the cross-group group gives up as soon as it
        returns True (:func:`~flower_shard.runtime.cross_group.wait_or_abandon`)."""
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
            self.wait(pg.allreduce([flat]))  # SUM
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
        """SUM-all-reduce ``flat`` across groups in place, striped over the replicas. Returns
        the values this rank all-reduced and the bytes it sent to its replicas."""
        striped = StripedAllreduce(pg, self.replicate_pg, flat)
        flat.copy_(striped.finish(self.wait))
        return striped.stripe, striped.replicate_bytes

    def wait(self, work) -> None:
        """Wait for a collective on the cross-group group (given up when :attr:`abandoned`)."""
        wait_or_abandon(work, self.abandoned)

    def _shares(self, pg, weight: float, device) -> list[float] | None:
        """Every group's ``w_g / sum w``, or None when all weights are equal (plain mean)."""
        mine = torch.tensor([float(weight)], dtype=torch.float64, device=device)
        weights = [torch.zeros_like(mine) for _ in range(pg.size())]
        # The raw ProcessGroup API also serves groups that torch.distributed has not
        # registered (the cross-world groups of the collective transport).
        self.wait(pg.allgather([weights], [mine]))
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
        self.wait(pg.allgather([gathered], [mine]))
        mean = Z.mean_of(gathered, self.compression, flat.numel(), self.chunk, shares)
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


class StripedAllreduce:
    """One striped SUM-all-reduce across groups, started at construction (HSDP).

    Replica ``r`` of ``replicate_pg`` all-reduces only the r-th 1/R stripe of ``flat``
    (zero-padded to equal stripes) across groups; :meth:`finish` waits for it and all-gathers
    the summed stripes from the other replicas over the fast intra-group tier. ``flat`` is not
    modified (an overlapped sync keeps it as the base of its rebase). ``pacer`` paces the
    cross-group all-reduce (:mod:`.pacing`: the stripe in ``pieces`` over ``window_s``).
    """

    def __init__(
        self, pg, replicate_pg, flat: torch.Tensor, pieces: int = 1, pacer=None, window_s=0.0
    ):
        self.replicate_pg = replicate_pg
        self.numel = flat.numel()
        r, replicas = replicate_pg.rank(), replicate_pg.size()
        self.stripe = -(-flat.numel() // replicas)
        self.padded = flat.new_zeros(self.stripe * replicas)
        self.padded[: flat.numel()] = flat
        self.mine = self.padded[r * self.stripe : (r + 1) * self.stripe].clone()
        self.replicate_bytes = (replicas - 1) * self.stripe * flat.element_size()
        mine = self.mine
        self.paced = PacedCollective(
            lambda a, b: pg.allreduce([mine[a:b]]), mine.numel(), pieces, pacer, window_s
        )

    def finish(self, wait) -> torch.Tensor:
        """The groups' sum of ``flat`` (a new tensor); ``wait`` waits for the cross-group work.
        A failed all-reduce raises here, after this replica joined the all-gather: the other
        replicas would hang in it otherwise."""
        failed = self.paced.finish(wait)
        self.replicate_pg.allgather([list(self.padded.split(self.stripe))], [self.mine]).wait()
        if failed is not None:
            raise failed
        return self.padded[: self.numel]


def build_outer_sync(
    cfg: TrainConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    group_pg=None,
    replicate_pg=None,
) -> OuterSync:
    """The outer sync of a run's settings, for ``model`` and its inner ``optimizer``.

    Parameters
    ----------
    cfg
        The run: outer optimizer, its LR and momentum, optimizer-state sync, compression.
    group_pg
        The process group across groups when it is fixed for the run (one torch job: the mesh's
        ``group`` dimension); None when every sync gets its own (a Flower group:
        :class:`~flower_shard.runtime.cross_group.CrossGroup`).
    replicate_pg
        HSDP: the process group of this rank's replicas inside its group (striped exchange).
    """
    return OuterSync(
        model,
        optimizer,
        group_pg,
        kind=cfg.outer,
        lr=cfg.outer_lr,
        momentum=cfg.outer_momentum,
        sync_optimizer_state=cfg.sync_optimizer_state,
        compression=cfg.compression,
        chunk=cfg.compression_chunk,
        error_feedback=cfg.error_feedback,
        replicate_pg=replicate_pg,
    )


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).float() for t in tensors])


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
