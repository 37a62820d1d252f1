"""``flower-shard plan``: rank candidate (G, K, T, sharding) layouts with the cost model.

Example, the paper's setting (512 A100 in nodes of 4, Llama 3.1 8B, bf16, batch 2 x 2048):

    flower-shard plan --model llama3.1-8b --gpus 512 --gpus-per-node 4 --nodes-per-site 32 \\
        --intra-node-gbps 2400 --inter-node-gbps 200 --inter-site-gbps 10 --bf16

Every layout is priced twice: its step time and throughput by
:mod:`~flower_shard.planning.costmodel` (``--transport``: the collective all-reduce between the
groups of one job, or the streaming transport's aggregators with Flower's control plane each
round), its memory per GPU by :mod:`~flower_shard.planning.memory` (as a collective run's ranks
hold it). Layouts whose peak exceeds ``--gpu-memory`` are marked and never recommended; the
table lists the layouts that fit first, fastest first.
Speed-ups are against the best G = 1 layout that fits (plain FSDP or HSDP over all GPUs), the
run a user would otherwise start. bf16 is priced as the runtime runs it
(``runtime/parallelize.py``: bf16 all-gathers, float32 gradient reduction).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from flower_shard import protocol as P
from flower_shard.config import choices as C
from flower_shard.planning.costmodel import (
    Layout,
    Network,
    Prediction,
    Workload,
    default_round_overhead_s,
    predict,
)
from flower_shard.planning.memory import GB, MemoryEstimate, ModelShape, StepSetup, estimate
from flower_shard.planning.plan_flags import SHARED, check_plan_args


@dataclass(frozen=True)
class MemoryBudget:
    """What a layout's memory is priced from, and the memory of one GPU."""

    shape: ModelShape
    setup: StepSetup
    gpu_bytes: float
    reserved: float = 0.0
    """Bytes per GPU kept free (CUDA context, NCCL buffers, fragmentation)."""

    def of(self, lay: Layout) -> MemoryEstimate:
        return estimate(
            self.shape,
            self.setup,
            lay.shard_degree,
            lay.groups,
            lay.replicate,
            self.reserved,
            lay.outer_overlap,
            lay.transport,
        )


@dataclass(frozen=True)
class Candidate:
    """One layout the planner considered, with the cost model's prediction and its memory."""

    layout: Layout
    prediction: Prediction
    memory: MemoryEstimate
    fits: bool
    """The peak per GPU is within the budget."""
    speedup: float = 0.0
    """Throughput over the best G = 1 layout that fits (see :func:`rank`)."""


