"""One rank's batches as torch tensors: the only module of :mod:`flower_shard.data` with torch."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from flower_shard.config import ConfigError
from flower_shard.config import choices as C
from flower_shard.data.corpus import load_blocks
from flower_shard.data.partition import partition_data


class BatchIterator:
    """Endless batches of one rank's blocks: a fresh seeded shuffle of its part every epoch.

    The position (epoch, index) is plain state, so a checkpoint can resume it exactly.
    """

    def __init__(
        self, blocks: np.ndarray, indices: np.ndarray, batch_size: int, seed: Sequence[int]
    ):
        if len(indices) < batch_size:
            raise ConfigError(
                f"a rank's data part has {len(indices)} blocks, fewer than --batch-size "
                f"{batch_size}; use a smaller batch, a shorter --seq-len or more data"
            )
        self.blocks, self.indices, self.batch_size = blocks, indices, batch_size
        self.seed = [int(s) for s in seed]
        self.epoch, self.position = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> np.ndarray:
        rng = np.random.default_rng([*self.seed, self.epoch])
        return self.indices[rng.permutation(len(self.indices))]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.position + self.batch_size > len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._shuffle()
        rows = np.sort(self._order[self.position : self.position + self.batch_size])
        self.position += self.batch_size
        batch = torch.from_numpy(self.blocks[rows].astype(np.int64))
        return batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._shuffle()


def rank_batches(
    directory: str | os.PathLike,
    seq_len: int,
    batch_size: int,
    groups: int,
    group_size: int,
    group: int,
    rank_in_group: int,
    seed: int,
    *,
    how: str = C.IID,
    label: str | None = None,
    alpha: float = 0.5,
) -> BatchIterator:
    """The training batches of one rank; ``how``, ``label`` and ``alpha`` are ``--partition``,
    ``--partition-label`` and ``--dirichlet-alpha`` (see :func:`partition_data`)."""
    blocks = load_blocks(directory, "train", seq_len)
    parts = partition_data(
        directory, seq_len, groups, group_size, seed, how, label, alpha, batch_size
    )
    indices = parts[group][rank_in_group]
    return BatchIterator(blocks, indices, batch_size, seed=[seed, group, rank_in_group])


def eval_shard(
    directory: str | os.PathLike, seq_len: int, n_sequences: int, rank: int, world_size: int
) -> np.ndarray:
    """This rank's share of the first ``n_sequences`` held-out blocks (strided over all ranks).

    The evaluated set is the same whatever the topology; only its split over ranks changes.
    """
    blocks = load_blocks(directory, "eval", seq_len)
    return blocks[: min(n_sequences, len(blocks))][rank::world_size]
