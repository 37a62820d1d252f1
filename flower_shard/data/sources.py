"""The documents of a corpus: which files, read how, and which are held out.

A text file is one document; a ``.jsonl`` / ``.parquet`` file, or a local ``datasets`` dataset
directory (``Dataset.save_to_disk``), is one document per record, named ``PATH#INDEX`` (the
record's position in the file); a directory of already-tokenised shards is one document per run
of tokens ended by the end-of-document id (:mod:`flower_shard.data.pretokenized`). The held-out
split is a stable hash of each document's name.

Every reader streams: records are read one at a time (``.jsonl`` line by line, ``.parquet`` by
record batch, a dataset directory by memory-mapped slices), never a whole column in memory, and
a reader can start at any record boundary (:class:`Unit`), so a large file is tokenised by
several workers at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from flower_shard.config import ConfigError
from flower_shard.data.units import Document, Unit

# Files of records (one document per record), as opposed to text files (one document each).
RECORD_SUFFIXES = (".jsonl", ".parquet")
# A `datasets` directory written by Dataset.save_to_disk holds these two files.
ARROW_MARKERS = ("dataset_info.json", "state.json")
ARROW = "arrow"  # the kind of a dataset directory (it is one "file" of the corpus)
# An already-tokenised corpus: a directory with this file and token files (data/pretokenized.py).
TOKENS_META = "tokens.json"
TOKEN_SUFFIXES = (".npy", ".bin")
# --partition-label value that labels each document with its source instead of a record field.
SOURCE_LABEL = "directory"


def stdlib_dir() -> Path:
    """Where the running Python keeps its standard library's source."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_arrow_dataset(path: str | os.PathLike) -> bool:
    """True if ``path`` is a directory written by ``datasets.Dataset.save_to_disk``."""
    return all(Path(path, marker).is_file() for marker in ARROW_MARKERS)


def list_documents(source: str | os.PathLike | None) -> tuple[Path, list[str]]:
    """The corpus root and its files as sorted relative POSIX paths.

    The standard library contributes its ``.py`` files (``site-packages`` excluded: that is not
    the standard library); a user directory contributes every regular, non-hidden file; a single
    ``.jsonl`` / ``.parquet`` file or dataset directory is the only "file" of its parent
    directory's corpus.
    """
    if source is not None and (
        (Path(source).is_file() and Path(source).suffix in RECORD_SUFFIXES)
        or is_arrow_dataset(source)
    ):
        path = Path(source).resolve()
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
        for d in list(dirnames):  # a dataset directory is one "file": read it, do not walk it
            if source is not None and is_arrow_dataset(Path(dirpath, d)):
                files.append(Path(dirpath, d).relative_to(root).as_posix())
                dirnames.remove(d)
        tokens = source is not None and Path(root, TOKENS_META).is_file()
        for name in filenames:
            if name.startswith(".") or (source is None and not name.endswith(".py")):
                continue
            if tokens and not name.endswith(TOKEN_SUFFIXES):  # tokens.json, a README, ...
                continue
            path = Path(dirpath, name)
            if not path.is_file():  # a FIFO, a socket, a dangling link: nothing to read
                raise ConfigError(
                    f"--data {root}: {path.relative_to(root)} is not a regular file; remove it "
                    "or point --data at a directory of regular files"
                )
            files.append(path.relative_to(root).as_posix())
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


def is_held_out(name: str, eval_fraction: float) -> bool:
    """True if this document belongs to the evaluation split (a stable hash of its name)."""
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction


def kind_of(path: Path) -> str:
    """How a corpus file is read: ``text``, ``jsonl``, ``parquet`` or ``arrow``."""
    if path.suffix in RECORD_SUFFIXES:
        return path.suffix[1:]
    return ARROW if path.is_dir() and is_arrow_dataset(path) else "text"


def read_unit(
    root: Path, unit: Unit, text_column: str, label_field: str | None
) -> Iterator[Document]:
    """The documents of ``unit`` in order.

    Raises
    ------
    ConfigError
        A record that is not a JSON object, lacks the text or label field, holds something
        other than text, or is not UTF-8; a text file asked for a label field; a .parquet file
        or dataset directory without ``pyarrow`` / ``datasets`` installed.
    """
    path = root / unit.rel
    if unit.kind == "text":
        if label_field is not None:
            raise ConfigError(
                f"--partition-label {label_field!r}: {unit.rel} is a text file, which has no "
                f"fields; use --partition-label {SOURCE_LABEL} (its top-level directory) or "
                "only .jsonl / .parquet data"
            )
        yield Document(unit.rel, unit.rel, path.read_bytes(), None)
        return
    from flower_shard.data import records

    reader = {"jsonl": records.jsonl, "parquet": records.parquet, ARROW: records.arrow}[unit.kind]
    for index, text, label in reader(path, unit, text_column, label_field):
        if text is None:  # a record without text: nothing to train on
            continue
        if not isinstance(text, str):
            raise ConfigError(
                f"--text-column {text_column!r}: record {index} of {path} holds "
                f"{type(text).__name__}, not text; set --text-column to a text field"
            )
        label = None if label_field is None else label_key(label)
        yield Document(f"{unit.rel}#{index}", unit.rel, text.encode("utf-8", "replace"), label)


def label_key(value) -> str:
    """A record's label value as a string: text as it is, anything else as JSON (null, 3, true)."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
