"""Models: Llama presets (a ``transformers`` LlamaConfig) or a local ``transformers`` directory.

Nothing is downloaded. A preset's architecture comes from the preset, its weights from the seed.
Large presets are built on the meta device and materialised only after sharding (see
:func:`materialize`), so no rank ever holds the full 8B model.

``--model`` may also name a local directory of any ``transformers`` causal LM: with
``config.json`` only, the model is built from that config and initialised from the seed; with
weights next to it (``model.safetensors``, sharded or not), those weights are loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from flower_shard.config import ConfigError
from flower_shard.config.presets import PRESETS, is_preset

# Weight files that make a model directory a checkpoint rather than a bare architecture.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def has_weights(directory: str | Path) -> bool:
    """True if a model directory holds weights (a checkpoint), not only ``config.json``."""
    return any(Path(directory, name).is_file() for name in WEIGHT_FILES)


def hf_config(directory: str | Path):
    """The ``transformers`` config of a local causal-LM directory; ConfigError if it is not one.

    Raises
    ------
    ConfigError
        No directory, no ``config.json``, a config transformers cannot read, or a model type
        without a causal-LM class.
    """
    path = Path(directory)
    if not path.is_dir() or not (path / "config.json").is_file():
        what = "has no config.json" if path.is_dir() else "is neither a preset nor a directory"
        raise ConfigError(
            f"--model {directory}: {what}; give a preset ({', '.join(PRESETS)}) or a local "
            "transformers model directory (config.json, optionally with safetensors weights)"
        )
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"--model {directory}: config.json is not a transformers config ({first}); "
            "write it with PretrainedConfig.save_pretrained"
        ) from exc
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(
            f"--model {directory}: model type {config.model_type!r} has no causal-LM class in "
            "transformers (AutoModelForCausalLM); give a decoder language model"
        )
    return config


def model_vocab_size(model: str, vocab_size: int | None = None) -> int:
    """Rows of the embedding that :func:`build_model` gives ``model`` for a tokenizer's vocab."""
    if is_preset(model):
        return max(PRESETS[model].vocab_size, vocab_size or 0)
    return int(hf_config(model).vocab_size)


def check_vocab(model: str, vocab_size: int, tokenizer: str | None) -> None:
    """Fail if the tokenizer emits ids the model cannot embed (presets grow, directories do not).

    Raises
    ------
    ConfigError
        The tokenizer's vocabulary is larger than the model directory's embedding.
    """
    rows = model_vocab_size(model, vocab_size)
    if vocab_size > rows:
        tok = f"--tokenizer {tokenizer}" if tokenizer else "the byte tokenizer"
        raise ConfigError(
            f"{tok} has {vocab_size} tokens but --model {model} embeds only {rows}; use the "
            "model's own tokenizer, or a model whose vocab_size is at least the tokenizer's"
        )


def _build_hf(
    directory: str, vocab_size: int | None, seed: int, meta: bool | None, load: bool
) -> nn.Module:
    from transformers import AutoModelForCausalLM

    config = hf_config(directory)
    if vocab_size and vocab_size > config.vocab_size:  # launchers say which tokenizer: check_vocab
        raise ConfigError(
            f"the tokenizer has {vocab_size} tokens but --model {directory} embeds only "
            f"{config.vocab_size}; use the model's own tokenizer or a larger vocab_size"
        )
    # Training keeps float32 parameters (bf16 is FSDP's compute dtype), whatever dtype the
    # directory's config or weights say.
    if load and has_weights(directory) and not meta:
        return AutoModelForCausalLM.from_pretrained(
            directory, local_files_only=True, dtype=torch.float32
        )
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def build_model(
    preset: str,
    vocab_size: int | None = None,
    seed: int = 0,
    max_positions: int | None = None,
    meta: bool | None = None,
    load_weights: bool = True,
) -> nn.Module:
    """Build a preset with random weights (seeded), or on the meta device for large presets.

    Every rank of every group calls this with the same seed, so all groups start identical.
    ``meta`` overrides the preset's choice of building on the meta device.

    ``preset`` may also be a local ``transformers`` causal-LM directory: its checkpoint is
    loaded (float32) when it holds weights and ``load_weights`` is true, otherwise the model is
    built from its ``config.json`` and initialised from ``seed``. Its vocabulary does not grow:
    a ``vocab_size`` larger than its embedding is a :class:`~flower_shard.config.ConfigError`,
    and ``max_positions`` is left to its config.
    """
    if not is_preset(preset):
        return _build_hf(preset, vocab_size, seed, meta, load_weights)
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
