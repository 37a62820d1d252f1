"""Model presets: Llama decoders from a ``transformers`` LlamaConfig, randomly initialised.

Nothing is downloaded: the architecture comes from the preset, the weights from the seed. Large
presets are built on the meta device and materialised only after sharding (see
:func:`materialize`), so no rank ever holds the full 8B model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class ModelPreset:
    """A named architecture."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    """Preset vocabulary; grown to the tokenizer's vocabulary when that is larger."""
    rope_theta: float = 10000.0
    max_positions: int = 2048
    meta_init: bool = False
    """Build on the meta device and initialise the shards after ``parallelize``."""
    extra: dict = field(default_factory=dict)

    def llama_config(self, vocab_size: int | None = None, max_positions: int | None = None):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=max(self.vocab_size, vocab_size or 0),
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=max(self.max_positions, max_positions or 0),
            rope_theta=self.rope_theta,
            tie_word_embeddings=False,
            use_cache=False,
            **self.extra,
        )


BYTE_VOCAB = 257  # 256 byte values + one end-of-document token

PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        # ~0.11M parameters: unit and integration tests.
        ModelPreset("tiny", 64, 2, 4, 2, 128, BYTE_VOCAB, max_positions=512),
        # ~12.8M parameters: CPU benchmarks.
        ModelPreset("small", 384, 8, 6, 2, 1024, BYTE_VOCAB, max_positions=1024),
        # ~104M parameters (GPT-2 small's width and depth): transfer benchmarks.
        ModelPreset("base", 768, 12, 12, 4, 3072, BYTE_VOCAB, max_positions=1024),
        # The real Llama 3.1 8B shape (8.03B parameters).
        ModelPreset(
            "llama3.1-8b",
            4096,
            32,
            32,
            8,
            14336,
            128256,
            rope_theta=500000.0,
            max_positions=131072,
            meta_init=True,
        ),
    )
}


def build_model(
    preset: str,
    vocab_size: int | None = None,
    seed: int = 0,
    max_positions: int | None = None,
    meta: bool | None = None,
) -> nn.Module:
    """Build a preset with random weights (seeded), or on the meta device for large presets.

    Every rank of every group calls this with the same seed, so all groups start identical.
    ``meta`` overrides the preset's choice of building on the meta device.
    """
    from transformers import LlamaForCausalLM

    spec = PRESETS[preset]
    config = spec.llama_config(vocab_size, max_positions)
    if spec.meta_init if meta is None else meta:
        with torch.device("meta"):
            return LlamaForCausalLM(config)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate a meta-built (and already sharded) model on ``device`` and initialise it.

    Each rank initialises only its own shards. The seed is the same everywhere, so the ranks
    holding the same shard in different groups draw the same values and all groups start equal.
    Non-persistent buffers (the rotary frequencies) are recomputed, since ``to_empty`` leaves
    them as garbage.
    """
    model.to_empty(device=device)
    torch.manual_seed(seed)
    std = model.config.initializer_range
    for name, param in model.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, std)
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)


def count_parameters(model: nn.Module) -> int:
    """Parameters of the full (unsharded) model; works on meta and on sharded models."""
    return sum(p.numel() for p in model.parameters())
