"""Server-side math on full arrays: weighted mean, outliers, trimmed mean, the wire format.

The checks of the replies themselves are in test_strategy_replies.py."""

from __future__ import annotations

import numpy as np
import pytest

from flower_shard.flower.server.aggregation import (
    norm_outliers,
    trimmed_mean,
    update_norms,
    weighted_mean,
)
from flower_shard.flower.wire import describe, pack, unpack


def model(value: float) -> dict[str, np.ndarray]:
    return {"a": np.full((2, 3), value, np.float32), "b": np.full(4, -value, np.float32)}


def test_packed_weights_round_trip_bit_exactly_and_name_each_problem():
    m = {"b": np.arange(4, dtype=np.float32) / 3, "a": np.random.default_rng(0).random((2, 3))}
    m["a"] = m["a"].astype(np.float32)
    expected = describe(m)
    flat = pack(m)
    assert flat.dtype == np.float32 and flat.shape == (10,)
    assert np.array_equal(flat[:6], m["a"].reshape(-1))  # sorted names: a, then b
    reason, back = unpack({"packed": flat}, expected)
    assert reason is None and all(np.array_equal(back[k], m[k]) for k in m)
    assert "missing" in unpack({}, expected)[0]
    assert "unexpected" in unpack({"packed": flat, "x": flat}, expected)[0]
    assert "shape" in unpack({"packed": flat[:-1]}, expected)[0]
    assert "dtype" in unpack({"packed": flat.astype(np.float64)}, expected)[0]


def test_weighted_mean_is_exact_in_float64():
    mean = weighted_mean([model(1.0), model(4.0)], [1, 2])
    assert np.array_equal(mean["a"], np.full((2, 3), 3.0, np.float32))
    assert mean["a"].dtype == np.float32


def test_norm_outliers_leave_one_out():
    g = model(0.0)
    norms = update_norms([model(1.0), model(1.1), model(1e4)], g)
    assert norms[0] == pytest.approx(np.sqrt(6 + 4))
    assert set(norm_outliers(norms, 10.0)) == {2}
    # With two groups the large one is still caught; the small one is not.
    assert set(norm_outliers(norms[1:], 10.0)) == {1}
    assert norm_outliers(norms, 0.0) == {} and norm_outliers(norms[:1], 10.0) == {}
    assert "the limit is 10x" in norm_outliers(norms, 10.0)[2]


def test_trimmed_mean_drops_the_extremes():
    models = [model(v) for v in (1.0, 2.0, 3.0, 4.0, 1000.0)]
    out = trimmed_mean(models, 0.2)  # drop 1 low and 1 high per coordinate
    assert np.array_equal(out["a"], np.full((2, 3), 3.0, np.float32))
    assert np.array_equal(out["b"], np.full(4, -3.0, np.float32))
    # Too few groups to trim: the plain mean.
    assert np.array_equal(trimmed_mean(models[:2], 0.2)["a"], np.full((2, 3), 1.5, np.float32))
