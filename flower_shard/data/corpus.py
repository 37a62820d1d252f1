"""A prepared corpus on disk: the token streams, their description and the training documents.

:func:`prepare_corpus` writes ``train.npy``, ``eval.npy``, ``corpus.json`` and ``train_docs.npz``
(tokenised on several workers in bounded memory by :mod:`flower_shard.data.prepare`, and shared
between the runs of a host through :mod:`flower_shard.data.cache`); the ranks memory-map the
streams as blocks of ``seq_len + 1`` tokens (:func:`load_blocks`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from flower_shard import runfiles as F
from flower_shard.config import ConfigError
from flower_shard.data import cache, pretokenized
from flower_shard.data.prepare import Job, tokenise
from flower_shard.data.sources import RECORD_SUFFIXES, SOURCE_LABEL, list_documents
from flower_shard.data.tokenizers import load_tokenizer

FORMAT = 2  # bump when what prepare_corpus writes changes: older preparations are redone


@dataclass(frozen=True)
class CorpusInfo:
    """What :func:`prepare_corpus` wrote: enough for the ranks to build the model and batches."""

    directory: str
    vocab_size: int
    eos_id: int
    tokenizer: str
    train_tokens: int
    eval_tokens: int
    train_files: int
    """Training documents (text files, or records of .jsonl / .parquet files)."""
    eval_files: int
    """Held-out documents."""

    @classmethod
    def load(cls, directory: str | os.PathLike) -> CorpusInfo:
        return cls(**json.loads(Path(directory, F.CORPUS_META).read_text()))


def prepare_corpus(
    out_dir: str | os.PathLike,
    source: str | None = None,
    tokenizer: str | None = None,
    eval_fraction: float = 0.05,
    text_column: str = "text",
    partition_label: str | None = None,
    workers: int = 0,
) -> CorpusInfo:
    """Tokenise the corpus into ``out_dir`` (train.npy, eval.npy, corpus.json, train_docs.npz)
    and describe it.

    ``partition_label`` (``--partition-label``): a record field is read into train_docs.npz as
    each training document's label; None or ``directory`` read nothing more (sources are
    always recorded). ``workers``: tokenising processes (0: one per core). A preparation of the
    same files (names, sizes, modification times), tokenizer, split, text column and label
    field is reused: from ``out_dir`` itself, or from the host's cache (hard links).
    """
    label_field = None if partition_label in (None, SOURCE_LABEL) else partition_label
    root, files = list_documents(source)
    vocab_size, eos_id, name = _vocabulary(source, tokenizer)
    fingerprint = corpus_fingerprint(root, files, name, eval_fraction, text_column, label_field)
    out = Path(out_dir)
    if cache.complete(out, fingerprint) and (out / F.TRAIN_DOCS).exists():
        return CorpusInfo.load(out)
    job = Job(
        str(root),
        tokenizer,
        eval_fraction,
        text_column,
        label_field,
        "",
        "uint16" if vocab_size <= 2**16 else "uint32",
    )
    meta = {"vocab_size": vocab_size, "eos_id": eos_id, "tokenizer": name}
    workers = workers or os.cpu_count() or 1
    what = str(source or root)
    entry_root = cache.cache_root()
    if entry_root is None:
        counts = _prepare_into(out, job, files, workers, what, fingerprint)
    else:
        entry = entry_root / fingerprint[:32]
        with cache.locked(entry):
            if not cache.complete(entry, fingerprint):
                _prepare_into(entry, job, files, workers, what, fingerprint)
        counts = json.loads((entry / F.CORPUS_META).read_text())
        cache.link_files(entry, out, (F.TRAIN_TOKENS, F.EVAL_TOKENS, F.TRAIN_DOCS))
    keys = ("train_tokens", "eval_tokens", "train_files", "eval_files")
    info = CorpusInfo(directory=str(out), **meta, **{k: counts[k] for k in keys})
    (out / cache.STAMP).unlink(missing_ok=True)
    (out / F.CORPUS_META).write_text(json.dumps(asdict(info), indent=2) + "\n")
    (out / cache.STAMP).write_text(fingerprint)
    return info


def _vocabulary(source, tokenizer: str | None) -> tuple[int, int, str]:
    """(vocab_size, eos_id, name) of the tokenizer, or of an already-tokenised corpus."""
    if pretokenized.is_pretokenized(source):
        if tokenizer is not None:
            raise ConfigError(
                f"--data {source} is already tokenised ({pretokenized.META}): drop --tokenizer"
            )
        spec = pretokenized.read_spec(Path(source))
        return spec.vocab_size, spec.eos_id, spec.name
    tok = load_tokenizer(tokenizer)
    return tok.vocab_size, tok.eos_id, tok.name


def corpus_fingerprint(root, files, tokenizer, eval_fraction, text_column, label_field) -> str:
    """What a preparation depends on: the files (names, sizes, modification times; every file of
    a dataset directory), the tokenizer, the split, the text column and the label field."""
    h = hashlib.sha256(f"format={FORMAT}\n".encode())
    for rel in files:
        path = root / rel
        inside = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for p in inside:
            st = p.stat()
            h.update(f"{p.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    h.update(f"{tokenizer}\0{eval_fraction}".encode())
    if any(Path(rel).suffix in RECORD_SUFFIXES or (root / rel).is_dir() for rel in files):
        h.update(f"\0column={text_column}".encode())
    if label_field is not None:
        h.update(f"\0label={label_field}".encode())
    return h.hexdigest()


def _prepare_into(dest: Path, job: Job, files, workers: int, what: str, fingerprint: str) -> dict:
    """Tokenise into ``dest`` (a run's data directory or a cache entry); return the counts."""
    from flower_shard.data.prepare import join

    dest.mkdir(parents=True, exist_ok=True)
    (dest / cache.STAMP).unlink(missing_ok=True)
    shard_dir = dest / ".shards"
    shutil.rmtree(shard_dir, ignore_errors=True)
    shard_dir.mkdir()
    job = Job(**{**asdict(job), "shard_dir": str(shard_dir)})
    try:
        shards = tokenise(job, files, workers, what)
        counts = {
            "train_tokens": sum(s.train_tokens for s in shards),
            "eval_tokens": sum(s.eval_tokens for s in shards),
            "train_files": sum(s.train_docs for s in shards),
            "eval_files": sum(s.eval_docs for s in shards),
        }
        if not counts["train_files"] or not counts["eval_files"]:
            raise ConfigError(
                f"corpus {what}: {counts['train_files'] + counts['eval_files']} document(s) "
                "cannot be split into training and held-out documents with --eval-fraction "
                f"{job.eval_fraction}; add data or change the fraction"
            )
        join(shards, shard_dir, dest, job.dtype, job.label_field)
    finally:
        shutil.rmtree(shard_dir, ignore_errors=True)
    (dest / F.CORPUS_META).write_text(
        json.dumps({"directory": str(dest), **counts}, indent=2) + "\n"
    )
    (dest / cache.STAMP).write_text(fingerprint)
    return counts


def load_blocks(directory: str | os.PathLike, split: str, seq_len: int) -> np.ndarray:
    """The split's token stream as a read-only ``(n_blocks, seq_len + 1)`` view (memory-mapped)."""
    stream = np.load(
        Path(directory, F.EVAL_TOKENS if split == "eval" else F.TRAIN_TOKENS), mmap_mode="r"
    )
    n = stream.size // (seq_len + 1)
    if n == 0:
        raise ConfigError(
            f"the {split} split has {stream.size} tokens, fewer than one block of "
            f"--seq-len {seq_len} + 1; use a shorter --seq-len or more data"
        )
    return stream[: n * (seq_len + 1)].reshape(n, seq_len + 1)


@dataclass(frozen=True)
class TrainDocuments:
    """The training documents of a prepared corpus, in stream order (``train_docs.npz``)."""

    starts: np.ndarray
    """Where each document begins in train.npy (token offsets, increasing)."""
    source_ids: np.ndarray
    """Each document's source, as an index into ``sources``."""
    sources: list[str]
    """The sources' names, sorted (see :func:`source_of`)."""
    label_ids: np.ndarray | None
    """Each document's label, as an index into ``labels``; None when no field was read."""
    labels: list[str] | None
    """The labels' names, sorted."""
    label_field: str | None
    """The record field the labels come from."""

    def labels_for(self, partition_label: str) -> np.ndarray:
        """Each document's label id for ``--partition-label`` (``directory``: its source).

        Raises
        ------
        ConfigError
            The prepared data holds no labels of that field.
        """
        if partition_label == SOURCE_LABEL:
            return self.source_ids
        if self.label_field != partition_label or self.label_ids is None:
            raise ConfigError(
                f"--partition-label {partition_label!r}: the prepared data holds labels of "
                f"{self.label_field!r}; prepare it again with this --partition-label"
            )
        return self.label_ids


def load_documents(directory: str | os.PathLike) -> TrainDocuments:
    """Read ``train_docs.npz`` (written by :func:`prepare_corpus`)."""
    with np.load(Path(directory, F.TRAIN_DOCS)) as z:  # str arrays: no pickle needed
        labelled = "label_ids" in z
        return TrainDocuments(
            starts=z["starts"],
            source_ids=z["source_ids"],
            sources=z["sources"].tolist(),
            label_ids=z["label_ids"] if labelled else None,
            labels=z["labels"].tolist() if labelled else None,
            label_field=str(z["label_field"]) if labelled else None,
        )
