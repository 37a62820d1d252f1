"""Training data: text files, tokenised once, packed into blocks, partitioned by group and rank.

The built-in corpus is the source of the running Python's standard library (every machine has
it, nothing is downloaded); ``--data`` takes a directory of text files instead, or a ``.jsonl``
/ ``.parquet`` file of records (or a directory holding such files), one document per record in
the ``--text-column`` field.

Pipeline (done once per run by the launcher, see :func:`prepare_corpus`):

1. list the files in a fixed order (sorted relative paths); a text file is one document, a
   ``.jsonl`` / ``.parquet`` file one document per record (``PATH#INDEX``);
2. hold out whole documents for evaluation, chosen by a hash of the document's name
   (deterministic, independent of the seed, so every run of a corpus evaluates on the same text);
3. tokenise (bytes by default, or a local Hugging Face tokenizer) and join the documents with an
   end-of-document token into one training and one evaluation stream, saved as ``.npy``.

``.parquet`` needs ``datasets`` (or ``pyarrow``); ``.jsonl`` is read with ``datasets`` when it is
installed and with the standard library's ``json`` otherwise.

The ranks then memory-map the streams. The training stream is cut into blocks of
``seq_len + 1`` tokens, and the blocks are split into G disjoint parts, one per group, that
together hold every block (``--partition``):

- ``iid``: a seeded permutation of the blocks cut into G contiguous parts;
- ``by-source``: every source (a top-level directory, or a file at the top level) goes whole to
  one group; largest source first, each onto the group with the fewest blocks so far;
- ``dirichlet``: for each label in sorted order, proportions p ~ Dirichlet(alpha, ..., alpha)
  over the G groups; the label's blocks, in stream order, are cut at
  ``floor(cumsum(p) * n_label)`` (flwr-datasets' DirichletPartitioner without self-balancing);
  if a group ends with fewer than K x batch-size blocks, all labels are drawn again from the
  same generator (10 attempts at most).

A block belongs to the document that holds its first token (blocks run across document ends);
``train_docs.npz`` records where each training document starts, its source and its label. Each
group's part is then cut into K parts (one per rank): for ``iid`` as before, a contiguous split
of the permuted part; otherwise after a permutation seeded with ``[seed, group]``. The held-out
split does not depend on the partition.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flower_shard.config import ConfigError

TRAIN_FILE = "train.npy"
EVAL_FILE = "eval.npy"
META_FILE = "corpus.json"
DOCS_FILE = "train_docs.npz"  # per training document: start in train.npy, source, label
# Files of records (one document per record), as opposed to text files (one document each).
RECORD_SUFFIXES = (".jsonl", ".parquet")
# --partition-label value that labels each document with its source instead of a record field.
SOURCE_LABEL = "directory"
DIRICHLET_ATTEMPTS = 10  # draws before giving up on every group getting enough blocks


def stdlib_dir() -> Path:
    """Where the running Python keeps its standard library's source."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_documents(source: str | os.PathLike | None) -> tuple[Path, list[str]]:
    """The corpus root and its files as sorted relative POSIX paths.

    The standard library contributes its ``.py`` files (``site-packages`` excluded: that is not
    the standard library); a user directory contributes every regular, non-hidden file; a single
    ``.jsonl`` / ``.parquet`` file is the only file of its parent directory's corpus.
    """
    if source is not None and Path(source).is_file() and Path(source).suffix in RECORD_SUFFIXES:
        path = Path(source)
        return path.parent, [path.name]
    root = stdlib_dir() if source is None else Path(source)
    if not root.is_dir():
        raise ConfigError(
            f"--data {root}: no such directory or .jsonl / .parquet file; point it at a "
            "directory of text files or at a .jsonl / .parquet file"
        )
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d
            for d in dirnames
            if not d.startswith(".") and d not in ("site-packages", "__pycache__")
        )
        for name in filenames:
            if name.startswith(".") or (source is None and not name.endswith(".py")):
                continue
            files.append(Path(dirpath, name).relative_to(root).as_posix())
    files.sort()
    if not files:
        raise ConfigError(f"--data {root}: the directory holds no files to train on")
    return root, files


def source_of(relpath: str) -> str:
    """The source of a corpus file (its relative POSIX path): its top-level directory, or the
    file itself when it lies at the top level. ``by-source`` gives each source to one group."""
    return relpath.split("/", 1)[0]


def count_sources(source: str | os.PathLike | None) -> int:
    """How many sources (see :func:`source_of`) the corpus ``source`` has, held-out files
    included: an upper bound on the sources that reach the training split."""
    return len({source_of(rel) for rel in list_documents(source)[1]})


