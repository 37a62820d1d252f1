"""How the training blocks are split between groups and ranks (``--partition``).

See :mod:`flower_shard.data` for the rules of ``iid``, ``by-source`` and ``dirichlet``.
"""

from __future__ import annotations

import os

import numpy as np

from flower_shard.config import ConfigError
from flower_shard.config import choices as C
from flower_shard.data.corpus import load_blocks, load_documents

DIRICHLET_ATTEMPTS = 10  # draws before giving up on every group getting enough blocks


def partition(n_blocks: int, groups: int, group_size: int, seed: int) -> list[list[np.ndarray]]:
    """Block indices of every (group, rank): ``parts[g][k]``.

    A seeded permutation of all blocks is split into G contiguous parts, each into K parts.
    The parts are disjoint and together hold every block; sizes differ by at most one.
    """
    if n_blocks < groups * group_size:
        raise ConfigError(
            f"only {n_blocks} training blocks for {groups * group_size} ranks; use a shorter "
            "--seq-len, fewer ranks or more data"
        )
    perm = np.random.default_rng(seed).permutation(n_blocks)
    return [list(np.array_split(part, group_size)) for part in np.array_split(perm, groups)]


def block_documents(starts: np.ndarray, n_blocks: int, seq_len: int) -> np.ndarray:
    """For each block of ``seq_len + 1`` tokens, the document that holds its first token."""
    first = np.arange(n_blocks, dtype=np.int64) * (seq_len + 1)
    return np.searchsorted(starts, first, side="right") - 1


def by_source_groups(sources: np.ndarray, groups: int) -> list[np.ndarray]:
    """Block indices of each group when every source goes whole to one group.

    ``sources[b]`` is block b's source id. Sources are placed largest first (most blocks; ties
    by id, i.e. by name), each onto the group with the fewest blocks so far (ties: the lowest
    group): the longest-processing-time rule, deterministic and without a seed.

    Raises
    ------
    ConfigError
        Fewer sources hold training blocks than there are groups.
    """
    ids, counts = np.unique(sources, return_counts=True)
    if len(ids) < groups:
        raise ConfigError(
            f"--partition by-source: the training blocks come from {len(ids)} source(s) "
            f"(top-level directories or files), fewer than the {groups} groups; use at most "
            f"{len(ids)} groups or --partition dirichlet"
        )
    owner = np.empty(int(ids.max()) + 1, dtype=np.int64)
    load = [0] * groups
    for i in sorted(range(len(ids)), key=lambda i: (-counts[i], ids[i])):
        g = min(range(groups), key=lambda g: (load[g], g))
        owner[ids[i]] = g
        load[g] += int(counts[i])
    of_block = owner[sources]
    return [np.flatnonzero(of_block == g) for g in range(groups)]


def dirichlet_groups(
    labels: np.ndarray, groups: int, alpha: float, seed: int, min_blocks: int = 1
) -> list[np.ndarray]:
    """Block indices of each group, label by label in Dirichlet(alpha) proportions.

    ``labels[b]`` is block b's label id. With one generator ``np.random.default_rng(seed)``:
    for each label in sorted order, draw p ~ Dirichlet(alpha x ones(G)) and cut the label's
    blocks (in stream order) at ``floor(cumsum(p)[:-1] * n_label)``: group g gets the g-th
    piece. As flwr-datasets' DirichletPartitioner (without self-balancing), when a group ends
    with fewer than ``min_blocks`` blocks, every label is drawn again (the generator goes on).

    Raises
    ------
    ConfigError
        After :data:`DIRICHLET_ATTEMPTS` draws some group still had fewer than ``min_blocks``.
    """
    rng = np.random.default_rng(seed)
    order = np.argsort(labels, kind="stable")  # blocks grouped by label, stream order inside
    classes, first = np.unique(labels[order], return_index=True)
    by_label = np.split(order, first[1:])
    smallest = 0
    for _ in range(DIRICHLET_ATTEMPTS):
        pieces: list[list[np.ndarray]] = [[] for _ in range(groups)]
        for blocks in by_label:
            p = rng.dirichlet(np.full(groups, float(alpha)))
            cuts = (np.cumsum(p) * len(blocks)).astype(np.int64)[:-1]
            for g, piece in enumerate(np.split(blocks, cuts)):
                pieces[g].append(piece)
        parts = [np.sort(np.concatenate(p)) for p in pieces]
        smallest = min(len(p) for p in parts)
        if smallest >= min_blocks:
            return parts
    raise ConfigError(
        f"--dirichlet-alpha {alpha}: {DIRICHLET_ATTEMPTS} draws over {len(classes)} label(s) "
        f"all left a group with fewer than {min_blocks} blocks (last: {smallest}); raise "
        "--dirichlet-alpha, use fewer groups or a smaller --batch-size"
    )


def split_ranks(parts: list[np.ndarray], group_size: int, seed: int) -> list[list[np.ndarray]]:
    """Cut each group's blocks into ``group_size`` disjoint parts (sizes differ by at most one)
    after a permutation seeded with ``[seed, group]``."""
    out = []
    for g, part in enumerate(parts):
        perm = np.random.default_rng([seed, g]).permutation(len(part))
        out.append(list(np.array_split(part[perm], group_size)))
    return out


def partition_data(
    directory: str | os.PathLike,
    seq_len: int,
    groups: int,
    group_size: int,
    seed: int,
    how: str = C.IID,
    label: str | None = None,
    alpha: float = 0.5,
    min_rank_blocks: int = 1,
) -> list[list[np.ndarray]]:
    """Block indices of every (group, rank) of a prepared corpus: ``parts[g][k]``.

    ``how`` is ``--partition`` (see the module's docstring); ``iid`` is :func:`partition`.
    ``min_rank_blocks`` (the batch size) makes ``dirichlet`` draw again until every group holds
    at least ``group_size x min_rank_blocks`` blocks.
    """
    n_blocks = len(load_blocks(directory, "train", seq_len))
    if how == C.IID:
        return partition(n_blocks, groups, group_size, seed)
    docs = load_documents(directory)
    of_block = block_documents(docs.starts, n_blocks, seq_len)
    if how == C.BY_SOURCE:
        parts = by_source_groups(docs.source_ids[of_block], groups)
    elif how == C.DIRICHLET:
        if label is None:
            raise ConfigError("--partition dirichlet needs --partition-label")
        labels = docs.labels_for(label)[of_block]
        parts = dirichlet_groups(labels, groups, alpha, seed, group_size * min_rank_blocks)
    else:
        raise ConfigError(f"--partition {how!r} is unknown; choose iid, by-source or dirichlet")
    return split_ranks(parts, group_size, seed)
