"""The memory model: its formulas by hand, its activations against the tensors autograd really
saves, and its peak against the memory of real `flower-shard train` ranks (bench/memory_model.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flower_shard.planning.memory import (
    ModelShape,
    StepSetup,
    activation_bytes,
    estimate,
    llama_shape,
)
from flower_shard.planning.shapes import preset_shape

BENCH = Path(__file__).resolve().parent.parent / "bench" / "memory_model.py"

# h = 8, L = 2, 2 heads of 4, 1 KV head, MLP 16, vocabulary 10: a layer has attention
# 2 x 8 x 8 + 2 x 8 x 4 = 192, MLP 3 x 8 x 16 = 384 and two norms of 8: 592 parameters; the
# model 2 x 592 + 2 x 10 x 8 (embedding, head) + 8 (final norm) = 1352, the root 168.
TOY = llama_shape(hidden=8, layers=2, heads=2, kv_heads=1, intermediate=16, vocab=10)


def test_a_llama_shape_by_hand():
    assert (TOY.params, TOY.layer_params, TOY.root_params, TOY.head_dim) == (1352, 592, 168, 4)
    assert preset_shape("llama3.1-8b").params == 8_030_261_248
    tied = llama_shape(8, 2, 2, 1, 16, 10, tied=True)
    assert tied.params == 1352 - 80


def test_activations_by_hand():
    # t = 2 x 3 = 6 tokens. fp32 (a = 4), per token and layer: norms 2 x (4h + 2ah + 4) = 200,
    # attention a (2q + 2kv) + 4 heads = 4 x 24 + 8 = 104, MLP 4 a i = 256: 560, so 3360 per
    # layer. Head: final norm 6 x 100 = 600, float32 log-probs 4 t V = 240, ids 8 t = 48,
    # rotary cos and sin 2 x seq x head_dim x a = 96: 984. Total 2 x 3360 + 984.
    assert activation_bytes(TOY, StepSetup(batch_size=2, seq_len=3)) == 7704
    # bf16 (a = 2): 136 + 56 + 128 = 320 per token and layer, 1920 per layer; head 6 x 68 +
    # 240 + 48 + 48 = 744.
    bf16 = StepSetup(batch_size=2, seq_len=3, bf16=True)
    assert activation_bytes(TOY, bf16) == 2 * 1920 + 744
    # Checkpointed layers keep their input (L a t h = 192) and rebuild one layer at a time.
    ac = StepSetup(batch_size=2, seq_len=3, bf16=True, activation_checkpointing=True)
    assert activation_bytes(TOY, ac) == 192 + 1920 + 744


def test_a_rank_by_hand():
    # S = 2, G = 2, nesterov, fp32, foreach AdamW: n = P / S = 676 values.
    setup = StepSetup(batch_size=2, seq_len=3, outer="nesterov")
    m = estimate(TOY, setup, shard=2, groups=2)
    assert (m.weights, m.adamw, m.gradients, m.optimizer_temp) == (2704, 5408, 2704, 2704)
    assert m.outer_state == 5408  # the last global weights and the momentum
    assert m.exchange == 2704 + 2704  # the flat buffer and the pseudo-gradient
    assert m.logits == 8 * 6 * 10
    # Gathered: root + two layers + the head's unsharded gradient, 4 B each.
    assert m.gathered == 4 * (168 + 2 * 592 + 80)
    assert m.persistent == 2704 + 5408 + 5408
    assert m.forward_backward == 7704 + 480 + 5728
    assert m.peak == m.persistent + m.forward_backward == 27432
    # G = 1 (the baseline) has no outer state and no exchange.
    alone = estimate(TOY, setup, shard=2, groups=1)
    assert (alone.outer_state, alone.exchange) == (0, 0)
    assert alone.peak == 27432 - 5408
    # The optimizer step is the peak when the activations are small: 1 token.
    tiny = estimate(TOY, StepSetup(batch_size=1, seq_len=1), shard=1, groups=1)
    assert tiny.peak == 4 * 1352 + 8 * 1352 + max(tiny.forward_backward, 2 * 4 * 1352)


def test_exchange_buffers_of_each_transport_by_hand():
    n = 676  # P / S with S = 2
    # int8 with chunks of 4: 1 + 4/4 = 2 bytes per value. fedavg keeps the global weights and
    # error feedback's residual; the sync holds four float32 temporaries and G + 1 payloads.
    int8 = StepSetup(batch_size=1, seq_len=1, compression="int8", compression_chunk=4)
    m = estimate(TOY, int8, shard=2, groups=4)
    assert m.outer_state == 4 * n * 2
    assert m.exchange == 4 * 4 * n + 5 * n * 2
    no_feedback = StepSetup(batch_size=1, seq_len=1, compression="bf16", error_feedback=False)
    assert estimate(TOY, no_feedback, shard=2, groups=4).outer_state == 4 * n
    # HSDP R = 2: the flat buffer, its zero-padded copy and this replica's stripe.
    hsdp = estimate(TOY, StepSetup(batch_size=1, seq_len=1), shard=2, groups=2, replicate=2)
    assert hsdp.exchange == 4 * n * (1 + 1.5) and hsdp.outer_state == 0
    # AdamW's moments synced too: three values per parameter in the flat buffer.
    moments = StepSetup(batch_size=1, seq_len=1, sync_optimizer_state=True)
    assert estimate(TOY, moments, shard=2, groups=2).exchange == 3 * 4 * n


def test_a_streaming_rank_keeps_its_exchange_state_in_host_memory_by_hand():
    n = 676  # P / S with S = 2
    # The outer optimizer runs on the aggregators: nesterov keeps nothing on the rank's GPU,
    # and the push and pull move one piece at a time. The host holds the view (4n), int8's
    # residual (4n) and the overlapped round's snapshot (4n).
    setup = StepSetup(batch_size=2, seq_len=3, outer="nesterov", compression="int8")
    collective = estimate(TOY, setup, shard=2, groups=2, overlap=True)
    m = estimate(TOY, setup, shard=2, groups=2, overlap=True, transport="streaming")
    assert (m.outer_state, m.exchange, m.host) == (0, 0, 3 * 4 * n)
    assert m.peak == collective.peak - collective.outer_state  # forward-backward is the peak
    plain = StepSetup(batch_size=2, seq_len=3)  # float32, synchronous: the view alone
    assert estimate(TOY, plain, shard=2, groups=2, transport="streaming").host == 4 * n
    no_feedback = StepSetup(batch_size=2, seq_len=3, compression="bf16", error_feedback=False)
    assert estimate(TOY, no_feedback, shard=2, groups=2, transport="streaming").host == 4 * n
    assert estimate(TOY, plain, shard=2, groups=1, transport="streaming").host == 0  # no sync
    assert collective.host == 0


def _saved_bytes(model, batch: int, seq: int, vocab: int) -> int:
    """Bytes of the distinct storages autograd saves in a forward and the loss, parameters
    excluded (the activations of the memory model)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, vocab, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids, use_cache=False).logits
        torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), ids.reshape(-1))
    return sum(seen.values())


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_activations_are_what_autograd_saves_in_a_real_llama(preset, bf16):
    import torch

    from flower_shard.config.presets import PRESETS
    from flower_shard.runtime.models import build_model

    model = build_model(preset)
    if bf16:  # what FSDP2's param_dtype=bf16 computes with
        model = model.to(torch.bfloat16)
    shape: ModelShape = preset_shape(preset)
    batch, seq = 2, 64
    saved = _saved_bytes(model, batch, seq, PRESETS[preset].vocab_size)
    # The one float32 scalar left over is the loss's.
    assert saved - 4 == activation_bytes(shape, StepSetup(batch, seq, bf16=bf16))


def test_the_model_against_real_ranks_peak_memory(tmp_path):
    """bench/memory_model.py, tiny (mostly activations) and small (about half weights, gradients
    and AdamW state) presets, sharded over K = 2: real `flower-shard train` ranks' VmHWM over an
    idle rank's VmRSS, within 25% of the predicted peak. (K = 1 is in the benchmark's default
    run and bench/RESULTS.md; left out here for CI time.)"""
    out = tmp_path / "memory.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--presets", "tiny", "small", "--ranks", "2"]
        + ["--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["preset"], r["ranks"]) for r in rows] == [("tiny", 2), ("small", 2)]
    for r in rows:
        assert r["predicted_mb"] > 150  # the state dwarfs a process's noise
        assert 0.75 <= r["ratio"] <= 1.25, proc.stdout
