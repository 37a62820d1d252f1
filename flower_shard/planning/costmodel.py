"""A cost model of FL+FSDP / FL+HSDP against FSDP / HSDP on a multi-tier network.

Pure functions, no torch (torch is imported by a Topology only to build a mesh). Notation: N
ranks, G groups of K ranks, K = R x S (HSDP replicate x shard), P parameters, T local steps per
round: a :class:`Layout`.

Bytes each rank sends, ring collectives (a ring all-gather or reduce-scatter over n ranks
moves (n-1)/n of the full tensor through every rank; an all-reduce twice that):

- inside a group, per step (FSDP2 with reshard after forward):
  ``allgathers`` x (S-1)/S x P x param_bytes   (forward and backward all-gathers)
  + (S-1)/S x P x grad_bytes                     (gradient reduce-scatter; twice that on gloo,
                                                  which runs it as an all-reduce)
  + 2 (R-1)/R x P/S x grad_bytes                 (HSDP: all-reduce of the shards across replicas)
- between groups, per round: 2 (G-1)/G x P/(S R) x 4 (one flat float32 all-reduce of the
  shards, striped over a group's R HSDP replicas, which then all-gather the stripes inside the
  group: (R-1)/R x P/S x 4 more intra-group bytes per round), so per step C_inter / T;
  compressed (bf16, int8: flower_shard.runtime.compression), a ring all-gather of the payloads
  instead, not striped, (G-1) x P/S x bytes per value (2, or 1 + 4 / chunk).

Times: a collective runs at the bandwidth of the slowest tier its ranks span (intra-node,
inter-node, inter-site), plus a latency term per ring step. A site's link is shared: when a
collective dimension crosses sites, all its parallel instances that leave one site (one per
rank of the site, up to the dimension's stride: S for HSDP's replicate all-reduce, K for the
outer sync, 1 for FSDP over all ranks) split that link's bandwidth. No overlap with compute
(an upper bound on the step time; ``overlap`` in [0, 1] hides that fraction of the intra-group
communication behind compute). Step time = compute + C_intra + C_inter / T. Throughput = N x
tokens per rank step / step time: the global batch of a group is B_local x K, not B_local x N,
so each group makes its own progress and throughput counts all N ranks.

Fragmented and overlapped outer sync (:mod:`flower_shard.runtime.streaming_sync`, the exchange
priced as above, striped or compressed): F fragments each move 1/F of the bytes, F times the
latency terms, so the same total time, spread over the round: each burst on the link carries 1/F
of the bytes (``extra["burst_bytes"]``, a group's bytes per fragment sync). Overlapped, a
round's exchange runs behind the next round's T steps: ``hidden = min(exchange, T x (compute +
C_intra))`` per round, and only the residual ``exchange - hidden`` holds the steps up. The model
assumes the exchange does not slow the steps down (on GPUs NCCL runs on its own stream; on CPU
gloo's thread competes with compute for cores, which the model does not price).
``extra["peak_link_share"]`` is the peak rate of the cross-group link as a share of its
bandwidth: 1 for an exchange sent at once (each burst goes at the link's rate, whatever F);
paced (``Layout.outer_pace``, :mod:`flower_shard.runtime.pacing`), the round's exchange spread
over ``WINDOW_SHARE`` of its T steps, ``min(1, exchange / (WINDOW_SHARE x T x step))``: the
same time is priced for pacing as for the overlap it paces.

The streaming transport (``Layout.transport``, :mod:`flower_shard.dataplane`) is priced as a
hub: every rank streams its shard's update to the aggregators and pulls the new values back.
The aggregators sit beside group 0 (as the ServerApp does), so the link in front of them
carries every group beyond it: G' x P values each way per round (G' groups beyond the hub's
node or site), at the uplink's and the downlink's bytes per value. Pipelined (the default
commit), the download runs one parameter behind the upload on a full-duplex link: the round
moves the larger of the two; otherwise the upload, then the download. For G = 2 across two
sites that is the ring all-reduce's time; for larger G the hub's link is G / 2 times busier
than a ring's. Fragments run on the collective transport only. ``Network.round_overhead_s``
adds what a round costs outside the steps and the bytes: Flower's control plane when a
deployment drives the rounds (0 for one torchrun job); overlap does not hide it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from flower_shard import protocol as P
from flower_shard.config import choices as C
from flower_shard.errors import ConfigError
from flower_shard.runtime.pacing import WINDOW_SHARE
from flower_shard.runtime.topology import Topology

PRICED_TRANSPORTS = (P.COLLECTIVE, P.STREAMING)
"""Transports the model prices (the flower transport sends whole models through Flower)."""
CONTROL_PLANE_S = 0.78
"""Flower's control plane per round, median (bench/control_plane.py, bench/RESULTS.md)."""


