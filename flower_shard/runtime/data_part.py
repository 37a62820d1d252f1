"""The data a rank works on: its part of the training corpus and its share of the held-out set."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flower_shard.config import TrainConfig
from flower_shard.data.batches import BatchIterator, eval_shard, rank_batches
from flower_shard.data.corpus import CorpusInfo
from flower_shard.runtime.distributed import world_sum
from flower_shard.runtime.placement import Placement


@dataclass
class DataPart:
    """One rank's data, chosen by its :class:`~flower_shard.runtime.placement.Placement`.

    The training corpus is split into G group parts and each group part into K rank parts
    (``--partition``), so the groups train on disjoint data whichever world they live in. The
    held-out set is the same for every topology; its blocks are strided over this world's ranks.
    """

    corpus: CorpusInfo
    batches: BatchIterator
    """Endless training batches; its position is checkpointed."""
    eval_blocks: np.ndarray
    """This rank's held-out blocks."""
    eval_total: int
    """Held-out blocks over all ranks of this world."""

    @classmethod
    def load(cls, data_dir: str | Path, cfg: TrainConfig, place: Placement) -> DataPart:
        """Every rank (it sums the held-out blocks over the world): this rank's part of the
        corpus prepared in ``data_dir``."""
        batches = rank_batches(
            data_dir,
            cfg.seq_len,
            cfg.batch_size,
            place.groups,
            place.group_size,
            place.group,
            place.rank_in_group,
            cfg.seed,
            how=cfg.partition,
            label=cfg.partition_label,
            alpha=cfg.dirichlet_alpha,
        )
        blocks = eval_shard(data_dir, cfg.seq_len, cfg.eval_sequences, place.rank, place.world)
        total = int(world_sum(len(blocks), place.device))
        return cls(CorpusInfo.load(data_dir), batches, blocks, total)
