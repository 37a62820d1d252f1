"""Checks before any process starts that need disk, tokenizers, model configs or CUDA.

The dataclass configs check their own fields (:meth:`TrainConfig.validate
<flower_shard.config.train.TrainConfig.validate>`); what needs I/O is checked here, above
:mod:`flower_shard.data` and :mod:`flower_shard.runtime.models`, so that the configuration
layer imports neither. Every launcher calls :func:`check` (one torch job, the ServerApp, a
group before it builds a run), then :func:`prepare_for` where it prepares the data.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from flower_shard import protocol as P
from flower_shard import runfiles
from flower_shard.config import choices as C
from flower_shard.config.presets import PRESETS
from flower_shard.config.train import TrainConfig
from flower_shard.errors import ConfigError

if TYPE_CHECKING:
    from flower_shard.config.federation import FederationConfig
    from flower_shard.data.corpus import CorpusInfo


def check(cfg: TrainConfig) -> TrainConfig:
    """:meth:`TrainConfig.validate`, then every check that touches the disk, ``transformers``
    or CUDA; raise :class:`ConfigError` (one line) on the first problem, return ``cfg``."""
    cfg.validate()
    check_model(cfg.model, cfg.seq_len)
    if cfg.data is not None:
        check_data(cfg.data)
    if cfg.partition == C.BY_SOURCE and cfg.groups > 1:
        check_sources(cfg.data, cfg.groups)
    if cfg.tokenizer is not None and not Path(cfg.tokenizer).is_dir():
        raise ConfigError(
            f"--tokenizer {cfg.tokenizer}: no such directory; give a local Hugging Face "
            "tokenizer directory (with tokenizer.json), or leave it out for bytes"
        )
    if cfg.resume is not None and not Path(cfg.resume, runfiles.CHECKPOINTS_DIR).is_dir():
        raise ConfigError(
            f"--resume {cfg.resume}: no {runfiles.CHECKPOINTS_DIR}/ there; give the output "
            "directory of a run that ran with --checkpoint-every > 0"
        )
    if cfg.tensorboard:
        require_tensorboard()
    if cfg.device == C.CUDA:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device here; use --device cpu or auto")
    return cfg


def check_federation(fed: FederationConfig) -> FederationConfig:
    """:func:`check` for the ServerApp's side of a Flower run (a stand-in topology: the groups
    check their own when a run reaches them); returns ``fed``."""
    check(dataclasses.replace(fed.train, groups=1, nproc_per_group=1, nnodes=1))
    if fed.transport == P.STREAMING:
        for flag, path in (
            ("dataplane-certfile", fed.dataplane_certfile),
            ("dataplane-keyfile", fed.dataplane_keyfile),
            ("dataplane-ca-certfile", fed.dataplane_ca_certfile),
            ("aggregator-secret-file", fed.aggregator_secret_file),
        ):
            if path and not Path(path).is_file():
                raise ConfigError(f"{flag} {path}: no such file")
    return fed


def check_model(model: str, seq_len: int) -> None:
    """A preset, or a local transformers directory whose positions cover ``seq_len``."""
    if model in PRESETS:
        return
    if not Path(model).exists():
        raise ConfigError(
            f"--model {model!r} is unknown; choose one of {', '.join(PRESETS)}, or give a "
            "local transformers model directory (with config.json)"
        )
    from flower_shard.runtime.models import hf_config

    positions = getattr(hf_config(model), "max_position_embeddings", None)
    if positions is not None and seq_len > positions:
        raise ConfigError(
            f"--seq-len {seq_len} exceeds --model {model}'s max_position_embeddings "
            f"{positions}; use a shorter --seq-len"
        )


def check_sources(data: str | None, groups: int) -> None:
    """``--partition by-source``: the data has at least one source per group."""
    from flower_shard.data.sources import count_sources

    sources = count_sources(data)
    if sources < groups:
        raise ConfigError(
            f"--partition by-source: the data has {sources} source(s) (top-level "
            f"directories or files) for {groups} groups; use at most {sources} "
            "groups, split the data into more directories, or use --partition dirichlet"
        )


def check_data(data: str, flag: str = "--data") -> None:
    """Raise :class:`ConfigError` unless ``data`` is a directory or a .jsonl / .parquet file."""
    from flower_shard.data.sources import RECORD_SUFFIXES

    path = Path(data)
    if not path.is_dir() and not (path.is_file() and path.suffix in RECORD_SUFFIXES):
        raise ConfigError(
            f"{flag} {data}: no such directory or .jsonl / .parquet file; point it "
            "at a directory of text files or at a .jsonl / .parquet file"
        )


def require_tensorboard(flag: str = "--tensorboard") -> None:
    """Raise :class:`ConfigError` unless the ``tensorboard`` package is installed.

    ``torch.utils.tensorboard`` needs it; looked up without importing it (seconds), so a
    run fails before any process starts.
    """
    from importlib.util import find_spec

    if find_spec("tensorboard") is None:
        raise ConfigError(
            f"{flag} needs the tensorboard package: pip install tensorboard "
            "(it is in flower-shard's dev extra)"
        )


def prepare_for(directory: str | Path, cfg: TrainConfig) -> CorpusInfo:
    """Tokenise ``cfg``'s corpus into ``directory`` (reused while current), then
    :func:`check_fits` it to ``cfg``."""
    from flower_shard.data.corpus import prepare_corpus

    info = prepare_corpus(
        directory,
        cfg.data,
        cfg.tokenizer,
        cfg.eval_fraction,
        cfg.text_column,
        cfg.partition_label,
        workers=cfg.data_workers,
    )
    check_fits(info, cfg)
    return info


def check_fits(info: CorpusInfo, cfg: TrainConfig) -> None:
    """Fail before launch if the corpus cannot feed the topology (see
    :func:`~flower_shard.data.partition.partition_data`), or if its tokenizer emits ids the
    model cannot embed."""
    from flower_shard.data.partition import partition_data
    from flower_shard.runtime.models import check_vocab

    check_vocab(cfg.model, info.vocab_size, cfg.tokenizer)
    n_train = info.train_tokens // (cfg.seq_len + 1)
    per_rank = n_train // cfg.world_size
    if per_rank < cfg.batch_size:
        raise ConfigError(
            f"{n_train} training blocks of --seq-len {cfg.seq_len} give each of the "
            f"{cfg.world_size} ranks {per_rank}, fewer than --batch-size {cfg.batch_size}; "
            "use a shorter sequence, a smaller batch, fewer ranks or more data"
        )
    if cfg.partition != C.IID:
        parts = partition_data(
            info.directory,
            cfg.seq_len,
            cfg.groups,
            cfg.nproc_per_group,
            cfg.seed,
            cfg.partition,
            cfg.partition_label,
            cfg.dirichlet_alpha,
            cfg.batch_size,
        )
        smallest, group = min((len(p), g) for g, ranks in enumerate(parts) for p in ranks)
        if smallest < cfg.batch_size:
            raise ConfigError(
                f"--partition {cfg.partition} leaves a rank of group {group} {smallest} training "
                f"blocks, fewer than --batch-size {cfg.batch_size}; use fewer groups, a smaller "
                "batch or a shorter --seq-len"
            )
    if info.eval_tokens < cfg.seq_len + 1:
        raise ConfigError(
            f"the held-out split has {info.eval_tokens} tokens, less than one block of "
            f"--seq-len {cfg.seq_len}; raise --eval-fraction or add data"
        )
