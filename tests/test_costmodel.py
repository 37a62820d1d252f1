"""The cost model against hand-computed cases, and against a real run's byte counts."""

from __future__ import annotations

import pytest
from conftest import train_cli

from flower_shard import protocol as P
from flower_shard.errors import ConfigError
from flower_shard.planning.costmodel import (
    Layout,
    Network,
    Workload,
    intra_group_bytes,
    llama_params,
    outer_stripe_gather_bytes,
    outer_sync_bytes,
    predict,
    speedup,
)
from flower_shard.runtime.models import build_model, count_parameters
from flower_shard.ux import metrics as M

GB = 1e9


def test_llama_parameter_count_matches_the_built_models():
    assert llama_params(4096, 32, 32, 8, 14336, 128256) == 8_030_261_248
    assert llama_params(64, 2, 4, 2, 128, 257) == count_parameters(build_model("tiny"))


def test_bytes_by_hand():
    w = Workload(params=1000, compute_s=1.0, tokens_per_step=10)
    # FSDP, K = S = 4: two all-gathers of 3/4 x 4000 B, one reduce-scatter of 3/4 x 4000 B.
    b = intra_group_bytes(w, Layout(world_size=8, groups=2))
    assert b == {"allgather": 6000.0, "reduce_scatter": 3000.0, "replicate_allreduce": 0.0}
    # HSDP K = 4 = R 2 x S 2: gathers over 2 ranks, then all-reduce of the 2000 B shard.
    b = intra_group_bytes(w, Layout(world_size=8, groups=2, sharding="hsdp", replicate=2))
    assert b == {"allgather": 4000.0, "reduce_scatter": 2000.0, "replicate_allreduce": 2000.0}
    # Outer sync over G = 2 of a 1000 B shard (P/S x 4 B): 2 x 1/2 x 1000.
    assert outer_sync_bytes(w, Layout(world_size=8, groups=2)) == 1000.0
    assert outer_sync_bytes(w, Layout(world_size=8, groups=1)) == 0.0
    # HSDP R = 2 x S = 2: each replica all-reduces one half (1000 B) of its 2000 B shard
    # across groups, then sends its averaged half to the other replica (1/2 x 2000 B).
    hsdp = Layout(world_size=8, groups=2, sharding="hsdp", replicate=2)
    assert outer_sync_bytes(w, hsdp) == 2 * 1 / 2 * 1000
    assert outer_stripe_gather_bytes(w, hsdp) == 1 / 2 * 2000
    assert (
        outer_stripe_gather_bytes(w, Layout(world_size=8, groups=1, sharding="hsdp", replicate=2))
        == 0.0
    )
    assert outer_stripe_gather_bytes(w, Layout(world_size=8, groups=2)) == 0.0  # R = 1
    # Compressed: a ring all-gather of (G-1) payloads of P/S values. int8 with chunks of 100:
    # 1 byte per value + one 4-byte scale per 100 values; bf16: 2 bytes per value.
    int8 = Workload(
        params=1000, compute_s=1.0, tokens_per_step=10, compression="int8", compression_chunk=100
    )
    assert outer_sync_bytes(int8, Layout(world_size=8, groups=2)) == 1 * 250 * 1.04
    bf16 = Workload(params=1000, compute_s=1.0, tokens_per_step=10, compression="bf16")
    assert outer_sync_bytes(bf16, Layout(world_size=4, groups=4)) == 3 * 1000 * 2


