"""Memory per GPU of one rank: the model the planner checks every layout against.

Pure arithmetic (no torch). It prices what the runtime holds, as it runs: parameters sharded by
FSDP2 over the S ranks of the ``shard`` mesh dimension (``parallelize``: each decoder layer one
unit, then the root with the embeddings, the final norm and the LM head), float32 sharded
parameters and gradients (with ``--bf16`` only the gathered copies and the activations are
bfloat16: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)``), AdamW, and the
outer optimizer on the rank's flat shard (:mod:`flower_shard.runtime.outer_sync`). Notation:
P parameters, S shard degree (K for FSDP, K / R for HSDP), G groups, t = B x seq tokens per
rank step, h hidden size, q = heads x head_dim, kv = kv_heads x head_dim, i the MLP's
intermediate size, V the vocabulary, L layers, a the compute dtype's bytes (2 bf16, 4 fp32).

Held all the time (``persistent``):

- weights ``4P/S``: the float32 shards (they are also AdamW's "master" weights: there is no
  other copy; nothing of a parameter or its state is left unsharded, except the rotary tables);
- AdamW ``8P/S``: ``exp_avg`` and ``exp_avg_sq``, float32, sharded like the weights;
- the outer optimizer (G > 1), on the rank's flat shard: nesterov ``8P/S`` (the last global
  weights and SGD's momentum); fedavg nothing, or ``4P/S`` global weights with compression,
  plus ``4P/S`` for error feedback's residual; with the overlapped sync, ``8P/S`` more (what the
  rank sent and the buffer being reduced, held for a round).

Then the largest of three phases, which never overlap:

- forward and backward: the activations (below), the loss's transient ``8 t V`` (at the start
  of backward the log-probs' gradient and the logits' gradient, float32, next to the saved
  log-probs), and the gathered compute copies ``a (P_root + 2 P_layer)`` (FSDP2 keeps the root
  unsharded from forward to backward and the last layer too; one more layer is in flight or
  prefetched) plus the LM head's unsharded gradient ``a V h`` made at the start of backward;
- the optimizer step: the sharded float32 gradients ``4P/S`` (they exist from the end of
  backward to ``zero_grad(set_to_none=True)``, never next to the activations) and, with
  PyTorch's multi-tensor (foreach) AdamW, the GPU default, one more ``4P/S`` temporary
  (``sqrt(exp_avg_sq)`` of every tensor at once);
- the outer sync (G > 1, the collective transport): the flat float32
  buffer of the rank's shard ``4n`` (n = P/S, 3P/S with the AdamW moments synced), HSDP's
  striped copy ``4n (1 + 1/R)``, nesterov's pseudo-gradient ``4P/S``; compressed (an all-gather
  of payloads): four float32 temporaries of ``4P/S`` and ``G + 1`` payloads. Pacing
  (``--outer-pace``) sends pieces of the same buffers: nothing more.

The streaming transport (:mod:`flower_shard.dataplane.rank`) keeps none of that on the GPU: the
outer optimizer runs on the aggregators, and a rank's exchange state is host memory
(``host``, not in the GPU's peak): its view of the global model ``4P/S`` (every HSDP replica
has one), the error-feedback residual ``4P/S`` when compressed (replica 0), and the overlapped
round's snapshot ``4P/S``. The pull and the push move one piece (one parameter's shard) at a
time between host and GPU; that transient is left out.

Activations (:func:`layer_activation_bytes`) are the tensors autograd saves, counted on
``transformers``' ``LlamaDecoderLayer`` with SDPA attention (q, k, v, the output and the
log-sum-exp are saved, never the t x t scores): per token and layer

    2 (4h + 2ah + 4)        the two RMSNorms: a float32 copy of the input, the normalised and
                            the scaled output, the reciprocal RMS
    + a (2q + 2kv) + 4 heads    attention: rotated q and k, v, the output, the log-sum-exp
    + 4 a i                 the SwiGLU MLP: gate, up, SiLU(gate), their product

which is Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(2022), section 4.1's per-layer count (34 s b h + 5 a s^2 b for GPT-3 in 16 bits) redone for a
Llama layer with flash-style attention. Plus the head: the final norm, the float32 log-probs
``4 t V`` and the token ids. With activation checkpointing of every decoder layer
(``torch.utils.checkpoint``), each layer keeps only its input ``a t h`` and one layer's
activations are rebuilt at a time during backward: ``L a t h + one layer + head``. The count
was checked tensor by tensor with ``torch.autograd.graph.saved_tensors_hooks`` (exact for the
tiny and small presets, fp32 and bf16, transformers 5.25); GPU kernels may keep other
workspaces (cuBLAS, NCCL), priced only through ``reserved``.

On failure: nothing here raises on a valid shape; the planner validates its flags first.
"""

