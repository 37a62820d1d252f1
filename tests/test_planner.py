"""`flower-shard plan`: memory-aware ranking, the user's model directory, bf16 priced as the
runtime runs it, speed-ups against the best G = 1 layout, one-line errors on bad flags."""

from __future__ import annotations

import dataclasses

import pytest

from flower_shard import protocol as P
from flower_shard.planning.costmodel import (
    CONTROL_PLANE_S,
    Layout,
    intra_group_bytes,
    predict,
    streaming_exchange_s,
)
from flower_shard.planning.memory import GB
from flower_shard.planning.planner import (
    MemoryBudget,
    best_baseline,
    candidates,
    recommended,
    step_setup,
    workload_and_network,
)
from flower_shard.planning.shapes import model_shape, preset_shape
from flower_shard.ux.cli import build_parser
from flower_shard.ux.cli import main as cli_main

# The paper's setting (planner.py's docstring): 512 A100 of 80 GB in nodes of 4, 32 per site.
PAPER = [
    *("--model", "llama3.1-8b", "--gpus", "512", "--gpus-per-node", "4"),
    *("--nodes-per-site", "32", "--intra-node-gbps", "2400", "--inter-node-gbps", "200"),
    *("--inter-site-gbps", "10", "--bf16"),
]


def plan_args(*flags: str):
    return build_parser().parse_args(["plan", *flags])


def ranked(*flags: str):
    args = plan_args(*flags)
    shape = model_shape(args.model, args.seq_len)
    w, net = workload_and_network(args, shape.params)
    budget = MemoryBudget(shape, step_setup(args), args.gpu_memory * GB, args.reserved_gb * GB)
    return candidates(
        w, net, args.gpus, budget, max_local_steps=args.max_local_steps, transport=args.transport
    )


def find(cands, sharding: str, groups: int, local_steps: int, overlap: bool = False):
    (c,) = [
        c
        for c in cands
        if (c.layout.sharding, c.layout.groups, c.layout.local_steps, c.layout.outer_overlap)
        == (sharding, groups, local_steps, overlap)
    ]
    return c


