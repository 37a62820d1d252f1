"""Checks before any process starts that need disk, tokenizers or model configs.

The dataclass configs check their own fields (:mod:`flower_shard.config`); what needs I/O, the
corpus, ``transformers`` or CUDA is checked here, above :mod:`flower_shard.data` and
:mod:`flower_shard.runtime.models`, so that the configuration layer imports neither.
"""

from __future__ import annotations

from pathlib import Path

from flower_shard.config import ConfigError
from flower_shard.data.corpus import CorpusInfo, prepare_corpus
from flower_shard.data.partition import partition_data


def prepare_for(directory: str | Path, cfg) -> CorpusInfo:
    """Tokenise ``cfg``'s corpus into ``directory`` (reused while current), then
    :func:`check_fits` it to ``cfg`` (a :class:`~flower_shard.config.TrainConfig`)."""
    info = prepare_corpus(
        directory,
        cfg.data,
        cfg.tokenizer,
        cfg.eval_fraction,
        cfg.text_column,
        cfg.partition_label,
    )
    check_fits(info, cfg)
    return info


def check_fits(info: CorpusInfo, cfg) -> None:
    """Fail before launch if the corpus cannot feed the topology (see :func:`partition` and
    :func:`partition_data`), or if its tokenizer emits ids the model cannot embed."""
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
    if cfg.partition != "iid":
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