def test_times_by_hand_and_c_total():
    # Two nodes of 4 ranks, one site; no latency so the arithmetic is exact.
    net = Network(
        ranks_per_node=4,
        intra_node_bw=1000.0,
        inter_node_bw=100.0,
        intra_node_lat=0,
        inter_node_lat=0,
        inter_site_lat=0,
    )
    w = Workload(params=1000, compute_s=1.0, tokens_per_step=10)
    fsdp = predict(w, Layout(world_size=8, groups=1), net)  # S = 8 spans both nodes: 100 B/s
    assert fsdp.intra_bytes == 2 * 7 / 8 * 4000 + 7 / 8 * 4000
    assert fsdp.intra_s == pytest.approx(fsdp.intra_bytes / 100.0)
    assert fsdp.inter_s == 0 and fsdp.step_s == pytest.approx(1.0 + fsdp.intra_s)
    # FL+FSDP, G = 2 groups = the 2 nodes, T = 4: C_total = C_intra + C_inter / T.
    fl = predict(w, Layout(world_size=8, groups=2, local_steps=4), net)
    assert fl.intra_s == pytest.approx(9000 / 1000.0)
    assert fl.inter_s == pytest.approx((2 * 0.5 * 1000 / 100.0) / 4)
    assert fl.step_s == pytest.approx(1.0 + fl.intra_s + fl.inter_s)
    # B_global = B_local x K per group; throughput counts all N ranks.
    assert fl.tokens_per_s == pytest.approx(8 * 10 / fl.step_s)
    assert speedup(w, Layout(world_size=8, groups=2, local_steps=4), net) == pytest.approx(
        fsdp.step_s / fl.step_s
    )
    assert fl.inter_byte_share == pytest.approx(fl.inter_bytes / (fl.inter_bytes + 9000))
    # FL+HSDP, groups = nodes, R = 2 x S = 2: 8000 B a step inside the node; once a round,
    # 1000 B stripes across nodes and their 1000 B all-gather back inside it.
    fl_hsdp = predict(
        w, Layout(world_size=8, groups=2, sharding="hsdp", replicate=2, local_steps=4), net
    )
    assert fl_hsdp.intra_s == pytest.approx(8000 / 1000.0 + (1000 / 1000.0) / 4)
    assert fl_hsdp.inter_s == pytest.approx((1000 / 100.0) / 4)


def test_overlap_hides_the_exchange_up_to_the_next_rounds_steps_and_fragments_split_it():
    # The same two nodes, latency on the inter-node tier so that fragments cost F x latency.
    net = Network(
        ranks_per_node=4,
        intra_node_bw=1000.0,
        inter_node_bw=100.0,
        intra_node_lat=0,
        inter_node_lat=0.01,
        inter_site_lat=0,
    )
    w = Workload(params=1000, compute_s=1.0, tokens_per_step=10)
    lay = Layout(world_size=8, groups=2, local_steps=4)
    sync = predict(w, lay, net)
    exchange = 2 * 0.5 * 1000 / 100.0 + 2 * 1 * 0.01  # 10 s of bytes, 2 ring steps of latency
    assert sync.inter_s * 4 == pytest.approx(exchange)
    # Overlapped, the 10.02 s exchange runs behind 4 steps of 1 + 9 s: all of it hidden.
    hidden = predict(w, Layout(world_size=8, groups=2, local_steps=4, outer_overlap=True), net)
    assert hidden.inter_s == 0 and hidden.extra["hidden_s"] == pytest.approx(exchange)
    assert hidden.step_s == pytest.approx(1.0 + sync.intra_s)
    # With T = 1 only one step of 10 s hides it: the 0.02 s residual is left.
    one = predict(w, Layout(world_size=8, groups=2, local_steps=1, outer_overlap=True), net)
    assert one.inter_s == pytest.approx(exchange - (1.0 + sync.intra_s))
    # F = 4 fragments: a quarter of the bytes per burst, four times the latency, no overlap.
    frag = predict(w, Layout(world_size=8, groups=2, local_steps=4, outer_fragments=4), net)
    assert frag.extra["burst_bytes"] == sync.extra["burst_bytes"] / 4 == 4 * 1000 / 4
    assert frag.inter_s * 4 == pytest.approx(10.0 + 4 * 2 * 0.01)