def candidates(
    w: Workload,
    net: Network,
    world: int,
    budget: MemoryBudget,
    local_steps=(1, 2, 4, 8, 16),
    max_local_steps: int = 8,
    transport: str = P.COLLECTIVE,
) -> list[Candidate]:
    """Every FSDP / HSDP layout with G dividing N and T in ``local_steps`` (T <= max), its
    groups exchanging over ``transport``, ranked by :func:`rank`."""
    out = []
    node = net.ranks_per_node
    for g in (d for d in range(1, world + 1) if world % d == 0):
        k = world // g
        shardings = [(C.FSDP, 1)]
        if k % node == 0 and k > node:  # HSDP: shard inside a node, replicate across nodes
            shardings.append((C.HSDP, k // node))
        for sharding, r in shardings:
            for t in local_steps if g > 1 else (1,):
                if t > max_local_steps:
                    continue
                for overlap in _overlaps(g):
                    lay = Layout(
                        world,
                        g,
                        sharding,
                        r,
                        local_steps=t,
                        outer_overlap=overlap,
                        transport=transport,
                    )
                    memory = budget.of(lay)
                    fits = memory.fits(budget.gpu_bytes)
                    out.append(Candidate(lay, predict(w, lay, net), memory, fits))
    return rank(out)


def _overlaps(groups: int) -> tuple[bool, ...]:
    """The outer sync's schedules a layout can run: overlapped too where there is an outer sync
    (G > 1; FSDP or HSDP, any compression: :mod:`flower_shard.runtime.streaming_sync`)."""
    return (False, True) if groups > 1 else (False,)


def best_baseline(cands: list[Candidate]) -> Candidate:
    """The fastest G = 1 layout that fits; the fastest G = 1 layout when none fits."""
    g1 = [c for c in cands if c.layout.groups == 1]
    fitting = [c for c in g1 if c.fits] or g1
    return max(fitting, key=lambda c: c.prediction.tokens_per_s)


def rank(cands: list[Candidate]) -> list[Candidate]:
    """Layouts that fit first, then by throughput; each with its speed-up over
    :func:`best_baseline`."""
    base = best_baseline(cands).prediction.tokens_per_s
    out = [
        Candidate(c.layout, c.prediction, c.memory, c.fits, c.prediction.tokens_per_s / base)
        for c in cands
    ]
    return sorted(out, key=lambda c: (not c.fits, -c.prediction.tokens_per_s))


def recommended(cands: list[Candidate]) -> Candidate | None:
    """The fastest layout with groups (G > 1) that fits, else the fastest G = 1 one that fits;
    None when nothing fits."""
    fitting = [c for c in cands if c.fits]
    return next((c for c in fitting if c.layout.groups > 1), fitting[0] if fitting else None)


def format_table(cands: list[Candidate], top: int = 15) -> str:
    """The ranked layouts; ``vs best G=1`` is :attr:`Candidate.speedup`."""
    rows = [
        f"{'sharding':8s} {'G':>5s} {'K':>5s} {'R':>3s} {'T':>3s} {'ovl':>3s} {'tokens/s':>12s} "
        f"{'step s':>8s} {'comm %':>7s} {'inter bytes %':>14s} {'vs best G=1':>12s} "
        f"{'mem/GPU GB':>11s} {'fits':>4s}"
    ]
    for c in cands[:top]:
        lay, p = c.layout, c.prediction
        rows.append(
            f"{lay.sharding:8s} {lay.groups:5d} {lay.group_size:5d} {lay.replicate:3d} "
            f"{lay.local_steps:3d} {'yes' if lay.outer_overlap else 'no':>3s} "
            f"{p.tokens_per_s:12,.0f} {p.step_s:8.3f} "
            f"{100 * p.comm_share:6.1f}% {100 * p.inter_byte_share:13.2f}% "
            f"{c.speedup:11.2f}x {c.memory.peak / GB:11.1f} {'yes' if c.fits else 'no':>4s}"
        )
    return "\n".join(rows)


def describe(c: Candidate) -> str:
    """``HSDP G=4 K=128 R=32 T=8``."""
    lay = c.layout
    r = f" R={lay.replicate}" if lay.sharding == C.HSDP else ""
    t = f" T={lay.local_steps}" if lay.groups > 1 else ""
    head = f"{lay.sharding.upper()} G={lay.groups} K={lay.group_size}{r}{t}"
    if lay.groups > 1 and lay.transport == P.STREAMING:  # a Flower run's config keys
        return head + " streaming" + (f" {P.OUTER_OVERLAP}=true" if lay.outer_overlap else "")
    return head + (" --outer-overlap" if lay.outer_overlap else "")


def summary_lines(cands: list[Candidate], gpu_gb: float) -> list[str]:
    """The baseline, what does not fit, and the recommendation, one line each."""
    base = best_baseline(cands)
    fits = "" if base.fits else f" (it does not fit in {gpu_gb:g} GB either)"
    lines = [
        f"speed-ups against the best G=1 layout, {describe(base)}: "
        f"{base.prediction.tokens_per_s:,.0f} tokens/s, {base.memory.peak / GB:.1f} GB/GPU{fits}"
    ]
    too_big = [c for c in cands if not c.fits]
    if too_big:
        fastest = max(too_big, key=lambda c: c.prediction.tokens_per_s)
        lines.append(
            f"{len(too_big)} of {len(cands)} layouts need more than {gpu_gb:g} GB per GPU and "
            f"are not recommended (fastest of them: {describe(fastest)}, "
            f"{fastest.memory.peak / GB:.1f} GB/GPU)"
        )
    best = recommended(cands)
    if best is None:
        lines.append(
            f"recommended: none; no layout fits in {gpu_gb:g} GB per GPU: use more GPUs or "
            "GPUs with more memory, a smaller --batch-size or --seq-len, or --bf16"
        )
        return lines
    p = best.prediction
    lines.append(
        f"recommended: {describe(best)}: {p.tokens_per_s:,.0f} tokens/s, {best.speedup:.2f}x "
        f"over {describe(base)}, {best.memory.peak / GB:.1f} GB/GPU{_host(best)}, communication "
        f"{100 * p.comm_share:.0f}% of a step, inter-group {100 * p.inter_byte_share:.2f}% of "
        "the bytes"
    )
    return lines


def _host(c: Candidate) -> str:
    """The host memory a rank's exchange keeps (the streaming transport's view), if any."""
    return f" (+ {c.memory.host / GB:.1f} GB of host memory per rank)" if c.memory.host else ""


def plan_from_args(args: argparse.Namespace) -> int:
    """``flower-shard plan``: check the flags, rank the layouts, print the table and the pick."""
    from flower_shard.planning.shapes import model_shape

    check_plan_args(args)
    shape = model_shape(args.model, args.seq_len)
    w, net = workload_and_network(args, shape.params)
    budget = MemoryBudget(shape, step_setup(args), args.gpu_memory * GB, args.reserved_gb * GB)
    cands = candidates(
        w, net, args.gpus, budget, max_local_steps=args.max_local_steps, transport=args.transport
    )
    print(
        f"{args.model}: {_count(w.params)} parameters, {args.gpus} GPUs "
        f"({args.gpus_per_node} per node, {net.nodes_per_site} node(s) per site, "
        f"{args.gpu_memory:g} GB each), compute {w.compute_s * 1e3:.0f} ms per step, "
        f"{'bf16' if args.bf16 else 'fp32'}, outer {args.outer}, {args.transport} transport "
        f"({net.round_overhead_s:g} s of control a round)"
    )
    print(format_table(cands, args.top))
    for line in summary_lines(cands, args.gpu_memory):
        print(line)
    return 0


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def step_setup(args: argparse.Namespace) -> StepSetup:
    """What the memory model needs of a rank's step, from the flags (GPU: foreach AdamW)."""
    return StepSetup(
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        bf16=args.bf16,
        activation_checkpointing=args.activation_checkpointing,
        outer=args.outer,
        compression=args.compression,
    )


def workload_and_network(args: argparse.Namespace, params: int) -> tuple[Workload, Network]:
    """The cost model's inputs from the flags: compute from 6 x P x tokens FLOPs per step.

    bf16 as ``parallelize`` runs it: parameters all-gathered in bf16 (2 bytes), gradients
    reduced in float32 (``reduce_dtype=torch.float32``: 4 bytes, HSDP's all-reduce too).
    """
    tokens = args.batch_size * args.seq_len
    w = Workload(
        params=params,
        compute_s=6 * params * tokens / (args.gpu_tflops * 1e12 * args.mfu),
        tokens_per_step=tokens,
        param_bytes=2 if args.bf16 else 4,
        grad_bytes=4,
        compression=args.compression,
        downlink_compression=args.downlink_compression,
    )
    overhead = args.round_overhead_s
    if overhead is None:
        overhead = default_round_overhead_s(args.transport)
    net = Network(
        ranks_per_node=args.gpus_per_node,
        nodes_per_site=args.nodes_per_site or args.gpus // args.gpus_per_node,
        intra_node_bw=args.intra_node_gbps * 1e9 / 8,
        inter_node_bw=args.inter_node_gbps * 1e9 / 8,
        inter_site_bw=args.inter_site_gbps * 1e9 / 8,
        site_link_shared=args.site_link == SHARED,
        round_overhead_s=overhead,
    )
    return w, net