def default_round_overhead_s(transport: str) -> float:
    """``Network.round_overhead_s`` unless told otherwise: Flower's control plane for the
    streaming transport (a deployment drives its rounds), none for the collective one (priced
    as one torchrun job)."""
    return CONTROL_PLANE_S if transport == P.STREAMING else 0.0


@dataclass(frozen=True)
class Network:
    """Per-tier bandwidth (bytes/s, per link) and latency (s), and how ranks map onto tiers."""

    ranks_per_node: int = 8
    nodes_per_site: int = 1 << 30
    """Nodes in one site; a collective over more ranks than a site holds crosses sites."""
    intra_node_bw: float = 300e9
    inter_node_bw: float = 25e9
    inter_site_bw: float = 1.25e9
    intra_node_lat: float = 5e-6
    inter_node_lat: float = 20e-6
    inter_site_lat: float = 1e-3
    site_link_shared: bool = True
    """The inter-site bandwidth is one link per site, shared by every ring that leaves the
    site at once (a WAN link; the emulated sites of bench/multitier.py). False: per rank."""
    backend: str = "nccl"
    """The collective library: ``nccl`` (ring reduce-scatter) or ``gloo`` (reduce-scatter as
    an all-reduce: twice the bytes)."""
    round_overhead_s: float = 0.0
    """Seconds a round spends on control outside the steps and the exchange's bytes: Flower's
    control plane where a deployment drives the rounds (:data:`CONTROL_PLANE_S`); 0 for one
    torchrun job."""

    def tier(self, span: int, stride: int = 1) -> tuple[float, float]:
        """(bandwidth per ring, latency) of a collective over ``span`` ranks ``stride`` apart.

        Ranks are laid out node by node, site by site; the collective touches ranks
        ``0, stride, ..., (span-1) * stride``, and the same collective runs at once on every
        offset (the other instances of its mesh dimension).
        """
        extent = (span - 1) * stride + 1
        site = self.ranks_per_node * self.nodes_per_site
        if extent <= self.ranks_per_node:
            return self.intra_node_bw, self.intra_node_lat
        if extent <= site:
            return self.inter_node_bw, self.inter_node_lat
        rings = min(stride, site) if self.site_link_shared else 1
        return self.inter_site_bw / rings, self.inter_site_lat


@dataclass(frozen=True)
class Workload:
    """The model and the per-rank step."""

    params: int
    """P: parameters of the model."""
    compute_s: float
    """Seconds of forward + backward + optimizer per step on one rank, communication excluded."""
    tokens_per_step: int
    """Tokens one rank processes per step (B_local x seq_len)."""
    param_bytes: int = 4
    """Bytes per parameter in the all-gathers (2 with bf16 compute)."""
    grad_bytes: int = 4
    """Bytes per gradient element in the reduce-scatter / all-reduce: 4 even with bf16
    compute, since the runtime reduces in float32 (``parallelize``: ``reduce_dtype``)."""
    allgathers: float = 2.0
    """All-gathers of every parameter per step (2 with reshard after forward)."""
    overlap: float = 0.0
    """Fraction of the intra-group communication hidden behind compute."""
    compression: str = C.NO_COMPRESSION
    """The outer sync's payload: `none` (float32 all-reduce), `bf16` or `int8` (all-gather)."""
    compression_chunk: int = 2048
    """int8: values per float32 scale."""
    downlink_compression: str = C.NO_COMPRESSION
    """The streaming transport's download of the new values: `none` (float32), or the delta
    in `bf16` / `int8` (run-config ``downlink-compression``)."""

    @property
    def exchange_value_bytes(self) -> float:
        """Bytes per value of the outer sync's payload."""
        return value_bytes(self.compression, self.compression_chunk)

    @property
    def downlink_value_bytes(self) -> float:
        """Bytes per value of the streaming transport's download."""
        return value_bytes(self.downlink_compression, self.compression_chunk)


def value_bytes(compression: str, chunk: int) -> float:
    """Bytes per value of a payload: float32, bf16, or int8 with a float32 scale per chunk."""
    return {C.NO_COMPRESSION: 4.0, C.BF16: 2.0, C.INT8: 1.0 + 4.0 / chunk}[compression]


