"""``flower-shard plan``: rank candidate (G, K, T, sharding) layouts with the cost model.

Example, the paper's setting (512 A100 in nodes of 4, Llama 3.1 8B, bf16, batch 2 x 2048):

    flower-shard plan --model llama3.1-8b --gpus 512 --gpus-per-node 4 --nodes-per-site 32 \\
        --intra-node-gbps 2400 --inter-node-gbps 200 --inter-site-gbps 10 --bf16
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from flower_shard.config import ConfigError
from flower_shard.planning.costmodel import (
    Layout,
    Network,
    Prediction,
    Workload,
    llama_params,
    predict,
)


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    sharding: str
    prediction: Prediction
    speedup: float
    """Throughput over the same-sharding baseline (G = 1) on the same ranks."""


def model_params(name: str) -> int:
    from flower_shard.config.presets import PRESETS

    p = PRESETS[name]
    return llama_params(
        p.hidden_size, p.num_layers, p.num_heads, p.num_kv_heads, p.intermediate_size, p.vocab_size
    )


def candidates(
    w: Workload, net: Network, world: int, local_steps=(1, 2, 4, 8, 16), max_local_steps: int = 8
) -> list[Candidate]:
    """Every FSDP / HSDP layout with G dividing N and T in ``local_steps`` (T <= max)."""
    out = []
    node = net.ranks_per_node
    for g in (d for d in range(1, world + 1) if world % d == 0):
        k = world // g
        shardings = [("fsdp", 1)]
        if k % node == 0 and k > node:  # HSDP: shard inside a node, replicate across nodes
            shardings.append(("hsdp", k // node))
        for sharding, r in shardings:
            base = predict(w, Layout(world, 1, r, 1), net)
            for t in local_steps if g > 1 else (1,):
                if t > max_local_steps:
                    continue
                lay = Layout(world, g, r, t)
                pred = predict(w, lay, net)
                out.append(Candidate(lay, sharding, pred, pred.tokens_per_s / base.tokens_per_s))
    return sorted(out, key=lambda c: -c.prediction.tokens_per_s)


def format_table(cands: list[Candidate], top: int = 15) -> str:
    rows = [
        f"{'sharding':8s} {'G':>5s} {'K':>5s} {'R':>3s} {'T':>3s} {'tokens/s':>12s} "
        f"{'step s':>8s} {'comm %':>7s} {'inter bytes %':>14s} {'vs G=1':>7s}"
    ]
    for c in cands[:top]:
        lay, p = c.layout, c.prediction
        rows.append(
            f"{c.sharding:8s} {lay.groups:5d} {lay.group_size:5d} {lay.replicate:3d} "
            f"{lay.local_steps:3d} {p.tokens_per_s:12,.0f} {p.step_s:8.3f} "
            f"{100 * p.comm_share:6.1f}% {100 * p.inter_byte_share:13.2f}% "
            f"{c.speedup:6.2f}x"
        )
    return "\n".join(rows)


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama3.1-8b", help="a preset (flower_shard.runtime.models)")
    p.add_argument("--gpus", type=int, default=512, help="N: all ranks")
    p.add_argument("--gpus-per-node", type=int, default=4)
    p.add_argument(
        "--nodes-per-site",
        type=int,
        default=None,
        help="nodes in one site (default: all nodes in one site)",
    )
    p.add_argument("--intra-node-gbps", type=float, default=2400.0, help="per link, Gbit/s")
    p.add_argument("--inter-node-gbps", type=float, default=200.0, help="per link, Gbit/s")
    p.add_argument("--inter-site-gbps", type=float, default=10.0, help="per link, Gbit/s")
    p.add_argument(
        "--site-link",
        choices=("shared", "per-rank"),
        default="shared",
        help="shared: one link per site, split by every ring that leaves it at once (a WAN "
        "link; what bench/multitier.py emulates and validates); per-rank: each GPU has its "
        "own inter-site path at --inter-site-gbps",
    )
    p.add_argument("--batch-size", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--bf16", action="store_true", help="bf16 all-gathers and gradients")
    p.add_argument("--gpu-tflops", type=float, default=312.0, help="peak dense TFLOP/s per GPU")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation of compute")
    p.add_argument(
        "--max-local-steps",
        type=int,
        default=8,
        help="largest T to consider (the paper finds T in 2..8 best)",
    )
    p.add_argument("--top", type=int, default=15, help="rows to print")


def plan_from_args(args: argparse.Namespace) -> int:
    from flower_shard.config.presets import PRESETS

    if args.model not in PRESETS:
        raise ConfigError(f"--model {args.model!r} is unknown; choose one of {', '.join(PRESETS)}")
    for flag in ("gpus", "gpus_per_node", "batch_size", "seq_len", "max_local_steps"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.gpus % args.gpus_per_node:
        raise ConfigError(f"--gpus {args.gpus} is not a multiple of --gpus-per-node")
    if (
        min(
            args.intra_node_gbps,
            args.inter_node_gbps,
            args.inter_site_gbps,
            args.gpu_tflops,
            args.mfu,
        )
        <= 0
    ):
        raise ConfigError("bandwidths, --gpu-tflops and --mfu must be > 0")
    params = model_params(args.model)
    tokens = args.batch_size * args.seq_len
    compute = 6 * params * tokens / (args.gpu_tflops * 1e12 * args.mfu)
    nbytes = 2 if args.bf16 else 4
    w = Workload(
        params=params,
        compute_s=compute,
        tokens_per_step=tokens,
        param_bytes=nbytes,
        grad_bytes=nbytes,
    )
    nodes = args.gpus // args.gpus_per_node
    net = Network(
        ranks_per_node=args.gpus_per_node,
        nodes_per_site=args.nodes_per_site or nodes,
        intra_node_bw=args.intra_node_gbps * 1e9 / 8,
        inter_node_bw=args.inter_node_gbps * 1e9 / 8,
        inter_site_bw=args.inter_site_gbps * 1e9 / 8,
        site_link_shared=args.site_link == "shared",
    )
    cands = candidates(w, net, args.gpus, max_local_steps=args.max_local_steps)
    print(
        f"{args.model}: {params / 1e9:.2f}B parameters, {args.gpus} GPUs "
        f"({args.gpus_per_node} per node, {net.nodes_per_site} nodes per site), "
        f"compute {compute * 1e3:.0f} ms per step"
    )
    print(format_table(cands, args.top))
    best = next((c for c in cands if c.layout.groups > 1), cands[0])
    lay = best.layout
    print(
        f"recommended: {best.sharding.upper()} groups, G={lay.groups} K={lay.group_size}"
        f"{f' R={lay.replicate}' if best.sharding == 'hsdp' else ''} T={lay.local_steps}: "
        f"{best.prediction.tokens_per_s:,.0f} tokens/s, {best.speedup:.2f}x over "
        f"{best.sharding.upper()} on all {args.gpus} GPUs, communication "
        f"{100 * best.prediction.comm_share:.0f}% of a step, inter-group "
        f"{100 * best.prediction.inter_byte_share:.2f}% of the bytes"
    )
    return 0
