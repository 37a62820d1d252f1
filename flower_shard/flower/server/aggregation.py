"""Server-side math on full arrays, as pure functions: weighted and robust means, outliers.

The outer step is the group runtime's own
:class:`~flower_shard.runtime.outer_optimizer.OuterOptimizer`, applied to the whole model
flattened in a fixed key order (:mod:`flower_shard.flower.wire`).
The replies are checked before any of this runs (:mod:`flower_shard.flower.server.replies`).
"""

from __future__ import annotations

import numpy as np

from flower_shard.flower.wire import Arrays


def weighted_mean(models: list[Arrays], weights: list[float]) -> dict[str, np.ndarray]:
    """sum_i w_i x_i / sum_i w_i per array, accumulated in float64, returned in float32."""
    total = float(sum(weights))
    out = {}
    for name in models[0]:
        acc = np.zeros(models[0][name].shape, dtype=np.float64)
        for model, w in zip(models, weights):
            acc += float(w) * model[name].astype(np.float64)
        out[name] = (acc / total).astype(np.float32)
    return out


def update_norms(models: list[Arrays], global_weights: Arrays) -> list[float]:
    """||x_g - global|| over all arrays of each group (float64)."""
    norms = []
    for model in models:
        sq = sum(
            float(np.sum((model[k].astype(np.float64) - global_weights[k]) ** 2))
            for k in global_weights
        )
        norms.append(sq**0.5)
    return norms


def norm_outliers(norms: list[float], factor: float) -> dict[int, str]:
    """Groups whose update is more than ``factor`` x the median of the OTHER groups' updates.

    Leave-one-out, so that with two groups the large one is caught (a plain median of two
    would sit halfway). ``factor`` <= 0, or a single group, disables the rule.
    """
    out = {}
    if factor <= 0 or len(norms) < 2:
        return out
    for i, n in enumerate(norms):
        ref = float(np.median([m for j, m in enumerate(norms) if j != i]))
        if n > factor * max(ref, 1e-12):
            out[i] = (
                f"update norm {n:.3g} is {n / max(ref, 1e-12):.1f}x the median of the "
                f"other groups ({ref:.3g}); the limit is {factor:g}x"
            )
    return out


def trimmed_mean(models: list[Arrays], trim_fraction: float) -> dict[str, np.ndarray]:
    """Coordinate-wise mean after dropping the floor(trim x G) lowest and highest values."""
    k = int(trim_fraction * len(models))
    if k == 0 or len(models) - 2 * k < 1:
        return weighted_mean(models, [1.0] * len(models))
    out = {}
    for name in models[0]:
        stacked = np.sort(np.stack([m[name].astype(np.float64) for m in models]), axis=0)
        out[name] = stacked[k : len(models) - k].mean(axis=0).astype(np.float32)
    return out