def _read_jsonl_stdlib(path: Path, column: str, flag: str, what: str) -> list:
    values = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"--data {path}: line {number} is not JSON ({exc.msg}); write one JSON "
                    "object per line"
                ) from None
            if not isinstance(record, dict) or column not in record:
                fields = ", ".join(record) if isinstance(record, dict) else "none"
                raise ConfigError(
                    f"{flag} {column!r}: line {number} of {path} has no such field "
                    f"(fields: {fields}); set {flag} to the field that holds the {what}"
                )
            values.append(record[column])
    return values


def _read_column(path: Path, column: str, flag: str = "--text-column", what: str = "text") -> list:
    """The ``column`` values of a .jsonl / .parquet file's records, in file order.

    ``flag`` and ``what`` name the setting and its content in the error messages.

    Raises
    ------
    ConfigError
        The column is missing, or a .parquet file cannot be read without ``datasets`` /
        ``pyarrow``.
    """
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        # The launcher's error must stay one line: no progress bars or info logs on stderr.
        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
        read = datasets.Dataset.from_json if path.suffix == ".jsonl" else None
        read = read or datasets.Dataset.from_parquet
        # A private cache: datasets would otherwise keep Arrow copies under ~/.cache for good.
        with tempfile.TemporaryDirectory() as cache:
            ds = read(str(path), cache_dir=cache, keep_in_memory=True)
            if column not in ds.column_names:
                raise ConfigError(
                    f"{flag} {column!r}: {path} has no such column (columns: "
                    f"{', '.join(ds.column_names)}); set {flag} to the one with the {what}"
                )
            return list(ds[column])
    if path.suffix == ".jsonl":
        return _read_jsonl_stdlib(path, column, flag, what)
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"--data {path}: reading .parquet needs the datasets package; pip install datasets "
            "(or pyarrow), or convert the file to .jsonl"
        ) from None
    names = pq.read_schema(path).names
    if column not in names:
        raise ConfigError(
            f"{flag} {column!r}: {path} has no such column (columns: {', '.join(names)}); "
            f"set {flag} to the one with the {what}"
        )
    return pq.read_table(path, columns=[column]).column(column).to_pylist()


def iter_documents(root: Path, files: list[str], text_column: str) -> Iterable[tuple[str, bytes]]:
    """``(name, UTF-8 text)`` of every document: a text file whole, a record file per record.

    A record's name is ``PATH#INDEX`` (its position among the file's records), so the held-out
    split picks records, not whole files: one .jsonl file is a corpus of its own.
    """
    for _, name, text, _ in _documents(root, files, text_column, None):
        yield name, text


