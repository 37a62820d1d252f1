"""Export a run's final global model as a ``transformers`` directory (``save_pretrained``).

``flower-shard export RUN_DIR --out DIR`` reads either kind of run directory:

- ``flower-shard train --out RUN_DIR``: ``config.json`` (the TrainConfig that ran) and
  ``final_model.safetensors`` (written by rank 0 when the run finishes);
- a Flower run's ``out-dir``: ``summary.json`` (the ServerApp records ``model``, ``tokenizer``
  and ``seq_len`` there) and ``final_model.safetensors`` (with the collective transport the
  ServerApp fetches it once from a group at the end of the run).

``DIR`` then loads with ``AutoModelForCausalLM.from_pretrained(DIR)``, and with
``AutoTokenizer.from_pretrained(DIR)`` when the run used a Hugging Face tokenizer. A byte-level
run has no tokenizer to export: its ids are the UTF-8 bytes, and 256 ends a document.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from flower_shard import protocol as P
from flower_shard import runfiles as F
from flower_shard.config.train import TrainConfig
from flower_shard.errors import ConfigError


@dataclass(frozen=True)
class RunModel:
    """What a run directory says about its final model."""

    weights: Path
    """The final global model, ``final_model.safetensors``."""
    model: str
    """The run's ``--model``: a preset name or a transformers model directory."""
    tokenizer: str | None
    """The run's ``--tokenizer`` directory; None for the byte tokenizer."""
    seq_len: int | None
    """The run's ``--seq-len`` (a preset's position table grows to it)."""
    eos_id: int | None = None
    """The corpus's end-of-document id (``data/corpus.json``), when the run dir has it."""