@dataclass(frozen=True)
class Layout(Topology):
    """A run's parallel degrees and its T: the :class:`~flower_shard.runtime.topology.Topology`
    that a real run builds its mesh from (N = G x K, K = R x S, checked on construction:
    :class:`~flower_shard.errors.ConfigError` names the degree that does not divide), plus the
    local steps per round that the cost model divides the exchange by."""

    local_steps: int = 1
    """T: inner steps per round; the outer sync costs 1 / T of itself per step."""
    outer_fragments: int = 1
    """F: the outer sync in F fragments staggered over the round."""
    outer_overlap: bool = False
    """The outer sync runs behind the next round's steps (one sync of delay)."""
    outer_pace: bool = False
    """The overlapped sync spread over its window instead of sent at once."""
    transport: str = P.COLLECTIVE
    """How groups exchange: ``collective`` (all-reduce between groups) or ``streaming``
    (through the aggregators: see the module docstring)."""
    pipelined: bool = True
    """Streaming: the download follows the upload (the pipelined commit), else it waits."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.transport not in PRICED_TRANSPORTS:
            raise ConfigError(
                f"the cost model prices transports {PRICED_TRANSPORTS}, not {self.transport!r}"
            )
        if self.outer_pace and (not self.outer_overlap or self.transport != P.COLLECTIVE):
            raise ConfigError(
                "pacing spreads an overlapped sync of the collective transport: set "
                "outer_overlap = True and transport = 'collective', or outer_pace = False"
            )
        if self.transport == P.STREAMING and self.outer_fragments > 1:
            raise ConfigError(
                "fragments run on the collective transport only: set outer_fragments = 1 "
                "with transport = 'streaming'"
            )


@dataclass(frozen=True)
class Prediction:
    step_s: float
    intra_s: float
    """Intra-group communication per step (after overlap)."""
    inter_s: float
    """Inter-group exchange per step (C_inter / T)."""
    intra_bytes: float
    """Bytes each rank sends inside its group per step."""
    inter_bytes: float
    """Bytes each rank sends to other groups per step (per round / T)."""
    tokens_per_s: float
    extra: dict = field(default_factory=dict)

    @property
    def comm_share(self) -> float:
        return (self.intra_s + self.inter_s) / self.step_s

    @property
    def inter_byte_share(self) -> float:
        total = self.intra_bytes + self.inter_bytes
        return self.inter_bytes / total if total else 0.0


def ring_fraction(n: int) -> float:
    """Fraction of the tensor a rank sends in a ring all-gather / reduce-scatter over n ranks."""
    return (n - 1) / n if n > 1 else 0.0


def sent_bytes(kind: str, payload: float, n: int, backend: str = "nccl") -> float:
    """Bytes one rank sends in one collective over ``n`` ranks whose ``payload`` is the
    all-gather's input, the reduce-scatter's input or the all-reduce's tensor, in bytes.

    A ring all-gather sends (n-1) x the input; a reduce-scatter (n-1)/n of it on NCCL, and
    2 (n-1)/n on gloo, which runs it as an all-reduce and keeps a chunk
    (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``); an all-reduce 2 (n-1)/n."""
    if kind == "allgather":
        return (n - 1) * payload
    if kind == "reduce_scatter":
        return (2 if backend == "gloo" else 1) * ring_fraction(n) * payload
    return 2 * ring_fraction(n) * payload


def intra_group_bytes(w: Workload, lay: Layout, backend: str = "nccl") -> dict[str, float]:
    """Bytes each rank sends inside its group in one step, per collective (the names of
    :mod:`flower_shard.runtime.intra_comm`, which counts them in a real run)."""
    s, r = lay.shard_degree, lay.replicate
    return {
        "allgather": w.allgathers * sent_bytes("allgather", w.params * w.param_bytes / s, s),
        "reduce_scatter": sent_bytes("reduce_scatter", w.params * w.grad_bytes, s, backend),
        "replicate_allreduce": sent_bytes("allreduce", w.params * w.grad_bytes / s, r),
    }


def outer_sync_bytes(w: Workload, lay: Layout) -> float:
    """Bytes each rank sends to other groups in one outer sync: its 1/R stripe of the float32
    shards in a ring all-reduce over G, or compressed shards in a ring all-gather (every group
    needs every payload to decode; not striped); streaming: its 1/K of the model, uploaded."""
    if lay.groups == 1:
        return 0.0
    if lay.transport == P.STREAMING:
        return w.params * w.exchange_value_bytes / lay.group_size
    if w.compression == C.NO_COMPRESSION:
        return 2 * ring_fraction(lay.groups) * w.params * 4 / lay.group_size
    return (lay.groups - 1) * w.params * w.exchange_value_bytes / lay.shard_degree


def outer_stripe_gather_bytes(w: Workload, lay: Layout) -> float:
    """Bytes each rank sends inside its group in one outer sync: the all-gather of the averaged
    stripes among the R replicas (none for FSDP, compressed syncs or G = 1)."""
    if lay.groups == 1 or w.compression != C.NO_COMPRESSION or lay.transport == P.STREAMING:
        return 0.0
    return sent_bytes("allgather", w.params * 4 / lay.group_size, lay.replicate)


def hub_link(net: Network, lay: Layout) -> tuple[float, float, int]:
    """The link in front of the aggregators, which sit beside group 0: its bandwidth, its
    latency, and how many groups lie beyond it (on other nodes, or other sites)."""
    g, k = lay.groups, lay.group_size
    node, site = net.ranks_per_node, net.ranks_per_node * net.nodes_per_site
    if g * k <= node:
        return net.intra_node_bw, net.intra_node_lat, g - 1
    if g * k <= site:  # a path per rank of the hub's node, as a collective has
        return net.inter_node_bw * min(k, node), net.inter_node_lat, g - max(1, node // k)
    paths = 1 if net.site_link_shared else min(k, site)
    return net.inter_site_bw * paths, net.inter_site_lat, g - max(1, site // k)


def streaming_exchange_s(w: Workload, lay: Layout, net: Network) -> float:
    """One round's exchange through the aggregators (see the module docstring): the groups
    beyond the hub's link upload P values each and download P values each across it."""
    if lay.groups == 1:
        return 0.0
    bw, lat, beyond = hub_link(net, lay)
    up = beyond * w.params * w.exchange_value_bytes / bw
    down = beyond * w.params * w.downlink_value_bytes / bw
    return (max(up, down) if lay.pipelined else up + down) + 2 * lat


