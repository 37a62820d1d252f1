"""Model presets and the learning-rate schedule (pure, single process)."""

from __future__ import annotations

import math

import pytest
import torch

from flower_shard.config.presets import PRESETS
from flower_shard.runtime.models import build_model, count_parameters
from flower_shard.runtime.outer_optimizer import OuterOptimizer
from flower_shard.runtime.schedule import warmup_cosine


def test_preset_sizes():
    assert count_parameters(build_model("tiny")) < 1_000_000
    assert 10e6 <= count_parameters(build_model("small")) <= 20e6
    big = build_model("llama3.1-8b")  # on the meta device: no memory
    assert all(p.is_meta for p in big.parameters())
    assert count_parameters(big) == 8_030_261_248  # Llama 3.1 8B
    c = big.config
    assert (
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.intermediate_size,
        c.vocab_size,
    ) == (4096, 32, 32, 8, 14336, 128256)
    assert c.rope_parameters["rope_theta"] == 500000.0


def test_same_seed_same_model_and_vocab_grows_to_the_tokenizer():
    a, b = build_model("tiny", seed=3), build_model("tiny", seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert build_model("tiny", vocab_size=1000).config.vocab_size == 1000
    assert build_model("tiny", vocab_size=10).config.vocab_size == PRESETS["tiny"].vocab_size


def test_warmup_cosine_schedule():
    total, warmup = 100, 10
    lrs = [warmup_cosine(s, total, warmup, 0.1) for s in range(total)]
    assert lrs[0] == pytest.approx(0.1) and lrs[warmup - 1] == pytest.approx(1.0)
    assert lrs[warmup] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)
    mid = warmup + (total - warmup - 1) // 2
    assert lrs[mid] == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (mid - warmup) / 89))
    )
    assert all(x >= y for x, y in zip(lrs[warmup:], lrs[warmup + 1 :]))


def test_outer_optimizer_fedavg_and_nesterov():
    w0, mean = torch.randn(50), torch.randn(50)
    assert torch.equal(OuterOptimizer(w0, "fedavg").step(mean), mean)
    # Nesterov by hand: buf = g; w -= lr * (g + mu * buf) on the first step.
    opt = OuterOptimizer(w0, "nesterov", lr=0.7, momentum=0.9)
    g = w0 - mean
    torch.testing.assert_close(opt.step(mean), w0 - 0.7 * (g + 0.9 * g))
    # lr 1, momentum 0: the mean again.
    torch.testing.assert_close(
        OuterOptimizer(w0, "nesterov", lr=1.0, momentum=0.0).step(mean), mean
    )
    with pytest.raises(ValueError, match="unknown"):
        OuterOptimizer(w0, "adam")
