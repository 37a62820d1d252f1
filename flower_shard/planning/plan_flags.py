"""The flags of ``flower-shard plan`` (:mod:`~flower_shard.planning.planner`) and their checks:
the cluster, the model and its step, and the exchange between groups."""

from __future__ import annotations

import argparse
import math

from flower_shard import protocol as P
from flower_shard.config import choices as C
from flower_shard.errors import ConfigError
from flower_shard.planning.costmodel import CONTROL_PLANE_S, PRICED_TRANSPORTS, Workload

SHARED, PER_RANK = "shared", "per-rank"
SITE_LINKS = (SHARED, PER_RANK)
"""--site-link: how the inter-site bandwidth is split (Network.site_link_shared)."""


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``flower-shard plan``: the cluster, then the model and its step."""
    _add_cluster_flags(p)
    _add_step_flags(p)
    p.add_argument(
        "--max-local-steps",
        type=int,
        default=8,
        help="largest T to consider (the paper finds T in 2..8 best)",
    )
    p.add_argument("--top", type=int, default=15, help="rows to print")
    p.add_argument(
        "--transport",
        choices=PRICED_TRANSPORTS,
        default=P.COLLECTIVE,
        help="how groups exchange: collective (all-reduce between the groups of one job) or "
        "streaming (through aggregators beside group 0, rounds driven by Flower)",
    )
    p.add_argument(
        "--round-overhead-s",
        type=float,
        default=None,
        help="seconds of control per round outside the steps and the bytes (default: Flower's "
        f"control plane, {CONTROL_PLANE_S} s, with --transport streaming; 0 with collective)",
    )
    p.add_argument(
        "--downlink-compression",
        choices=C.COMPRESSIONS,
        default=C.NO_COMPRESSION,
        help="--transport streaming: the payload of the new values' download",
    )


def _add_cluster_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, default=512, help="N: all ranks")
    p.add_argument("--gpus-per-node", type=int, default=4)
    p.add_argument(
        "--nodes-per-site",
        type=int,
        default=None,
        help="nodes in one site; divides the nodes (default: all nodes in one site)",
    )
    p.add_argument("--intra-node-gbps", type=float, default=2400.0, help="per link, Gbit/s")
    p.add_argument("--inter-node-gbps", type=float, default=200.0, help="per link, Gbit/s")
    p.add_argument("--inter-site-gbps", type=float, default=10.0, help="per link, Gbit/s")
    p.add_argument(
        "--site-link",
        choices=SITE_LINKS,
        default=SHARED,
        help="shared: one link per site, split by every ring that leaves it at once (a WAN "
        "link; what bench/multitier.py emulates and validates); per-rank: each GPU has its "
        "own inter-site path at --inter-site-gbps",
    )
    p.add_argument("--gpu-tflops", type=float, default=312.0, help="peak dense TFLOP/s per GPU")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation, in (0, 1]")
    p.add_argument("--gpu-memory", type=float, default=80.0, help="GB of memory per GPU")
    p.add_argument(
        "--reserved-gb",
        type=float,
        default=2.0,
        help="GB per GPU kept free for the CUDA context, NCCL buffers and fragmentation",
    )


def _add_step_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="llama3.1-8b",
        help="a preset (flower_shard/config/presets.py) or a local transformers model directory "
        "(config.json, with or without weights), as `train` takes it",
    )
    p.add_argument("--batch-size", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 compute as `train --bf16` runs it: bf16 all-gathers and activations, "
        "float32 gradient reduce-scatters, weights and optimizer state",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="price activations as with every decoder layer checkpointed (a what-if: `train` "
        "does not checkpoint activations)",
    )
    p.add_argument(
        "--outer",
        choices=C.OUTER_OPTIMIZERS,
        default=C.FEDAVG,
        help="the outer optimizer (nesterov keeps two more float32 copies of a rank's shard)",
    )
    p.add_argument(
        "--compression",
        choices=C.COMPRESSIONS,
        default=Workload.compression,
        help="the outer sync's payload between groups: float32 all-reduce (none), or a bf16 / "
        "int8 all-gather (flower_shard/runtime/compression.py)",
    )


def check_plan_args(args: argparse.Namespace) -> None:
    """Raise :class:`ConfigError` (one line) on the first wrong flag."""
    for flag in ("gpus", "gpus_per_node", "batch_size", "seq_len", "max_local_steps", "top"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.gpus % args.gpus_per_node:
        raise ConfigError(f"--gpus {args.gpus} is not a multiple of --gpus-per-node")
    nodes = args.gpus // args.gpus_per_node
    sites = args.nodes_per_site
    if sites is not None and (sites < 1 or nodes % sites):
        raise ConfigError(
            f"--nodes-per-site {sites} must divide the {nodes} nodes (--gpus / --gpus-per-node)"
        )
    numbers = ("intra_node_gbps", "inter_node_gbps", "inter_site_gbps", "gpu_tflops")
    for flag in (*numbers, "mfu", "gpu_memory", "reserved_gb"):
        if not math.isfinite(getattr(args, flag)):
            raise ConfigError(f"--{flag.replace('_', '-')} must be a finite number")
    for flag in (*numbers, "gpu_memory"):
        if getattr(args, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be > 0")
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu {args.mfu:g} must be in (0, 1]: a share of the peak FLOP/s")
    if not 0 <= args.reserved_gb < args.gpu_memory:
        raise ConfigError("--reserved-gb must be >= 0 and less than --gpu-memory")
    overhead = args.round_overhead_s
    if overhead is not None and not (math.isfinite(overhead) and overhead >= 0):
        raise ConfigError(f"--round-overhead-s {overhead:g} must be a finite number >= 0")
    if args.downlink_compression != C.NO_COMPRESSION and args.transport != P.STREAMING:
        raise ConfigError(
            "--downlink-compression prices the streaming transport's download: add "
            "--transport streaming, or drop it"
        )
