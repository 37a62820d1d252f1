"""The group runtime: one rank's model shards, inner optimizer, data and outer sync, and its steps.

Components, each built by its own builder and declared here in the order they are made
(torchtitan's layout):

1. placement: topology, device mesh, this rank's group (:mod:`~flower_shard.runtime.placement`,
   given);
2. data: this rank's part of the corpus (:mod:`~flower_shard.runtime.data_part`, given);
3. model: built from the preset, sharded with :func:`~flower_shard.runtime.parallelize.parallelize`,
   its FSDP collectives counted (:mod:`~flower_shard.runtime.intra_comm`);
4. inner optimizer and LR schedule (:mod:`~flower_shard.runtime.schedule`);
5. outer sync (:mod:`~flower_shard.runtime.outer_sync`, given as a builder, or none);
6. checkpointer (:mod:`~flower_shard.runtime.group_checkpoint`).

Two thin drivers run it: the one-job loop (:mod:`flower_shard.runtime.trainer`) and the Flower
group worker (:mod:`flower_shard.flower.group.worker`). Neither reaches inside: they call
:meth:`GroupTrainer.train_steps`, :meth:`~GroupTrainer.evaluate`, the outer sync and the
checkpointer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from flower_shard.config import TrainConfig
from flower_shard.runtime import intra_comm
from flower_shard.runtime.data_part import DataPart
from flower_shard.runtime.distributed import shutdown, world_sum
from flower_shard.runtime.evaluation import lm_loss, loss_sums
from flower_shard.runtime.group_checkpoint import GroupCheckpointer, TrainState
from flower_shard.runtime.models import build_model, is_meta, materialize
from flower_shard.runtime.outer_sync import OuterSync
from flower_shard.runtime.parallelize import parallelize
from flower_shard.runtime.placement import Placement
from flower_shard.runtime.schedule import LRSchedule, build_optimizer

OuterSyncBuilder = Callable[[nn.Module, torch.optim.Optimizer], OuterSync]
"""Makes the outer sync for the model and its inner optimizer (see
:func:`~flower_shard.runtime.outer_sync.build_outer_sync`)."""


@dataclass(frozen=True)
class StepStats:
    """What a run of inner steps did, the same on every rank of the world."""

    loss: float
    """Mean training loss over the steps and the world's ranks."""
    steps: int
    tokens: int
    """Tokens over all ranks of the world."""
    seconds: float
    intra: dict
    """FSDP's collectives in these steps: ``{kind: {"calls", "bytes", "seconds"}}``."""

    @property
    def intra_bytes(self) -> float:
        """Bytes this rank sent in FSDP's collectives."""
        return sum(k["bytes"] for k in self.intra.values())

    @property
    def intra_s(self) -> float:
        return sum(k["seconds"] for k in self.intra.values())


def build_sharded_model(
    cfg: TrainConfig, vocab_size: int, place: Placement
) -> tuple[nn.Module, intra_comm.IntraCommStats]:
    """The run's model, sharded over the group's sub-mesh, and the counters of its collectives.

    Every rank builds the same seeded model, so every group starts from identical weights (a
    model too large for one host is built on the meta device and materialised after sharding).
    """
    model = build_model(cfg.model, vocab_size, cfg.seed, cfg.seq_len)
    parallelize(model, place.sharding_mesh(), bf16=cfg.bf16)
    intra = intra_comm.install(model, cfg.replicate, place.device)
    if is_meta(model):
        materialize(model, place.device, cfg.seed)
    return model, intra


