"""A prepared corpus on disk: the token streams, their description and the training documents.

:func:`prepare_corpus` writes ``train.npy``, ``eval.npy``, ``corpus.json`` and ``train_docs.npz``;
the ranks memory-map the streams as blocks of ``seq_len + 1`` tokens (:func:`load_blocks`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flower_shard.config import ConfigError
from flower_shard.data.sources import (
    RECORD_SUFFIXES,
    SOURCE_LABEL,
    _documents,
    is_held_out,
    list_documents,
    source_of,
)
from flower_shard.data.tokenizers import load_tokenizer

TRAIN_FILE = "train.npy"


EVAL_FILE = "eval.npy"


META_FILE = "corpus.json"


DOCS_FILE = "train_docs.npz"  # per training document: start in train.npy, source, label


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
        return cls(**json.loads(Path(directory, META_FILE).read_text()))


def prepare_corpus(
    out_dir: str | os.PathLike,
    source: str | None = None,
    tokenizer: str | None = None,
    eval_fraction: float = 0.05,
    text_column: str = "text",
    partition_label: str | None = None,
) -> CorpusInfo:
    """Tokenise the corpus into ``out_dir`` (train.npy, eval.npy, corpus.json, train_docs.npz)
    and describe it.

    ``partition_label`` (``--partition-label``): a record field is read into train_docs.npz as
    each training document's label; None or ``directory`` read nothing more (sources are
    always recorded). Reuses an earlier preparation in ``out_dir`` when it was made from the
    same files (same names, sizes and modification times), tokenizer, split and, for record
    files, text column and label field.
    """
    label_field = None if partition_label in (None, SOURCE_LABEL) else partition_label
    root, files = list_documents(source)
    tok = load_tokenizer(tokenizer)
    fingerprint = hashlib.sha256()
    for rel in files:
        st = (root / rel).stat()
        fingerprint.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    fingerprint.update(f"{tok.name}\0{eval_fraction}".encode())
    # Only record files read the column: leave text-only fingerprints (and caches) as they were.
    if any(Path(rel).suffix in RECORD_SUFFIXES for rel in files):
        fingerprint.update(f"\0column={text_column}".encode())
    if label_field is not None:  # without one, fingerprints (and caches) stay as they were
        fingerprint.update(f"\0label={label_field}".encode())
    out = Path(out_dir)
    stamp = out / "fingerprint"
    fresh = stamp.exists() and stamp.read_text() == fingerprint.hexdigest()
    # A preparation made before train_docs.npz existed is redone (train.npy comes out the same).
    if fresh and (out / DOCS_FILE).exists():
        return CorpusInfo.load(out)

    streams: dict[bool, list[np.ndarray]] = {False: [], True: []}
    counts = {False: 0, True: 0}
    eos = np.asarray([tok.eos_id], dtype=np.uint32)
    # Per training document: where it starts in the training stream, its source, its label.
    starts, sources, labels, position = [], [], [], 0
    for rel, name, text, label in _documents(root, files, text_column, label_field):
        held_out = is_held_out(name, eval_fraction)
        ids = tok.encode(text).astype(np.uint32)
        streams[held_out] += [ids, eos]
        counts[held_out] += 1
        if not held_out:
            starts.append(position)
            sources.append(source_of(rel))
            labels.append(label)
            position += ids.size + 1
    if not counts[False] or not counts[True]:
        raise ConfigError(
            f"corpus {source or root}: {sum(counts.values())} document(s) cannot be split into "
            f"training and held-out documents with --eval-fraction {eval_fraction}; add data "
            "or change the fraction"
        )
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    out.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for held_out, name in ((False, TRAIN_FILE), (True, EVAL_FILE)):
        tokens = np.concatenate(streams[held_out]).astype(dtype)
        tmp = out / f".{name}.tmp"
        with open(tmp, "wb") as fh:
            np.save(fh, tokens)
        os.replace(tmp, out / name)
        sizes[held_out] = int(tokens.size)
    write_documents(out, starts, sources, labels if label_field is not None else None, label_field)
    info = CorpusInfo(
        directory=str(out),
        vocab_size=tok.vocab_size,
        eos_id=tok.eos_id,
        tokenizer=tok.name,
        train_tokens=sizes[False],
        eval_tokens=sizes[True],
        train_files=counts[False],
        eval_files=counts[True],
    )
    (out / META_FILE).write_text(json.dumps(info.__dict__, indent=2) + "\n")
    stamp.write_text(fingerprint.hexdigest())
    return info


def load_blocks(directory: str | os.PathLike, split: str, seq_len: int) -> np.ndarray:
    """The split's token stream as a read-only ``(n_blocks, seq_len + 1)`` view (memory-mapped)."""
    stream = np.load(Path(directory, EVAL_FILE if split == "eval" else TRAIN_FILE), mmap_mode="r")
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


def write_documents(
    out: Path,
    starts: list[int],
    sources: list[str],
    labels: list[str] | None,
    label_field: str | None,
) -> None:
    """Save the training documents' starts, sources and labels as ``out/train_docs.npz``."""
    source_names, source_ids = np.unique(np.asarray(sources, dtype=str), return_inverse=True)
    arrays = {
        "starts": np.asarray(starts, dtype=np.int64),
        "source_ids": source_ids.astype(np.int64),
        "sources": source_names,
    }
    if labels is not None:
        label_names, label_ids = np.unique(np.asarray(labels, dtype=str), return_inverse=True)
        arrays |= {
            "label_ids": label_ids.astype(np.int64),
            "labels": label_names,
            "label_field": np.asarray(label_field),
        }
    tmp = out / f".{DOCS_FILE}.tmp"
    with open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
    os.replace(tmp, out / DOCS_FILE)


def load_documents(directory: str | os.PathLike) -> TrainDocuments:
    """Read ``train_docs.npz`` (written by :func:`prepare_corpus`)."""
    with np.load(Path(directory, DOCS_FILE)) as z:  # str arrays: no pickle needed
        labelled = "label_ids" in z
        return TrainDocuments(
            starts=z["starts"],
            source_ids=z["source_ids"],
            sources=z["sources"].tolist(),
            label_ids=z["label_ids"] if labelled else None,
            labels=z["labels"].tolist() if labelled else None,
            label_field=str(z["label_field"]) if labelled else None,
        )