def test_pacing_spreads_the_exchange_over_its_window_and_lowers_the_peak_by_hand():
    net = Network(ranks_per_node=4, intra_node_bw=1000.0, inter_node_bw=100.0, inter_node_lat=0)
    w = Workload(params=1000, compute_s=1.0, tokens_per_step=10)
    ovl = dict(world_size=8, groups=2, local_steps=4, outer_overlap=True)
    sent = predict(w, Layout(**ovl), net)
    paced = predict(w, Layout(**ovl, outer_pace=True), net)
    # Each rank's 1000 bytes take 10 s at 100 B/s; spread over 0.8 of 4 steps of 10 s: 31%.
    assert sent.extra["peak_link_share"] == 1.0
    assert paced.extra["peak_link_share"] == pytest.approx(10.0 / (0.8 * 4 * sent.step_s))
    assert paced.step_s == sent.step_s  # the same bytes in the same window: the same time
    # With T = 1 the window is shorter than the exchange: at the link's rate after all.
    one = dict(ovl, local_steps=1)
    assert predict(w, Layout(**one, outer_pace=True), net).extra["peak_link_share"] == 1.0
    assert predict(w, Layout(8, 1), net).extra["peak_link_share"] == 0.0  # no outer sync
    for bad in (dict(ovl, outer_overlap=False), dict(ovl, transport=P.STREAMING)):
        with pytest.raises(ConfigError, match="pacing spreads an overlapped sync"):
            Layout(**bad, outer_pace=True)


def sites_of_4() -> Network:
    """Sites of 4 ranks (one node each) joined by a 100 B/s link per site, everything inside a
    site free."""
    return Network(
        ranks_per_node=4,
        nodes_per_site=1,
        intra_node_bw=1e12,
        inter_site_bw=100.0,
        intra_node_lat=0,
        inter_site_lat=0,
    )


def test_gloo_reduce_scatter_and_the_shared_site_link_by_hand():
    w = Workload(params=1000, compute_s=1.0, tokens_per_step=10)
    # gloo runs a reduce-scatter as an all-reduce: 2 x 3/4 x 4000 B instead of 3/4 x 4000 B.
    b = intra_group_bytes(w, Layout(world_size=8, groups=2), backend="gloo")
    assert b["reduce_scatter"] == 6000.0 and b["allgather"] == 6000.0
    net = sites_of_4()
    # HSDP R = 2 across the sites, S = 4 inside: 4 all-reduces of 1000 B shards leave each site
    # at once and share its link: 4 x (2 x 1/2 x 1000 B) / 100 B/s.
    hsdp = predict(w, Layout(world_size=8, groups=1, sharding="hsdp", replicate=2), net)
    assert hsdp.intra_s == pytest.approx(4 * 1000 / 100.0, rel=1e-6)
    # The outer sync of G = 2 site-groups: K = 4 rings of 1000 B shards share the link; T = 2.
    fl = predict(w, Layout(world_size=8, groups=2, local_steps=2), net)
    assert fl.inter_s == pytest.approx(4 * 1000 / 100.0 / 2)
    # FSDP over all 8 ranks: one ring, one crossing per direction, the link to itself.
    fsdp = predict(w, Layout(world_size=8, groups=1), net)
    assert fsdp.intra_s == pytest.approx((2 * 7 / 8 * 4000 + 7 / 8 * 4000) / 100.0)
    per_rank = Network(**{**net.__dict__, "site_link_shared": False})
    assert predict(
        w, Layout(world_size=8, groups=1, sharding="hsdp", replicate=2), per_rank
    ).intra_s == pytest.approx(hsdp.intra_s / 4)


