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
``seq_len + 1`` tokens; a seeded permutation of the blocks is split into G contiguous parts
(one per group) and each part into K parts (one per rank): disjoint, and together every block.
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
# Files of records (one document per record), as opposed to text files (one document each).
RECORD_SUFFIXES = (".jsonl", ".parquet")


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


def _read_jsonl_stdlib(path: Path, column: str) -> list:
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
                    f"--text-column {column!r}: line {number} of {path} has no such field "
                    f"(fields: {fields}); set --text-column to the field that holds the text"
                )
            values.append(record[column])
    return values


def _read_column(path: Path, column: str) -> list:
    """The ``column`` values of a .jsonl / .parquet file's records, in file order.

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
                    f"--text-column {column!r}: {path} has no such column (columns: "
                    f"{', '.join(ds.column_names)}); set --text-column to the one with the text"
                )
            return list(ds[column])
    if path.suffix == ".jsonl":
        return _read_jsonl_stdlib(path, column)
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
            f"--text-column {column!r}: {path} has no such column (columns: {', '.join(names)}); "
            "set --text-column to the one with the text"
        )
    return pq.read_table(path, columns=[column]).column(column).to_pylist()


def iter_documents(root: Path, files: list[str], text_column: str) -> Iterable[tuple[str, bytes]]:
    """``(name, UTF-8 text)`` of every document: a text file whole, a record file per record.

    A record's name is ``PATH#INDEX`` (its position among the file's records), so the held-out
    split picks records, not whole files: one .jsonl file is a corpus of its own.
    """
    for rel in files:
        path = root / rel
        if path.suffix not in RECORD_SUFFIXES:
            yield rel, path.read_bytes()
            continue
        for index, value in enumerate(_read_column(path, text_column)):
            if value is None:  # a record without text: nothing to train on
                continue
            if not isinstance(value, str):
                raise ConfigError(
                    f"--text-column {text_column!r}: record {index} of {path} holds "
                    f"{type(value).__name__}, not text; set --text-column to a text field"
                )
            yield f"{rel}#{index}", value.encode("utf-8")


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
) -> CorpusInfo:
    """Tokenise the corpus into ``out_dir`` (train.npy, eval.npy, corpus.json) and describe it.

    Reuses an earlier preparation in ``out_dir`` when it was made from the same files (same
    names, sizes and modification times), tokenizer, split and, for record files, text column.
    """
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
    out = Path(out_dir)
    stamp = out / "fingerprint"
    if stamp.exists() and stamp.read_text() == fingerprint.hexdigest():
        return CorpusInfo.load(out)

    streams: dict[bool, list[np.ndarray]] = {False: [], True: []}
    counts = {False: 0, True: 0}
    eos = np.asarray([tok.eos_id], dtype=np.uint32)
    for name, text in iter_documents(root, files, text_column):
        held_out = is_held_out(name, eval_fraction)
        streams[held_out] += [tok.encode(text).astype(np.uint32), eos]
        counts[held_out] += 1
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
) -> BatchIterator:
    """The training batches of one rank."""
    blocks = load_blocks(directory, "train", seq_len)
    indices = partition(len(blocks), groups, group_size, seed)[group][rank_in_group]
    return BatchIterator(blocks, indices, batch_size, seed=[seed, group, rank_in_group])


def eval_shard(
    directory: str | os.PathLike, seq_len: int, n_sequences: int, rank: int, world_size: int
) -> np.ndarray:
    """This rank's share of the first ``n_sequences`` held-out blocks (strided over all ranks).

    The evaluated set is the same whatever the topology; only its split over ranks changes.
    """
    blocks = load_blocks(directory, "eval", seq_len)
    return blocks[: min(n_sequences, len(blocks))][rank::world_size]


def check_fits(info: CorpusInfo, cfg) -> None:
    """Fail before launch if the corpus cannot feed the topology (see :func:`partition`), or if
    its tokenizer emits ids the model cannot embed."""
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
    if info.eval_tokens < cfg.seq_len + 1:
        raise ConfigError(
            f"the held-out split has {info.eval_tokens} tokens, less than one block of "
            f"--seq-len {cfg.seq_len}; raise --eval-fraction or add data"
        )
