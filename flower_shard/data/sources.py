"""The documents of a corpus: which files, read how, and which are held out.

A text file is one document; a ``.jsonl`` / ``.parquet`` file is one document per record
(``PATH#INDEX``). The held-out split is a stable hash of each document's name.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from flower_shard.config import ConfigError

# Files of records (one document per record), as opposed to text files (one document each).
RECORD_SUFFIXES = (".jsonl", ".parquet")


# --partition-label value that labels each document with its source instead of a record field.
SOURCE_LABEL = "directory"


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
