"""Server-side math on full arrays, as pure functions: weighted and trimmed means, update norms,
clipping.

Nothing here can overflow on finite inputs: weights are rescaled by one power of two before use
(:func:`scaled_weights`: exact, so a mean is bit-identical to ``sum w x / sum w`` computed
directly whenever that does not overflow) and sums run in float64 over float32 values. The
rules that decide the weights and the clipping are :mod:`~flower_shard.flower.server.robust`'s;
the replies are checked before any of this runs (:mod:`~flower_shard.flower.server.replies`).
The outer step is the group runtime's own
:class:`~flower_shard.runtime.outer_optimizer.OuterOptimizer`, applied to the whole model
flattened in a fixed key order (:mod:`flower_shard.flower.wire`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from flower_shard.flower.wire import Arrays

FOLD_CHUNK = 1 << 22
"""Values of one array that the weighted mean folds at once (bounds its float64 temporaries)."""
TRIM_CHUNK = 1 << 20
"""Values per array that the trimmed mean sorts at once (bounds its memory: ~5 x G x 8 bytes
per value)."""


def scaled_weights(weights: Sequence[float]) -> np.ndarray:
    """The weights as float64, all divided by one power of two so that the largest is in
    [0.5, 1): the ratios are exact, and a sum of G weighted float32 values cannot overflow.

    Raises
    ------
    ValueError
        A weight that is not a number (a bool, a string), not finite, or negative; no weight
        above 0.
    """
    values = []
    for w in weights:
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, float, np.number)):
            raise ValueError(f"a weight must be a number, got {type(w).__name__} {w!r}")
        w = int(w) if isinstance(w, (int, np.integer)) else float(w)
        if not (isinstance(w, int) or math.isfinite(w)) or w < 0:
            raise ValueError(f"weights must be finite and >= 0, got {w!r}")
        values.append(w)
    if not any(w > 0 for w in values):
        raise ValueError(f"at least one weight must be above 0, got {values}")
    top = max(values)
    # top / 2**e is in [0.5, 1): an int's bit length, a float's binary exponent.
    e = top.bit_length() if isinstance(top, int) else math.frexp(top)[1]
    scaled = [w / (1 << e) if isinstance(w, int) and e >= 0 else math.ldexp(w, -e) for w in values]
    return np.array(scaled, dtype=np.float64)


def weighted_mean(models: Sequence[Arrays], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """sum_i w_i x_i / sum_i w_i per array, accumulated in float64, returned in float32.

    The weights are :func:`scaled_weights` (exact rescaling), so any finite weights work, and
    the result is the same bits as the direct formula wherever that one does not overflow.
    """
    order = list(models[0])
    return _named(weighted_mean_flat(models, weights, order), models[0], order)


def weighted_mean_flat(
    models: Sequence[Arrays], weights: Sequence[float], order: Sequence[str]
) -> np.ndarray:
    """:func:`weighted_mean` as one flat float32 vector, the arrays concatenated in ``order``.

    Each array of each model is read once (a spooled reply is read from disk then), folded
    slice by slice into one float64 accumulator the size of that array: the memory is the
    result, the largest array twice over and a slice, whatever the number of models.
    """
    scaled = scaled_weights(weights)
    total = math.fsum(scaled)
    out = np.empty(sum(int(np.prod(models[0][k].shape)) for k in order), dtype=np.float32)
    at = 0
    for name in order:
        acc = None
        for model, w in zip(models, scaled):
            values = model[name].reshape(-1)
            if acc is None:
                acc = np.zeros(values.size, dtype=np.float64)
            for s in range(0, values.size, FOLD_CHUNK):
                acc[s : s + FOLD_CHUNK] += w * values[s : s + FOLD_CHUNK].astype(np.float64)
            del values
        for s in range(0, acc.size, FOLD_CHUNK):
            out[at + s : at + min(acc.size, s + FOLD_CHUNK)] = acc[s : s + FOLD_CHUNK] / total
        at += acc.size
    return out


def _named(flat: np.ndarray, like: Arrays, order: Sequence[str]) -> dict[str, np.ndarray]:
    """Views of ``flat`` shaped like ``like``'s arrays, in ``order``."""
    out, at = {}, 0
    for k in order:
        shape = like[k].shape
        n = int(np.prod(shape))
        out[k] = flat[at : at + n].reshape(shape)
        at += n
    return out


