"""Server-side math on full arrays, as pure functions: validation, weighted mean, outer step.

The outer step is the group runtime's own :class:`~flower_shard.outer_sync.OuterOptimizer`,
applied here to the whole model flattened in a fixed key order.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

Arrays = Mapping[str, np.ndarray]


def describe(arrays: Arrays) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype) of a model: what every reply must match."""
    return {k: (tuple(v.shape), str(v.dtype)) for k, v in arrays.items()}


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