from __future__ import annotations

from dataclasses import dataclass

from flower_shard import protocol as P
from flower_shard.config import choices as C

GB = 1e9


@dataclass(frozen=True)
class ModelShape:
    """The architecture the memory model needs: sizes of a decoder-only transformer.

    ``params`` and ``layer_params`` are the exact counts when known (a model built on the meta
    device); :func:`llama_shape` computes them for a Llama.
    """

    params: int
    """P: every parameter."""
    layer_params: int
    """Parameters of one decoder layer (one FSDP unit)."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int
    tied: bool = False
    """The LM head shares the embedding's weights."""

    @property
    def root_params(self) -> int:
        """The root FSDP unit: everything outside the decoder layers (embeddings, final norm,
        LM head)."""
        return self.params - self.layers * self.layer_params


def llama_shape(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    tied: bool = False,
    head_dim: int | None = None,
) -> ModelShape:
    """A Llama decoder's shape (no biases; RMSNorm weights included)."""
    hd = head_dim or hidden // heads
    attn = 2 * hidden * heads * hd + 2 * hidden * kv_heads * hd
    layer = attn + 3 * hidden * intermediate + 2 * hidden
    params = layers * layer + vocab * hidden * (1 if tied else 2) + hidden
    return ModelShape(params, layer, layers, hidden, heads, kv_heads, intermediate, vocab, hd, tied)


@dataclass(frozen=True)
class StepSetup:
    """What one rank runs: its batch and the options that change its memory."""

    batch_size: int
    seq_len: int
    bf16: bool = False
    activation_checkpointing: bool = False
    outer: str = C.FEDAVG
    compression: str = C.NO_COMPRESSION
    compression_chunk: int = 2048
    error_feedback: bool = True
    sync_optimizer_state: bool = False
    foreach: bool = True
    """AdamW's multi-tensor step, PyTorch's default on GPU (one full-size temporary); CPU runs
    the per-tensor loop (False: only the largest tensor's temporaries, left out)."""

    @property
    def tokens(self) -> int:
        """t: tokens one rank processes per step."""
        return self.batch_size * self.seq_len

    @property
    def act_bytes(self) -> int:
        """a: bytes per element of the compute dtype."""
        return 2 if self.bf16 else 4


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU of one rank, by what holds them (see the module docstring)."""

    weights: float
    adamw: float
    outer_state: float
    activations: float
    logits: float
    gathered: float
    gradients: float
    optimizer_temp: float
    exchange: float
    reserved: float = 0.0
    """Kept free for the CUDA context, NCCL's buffers and the allocator's fragmentation."""
    host: float = 0.0
    """Host memory (CPU RAM) of the rank's exchange state, not on the GPU: the streaming
    transport's view, residual and snapshot."""

    @property
    def persistent(self) -> float:
        return self.weights + self.adamw + self.outer_state + self.reserved

    @property
    def forward_backward(self) -> float:
        return self.activations + self.logits + self.gathered

    @property
    def optimizer_step(self) -> float:
        return self.gradients + self.optimizer_temp

    @property
    def peak(self) -> float:
        """The most the rank holds at once: persistent + the largest phase."""
        phases = (self.forward_backward, self.optimizer_step, self.exchange)
        return self.persistent + max(phases)

    def fits(self, gpu_bytes: float) -> bool:
        return self.peak <= gpu_bytes