def test_the_streaming_transport_is_priced_as_a_hub_by_hand():
    w = Workload(params=1000, compute_s=1.0, tokens_per_step=10)
    net = sites_of_4()

    def exchange(groups: int, w=w, net=net, **kw) -> float:
        lay = Layout(4 * groups, groups, local_steps=1, transport=P.STREAMING, **kw)
        return predict(w, lay, net).extra["exchange_s"]

    # G = 2: site 1's 4000 B go up and come back down across the hub's link, at once when
    # pipelined (40 s, as the ring all-reduce of 4 shards of 1000 B), one after the other not.
    assert exchange(2) == pytest.approx(40.0)
    ring = predict(w, Layout(8, 2, local_steps=1), net).extra["exchange_s"]
    assert ring == pytest.approx(40.0)
    assert exchange(2, pipelined=False) == pytest.approx(80.0)
    # G = 4 sites: three groups beyond the hub, 3 x 4000 B each way; the ring moves 2 x 3/4.
    assert exchange(4) == pytest.approx(120.0)
    assert predict(w, Layout(16, 4, local_steps=1), net).extra["exchange_s"] == pytest.approx(60)
    # int8 up (1 + 4/2048 B a value), float32 down: the download is the longer direction.
    int8 = Workload(params=1000, compute_s=1.0, tokens_per_step=10, compression="int8")
    assert exchange(2, w=int8) == pytest.approx(40.0)
    both = Workload(**{**int8.__dict__, "downlink_compression": "int8"})
    assert exchange(2, w=both) == pytest.approx(1000 * (1 + 4 / 2048) / 100.0)
    # What a rank sends to other groups: its quarter of the model, uploaded; no stripe gather.
    lay = Layout(8, 2, local_steps=4, transport=P.STREAMING)
    assert outer_sync_bytes(w, lay) == 1000.0 and outer_stripe_gather_bytes(w, lay) == 0.0
    # Overlapped: 4 steps of 1 s hide 4 of the 40 s; Flower's 0.5 s a round is never hidden.
    flower = Network(**{**net.__dict__, "round_overhead_s": 0.5})
    ovl = predict(w, Layout(8, 2, local_steps=4, outer_overlap=True, transport=P.STREAMING), flower)
    assert ovl.extra["hidden_s"] == pytest.approx(4.0)
    assert ovl.inter_s == pytest.approx((40.0 - 4.0 + 0.5) / 4)
    assert predict(w, Layout(8, 1), flower).inter_s == 0  # one job: no rounds, no control
    with pytest.raises(ConfigError, match="fragments run on the collective transport only"):
        Layout(8, 2, outer_fragments=2, transport=P.STREAMING)
    with pytest.raises(ConfigError, match="prices transports"):
        Layout(8, 2, transport=P.FLOWER)


def test_more_local_steps_never_slow_down_and_slow_sites_favour_groups():
    w = Workload(params=10**8, compute_s=0.5, tokens_per_step=4096)
    net = Network(ranks_per_node=4, nodes_per_site=2, inter_site_bw=0.1 * GB)
    steps = [predict(w, Layout(16, 2, local_steps=t), net).step_s for t in (1, 2, 4, 8, 16)]
    assert steps == sorted(steps, reverse=True)
    assert speedup(w, Layout(16, 2, local_steps=8), net) > 2  # FSDP across sites is link-bound
    with pytest.raises(ConfigError, match="N = 10 is not divisible by --groups 3"):
        Layout(world_size=10, groups=3)  # the Topology's own check, as a real run's


