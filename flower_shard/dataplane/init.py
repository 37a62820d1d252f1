"""The run's first global weights, for the parameters one aggregator owns.

- a preset built on the meta device (the 8B model): each parameter drawn from its own seeded
  generator (``numpy.random.default_rng([seed, crc32(name)])``, normal with the config's
  initializer_range; norms 1), one parameter at a time: no whole model is ever built here;
- another preset, or a model directory without weights: the model built from the seed as the
  groups build it, and its owned parameters kept;
- a model directory with safetensors weights: the owned tensors read one by one.

The groups download these weights before their first round, so every group starts from the
same model whatever its K.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np


def parameter_shapes(model: str, vocab_size: int, seq_len: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter, from a model built on the meta device (no memory)."""
    from flower_shard.runtime.models import build_model

    built = build_model(model, vocab_size, 0, seq_len, meta=True, load_weights=False)
    return {name: tuple(p.shape) for name, p in built.named_parameters()}


def initial_weights(spec: dict, params) -> dict[str, np.ndarray]:
    """Float32 arrays of ``params`` (:class:`~.layout.Param`) for ``spec``: ``{"kind":
    "model", model, vocab_size, seed, seq_len}``, or ``{"kind": "random", seed, std}`` (every
    parameter drawn as a meta-built preset's are: synthetic models of any shape, for the
    exchange benchmark and tests)."""
    if spec.get("kind") == "random":  # numpy alone: no torch in this process
        std = float(spec.get("std", 0.02))
        return {p.name: _drawn(p.name, p.shape, int(spec["seed"]), std) for p in params}
    from flower_shard.config.presets import PRESETS
    from flower_shard.runtime.models import build_model, has_weights

    names = [p.name for p in params]
    model, vocab = spec["model"], int(spec["vocab_size"])
    seed, seq_len = int(spec["seed"]), int(spec["seq_len"])
    if model in PRESETS and PRESETS[model].meta_init:
        meta = build_model(model, vocab, seed, seq_len, meta=True)
        std = meta.config.initializer_range
        shapes = {n: tuple(p.shape) for n, p in meta.named_parameters()}
        return {n: _drawn(n, shapes[n], seed, std) for n in names}
    if model not in PRESETS and has_weights(model):
        return _read_owned(Path(model), names)
    built = build_model(model, vocab, seed, seq_len)
    params = dict(built.named_parameters())
    return {n: params[n].detach().float().numpy().copy() for n in names}


def _drawn(name: str, shape: tuple[int, ...], seed: int, std: float) -> np.ndarray:
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)


def _read_owned(directory: Path, names: list[str]) -> dict[str, np.ndarray]:
    """Owned tensors of a (maybe sharded) safetensors checkpoint, one at a time."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    out: dict[str, np.ndarray] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open is not iterable
                if key in names:
                    out[key] = fh.get_tensor(key).float().numpy()
    missing = sorted(set(names) - set(out))
    if missing:
        raise ValueError(f"{directory}: no weights for {missing[:3]}")
    return out
