"""Compressed exchange: the formats, error feedback, validation, and the outer step from deltas."""

from __future__ import annotations

import pytest
import torch

from flower_shard.config import ConfigError, TrainConfig
from flower_shard.runtime import compression as Z
from flower_shard.runtime.outer_optimizer import OuterOptimizer


def test_int8_matches_a_hand_computed_chunk():
    values = torch.tensor([0.0, 1.27, -0.635, 0.3, 2.0, -1.0, 0.0])
    payload = Z.compress(values, "int8", chunk=4)
    # chunk 1: max |v| = 1.27 -> scale 0.01; chunk 2 (padded with a zero): max 2.0 -> 2/127
    s1, s2 = torch.tensor(1.27) / 127, torch.tensor(2.0) / 127
    assert torch.equal(payload[Z.SCALES], torch.stack([s1, s2]))
    expected_q = [0, 127, round(-0.635 / s1.item()), round(0.3 / s1.item()), 127, -64, 0]
    assert payload[Z.DATA].tolist() == expected_q
    assert payload[Z.DATA].dtype == torch.int8
    decoded = Z.decompress(payload, "int8", 4)
    assert torch.equal(decoded[:4], payload[Z.DATA][:4].float() * s1)
    assert torch.equal(decoded[4:], payload[Z.DATA][4:].float() * s2)
    # Round to nearest: off by at most half a step.
    assert (decoded - values).abs().max() <= max(s1, s2) / 2


def test_bf16_is_torch_bfloat16_bits_and_zero_chunks_decode_to_zero():
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    payload = Z.compress(values, "bf16", 64)
    assert payload[Z.DATA].dtype == torch.int16
    assert torch.equal(Z.decompress(payload, "bf16", 64), values.to(torch.bfloat16).float())
    zeros = Z.compress(torch.zeros(10), "int8", 4)
    assert torch.equal(zeros[Z.SCALES], torch.zeros(3))
    assert torch.equal(Z.decompress(zeros, "int8", 4), torch.zeros(10))


@pytest.mark.parametrize("kind", Z.KINDS)
def test_bytes_round_trip_and_sizes(kind):
    values = torch.randn(5000, generator=torch.Generator().manual_seed(1)) * 1e-3
    payload = Z.compress(values, kind, 2048)
    raw = Z.to_bytes(payload)
    assert raw.dtype == torch.uint8 and raw.numel() == Z.payload_bytes(kind, 5000, 2048)
    back = Z.from_bytes(raw, kind, 5000, 2048)
    assert all(torch.equal(back[k], payload[k]) for k in payload)
    assert Z.payload_bytes(kind, 5000, 2048) == {"none": 20000, "bf16": 10000, "int8": 5012}[kind]


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_error_feedback_loses_nothing_only_delays(kind):
    gen = torch.Generator().manual_seed(2)
    ef = Z.ErrorFeedback(kind, 256, 3000)
    sent, inputs = torch.zeros(3000, dtype=torch.float64), torch.zeros(3000, dtype=torch.float64)
    for _ in range(5):
        delta = torch.randn(3000, generator=gen) * 1e-2
        before = ef.residual.clone()
        decoded = Z.decompress(ef.compress(delta), kind, 256)
        # Bit for bit: what was sent plus what is kept is what there was to send.
        assert torch.equal(decoded + ef.residual, delta + before)
        sent += decoded.double()
        inputs += delta.double()
    # Over rounds, the sent total trails the true total by exactly the residual (up to f64 sums).
    assert torch.allclose(sent + ef.residual.double(), inputs, atol=1e-9)
    assert ef.residual.abs().max() > 0

    plain = Z.ErrorFeedback(kind, 256, 3000, enabled=False)
    delta = torch.randn(3000, generator=gen)
    alone = Z.decompress(Z.compress(delta, kind, 256), kind, 256)
    assert torch.equal(Z.decompress(plain.compress(delta), kind, 256), alone)
    assert plain.residual.numel() == 0


def test_a_diverged_delta_does_not_poison_the_residual():
    ef = Z.ErrorFeedback("int8", 4, 8)
    ef.compress(torch.full((8,), 0.3) * torch.arange(8))
    assert ef.residual.abs().max() > 0
    diverged = torch.ones(8)
    diverged[5] = float("nan")
    assert Z.check_payload(ef.compress(diverged), "int8", 8, 4) is not None
    assert torch.equal(ef.residual, torch.zeros(8))


