"""Server-side math on full arrays, as pure functions: validation, weighted mean, outer step.

The outer step is the group runtime's own :class:`~flower_shard.runtime.outer_sync.OuterOptimizer`,
applied here to the whole model flattened in a fixed key order.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

Arrays = Mapping[str, np.ndarray]


def describe(arrays: Arrays) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype) of a model: what every reply must match."""
    return {k: (tuple(v.shape), str(v.dtype)) for k, v in arrays.items()}


def pack(arrays: Arrays) -> np.ndarray:
    """Every array, flattened and concatenated in sorted-name order, as one float32 vector.

    The flower transport's wire format: one Array per message instead of one per tensor, so
    Flower's per-object costs (a request and a hash at every hop) are paid a few times per
    message, not hundreds."""
    return np.concatenate(
        [np.ascontiguousarray(arrays[k], dtype=np.float32).reshape(-1) for k in sorted(arrays)]
    )


def unpack(
    arrays: Arrays, expected: Mapping[str, tuple[tuple[int, ...], str]]
) -> tuple[str | None, dict[str, np.ndarray]]:
    """(why a packed reply cannot be used, {}) or (None, its named arrays): exactly one
    1-D float32 array named ``packed`` holding every expected value, cut in sorted order."""
    from flower_shard.protocol import PACKED

    if PACKED not in arrays:
        return f"missing arrays [{PACKED!r}]", {}
    if len(arrays) > 1:
        return f"unexpected arrays {sorted(set(arrays) - {PACKED})[:3]}", {}
    flat = arrays[PACKED]
    numel = sum(int(np.prod(shape)) for shape, _ in expected.values())
    if flat.ndim != 1 or flat.size != numel:
        return f"wrong shape: packed weights {tuple(flat.shape)}, expected ({numel},)", {}
    if flat.dtype != np.float32:
        return f"packed weights have dtype {flat.dtype}, expected float32", {}
    return None, unflatten_flat(flat, expected, sorted(expected))


def check_arrays(arrays: Arrays, expected: Mapping[str, tuple[tuple[int, ...], str]]) -> str | None:
    """Why a group's weights cannot be used, or None if they can.

    Checks, in order: missing keys, extra keys, shapes, dtypes, non-finite values.
    """
    missing = sorted(set(expected) - set(arrays))
    if missing:
        return f"missing arrays {missing[:3]}{'...' if len(missing) > 3 else ''}"
    extra = sorted(set(arrays) - set(expected))
    if extra:
        return f"unexpected arrays {extra[:3]}{'...' if len(extra) > 3 else ''}"
    for name, (shape, dtype) in expected.items():
        a = arrays[name]
        if tuple(a.shape) != shape:
            return f"{name} has shape {tuple(a.shape)}, expected {shape}"
        if str(a.dtype) != dtype:
            return f"{name} has dtype {a.dtype}, expected {dtype}"
    for name, a in arrays.items():
        if not np.isfinite(a).all():
            return f"{name} has non-finite values"
    return None


def check_weight(value) -> str | None:
    """Why a reported token count cannot weight the average, or None."""
    if not isinstance(value, (int, float)) or not np.isfinite(value) or value <= 0:
        return f"num-tokens must be a finite number > 0, got {value!r}"
    return None


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


def flatten(arrays: Arrays, order: list[str]):
    import torch

    return torch.cat([torch.from_numpy(np.ascontiguousarray(arrays[k])).reshape(-1) for k in order])


def unflatten(flat, like: Arrays, order: list[str]) -> dict[str, np.ndarray]:
    out, offset = {}, 0
    flat = flat.detach().cpu().numpy()
    for k in order:
        n = like[k].size
        out[k] = flat[offset : offset + n].reshape(like[k].shape).copy()
        offset += n
    return out


def unflatten_flat(
    flat: np.ndarray, expected: dict[str, tuple[tuple[int, ...], str]], order: list[str]
) -> dict[str, np.ndarray]:
    """A flat numpy vector cut into named arrays of the ``expected`` shapes, in ``order``."""
    out, offset = {}, 0
    for k in order:
        shape = expected[k][0]
        n = int(np.prod(shape))
        out[k] = flat[offset : offset + n].reshape(shape)
        offset += n
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