def _collective_s(nbytes: float, n: int, bw: float, lat: float, steps_per_rank: int) -> float:
    return 0.0 if n <= 1 or nbytes == 0 else nbytes / bw + steps_per_rank * (n - 1) * lat


def predict(w: Workload, lay: Layout, net: Network) -> Prediction:
    """Step time, communication and throughput of one layout."""
    s, r, g = lay.shard_degree, lay.replicate, lay.groups
    b = intra_group_bytes(w, lay, net.backend)
    # Shard dim: S consecutive ranks; replicate dim: R ranks S apart; groups: G ranks K apart.
    bw_s, lat_s = net.tier(s)
    bw_r, lat_r = net.tier(r, stride=s)
    bw_g, lat_g = net.tier(g, stride=lay.group_size)
    intra = (
        _collective_s(b["allgather"], s, bw_s, lat_s, int(round(w.allgathers)))
        + _collective_s(b["reduce_scatter"], s, bw_s, lat_s, 2 if net.backend == "gloo" else 1)
        + _collective_s(b["replicate_allreduce"], r, bw_r, lat_r, 2)
    ) * (1.0 - w.overlap)
    gather = outer_stripe_gather_bytes(w, lay)  # once a round, not overlapped
    intra += _collective_s(gather, r, bw_r, lat_r, 1) / lay.local_steps
    ring_steps = 2 if w.compression == C.NO_COMPRESSION else 1  # all-reduce vs all-gather
    f = lay.outer_fragments
    if lay.transport == P.STREAMING:
        exchange = streaming_exchange_s(w, lay, net)
    else:
        exchange = f * _collective_s(outer_sync_bytes(w, lay) / f, g, bw_g, lat_g, ring_steps)
    hidden = min(exchange, lay.local_steps * (w.compute_s + intra)) if lay.outer_overlap else 0.0
    control = net.round_overhead_s if g > 1 else 0.0  # one job of G = 1 has no rounds
    inter = (exchange - hidden + control) / lay.local_steps
    step = w.compute_s + intra + inter
    burst = lay.group_size * outer_sync_bytes(w, lay) / f  # one group's bytes per fragment sync
    peak = 1.0 if exchange > 0 else 0.0
    if lay.outer_pace and exchange > 0:
        peak = min(1.0, outer_sync_bytes(w, lay) / bw_g / (WINDOW_SHARE * lay.local_steps * step))
    return Prediction(
        step_s=step,
        intra_s=intra,
        inter_s=inter,
        intra_bytes=sum(b.values()) + gather / lay.local_steps,
        inter_bytes=outer_sync_bytes(w, lay) / lay.local_steps,
        tokens_per_s=lay.world_size * w.tokens_per_step / step,
        extra={
            "bytes": b,
            "exchange_s": exchange,
            "hidden_s": hidden,
            "burst_bytes": burst,
            "peak_link_share": peak,
        },
    )


def speedup(w: Workload, fl: Layout, net: Network) -> float:
    """Throughput of ``fl`` over the same N ranks as one FSDP/HSDP job (G = 1, T = 1)."""
    base = dataclasses.replace(fl, groups=1, local_steps=1)
    return predict(w, fl, net).tokens_per_s / predict(w, base, net).tokens_per_s


def llama_params(
    hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, vocab: int, tied: bool = False
) -> int:
    """Parameters of a Llama decoder (no biases; RMSNorm weights included)."""
    head_dim = hidden // heads
    attn = hidden * hidden * 2 + 2 * hidden * kv_heads * head_dim
    block = attn + 3 * hidden * mlp + 2 * hidden
    return layers * block + vocab * hidden * (1 if tied else 2) + hidden
