"""Checks before any process starts that need disk, tokenizers, model configs or CUDA.

The dataclass configs check their own fields (:meth:`TrainConfig.validate
<flower_shard.config.train.TrainConfig.validate>`); what needs I/O is checked here, above
:mod:`flower_shard.data` and :mod:`flower_shard.runtime.models`, so that the configuration
layer imports neither. Every launcher calls :func:`check` (one torch job, the ServerApp, a
group before it builds a run), then :func:`prepare_for` where it prepares the data.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING

from flower_shard import protocol as P
from flower_shard import runfiles
from flower_shard.config import choices as C
from flower_shard.config.presets import PRESETS
from flower_shard.config.train import TrainConfig
from flower_shard.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
"""Any of these in a model directory: it ships its tokenizer."""

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
    if cfg.tokenizer is not None and cfg.model not in PRESETS:  # presets grow to any vocabulary
        from flower_shard.data.tokenizers import load_tokenizer
        from flower_shard.runtime.models import check_vocab

        check_vocab(cfg.model, load_tokenizer(cfg.tokenizer).vocab_size, cfg.tokenizer)
    if cfg.data is not None:
        check_records(cfg.data, cfg.text_column)
    if cfg.tensorboard:
        require_tensorboard()
    ranks = "the ranks per host (--groups x --nproc-per-group / --nnodes)"
    check_device(cfg.device, cfg.groups * cfg.nproc_per_group // cfg.nnodes, ranks)
    return cfg


def check_device(device: str, local_ranks: int, ranks_flag: str = "--nproc-per-group") -> None:
    """``cuda``: CUDA must be there, with a GPU for each of this host's ``local_ranks`` (rank i
    computes on ``cuda:i``); ``auto`` picks CUDA when it is there, so the same count applies.
    Without an NVIDIA device file ``auto`` means CPU and torch is not even imported."""
    if device == C.CPU or (device == C.AUTO and not Path("/dev/nvidia0").exists()):
        return
    import torch

    if not torch.cuda.is_available():
        if device == C.AUTO:
            return
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise ConfigError(
            f"--device cuda: no CUDA device visible to torch {torch.__version__}{hint}; use "
            "--device cpu, or install a CUDA build of torch"
        )
    gpus = torch.cuda.device_count()
    if local_ranks > gpus:
        raise ConfigError(
            f"--device {device}: {local_ranks} ranks on this host but {gpus} GPU(s) visible; "
            f"lower {ranks_flag} to {gpus}, give each node its own GPUs with "
            "CUDA_VISIBLE_DEVICES, or use --device cpu"
        )


def check_federation(fed: FederationConfig) -> FederationConfig:
    """:func:`check` for the ServerApp's side of a Flower run (a stand-in topology: the groups
    check their own when a run reaches them); returns ``fed``."""
    fed = dataclasses.replace(fed, train=with_model_tokenizer(fed.train))
    check(fed.stand_in())
    check_out(fed.train, flag="out-dir")
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
    from flower_shard.runtime.models import build_model, hf_config

    try:  # a config transformers rejects, or one whose shapes cannot be built (on meta: free)
        config = hf_config(model)
        build_model(model, meta=True)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the user's file becomes one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[-1].strip()
        raise ConfigError(
            f"--model {model}: its config.json does not describe a model that can be built "
            f"({first}); fix it, or write it with PretrainedConfig.save_pretrained"
        ) from None
    positions = getattr(config, "max_position_embeddings", None)
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
    """Raise :class:`ConfigError` unless ``data`` is a readable directory or a readable
    regular .jsonl / .parquet file (a FIFO or device is never opened: it could block)."""
    from flower_shard.data.sources import RECORD_SUFFIXES

    path = Path(data)
    if path.is_dir():
        if not os.access(path, os.R_OK | os.X_OK):
            raise ConfigError(f"{flag} {data}: the directory cannot be read (permissions)")
        return
    if path.exists() and not path.is_file():
        raise ConfigError(
            f"{flag} {data} is not a regular file (a FIFO, socket or device); point it at a "
            "directory of text files or at a .jsonl / .parquet file"
        )
    if not (path.is_file() and path.suffix in RECORD_SUFFIXES):
        raise ConfigError(
            f"{flag} {data}: no such directory or .jsonl / .parquet file; point it "
            "at a directory of text files or at a .jsonl / .parquet file"
        )
    try:
        with open(path, "rb") as f:  # a regular file: opening cannot block
            f.read(1)
    except OSError as exc:
        raise ConfigError(f"{flag} {data}: cannot be read ({exc.strerror})") from None


def check_records(data: str, text_column: str) -> None:
    """The first record of each kind of record file in ``data`` (``.jsonl``, ``.parquet``, a
    dataset directory) has ``text_column``: a wrong ``--text-column`` fails here, before
    launch, not in the middle of tokenising."""
    from flower_shard.data.sources import kind_of, list_documents, read_unit
    from flower_shard.data.units import Unit

    root, files = list_documents(data)
    seen = {"text"}
    for rel in files:
        kind = kind_of(root / rel)
        if kind not in seen:
            seen.add(kind)
            next(read_unit(root, Unit(rel, kind), text_column, None), None)


def with_model_tokenizer(cfg: TrainConfig) -> TrainConfig:
    """``--model DIR`` that holds a tokenizer, and no ``--tokenizer``: the model's own (its
    embedding rows are that tokenizer's ids; bytes would train it on other ids)."""
    model = Path(cfg.model)
    ships = model.is_dir() and any((model / name).is_file() for name in TOKENIZER_FILES)
    return dataclasses.replace(cfg, tokenizer=cfg.model) if cfg.tokenizer is None and ships else cfg