def run_model(
    run_dir: str | os.PathLike, model: str | None = None, tokenizer: str | None = None
) -> RunModel:
    """Read what :func:`export_pretrained` needs from a train or Flower run directory.

    A ``summary.json`` makes it a Flower run (the ServerApp writes no ``config.json``, as
    ``flower-shard report`` assumes too); otherwise ``config.json`` must be there. ``model`` and
    ``tokenizer`` override what the run recorded.

    Raises
    ------
    ConfigError
        Not a run directory, a failed Flower run, no final model in it, or no record of the
        model and no ``model`` given.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise ConfigError(
            f"RUN_DIR {run_dir}: no such directory; give the --out of `flower-shard train` or "
            "the out-dir of a Flower run"
        )
    summary, config = run / F.SUMMARY_FILE, run / F.CONFIG_FILE
    if summary.is_file():
        try:
            info = json.loads(summary.read_text())
        except json.JSONDecodeError:
            info = None
        if not isinstance(info, dict) or info.get(P.S_STATUS) != P.STATUS_OK:
            raise ConfigError(
                f"RUN_DIR {run_dir}: {F.SUMMARY_FILE} does not say the run finished (status "
                f"{info.get(P.S_STATUS) if isinstance(info, dict) else 'unreadable'}); export a "
                "run that completed"
            )
        if P.S_MODEL not in info and model is None:
            raise ConfigError(
                f"RUN_DIR {run_dir}: {F.SUMMARY_FILE} does not record the model (an older "
                "ServerApp); pass --model (and --tokenizer) as the run had them"
            )
        recorded = info.get(P.S_MODEL), info.get(P.S_TOKENIZER), info.get(P.S_SEQ_LEN)
    elif config.is_file():
        cfg = TrainConfig.from_json(config)
        recorded = cfg.model, cfg.tokenizer, cfg.seq_len
    else:
        raise ConfigError(
            f"RUN_DIR {run_dir}: neither {F.CONFIG_FILE} nor {F.SUMMARY_FILE} there; give the "
            "--out of `flower-shard train` or the out-dir of a Flower run"
        )
    weights = run / F.FINAL_MODEL
    if not weights.is_file():
        raise ConfigError(
            f"RUN_DIR {run_dir}: no {F.FINAL_MODEL}; a train run and a Flower run (any "
            "transport) write it when they finish: rerun to completion"
        )
    from flower_shard.data.corpus import CorpusInfo  # numpy: not at CLI start

    corpus = run / F.DATA_DIR
    eos = CorpusInfo.load(corpus).eos_id if (corpus / F.CORPUS_META).is_file() else None
    return RunModel(weights, model or recorded[0], tokenizer or recorded[1], recorded[2], eos)


def _skeleton(model: str, state: Mapping, seq_len: int | None):
    """An initialised model of ``model``'s architecture that ``state`` fits (weights overwritten).

    A preset's vocabulary grew to the run's tokenizer: the saved embedding says how far.
    """
    from flower_shard.config.presets import is_preset
    from flower_shard.runtime.models import build_model

    if not is_preset(model):
        return build_model(model, load_weights=False)
    meta = build_model(model, meta=True)
    embedding = meta.get_input_embeddings().weight
    key = next(name for name, p in meta.named_parameters() if p is embedding)
    if key not in state:
        raise ConfigError(
            f"the final weights have no {key}; they are not a --model {model} model: export "
            "with the model the run trained"
        )
    return build_model(model, int(state[key].shape[0]), 0, seq_len, meta=False)


def export_pretrained(
    state_dict_or_safetensors_path: Mapping | str | os.PathLike,
    model_spec: str,
    out_dir: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
    *,
    seq_len: int | None = None,
    eos_id: int | None = None,
) -> Path:
    """Write a trained model as a ``transformers`` directory; return that directory.

    Parameters
    ----------
    state_dict_or_safetensors_path
        The full (unsharded) weights: a state dict of tensors or arrays, or the path of a
        safetensors file such as a run's ``final_model.safetensors``.
    model_spec
        The run's ``--model``: a preset name or a local transformers model directory.
    out_dir
        Where ``save_pretrained`` writes ``config.json`` and ``model.safetensors`` (created).
    tokenizer_dir
        The run's ``--tokenizer`` directory, saved alongside; None (bytes) saves no tokenizer.
    seq_len
        The run's ``--seq-len``: a preset's position table was grown to it.
    eos_id
        The corpus's end-of-document id, written into a preset's config (its Llama default
        means nothing to the run's tokenizer); a model directory's own config is kept.

    Raises
    ------
    ConfigError
        The weights do not fit the model (missing, unexpected or mis-shaped tensors).
    """
    from flower_shard.config.presets import is_preset

    state = _load_state(state_dict_or_safetensors_path)
    model = _skeleton(model_spec, state, seq_len)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        detail = " ".join(str(exc).split())[:200]
        raise ConfigError(
            f"the final weights do not fit --model {model_spec} ({detail}); export with the "
            "model the run trained"
        ) from None
    if is_preset(model_spec):
        _ready_to_generate(model.config, model.generation_config, eos_id)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)  # safetensors: the only format transformers 5 writes
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True).save_pretrained(
            out
        )
    return out


def _load_state(source: Mapping | str | os.PathLike) -> dict:
    """Tensors from a safetensors file, or from a state dict of tensors or arrays."""
    import torch

    if isinstance(source, (str, os.PathLike)):
        from safetensors.torch import load_file

        return load_file(str(source))
    return {k: torch.as_tensor(v) for k, v in source.items()}


def _ready_to_generate(config, generation_config, eos_id: int | None) -> None:
    """A preset's config as whoever generates with the export wants it: the KV cache on
    (training switched it off) and the corpus's end-of-document id (its Llama default means
    nothing to the run's tokenizer)."""
    config.use_cache = True
    if eos_id is not None:
        config.eos_token_id = eos_id
        if generation_config is not None:
            generation_config.eos_token_id = eos_id


def add_export_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="a finished run: the --out of `flower-shard train` or a Flower run's out-dir",
    )
    parser.add_argument("--out", required=True, help="the transformers directory to write")
    parser.add_argument(
        "--model",
        default=None,
        help="the run's --model, when the run directory does not name it or names a path that "
        "is elsewhere here",
    )
    parser.add_argument(
        "--tokenizer", default=None, help="the run's --tokenizer directory, to override the run's"
    )


def export_from_args(args: argparse.Namespace) -> int:
    from flower_shard.config.presets import is_preset

    run = run_model(args.run_dir, args.model, args.tokenizer)
    # The run recorded paths as given when it started: relative ones resolve from there only.
    model_dir = None if is_preset(run.model) else run.model
    for flag, path in (("--model", model_dir), ("--tokenizer", run.tokenizer)):
        if path is not None and not Path(path).is_dir():
            raise ConfigError(
                f"{flag} {path} (the run's) is not a directory here; run export from where the "
                f"run was started, or pass {flag} DIR"
            )
    out = export_pretrained(
        run.weights, run.model, args.out, run.tokenizer, seq_len=run.seq_len, eos_id=run.eos_id
    )
    print(f"flower-shard export: {out} (model {run.model}, tokenizer {run.tokenizer or 'none'})")
    return 0
