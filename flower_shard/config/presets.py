"""Model presets: named Llama architectures (pure data; ``transformers`` is imported only to
build a config from one).

Nothing is downloaded: a preset's architecture comes from here, its weights from the seed
(:mod:`flower_shard.runtime.models`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


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


def is_preset(model: str) -> bool:
    """True if ``model`` names a preset rather than a model directory."""
    return model in PRESETS