def layer_activation_bytes(m: ModelShape, tokens: int, a: int) -> float:
    """Bytes autograd saves in one decoder layer for ``tokens`` tokens in ``a``-byte compute."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    norms = 2 * (4 * m.hidden + 2 * a * m.hidden + 4)
    attention = a * (2 * q + 2 * kv) + 4 * m.heads
    mlp = 4 * a * m.intermediate
    return tokens * (norms + attention + mlp)


def activation_bytes(m: ModelShape, s: StepSetup) -> float:
    """Saved activations of a whole forward (all layers and the head), with or without
    activation checkpointing of each decoder layer."""
    t, a = s.tokens, s.act_bytes
    layer = layer_activation_bytes(m, t, a)
    rotary = 2 * s.seq_len * m.head_dim * a  # cos and sin, shared by the layers
    head = t * (4 * m.hidden + 2 * a * m.hidden + 4) + 4 * t * m.vocab + 8 * t + rotary
    if s.activation_checkpointing:
        return m.layers * a * t * m.hidden + layer + head
    return m.layers * layer + head


def outer_state_bytes(
    m: ModelShape, s: StepSetup, shard: int, groups: int, overlap: bool = False, replicate: int = 1
) -> float:
    """The outer optimizer's flat state on one rank (nothing for G = 1), with the overlapped
    sync's buffers in flight: the weights as sent and the all-reduce buffer (striped over R
    HSDP replicas: the padded copy and this replica's stripe), or, compressed, the weights as
    sent, this rank's payload and the G payloads gathered."""
    if groups == 1:
        return 0.0
    n = m.params / shard
    compressed = s.compression != C.NO_COMPRESSION
    kept = 2 if s.outer == C.NESTEROV else (1 if compressed else 0)
    residual = 1 if compressed and s.error_feedback else 0
    state = 4.0 * n * (kept + residual)
    if not overlap:
        return state
    if compressed:
        return state + 4.0 * n + (groups + 1) * n * payload_bytes_per_value(s)
    return state + 4.0 * n * (2 + (1 / replicate if replicate > 1 else 0))


def payload_bytes_per_value(s: StepSetup) -> float:
    """Bytes per value of a compressed payload (int8 carries one float32 scale per chunk)."""
    return 2.0 if s.compression == C.BF16 else 1.0 + 4.0 / s.compression_chunk


def exchange_bytes(m: ModelShape, s: StepSetup, shard: int, groups: int, replicate: int) -> float:
    """Transient buffers of one outer sync on one rank (nothing for G = 1)."""
    if groups == 1:
        return 0.0
    n = m.params / shard
    if s.compression != C.NO_COMPRESSION:
        return 4 * 4.0 * n + (groups + 1) * n * payload_bytes_per_value(s)
    flat = 4.0 * n * (3 if s.sync_optimizer_state else 1)
    striped = flat * (1 + 1 / replicate) if replicate > 1 else 0.0
    pseudo_gradient = 4.0 * n if s.outer == C.NESTEROV else 0.0
    return flat + striped + pseudo_gradient


def estimate(
    m: ModelShape,
    s: StepSetup,
    shard: int,
    groups: int = 1,
    replicate: int = 1,
    reserved: float = 0.0,
    overlap: bool = False,
    transport: str = P.COLLECTIVE,
) -> MemoryEstimate:
    """The memory of one rank that shards the model over ``shard`` ranks, in a run of
    ``groups`` groups whose HSDP replicate degree is ``replicate`` (``overlap``: the outer sync
    overlapped with the next round) exchanging over ``transport`` (collective or streaming)."""
    n, a = m.params / shard, s.act_bytes
    streaming = transport == P.STREAMING and groups > 1
    host = 0.0
    if streaming:
        compressed = s.compression != C.NO_COMPRESSION
        host = 4.0 * n * (1 + (compressed and s.error_feedback) + overlap)
    return MemoryEstimate(
        weights=4.0 * n,
        adamw=8.0 * n,
        outer_state=0.0
        if streaming
        else outer_state_bytes(m, s, shard, groups, overlap, replicate),
        activations=activation_bytes(m, s),
        logits=8.0 * s.tokens * m.vocab,
        gathered=a * (m.root_params + 2 * m.layer_params + m.vocab * m.hidden),
        gradients=4.0 * n,
        optimizer_temp=4.0 * n if s.foreach else 0.0,
        exchange=0.0 if streaming else exchange_bytes(m, s, shard, groups, replicate),
        reserved=reserved,
        host=host,
    )