def trim_count(groups: int, fraction: float) -> int:
    """Groups dropped at EACH end of every coordinate: ``max(1, floor(fraction x G))``, at most
    as many as leave one value.

    Raises
    ------
    ValueError
        Fewer than 3 groups: nothing is left once one group is dropped at each end.
    """
    if groups < 3:
        raise ValueError(
            f"trimmed-mean drops at least one group at each end of every coordinate: it needs "
            f"3 or more groups, this round has {groups}"
        )
    return min(max(1, math.floor(fraction * groups)), (groups - 1) // 2)


def trimmed_mean(
    models: Sequence[Arrays], weights: Sequence[float], trim_fraction: float
) -> dict[str, np.ndarray]:
    """Coordinate-wise trimmed mean, weighted.

    For every coordinate, the values of the G groups are sorted and the :func:`trim_count`
    lowest and highest are dropped whatever their weights (a large weight cannot shield an
    extreme value); the values left are averaged with their groups' weights (each coordinate
    renormalised by the weights of the groups it kept). Equal weights give the plain trimmed
    mean. Ties are broken by group order.

    Raises
    ------
    ValueError
        Fewer than 3 groups (:func:`trim_count`), or a weight that is not > 0.
    """
    order = list(models[0])
    return _named(trimmed_mean_flat(models, weights, trim_fraction, order), models[0], order)


def trimmed_mean_flat(
    models: Sequence[Arrays], weights: Sequence[float], trim_fraction: float, order: Sequence[str]
) -> np.ndarray:
    """:func:`trimmed_mean` as one flat float32 vector, the arrays concatenated in ``order``
    (each coordinate needs every group's value: it holds every model's slice of
    :data:`TRIM_CHUNK` values at once)."""
    k = trim_count(len(models), trim_fraction)
    scaled = scaled_weights(weights)
    if not (scaled > 0).all():
        raise ValueError("trimmed-mean needs every weight above 0")
    out = np.empty(sum(int(np.prod(models[0][n].shape)) for n in order), dtype=np.float32)
    at = 0
    for name in order:
        flat = [m[name].reshape(-1) for m in models]
        result = out[at : at + flat[0].size]
        for start in range(0, flat[0].size, TRIM_CHUNK):
            part = np.stack([f[start : start + TRIM_CHUNK].astype(np.float64) for f in flat])
            rank = np.argsort(part, axis=0, kind="stable")[k : len(models) - k]
            kept = np.take_along_axis(part, rank, axis=0)
            w = scaled[rank]
            result[start : start + TRIM_CHUNK] = (kept * w).sum(axis=0) / w.sum(axis=0)
        at += flat[0].size
        del flat
    return out


@dataclass(frozen=True)
class Norms:
    """The size of one update (``trained - global``, or a decoded pseudo-gradient)."""

    l2: float
    """Its Euclidean norm over the whole model."""
    linf: float
    """Its largest coordinate, in absolute value."""


def update_norms(models: list[Arrays], global_weights: Arrays) -> list[Norms]:
    """The :class:`Norms` of ``x_g - global`` over all arrays of each group (float64)."""
    out = []
    for model in models:
        sq, peak = 0.0, 0.0
        for k in global_weights:
            d = model[k].astype(np.float64) - global_weights[k]
            sq += float(np.dot(d.reshape(-1), d.reshape(-1)))
            peak = max(peak, float(np.abs(d).max(initial=0.0)))
        out.append(Norms(math.sqrt(sq), peak))
    return out


def delta_norms(delta: np.ndarray) -> Norms:
    """The :class:`Norms` of a flat pseudo-gradient (float64)."""
    d = delta.astype(np.float64).reshape(-1)
    return Norms(math.sqrt(float(np.dot(d, d))), float(np.abs(d).max(initial=0.0)))


def clip_delta(delta: np.ndarray, scale: float, bound: float | None) -> np.ndarray:
    """``scale x clamp(delta, -bound, bound)`` in float64 (``bound`` None: no clamp)."""
    d = delta.astype(np.float64)
    if bound is not None:
        np.clip(d, -bound, bound, out=d)
    return d * scale


def clip_update(
    model: Arrays, global_weights: Arrays, scale: float, bound: float | None
) -> Mapping[str, np.ndarray]:
    """The model whose update is :func:`clip_delta` of ``model``'s: ``global + scale x
    clamp(model - global, -bound, bound)`` per array, float64, each array computed when read
    (a mean over clipped replies then holds one clipped array at a time, not whole models)."""
    return LazyArrays(
        list(global_weights),
        lambda k: (
            global_weights[k]
            + clip_delta(model[k].astype(np.float64) - global_weights[k], scale, bound)
        ),
    )


class LazyArrays(Mapping):
    """Named arrays computed when read (``compute(name)``), never kept: a mean over G such
    models holds one computed array at a time."""

    def __init__(self, names: Sequence[str], compute: Callable[[str], np.ndarray]):
        self.names, self.compute = list(names), compute

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.names:
            raise KeyError(name)
        return self.compute(name)

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