def _label_key(value) -> str:
    """A record's label value as a string: text as it is, anything else as JSON (null, 3, true)."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _documents(
    root: Path, files: list[str], text_column: str, label_field: str | None
) -> Iterator[tuple[str, str, bytes, str | None]]:
    """``(file, name, UTF-8 text, label)`` of every document (see :func:`iter_documents`).

    ``label`` is the record's ``label_field`` value (:func:`_label_key`), or None without a
    ``label_field``.

    Raises
    ------
    ConfigError
        A text value is not text, a record lacks the label field, or a ``label_field`` is asked
        of a text file (which has no fields).
    """
    for rel in files:
        path = root / rel
        if path.suffix not in RECORD_SUFFIXES:
            if label_field is not None:
                raise ConfigError(
                    f"--partition-label {label_field!r}: {rel} is a text file, which has no "
                    f"fields; use --partition-label {SOURCE_LABEL} (its top-level directory) or "
                    "only .jsonl / .parquet data"
                )
            yield rel, rel, path.read_bytes(), None
            continue
        texts = _read_column(path, text_column)
        labels = [None] * len(texts)
        if label_field is not None:
            labels = _read_column(path, label_field, "--partition-label", "label")
        for index, (value, label) in enumerate(zip(texts, labels)):
            if value is None:  # a record without text: nothing to train on
                continue
            if not isinstance(value, str):
                raise ConfigError(
                    f"--text-column {text_column!r}: record {index} of {path} holds "
                    f"{type(value).__name__}, not text; set --text-column to a text field"
                )
            label = None if label_field is None else _label_key(label)
            yield rel, f"{rel}#{index}", value.encode("utf-8"), label


def is_held_out(relpath: str, eval_fraction: float) -> bool:
    """True if this document belongs to the evaluation split (a stable hash of its name)."""
    digest = hashlib.sha256(relpath.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus 256 as end-of-document."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (never from a hub)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # transformers raises many types for a bad directory
            raise ConfigError(
                f"--tokenizer {path}: not a loadable tokenizer directory ({type(exc).__name__}); "
                "it needs tokenizer.json or the files of a saved tokenizer"
            ) from exc
        self.name = f"hf:{Path(path).resolve()}"
        self.vocab_size = len(self._tok)
        eos = self._tok.eos_token_id
        self.eos_id = eos if eos is not None else self.vocab_size - 1

    def encode(self, data: bytes) -> np.ndarray:
        ids = self._tok(data.decode("utf-8", errors="replace"), add_special_tokens=False)
        return np.asarray(ids["input_ids"], dtype=np.uint32)


def load_tokenizer(path: str | None):
    return ByteTokenizer() if path is None else HFTokenizer(path)


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


def partition(n_blocks: int, groups: int, group_size: int, seed: int) -> list[list[np.ndarray]]:
    """Block indices of every (group, rank): ``parts[g][k]``.

    A seeded permutation of all blocks is split into G contiguous parts, each into K parts.
    The parts are disjoint and together hold every block; sizes differ by at most one.
    """
    if n_blocks < groups * group_size:
        raise ConfigError(
            f"only {n_blocks} training blocks for {groups * group_size} ranks; use a shorter "
            "--seq-len, fewer ranks or more data"
        )
    perm = np.random.default_rng(seed).permutation(n_blocks)
    return [list(np.array_split(part, group_size)) for part in np.array_split(perm, groups)]


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


def block_documents(starts: np.ndarray, n_blocks: int, seq_len: int) -> np.ndarray:
    """For each block of ``seq_len + 1`` tokens, the document that holds its first token."""
    first = np.arange(n_blocks, dtype=np.int64) * (seq_len + 1)
    return np.searchsorted(starts, first, side="right") - 1


def by_source_groups(sources: np.ndarray, groups: int) -> list[np.ndarray]:
    """Block indices of each group when every source goes whole to one group.

    ``sources[b]`` is block b's source id. Sources are placed largest first (most blocks; ties
    by id, i.e. by name), each onto the group with the fewest blocks so far (ties: the lowest
    group): the longest-processing-time rule, deterministic and without a seed.

    Raises
    ------
    ConfigError
        Fewer sources hold training blocks than there are groups.
    """
    ids, counts = np.unique(sources, return_counts=True)
    if len(ids) < groups:
        raise ConfigError(
            f"--partition by-source: the training blocks come from {len(ids)} source(s) "
            f"(top-level directories or files), fewer than the {groups} groups; use at most "
            f"{len(ids)} groups or --partition dirichlet"
        )
    owner = np.empty(int(ids.max()) + 1, dtype=np.int64)
    load = [0] * groups
    for i in sorted(range(len(ids)), key=lambda i: (-counts[i], ids[i])):
        g = min(range(groups), key=lambda g: (load[g], g))
        owner[ids[i]] = g
        load[g] += int(counts[i])
    of_block = owner[sources]
    return [np.flatnonzero(of_block == g) for g in range(groups)]


def dirichlet_groups(
    labels: np.ndarray, groups: int, alpha: float, seed: int, min_blocks: int = 1
) -> list[np.ndarray]:
    """Block indices of each group, label by label in Dirichlet(alpha) proportions.

    ``labels[b]`` is block b's label id. With one generator ``np.random.default_rng(seed)``:
    for each label in sorted order, draw p ~ Dirichlet(alpha x ones(G)) and cut the label's
    blocks (in stream order) at ``floor(cumsum(p)[:-1] * n_label)``: group g gets the g-th
    piece. As flwr-datasets' DirichletPartitioner (without self-balancing), when a group ends
    with fewer than ``min_blocks`` blocks, every label is drawn again (the generator goes on).

    Raises
    ------
    ConfigError
        After :data:`DIRICHLET_ATTEMPTS` draws some group still had fewer than ``min_blocks``.
    """
    rng = np.random.default_rng(seed)
    order = np.argsort(labels, kind="stable")  # blocks grouped by label, stream order inside
    classes, first = np.unique(labels[order], return_index=True)
    by_label = np.split(order, first[1:])
    smallest = 0
    for _ in range(DIRICHLET_ATTEMPTS):
        pieces: list[list[np.ndarray]] = [[] for _ in range(groups)]
        for blocks in by_label:
            p = rng.dirichlet(np.full(groups, float(alpha)))
            cuts = (np.cumsum(p) * len(blocks)).astype(np.int64)[:-1]
            for g, piece in enumerate(np.split(blocks, cuts)):
                pieces[g].append(piece)
        parts = [np.sort(np.concatenate(p)) for p in pieces]
        smallest = min(len(p) for p in parts)
        if smallest >= min_blocks:
            return parts
    raise ConfigError(
        f"--dirichlet-alpha {alpha}: {DIRICHLET_ATTEMPTS} draws over {len(classes)} label(s) "
        f"all left a group with fewer than {min_blocks} blocks (last: {smallest}); raise "
        "--dirichlet-alpha, use fewer groups or a smaller --batch-size"
    )


def split_ranks(parts: list[np.ndarray], group_size: int, seed: int) -> list[list[np.ndarray]]:
    """Cut each group's blocks into ``group_size`` disjoint parts (sizes differ by at most one)
    after a permutation seeded with ``[seed, group]``."""
    out = []
    for g, part in enumerate(parts):
        perm = np.random.default_rng([seed, g]).permutation(len(part))
        out.append(list(np.array_split(part[perm], group_size)))
    return out


def partition_data(
    directory: str | os.PathLike,
    seq_len: int,
    groups: int,
    group_size: int,
    seed: int,
    how: str = "iid",
    label: str | None = None,
    alpha: float = 0.5,
    min_rank_blocks: int = 1,
) -> list[list[np.ndarray]]:
    """Block indices of every (group, rank) of a prepared corpus: ``parts[g][k]``.

    ``how`` is ``--partition`` (see the module's docstring); ``iid`` is :func:`partition`.
    ``min_rank_blocks`` (the batch size) makes ``dirichlet`` draw again until every group holds
    at least ``group_size x min_rank_blocks`` blocks.
    """
    n_blocks = len(load_blocks(directory, "train", seq_len))
    if how == "iid":
        return partition(n_blocks, groups, group_size, seed)
    docs = load_documents(directory)
    of_block = block_documents(docs.starts, n_blocks, seq_len)
    if how == "by-source":
        parts = by_source_groups(docs.source_ids[of_block], groups)
    elif how == "dirichlet":
        if label is None:
            raise ConfigError("--partition dirichlet needs --partition-label")
        labels = docs.labels_for(label)[of_block]
        parts = dirichlet_groups(labels, groups, alpha, seed, group_size * min_rank_blocks)
    else:
        raise ConfigError(f"--partition {how!r} is unknown; choose iid, by-source or dirichlet")
    return split_ranks(parts, group_size, seed)


class BatchIterator:
    """Endless batches of one rank's blocks: a fresh seeded shuffle of its part every epoch.

    The position (epoch, index) is plain state, so a checkpoint can resume it exactly.
    """

    def __init__(
        self, blocks: np.ndarray, indices: np.ndarray, batch_size: int, seed: Sequence[int]
    ):
        if len(indices) < batch_size:
            raise ConfigError(
                f"a rank's data part has {len(indices)} blocks, fewer than --batch-size "
                f"{batch_size}; use a smaller batch, a shorter --seq-len or more data"
            )
        self.blocks, self.indices, self.batch_size = blocks, indices, batch_size
        self.seed = [int(s) for s in seed]
        self.epoch, self.position = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> np.ndarray:
        rng = np.random.default_rng([*self.seed, self.epoch])
        return self.indices[rng.permutation(len(self.indices))]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.position + self.batch_size > len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._shuffle()
        rows = np.sort(self._order[self.position : self.position + self.batch_size])
        self.position += self.batch_size
        batch = torch.from_numpy(self.blocks[rows].astype(np.int64))
        return batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._shuffle()


def rank_batches(
    directory: str | os.PathLike,
    seq_len: int,
    batch_size: int,
    groups: int,
    group_size: int,
    group: int,
    rank_in_group: int,
    seed: int,
    *,
    how: str = "iid",
    label: str | None = None,
    alpha: float = 0.5,
) -> BatchIterator:
    """The training batches of one rank; ``how``, ``label`` and ``alpha`` are ``--partition``,
    ``--partition-label`` and ``--dirichlet-alpha`` (see :func:`partition_data`)."""
    blocks = load_blocks(directory, "train", seq_len)
    parts = partition_data(
        directory, seq_len, groups, group_size, seed, how, label, alpha, batch_size
    )
    indices = parts[group][rank_in_group]
    return BatchIterator(blocks, indices, batch_size, seed=[seed, group, rank_in_group])


def eval_shard(
    directory: str | os.PathLike, seq_len: int, n_sequences: int, rank: int, world_size: int
) -> np.ndarray:
    """This rank's share of the first ``n_sequences`` held-out blocks (strided over all ranks).

    The evaluated set is the same whatever the topology; only its split over ranks changes.
    """
    blocks = load_blocks(directory, "eval", seq_len)
    return blocks[: min(n_sequences, len(blocks))][rank::world_size]


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
    from flower_shard.models import check_vocab

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