def test_check_payload_names_the_problem():
    good = Z.compress(torch.ones(10), "int8", 4)
    assert Z.check_payload(good, "int8", 10, 4) is None
    assert "expected" in Z.check_payload({Z.DATA: good[Z.DATA]}, "int8", 10, 4)
    wrong_dtype = dict(good, **{Z.DATA: good[Z.DATA].to(torch.int16)})
    assert "torch.int16" in Z.check_payload(wrong_dtype, "int8", 10, 4)
    assert "(9,)" in Z.check_payload(dict(good, **{Z.DATA: good[Z.DATA][:9]}), "int8", 10, 4)
    nan_scale = dict(good, **{Z.SCALES: torch.tensor([float("nan"), 1.0, 1.0])})
    assert "non-finite" in Z.check_payload(nan_scale, "int8", 10, 4)
    # A delta that diverged makes its own payload refused (bf16 keeps the NaN, int8 its scale).
    diverged = torch.ones(10)
    diverged[3] = float("inf")
    for kind in ("bf16", "int8", "none"):
        assert "non-finite" in Z.check_payload(Z.compress(diverged, kind, 4), kind, 10, 4)


def test_outer_step_from_a_pseudo_gradient_equals_the_step_from_the_mean():
    gen = torch.Generator().manual_seed(3)
    w0, means = torch.randn(100, generator=gen), [torch.randn(100, generator=gen) for _ in range(3)]
    for kind in ("fedavg", "nesterov"):
        by_mean = OuterOptimizer(w0, kind, 0.7, 0.9)
        by_delta = OuterOptimizer(w0, kind, 0.7, 0.9, track_weights=True)
        for mean in means:
            a = by_mean.step(mean).clone()
            b = by_delta.apply(by_delta.weights.detach() - mean).clone()
            if kind == "nesterov":  # the same SGD step on the same gradient
                assert torch.equal(a, b)
            else:  # w - (w - mean) is the mean up to one rounding
                assert torch.allclose(a, b, atol=1e-6) and not torch.equal(b, w0)
        state = by_delta.state_dict()
        again = OuterOptimizer(torch.zeros(100), kind, 0.7, 0.9, track_weights=True)
        again.load_state_dict(state)
        assert torch.equal(again.weights, by_delta.weights)
    with pytest.raises(RuntimeError, match="track_weights"):
        OuterOptimizer(w0, "fedavg").apply(w0)


def test_bad_compression_settings_fail_in_one_line():
    with pytest.raises(ConfigError, match="--compression 'fp4' is unknown"):
        TrainConfig(compression="fp4").validate()
    with pytest.raises(ConfigError, match="--compression-chunk must be a positive integer"):
        TrainConfig(compression="int8", compression_chunk=0).validate()
    with pytest.raises(ConfigError, match="drop --sync-optimizer-state"):
        TrainConfig(compression="int8", sync_optimizer_state=True).validate()


@pytest.mark.parametrize("kind", Z.KINDS)
def test_bytes_round_trip_for_any_shard_size(kind):
    """A rank's shard need not hold a multiple of 4 values (uneven sharding, e.g. K = 3): the
    int8 scales then start at an unaligned byte offset (a float32 view of it used to fail)."""
    gen = torch.Generator().manual_seed(4)
    for numel in (1, 2, 3, 5, 6, 7, 4097):
        values = torch.randn(numel, generator=gen)
        payload = Z.compress(values, kind, 4)
        back = Z.from_bytes(Z.to_bytes(payload), kind, numel, 4)
        assert all(torch.equal(back[k], payload[k]) for k in payload), numel
        assert torch.equal(Z.decompress(back, kind, 4), Z.decompress(payload, kind, 4))


def test_int8_sync_of_uneven_shards_under_torchrun(tmp_path):
    """The one-job path end to end: tiny with K = 3 shards its parameters unevenly (sizes
    that are not multiples of 4), and int8 compresses each rank's shard on its own."""
    from conftest import train_cli

    from flower_shard import protocol as P
    from flower_shard.ux import metrics as M

    out = tmp_path / "run"
    train_cli(
        out,
        *("--compression", "int8", "--groups", "2", "--nproc-per-group", "3", "--model", "tiny"),
        *("--rounds", "2", "--local-steps", "1", "--seq-len", "16", "--batch-size", "1"),
        *("--eval-every", "0", "--quiet"),
    )
    rounds = M.read_metrics(out)
    assert [r[P.ROUND] for r in rounds] == [1, 2]
    # int8 moved 1 byte per value plus the scales: a shard of n values is n + 4 * ceil(n / c)
    # bytes, so the payload is not a multiple of 4 bytes when some shard is not.
    assert all(r[P.OUTER_SYNC_PAYLOAD_BYTES] > 0 for r in rounds)
