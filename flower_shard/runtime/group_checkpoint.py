"""A group's checkpoint: every rank's shards through DCP, and the group's counters beside them.

The directory format (atomic round directories with a verified manifest) is
:mod:`flower_shard.runtime.checkpoint`'s. Inside one round's directory:

- DCP files: ``model`` (sharded weights), ``optim`` (AdamW state) and, with an outer sync that
  keeps state, ``outer`` (its flat buffers cut back into per-parameter DTensors); DTensors, so
  a checkpoint loads onto a different number of ranks;
- ``trainer.json`` (group rank 0): round, step, tokens, group, the LR schedule's state, every
  rank's data position and ``local_steps``; ``extra.safetensors``: tensors that rank 0 holds
  alone (such as the flower transport's error-feedback residual);
- ``run.json``: the run, the group and the settings (:func:`~flower_shard.runtime.checkpoint.
  read_identity`).

Nothing in it is unpickled as code: DCP's tensors are read with ``torch.load(...,
weights_only=True)``, its other values likewise (:class:`SafeLoadPlanner`), and its
``.metadata`` (a pickle) through an unpickler that admits only DCP's own record types
(:class:`SafeReader`); a file that names anything else is refused.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from flower_shard import runfiles
from flower_shard.config.identity import GROUP
from flower_shard.data.batches import BatchIterator
from flower_shard.errors import CheckpointError
from flower_shard.runtime import checkpoint as C
from flower_shard.runtime.outer_sync import OuterSync
from flower_shard.runtime.placement import Placement
from flower_shard.runtime.schedule import LRSchedule

log = logging.getLogger(__name__)

DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of the shards
REQUIRED = (C.IDENTITY, C.GROUP_TRAINER, DCP_METADATA)
"""What a group checkpoint's manifest must list."""