def check_out(cfg: TrainConfig, flag: str = "--out") -> None:
    """Where a run writes (``--out``, a Flower run's ``out-dir``): a directory or a new path
    below one, not inside the run's own ``--data`` (the run would train on its output), and
    not the data itself; ``--resume`` a directory. One-line :class:`ConfigError` otherwise."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{flag} {cfg.out} is a file; give a directory (or a new path)")
    parent = next((p for p in out.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigError(f"{flag} {cfg.out}: {parent} is a file, not a directory")
    if parent is not None and not out.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {cfg.out}: cannot create it in {parent} (permissions)")
    if cfg.data is not None:
        data, target = Path(cfg.data).resolve(), out.resolve()
        if target == data or data in target.parents:
            raise ConfigError(
                f"{flag} {cfg.out} is inside --data {cfg.data}: the run would read its own "
                "output as training data; write it somewhere else"
            )
    if cfg.resume is not None and Path(cfg.resume).exists() and not Path(cfg.resume).is_dir():
        raise ConfigError(f"--resume {cfg.resume} is a file; give a run's output directory")


def check_run_dir(out: str | Path, run: str | None, flag: str = "--out") -> None:
    """Raise :class:`ConfigError` if ``out/checkpoints`` holds committed checkpoints that are
    not of run ``run`` (None: a new run, whose checkpoints cannot be there yet): a new run
    there would prune them as older than its own, and a resume could load them."""
    from flower_shard.config.identity import RUN
    from flower_shard.runtime import checkpoint as C

    for path in C.committed(Path(out, runfiles.CHECKPOINTS_DIR)):
        try:
            theirs = C.read_identity(path).get(RUN)
        except C.CheckpointError:
            theirs = None
        if run is None or theirs != run:
            resume = "--resume" if flag.startswith("--") else "resume ="
            how = f"continue it with {resume} {out}, or use" if run is None else "use"
            raise ConfigError(
                f"{flag} {out} holds the checkpoints of another run "
                f"({path.relative_to(out)}); {how} a fresh {flag}: runs must not mix their "
                "checkpoints"
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