class GroupTrainer:
    """One rank of a group: its components and the inner steps that use them.

    Each rank trains on its own disjoint part of the corpus; the inner optimizer is AdamW with
    warm-up + cosine, and its state never leaves the rank. The drivers decide when the outer
    sync runs and what a failure costs.

    On failure: an exception inside a collective (a step, an evaluation, a checkpoint) leaves
    the ranks of the world out of step; it propagates and the driver ends the world (torchrun
    stops the job). Only the cross-group sync is made recoverable
    (:func:`~flower_shard.runtime.commit.sync_or_rollback`).

    Parameters
    ----------
    cfg
        The run.
    place
        Where this rank sits (:class:`~flower_shard.runtime.placement.Placement`).
    data
        This rank's data (:class:`~flower_shard.runtime.data_part.DataPart`).
    outer
        Builds the outer sync for the model and optimizer; None: this trainer does none.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        place: Placement,
        data: DataPart,
        outer: OuterSyncBuilder | None = None,
    ):
        self.cfg, self.place, self.data = cfg, place, data
        self.model, self.intra = build_sharded_model(cfg, data.corpus.vocab_size, place)
        self.optimizer = build_optimizer(cfg, self.model)
        self.schedule = LRSchedule(self.optimizer, cfg)
        self.outer = outer(self.model, self.optimizer) if outer is not None else None
        self.state = TrainState(local_steps=cfg.local_steps)
        self.checkpointer = GroupCheckpointer(
            place,
            self.model,
            self.optimizer,
            self.schedule,
            data.batches,
            self.state,
            self.outer,
            keep=cfg.keep_checkpoints,
        )
        self.on_step: Callable[[int], None] | None = None
        """Called with the step after each inner step (the one-job run's progress bar)."""

    @property
    def device(self) -> torch.device:
        return self.place.device

    def train_steps(
        self,
        n: int,
        seconds: float | None = None,
        progress: tuple[int, int] | None = None,
        between: Callable[[int], None] | None = None,
    ) -> StepStats:
        """``n`` inner steps on every rank of this world.

        Time-budgeted (``seconds``): steps until ``seconds`` have passed, at least one and at
        most ``n``. Rank 0's clock decides, broadcast after each step, so every rank of the
        group stops after the same step (FSDP needs every rank in every collective).
        ``progress`` = (rounds done, rounds in the run): the LR schedule then follows the
        run's time, ``(done + elapsed / seconds) / rounds`` of the way through. ``between`` is
        called on every rank with the steps done after each step (a fragmented outer sync).
        """
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=self.device)
        clock = torch.zeros(1, dtype=torch.float64, device=self.device)
        done = 0
        self.intra.take()  # what evaluation or loading gathered is not this round's steps
        while done < n:
            if seconds is not None and progress is not None:
                # The position at this step's start sets the LR of the next step (one step of
                # lag), the same on every rank since the clock is rank 0's.
                rounds_done, rounds = progress
                fraction = min(1.0, (rounds_done + clock.item() / seconds) / rounds)
                self.schedule.position = fraction * self.cfg.total_steps
            inputs, targets = next(self.data.batches)
            loss_sum += self.train_step(inputs.to(self.device), targets.to(self.device))
            done += 1
            if self.on_step is not None:
                self.on_step(self.state.step)
            if between is not None:
                between(done)
            if seconds is not None:
                clock.fill_(_elapsed(start, self.device))
                dist.broadcast(clock, src=0)
                if clock.item() >= seconds:
                    break
        elapsed = _elapsed(start, self.device)
        world = self.place.world
        tokens = done * self.cfg.batch_size * self.cfg.seq_len * world
        self.state.tokens += tokens
        loss = world_sum(loss_sum, self.device) / (done * world)
        return StepStats(loss, done, tokens, elapsed, self.intra.take())

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One inner AdamW step on this rank's batch; returns the (detached) loss."""
        self.model.train()
        loss = lm_loss(self.model, inputs, targets)
        loss.backward()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        return loss.detach()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean held-out loss over the fixed evaluation set, over all ranks of this world.

        Every rank of a group must run the same number of forwards (FSDP gathers inside them),
        so ranks with fewer sequences pad with zero-weighted rows.
        """
        per_rank = math.ceil(self.data.eval_total / self.place.world)
        forwards = math.ceil(per_rank / self.cfg.batch_size)
        total = loss_sums(
            self.model, self.data.eval_blocks, self.cfg.batch_size, self.device, forwards=forwards
        )
        dist.all_reduce(total)
        return (total[0] / total[1]).item()

    def close(self, clean: bool = False) -> None:
        """Leave the torch world (``clean``: every rank got here without an error)."""
        shutdown(clean)


def _elapsed(start: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