def _fsdp_payloads(model, s: int) -> list[tuple[int, int, int]]:
    """Per FSDP unit of ``parallelize`` (each decoder layer, then the root with the rest): its
    all-gather input, its reduce-scatter input (float32 bytes, dim 0 padded to a multiple of
    S as FSDP2 does) and its all-gathers per step: two (forward, backward), one for the last
    layer, which is kept from forward to backward."""
    layers = list(model.model.layers)
    units = [(layer, 1 if i == len(layers) - 1 else 2) for i, layer in enumerate(layers)]
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = [p for p in model.parameters() if id(p) not in in_layers]
    out = []
    for params, gathers in [(list(u.parameters()), g) for u, g in units] + [(root, 2)]:
        shard = sum(-(-p.shape[0] // s) * (p.numel() // p.shape[0]) * 4 for p in params)
        out.append((shard, shard * s, gathers))
    return out


def test_byte_counts_match_a_real_run(tmp_path):
    """The intra-group bytes counted on FSDP's collectives in a real run are exactly what the
    model's shapes give, their reduce-scatter part is the cost model's, and the outer sync's
    bytes are what the cost model predicts."""
    out = tmp_path / "run"
    train_cli(
        out,
        "--groups",
        "2",
        "--nproc-per-group",
        "2",
        "--local-steps",
        "1",
        "--rounds",
        "1",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--eval-every",
        "0",
        "--quiet",
    )
    (record,) = M.read_metrics(out)
    params = count_parameters(build_model("tiny"))
    w = Workload(params=params, compute_s=1.0, tokens_per_step=64)
    lay = Layout(world_size=4, groups=2)
    # FSDP2 pads uneven shards; the runtime sends each rank's real shard, so the model's
    # P/S is exact up to the rounding of the split (a few elements per tensor).
    assert record[P.OUTER_SYNC_BYTES] == pytest.approx(outer_sync_bytes(w, lay), rel=0.01)
    # Exact, from the shapes: S = 2, gloo (a reduce-scatter is an all-reduce: 2 x 1/2).
    units = _fsdp_payloads(build_model("tiny"), 2)
    steps = record[P.STEP]
    comm = record[P.INTRA_COMM]
    assert comm["allgather"]["calls"] == steps * sum(g for _, _, g in units)
    assert comm["allgather"]["bytes"] == steps * sum(g * (2 - 1) * a for a, _, g in units)
    assert comm["reduce_scatter"]["calls"] == steps * len(units)
    assert comm["reduce_scatter"]["bytes"] == steps * sum(2 * 1 / 2 * r for _, r, _ in units)
    assert comm["replicate_allreduce"]["calls"] == 0
    assert record[P.INTRA_BYTES] == comm["allgather"]["bytes"] + comm["reduce_scatter"]["bytes"]
    assert 0 < record[P.INTRA_COMM_S] < record[P.COMPUTE_S]
    # The cost model's reduce-scatter is the same up to FSDP2's padding of dim 0.
    model = intra_group_bytes(w, lay, backend="gloo")
    assert comm["reduce_scatter"]["bytes"] == pytest.approx(steps * model["reduce_scatter"], 0.01)


def test_hsdp_replicate_allreduce_is_counted_in_a_real_run(tmp_path):
    """HSDP, K = 4 = R 2 x S 2: after each reduce-scatter over S, FSDP2 all-reduces the
    gradient shard over R; its bytes are 2 (R-1)/R of the shard, once per unit per step."""
    out = tmp_path / "run"
    train_cli(
        out,
        *("--groups", "1", "--nproc-per-group", "4", "--sharding", "hsdp", "--replicate", "2"),
        *("--local-steps", "2", "--rounds", "1", "--seq-len", "32", "--batch-size", "2"),
        *("--eval-every", "0", "--quiet"),
    )
    (record,) = M.read_metrics(out)
    units = _fsdp_payloads(build_model("tiny"), 2)
    comm, steps = record[P.INTRA_COMM], record[P.STEP]
    assert comm["allgather"]["bytes"] == steps * sum(g * a for a, _, g in units)
    assert comm["reduce_scatter"]["bytes"] == steps * sum(r for _, r, _ in units)
    shard_bytes = [r // 2 for _, r, _ in units]  # the reduce-scatter's output over S = 2
    assert comm["replicate_allreduce"]["calls"] == steps * len(units)
    assert comm["replicate_allreduce"]["bytes"] == steps * sum(2 * 1 / 2 * b for b in shard_bytes)
    assert comm["replicate_allreduce"]["seconds"] > 0
