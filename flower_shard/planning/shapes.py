"""The shape of the model a plan is for: a preset, or a local ``transformers`` directory.

A preset's shape is arithmetic (:func:`~flower_shard.planning.memory.llama_shape`). A directory
is checked as ``flower-shard train`` checks it (:func:`flower_shard.preflight.check_model`: a
``config.json`` that transformers reads, a causal LM, positions covering ``--seq-len``) and
then built on the meta device (no memory, no weights read) exactly as the runtime builds it, so
``P`` and the parameters of each decoder layer (the FSDP units of
:func:`~flower_shard.runtime.parallelize.decoder_layers`) are exact for any architecture;
torch and transformers are imported only then. The activation formula prices every layer as a
Llama layer with the config's sizes (hidden, heads, KV heads, intermediate size, vocabulary).
"""

from __future__ import annotations

from flower_shard.config.presets import PRESETS
from flower_shard.errors import ConfigError
from flower_shard.planning.memory import ModelShape, llama_shape


def preset_shape(name: str) -> ModelShape:
    """The shape of the preset ``name``."""
    p = PRESETS[name]
    return llama_shape(
        p.hidden_size,
        p.num_layers,
        p.num_heads,
        p.num_kv_heads,
        p.intermediate_size,
        p.vocab_size,
    )


def _size(config, names: tuple[str, ...], directory: str, default: int | None = None) -> int:
    """The first of ``names`` that the config sets (transformers' own aliases included)."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    if default is not None:
        return default
    raise ConfigError(
        f"--model {directory}: config.json sets none of {', '.join(names)}; the planner needs "
        "a decoder's sizes (a Llama-like config)"
    )


def directory_shape(directory: str, seq_len: int) -> ModelShape:
    """The shape of a local transformers model directory (checked, then built on meta).

    Raises
    ------
    ConfigError
        What :func:`flower_shard.preflight.check_model` refuses, or a config without a
        decoder's sizes.
    """
    from flower_shard.preflight import check_model
    from flower_shard.runtime.models import build_model, count_parameters, hf_config
    from flower_shard.runtime.parallelize import decoder_layers

    check_model(directory, seq_len)
    config = hf_config(directory)
    hidden = _size(config, ("hidden_size", "n_embd", "d_model"), directory)
    heads = _size(config, ("num_attention_heads", "n_head"), directory)
    model = build_model(directory, meta=True)
    layers = decoder_layers(model)
    if not layers:
        raise ConfigError(
            f"--model {directory}: no repeated decoder layers found; the planner needs a "
            "decoder-only transformer"
        )
    return ModelShape(
        params=count_parameters(model),
        layer_params=sum(p.numel() for p in layers[0].parameters()),
        layers=len(layers),
        hidden=hidden,
        heads=heads,
        kv_heads=_size(config, ("num_key_value_heads",), directory, heads),
        intermediate=_size(config, ("intermediate_size", "n_inner"), directory, 4 * hidden),
        vocab=_size(config, ("vocab_size",), directory),
        head_dim=_size(config, ("head_dim",), directory, hidden // heads),
        tied=bool(getattr(config, "tie_word_embeddings", False)),
    )


def model_shape(model: str, seq_len: int) -> ModelShape:
    """``--model``: a preset's shape, or a directory's (see :func:`directory_shape`)."""
    if model in PRESETS:
        return preset_shape(model)
    return directory_shape(model, seq_len)
