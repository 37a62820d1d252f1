"""A group's checkpoint: every rank's shards through DCP, and the group's counters beside them.

The directory format (atomic round directories with a verified manifest) is
:mod:`flower_shard.runtime.checkpoint`'s. Inside one round's directory:

- DCP files: ``model`` (sharded weights), ``optim`` (AdamW state) and, with an outer sync that
  keeps state, ``outer`` (its flat buffers cut back into per-parameter DTensors); DTensors, so
  a checkpoint loads onto a different number of ranks;
- ``trainer.pt`` (group rank 0): round, step, tokens, group, the LR schedule's state, every
  rank's data position, ``local_steps`` and ``extra`` (state that rank 0 holds alone, such as
  the flower transport's error-feedback residual).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from flower_shard import runfiles
from flower_shard.data.batches import BatchIterator
from flower_shard.errors import CheckpointError
from flower_shard.runtime import checkpoint as C
from flower_shard.runtime.outer_sync import OuterSync
from flower_shard.runtime.placement import Placement
from flower_shard.runtime.schedule import LRSchedule

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """The counters of a group's training that a checkpoint keeps with the tensors."""

    local_steps: int
    """T of the next round (changes only with --adaptive-t)."""
    step: int = 0
    """Inner steps so far."""
    tokens: int = 0
    """Tokens this world trained on so far."""
    round: int = 0
    """The last round done."""


@dataclass(frozen=True)
class Loaded:
    """What :meth:`GroupCheckpointer.load` loaded besides the tensors."""

    round: int
    extra: dict = field(default_factory=dict)


def checkpoint_root(run_dir: str | Path, group: int) -> Path:
    """Where group ``group``'s checkpoints of the one-job run in ``run_dir`` live."""
    return Path(run_dir, runfiles.CHECKPOINTS_DIR, runfiles.group_checkpoints(group))


class GroupCheckpointer:
    """Saves and loads a group's whole training state; every rank of the group takes part.

    A save writes into a staging directory that group rank 0 commits (manifest, fsync, rename)
    once every rank's shards are in: a crash mid-save leaves the previous checkpoint as the
    newest. A load expects a checkpoint that was verified once (by the rank that chose it);
    hashing it again on every rank would multiply the cost by the group size. ``root`` must be
    one directory that all ranks of the group see (a shared file system when a group spans
    hosts).
    """

    def __init__(
        self,
        place: Placement,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: LRSchedule,
        batches: BatchIterator,
        state: TrainState,
        outer: OuterSync | None = None,
        keep: int = 0,
    ):
        self.place, self.model, self.optimizer = place, model, optimizer
        self.schedule, self.batches, self.state, self.outer = schedule, batches, state, outer
        self.keep = keep

    def _sharded_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        state = {"model": model, "optim": optim}
        if self.outer is not None:
            state["outer"] = self.outer.sharded_state(self.model)
        return state

    def save(self, root: str | Path, rnd: int, extra: dict | None = None) -> None:
        """Every rank of the group: save the state after round ``rnd`` under ``root``."""
        import torch.distributed.checkpoint as dcp

        pg = self.place.group_pg
        head = dist.get_rank(pg) == 0
        box = [str(C.staging_dir(root, rnd)) if head else None]
        dist.broadcast_object_list(box, group_src=0, group=pg)
        dcp.save(self._sharded_state(), checkpoint_id=box[0], process_group=pg)
        data = [None] * dist.get_world_size(pg)
        dist.all_gather_object(data, self.batches.state_dict(), group=pg)
        if head:
            meta = {
                "round": rnd,
                "step": self.state.step,
                "tokens": self.state.tokens,
                "group": self.place.group,
                "scheduler": self.schedule.state_dict(),
                "data": data,
                "extra": extra or {},
                "local_steps": self.state.local_steps,
            }
            torch.save(meta, Path(box[0]) / C.GROUP_TRAINER)
            C.commit(Path(box[0]), root, rnd, keep=self.keep)
        dist.barrier(group=pg)

    def load(self, path: str | Path) -> Loaded:
        """Every rank of the group: load a verified checkpoint saved by :meth:`save`.

        It may come from a group with another number of ranks: DCP reshards the weights and
        the optimizer state. The data position carries over only with the same number of ranks
        (the data partition depends on it); otherwise the data starts afresh.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        pg = self.place.group_pg
        state = self._sharded_state()
        dcp.load(state, checkpoint_id=str(path), process_group=pg)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        meta = torch.load(Path(path) / C.GROUP_TRAINER, weights_only=False)
        self.state.step, self.state.tokens = meta["step"], meta["tokens"]
        self.state.round = meta["round"]
        self.state.local_steps = meta.get("local_steps", self.state.local_steps)
        self.schedule.load_state_dict(meta["scheduler"])
        if len(meta["data"]) == dist.get_world_size(pg):
            self.batches.load_state_dict(meta["data"][dist.get_rank(pg)])
        return Loaded(meta["round"], meta.get("extra", {}))

    def resume_world(self, run_dir: str | Path) -> int:
        """Every rank of a one-job world: load the newest round that EVERY group has a good
        checkpoint of in ``run_dir`` and return it.

        Each group's rank 0 verifies its group's checkpoints (a refused one is logged with its
        reason); the world agrees on the newest round they all have.
        """
        root = checkpoint_root(run_dir, self.place.group)
        good: list[int] = []
        if dist.get_rank(self.place.group_pg) == 0:  # the group's head verifies, the others wait
            good = list(C.good_rounds(root, log=log.warning))
        every: list = [None] * self.place.world
        dist.all_gather_object(every, good)
        k = self.place.group_size
        heads = range(0, self.place.world, k)
        common = set.intersection(*(set(every[r]) for r in heads))
        if not common:
            raise CheckpointError(
                f"--resume {run_dir}: no round has a good checkpoint in every group; "
                "start the run afresh"
            )
        rnd = max(common)
        self.load(C.round_dir(root, rnd))
        return rnd
