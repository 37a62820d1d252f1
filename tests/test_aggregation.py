"""Server-side math on full arrays: weighted mean, update norms, clipping, trimmed mean, the
robust rules' decisions, the wire format.

The checks of the replies themselves are in test_strategy_replies.py; hostile rounds through
the transport in test_robust_aggregation.py."""

from __future__ import annotations

import numpy as np
import pytest

from flower_shard.flower.server.aggregation import (
    Norms,
    clip_delta,
    clip_update,
    trim_count,
    trimmed_mean,
    update_norms,
    weighted_mean,
)
from flower_shard.flower.server.robust import RobustRules, Update
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


def test_update_norms_and_clipping_are_exact():
    g = model(0.0)
    norms = update_norms([model(1.0), model(-2.0)], g)
    assert norms == [Norms(np.sqrt(6 + 4), 1.0), Norms(2 * np.sqrt(10), 2.0)]
    clipped = clip_update(model(3.0), g, 0.5, 2.0)  # clamp to +-2, then halve
    assert np.array_equal(clipped["a"], np.full((2, 3), 1.0)) and clipped["a"].dtype == np.float64
    assert np.array_equal(clipped["b"], np.full(4, -1.0))
    assert np.array_equal(clip_delta(np.array([3.0, -0.5], np.float32), 1.0, None), [3.0, -0.5])


def test_the_norm_rule_is_leave_one_out_on_the_weighted_norm():
    """Equal weights: the old rule (an update above 10x the median of the OTHER groups' is out),
    with two groups too; the reason names the limit."""

    def judge(norms, factor=10.0):
        return RobustRules(factor).judge([Update(64.0, 1, n, n / 10) for n in norms]).rejected

    norms = [float(np.sqrt(10)), 1.1 * float(np.sqrt(10)), 1e4 * float(np.sqrt(10))]
    assert set(judge(norms)) == {2}
    assert set(judge(norms[1:])) == {1}  # of two, the large one goes; the small one stays
    assert judge(norms, 0.0) == {} and judge(norms[:1]) == {}
    assert "the limit is 10x" in judge(norms)[2]


def test_trimmed_mean_drops_the_extremes_and_weights_the_rest():
    models = [model(v) for v in (1.0, 2.0, 3.0, 4.0, 1000.0)]
    out = trimmed_mean(models, [1] * 5, 0.2)  # drop 1 low and 1 high per coordinate
    assert np.array_equal(out["a"], np.full((2, 3), 3.0, np.float32))
    assert np.array_equal(out["b"], np.full(4, -3.0, np.float32))
    # The weights of the values kept: 2, 3, 4 with 1, 1, 2 -> 13 / 4. A huge weight on an
    # extreme value does not keep it in.
    out = trimmed_mean(models, [1, 1, 1, 2, 10**9], 0.2)
    assert np.array_equal(out["a"], np.full((2, 3), 3.25, np.float32))
    assert [trim_count(g, 0.2) for g in (3, 4, 5, 9, 10, 11)] == [1, 1, 1, 1, 2, 2]
    assert [trim_count(g, 0.49) for g in (3, 4, 5, 7)] == [1, 1, 2, 3]
    assert trim_count(3, 0.0) == 1  # asked to trim: at least one group each side
    with pytest.raises(ValueError, match="needs 3 or more groups"):
        trimmed_mean(models[:2], [1, 1], 0.2)