def test_it_prices_the_overlapped_sync_and_recommends_it_on_a_slow_link(capsys):
    slow = [*PAPER[:-3], "--inter-site-gbps", "1", "--bf16"]
    cands = ranked(*slow)
    for g, t in ((16, 2), (64, 4)):
        sync, overlap = find(cands, "fsdp", g, t), find(cands, "fsdp", g, t, overlap=True)
        assert overlap.prediction.tokens_per_s > sync.prediction.tokens_per_s
        # Two flat float32 copies of the rank's shard more: 8 P / K bytes.
        extra = overlap.memory.outer_state - sync.memory.outer_state
        assert extra == pytest.approx(8 * 8_030_261_248 / (512 // g))
    # HSDP stripes it: the padded copy and the stripe beside the weights as sent.
    hsdp = [c for c in cands if c.layout.sharding == "hsdp" and c.layout.groups > 1]
    for c in (c for c in hsdp if c.layout.outer_overlap):
        sync = next(
            s for s in hsdp if s.layout == dataclasses.replace(c.layout, outer_overlap=False)
        )
        per_value = 4 * (2 + 1 / c.layout.replicate)
        extra = c.memory.outer_state - sync.memory.outer_state
        assert extra == pytest.approx(per_value * 8_030_261_248 / c.layout.shard_degree)
    assert cli_main(["plan", *slow]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("recommended:"))
    assert "--outer-overlap" in line


def test_the_streaming_transport_is_priced_through_the_aggregators_with_flowers_rounds(capsys):
    # The paper's four sites of 128 GPUs at 10 Gbit/s: with G = 4, one group a site, the hub's
    # link carries 3 groups' models each way.
    four_sites = PAPER
    args = plan_args(*four_sites, "--transport", "streaming")
    w, net = workload_and_network(args, model_shape(args.model, args.seq_len).params)
    assert net.round_overhead_s == CONTROL_PLANE_S  # Flower drives the rounds
    cands = ranked(*four_sites, "--transport", "streaming")
    collective = ranked(*four_sites)
    c = find(cands, "fsdp", 4, 8)
    assert c.layout.transport == P.STREAMING
    exchange = streaming_exchange_s(w, c.layout, net)
    assert exchange == pytest.approx(3 * w.params * 4 / (10e9 / 8) + 2 * net.inter_site_lat)
    assert c.prediction.inter_s == pytest.approx((exchange + CONTROL_PLANE_S) / 8)
    # With G = 4 the hub's link is twice as busy as a ring's: slower than the collective.
    ring = find(collective, "fsdp", 4, 8)
    assert ring.prediction.extra["exchange_s"] == pytest.approx(exchange / 2, rel=1e-3)
    assert c.prediction.tokens_per_s < ring.prediction.tokens_per_s
    # The G = 1 baseline is one job either way: same throughput, no control plane.
    assert best_baseline(cands).prediction == best_baseline(collective).prediction
    # Overlap hides the bytes, not Flower's rounds; the pick reads as a Flower run's keys.
    ovl = find(cands, "fsdp", 4, 8, overlap=True)
    hidden = predict(w, ovl.layout, net).extra["hidden_s"]
    assert ovl.prediction.inter_s == pytest.approx((exchange - hidden + CONTROL_PLANE_S) / 8)
    assert cli_main(["plan", *four_sites, "--transport", "streaming"]) == 0
    out = capsys.readouterr().out
    assert "streaming transport (0.78 s of control a round)" in out.splitlines()[0]
    line = next(x for x in out.splitlines() if x.startswith("recommended:"))
    assert " streaming" in line and "--outer-overlap" not in line
    # Its ranks keep no outer optimizer on the GPU: the view (and the snapshot) is host memory.
    assert ovl.memory.outer_state == 0 and ovl.memory.host == 2 * 4 * w.params / 128
    assert ovl.memory.peak < find(collective, "fsdp", 4, 8, overlap=True).memory.peak
    assert f"(+ {ovl.memory.host / 1e9:.1f} GB of host memory per rank)" in line
    # An explicit overhead replaces the default.
    args = plan_args(*four_sites, "--transport", "streaming", "--round-overhead-s", "0")
    assert workload_and_network(args, 1000)[1].round_overhead_s == 0.0


def table_rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.startswith(("fsdp ", "hsdp "))]


def test_the_8b_model_on_512_gpus_recommends_only_layouts_that_fit():
    cands = ranked(*PAPER)
    for g in (256, 512):  # K = 2 and 1: the sharded state alone is 48 and 96 GB per GPU
        c = find(cands, "fsdp", g, 8)
        assert not c.fits and c.memory.peak > 80 * GB
        assert c.memory.weights + c.memory.adamw == 12 * 8_030_261_248 / (512 // g)
    best = recommended(cands)
    assert best.fits and best.layout.groups > 1 and best.memory.peak <= 80 * GB
    assert best is cands[0]  # the fastest layout that fits
    fits = [c.fits for c in cands]
    assert fits == sorted(fits, reverse=True)  # all that fit come first
    throughput = [c.prediction.tokens_per_s for c in cands if c.fits]
    assert throughput == sorted(throughput, reverse=True)


def test_the_paper_setting_prints_memory_and_fits_columns(capsys):
    assert cli_main(["plan", *PAPER, "--top", "1000"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("sharding"))
    assert header.split()[-4:] == ["G=1", "mem/GPU", "GB", "fits"]
    rows = table_rows(out)
    marks = {(r[0], int(r[1]), int(r[4])): r[-1] for r in rows}
    assert marks[("fsdp", 256, 8)] == marks[("fsdp", 512, 8)] == "no"
    assert [r[-1] for r in rows] == sorted((r[-1] for r in rows), reverse=True)  # yes, then no
    line = next(x for x in out.splitlines() if x.startswith("recommended:"))
    assert "FSDP G=256" not in line and "FSDP G=512" not in line
    assert "need more than 80 GB per GPU and are not recommended" in out


def test_a_whole_8b_model_per_gpu_does_not_fit_on_one_node(capsys):
    assert cli_main(["plan", "--gpus", "8", "--gpus-per-node", "8", "--bf16", "--top", "50"]) == 0
    out = capsys.readouterr().out
    rows = {(r[0], int(r[1]), int(r[4])): r for r in table_rows(out)}
    g8 = rows[("fsdp", 8, 1)]
    assert g8[-1] == "no" and float(g8[-2]) > 80  # weights + AdamW alone: 12 x 8.03 GB
    assert "recommended: FSDP G=8" not in out


def test_bf16_all_gathers_at_2_bytes_and_reduces_gradients_at_4():
    w, _ = workload_and_network(plan_args("--bf16"), 1000)
    assert (w.param_bytes, w.grad_bytes) == (2, 4)
    # FSDP, S = 4: two all-gathers of 3 x 250 values at 2 B; a reduce-scatter of 3/4 x 1000
    # values at 4 B (float32, as parallelize's reduce_dtype); HSDP's all-reduce at 4 B too.
    b = intra_group_bytes(w, Layout(world_size=8, groups=2))
    assert b == {"allgather": 3000.0, "reduce_scatter": 3000.0, "replicate_allreduce": 0.0}
    b = intra_group_bytes(w, Layout(world_size=8, groups=2, sharding="hsdp", replicate=2))
    assert b["replicate_allreduce"] == 2 * 1 / 2 * 500 * 4
    fp32, _ = workload_and_network(plan_args(), 1000)
    assert (fp32.param_bytes, fp32.grad_bytes) == (4, 4)


def test_speedups_are_against_the_best_g1_layout_that_fits():
    cands = ranked(*PAPER)
    base = best_baseline(cands)
    g1 = [c for c in cands if c.layout.groups == 1]
    assert {c.layout.sharding for c in g1} == {"fsdp", "hsdp"} and base.fits
    assert base.prediction.tokens_per_s == max(c.prediction.tokens_per_s for c in g1 if c.fits)
    for c in cands:  # FSDP and HSDP rows alike: one baseline
        assert c.speedup == c.prediction.tokens_per_s / base.prediction.tokens_per_s
    assert base.speedup == 1.0


def test_a_model_directory_is_priced_like_the_same_preset(tmp_path, capsys):
    from flower_shard.config.presets import PRESETS

    directory = tmp_path / "small-config"
    PRESETS["small"].llama_config().save_pretrained(directory)
    assert model_shape(str(directory), 1024) == preset_shape("small")
    flags = ["--gpus", "8", "--gpus-per-node", "8", "--seq-len", "1024", "--top", "5"]
    assert cli_main(["plan", "--model", "small", *flags]) == 0
    preset_out = capsys.readouterr().out
    assert cli_main(["plan", "--model", str(directory), *flags]) == 0
    directory_out = capsys.readouterr().out
    assert directory_out.replace(str(directory), "small") == preset_out
    assert preset_out.startswith("small: 12.8M parameters")


def test_a_non_llama_directory_counts_its_own_parameters(tmp_path):
    from transformers import GPT2Config

    from flower_shard.runtime.models import build_model, count_parameters

    directory = tmp_path / "gpt2"
    GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=300, n_positions=256).save_pretrained(
        directory
    )
    shape = model_shape(str(directory), 128)
    model = build_model(str(directory), meta=True)
    assert shape.params == count_parameters(model)
    assert shape.layer_params == sum(p.numel() for p in model.transformer.h[0].parameters())
    assert (shape.layers, shape.hidden, shape.heads, shape.intermediate) == (3, 64, 4, 256)
    assert shape.tied  # GPT-2 ties its LM head to the embedding


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--mfu", "0"], "--mfu 0 must be in (0, 1]"),
        (["--mfu", "1.5"], "--mfu 1.5 must be in (0, 1]"),
        (["--mfu", "nan"], "--mfu must be a finite number"),
        (["--nodes-per-site", "3"], "--nodes-per-site 3 must divide the 128 nodes"),
        (["--nodes-per-site", "0"], "--nodes-per-site 0 must divide"),
        (["--gpus", "0"], "--gpus must be >= 1"),
        (["--gpus-per-node", "-4"], "--gpus-per-node must be >= 1"),
        (["--gpu-memory", "0"], "--gpu-memory must be > 0"),
        (["--gpu-memory", "inf"], "--gpu-memory must be a finite number"),
        (["--inter-site-gbps", "-1"], "--inter-site-gbps must be > 0"),
        (["--reserved-gb", "90"], "--reserved-gb must be >= 0 and less than --gpu-memory"),
        (["--model", "/nonexistent/model"], "--model '/nonexistent/model' is unknown"),
        (["--round-overhead-s", "-1"], "--round-overhead-s -1 must be a finite number >= 0"),
        (["--round-overhead-s", "nan"], "--round-overhead-s nan must be a finite number >= 0"),
        (["--downlink-compression", "int8"], "add --transport streaming, or drop it"),
    ],
)
def test_bad_flags_fail_with_one_line_and_status_2(flags, message, capsys):
    assert cli_main(["plan", *flags]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flower-shard: error: "), captured.err
    assert message in lines[0] and not captured.out