_DCP = "torch.distributed.checkpoint"
_METADATA_TYPES = {
    (f"{_DCP}.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {(f"{_DCP}.filesystem", "_StorageInfo"), ("torch", "Size"), ("pathlib", "PosixPath")}
_METADATA_TYPES.add(("torch.serialization", "_get_layout"))  # a string -> torch.strided lookup


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: its record types, torch dtypes and sizes, nothing else."""

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or (module, name) in _METADATA_TYPES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"the checkpoint's {DCP_METADATA} refers to {module}.{name}, which is not a "
            "checkpoint record (a tampered file?)"
        )


class SafeReader(FileSystemReader):
    """DCP's file reader, except that ``.metadata`` admits only DCP's records and the shard
    files it names must lie inside the checkpoint."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
            raise CheckpointError(f"{path}: {exc}") from None
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        for info in (metadata.storage_data or {}).values():
            name = Path(str(getattr(info, "relative_path", "")))
            if name.is_absolute() or ".." in name.parts or not name.parts:
                raise CheckpointError(f"{path} names a shard outside the checkpoint: {name}")
        return metadata


def check_metadata(path: str | Path) -> None:
    """Read a group checkpoint's DCP index as a load would (:class:`SafeReader`), without
    loading anything: :class:`CheckpointError` if it names anything but DCP's records."""
    SafeReader(path).read_metadata()


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, with its non-tensor values read by ``torch.load(...,
    weights_only=True)`` (DCP's own uses ``weights_only=False``: any pickle)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


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
    """What :meth:`GroupCheckpointer.load` loaded besides the sharded state."""

    round: int
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    """Rank 0's own tensors, by name (empty on the other ranks' checkpoints)."""


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
        self.identity: dict | None = None
        """The identity of the checkpoint loaded last (None: none loaded)."""

    def _sharded_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        state = {"model": model, "optim": optim}
        if self.outer is not None:
            state["outer"] = self.outer.sharded_state(self.model)
        return state

    def save(
        self, root: str | Path, rnd: int, extra: dict | None = None, identity: dict | None = None
    ) -> None:
        """Every rank of the group: save the state after round ``rnd`` under ``root``.

        ``extra``: tensors by name that rank 0 holds alone. ``identity``: the run's (see
        :func:`~flower_shard.runtime.checkpoint.read_identity`); by default the one in
        ``root/run.json`` (a launcher writes it before the run), else the one of the
        checkpoint this group loaded.
        """
        import torch.distributed.checkpoint as dcp

        pg = self.place.group_pg
        head = dist.get_rank(pg) == 0
        box = [str(C.staging_dir(root, rnd)) if head else None]
        dist.broadcast_object_list(box, group_src=0, group=pg)
        dcp.save(self._sharded_state(), checkpoint_id=box[0], process_group=pg)
        data = [None] * dist.get_world_size(pg)
        dist.all_gather_object(data, self.batches.state_dict(), group=pg)
        if head:
            self._write_head(Path(box[0]), rnd, data, extra, identity or self._identity(root))
            C.commit(Path(box[0]), root, rnd, keep=self.keep)
        dist.barrier(group=pg)

    def _identity(self, root: str | Path) -> dict:
        if Path(root, C.IDENTITY).is_file():
            return C.read_identity(root)
        return self.identity or {}

    def _write_head(self, tmp: Path, rnd: int, data: list, extra: dict | None, identity) -> None:
        """Group rank 0: the counters (JSON), rank 0's own tensors and the identity."""
        from safetensors.torch import save_file

        meta = {
            "round": rnd,
            "step": self.state.step,
            "tokens": self.state.tokens,
            "group": self.place.group,
            "scheduler": self.schedule.state_dict(),
            "data": data,
            "local_steps": self.state.local_steps,
        }
        (tmp / C.GROUP_TRAINER).write_text(json.dumps(meta, indent=1, default=int) + "\n")
        if extra:
            tensors = {k: v.detach().cpu().contiguous() for k, v in extra.items()}
            save_file(tensors, str(tmp / C.GROUP_EXTRA))
        C.write_identity(tmp, identity)

    def load(self, path: str | Path) -> Loaded:
        """Every rank of the group: load a verified checkpoint saved by :meth:`save`.

        It may come from a group with another number of ranks: DCP reshards the weights and
        the optimizer state. The data position carries over only with the same number of ranks
        (the data partition depends on it); otherwise the data starts afresh. The checkpoint's
        identity becomes this checkpointer's (a later save carries it on).
        """
        import torch.distributed.checkpoint as dcp
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import set_state_dict

        path = Path(path)
        pg = self.place.group_pg
        state = self._sharded_state()
        dcp.load(
            state,
            storage_reader=SafeReader(path),
            planner=SafeLoadPlanner(),
            process_group=pg,
        )
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        meta = json.loads((path / C.GROUP_TRAINER).read_text())
        self.state.step, self.state.tokens = meta["step"], meta["tokens"]
        self.state.round = meta["round"]
        self.state.local_steps = meta.get("local_steps", self.state.local_steps)
        self.schedule.load_state_dict(meta["scheduler"])
        if len(meta["data"]) == dist.get_world_size(pg):
            self.batches.load_state_dict(meta["data"][dist.get_rank(pg)])
        extra = load_file(str(path / C.GROUP_EXTRA)) if (path / C.GROUP_EXTRA).is_file() else {}
        self.identity = C.read_identity(path)
        return Loaded(meta["round"], extra)

    def resume_world(self, run_dir: str | Path) -> int:
        """Every rank of a one-job world: load the newest round that EVERY group has a good
        checkpoint of in ``run_dir`` and return it.

        Each group's rank 0 verifies its group's checkpoints (a refused one is logged with its
        reason, as is one that records another group); the world agrees on the newest round
        they all have. (The launcher checked the checkpoints' run and settings before it
        started the ranks.)
        """
        root = checkpoint_root(run_dir, self.place.group)
        good: list[int] = []
        if dist.get_rank(self.place.group_pg) == 0:  # the group's head verifies, the others wait
            good = list(
                C.good_rounds(root, log=log.warning, required=REQUIRED, accept=self._ours(root))
            )
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

    def _ours(self, root: Path):
        """Whether a round under ``root`` records this group (logged when not)."""

        def accept(rnd: int) -> bool:
            try:
                group = C.read_identity(C.round_dir(root, rnd)).get(GROUP)
            except CheckpointError as exc:
                log.warning("checkpoint refused: %s", exc)
                return False
            if group != self.place.group:
                log.warning(
                    "checkpoint refused: %s records group %s, not %s",
                    C.round_dir(root, rnd),
                    group,
                    self.place.group,
                )
            return group == self.place.group

        return accept
