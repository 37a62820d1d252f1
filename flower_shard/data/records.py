"""Streaming readers of record files, and how a large one is cut into pieces for the workers.

A reader yields ``(index, text, label)`` for the records of one :class:`~.sources.Unit`, in file
order, holding one record (``.jsonl``) or one record batch (``.parquet``, dataset directories)
in memory at a time. ``index`` is the record's position in its file, the same however the file
is cut, so a document keeps its name (and its held-out choice) whatever the number of workers.

- ``.jsonl``: one JSON object per non-blank line, read with the standard library; a large file
  is cut at line boundaries into byte ranges (:func:`split_jsonl`) whose first record index is
  counted by the workers in a first pass (:func:`count_jsonl`).
- ``.parquet``: ``pyarrow`` record batches; cut by row group.
- a ``datasets`` directory (``Dataset.save_to_disk``): memory-mapped with ``datasets``; cut by
  row ranges.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from flower_shard.config import ConfigError
from flower_shard.data.units import Unit

BATCH_ROWS = 1024  # records per batch read from .parquet files and dataset directories


def split_jsonl(path: Path, piece_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges ``[start, stop)`` of about ``piece_bytes`` that begin and end at line
    starts and together cover ``path``."""
    size = path.stat().st_size
    cuts = [0]
    with open(path, "rb") as fh:
        while cuts[-1] + piece_bytes < size:
            fh.seek(cuts[-1] + piece_bytes)
            fh.readline()  # to the start of the next line
            if fh.tell() >= size:
                break
            cuts.append(fh.tell())
    return list(zip(cuts, [*cuts[1:], size]))


def count_jsonl(path: Path, start: int, stop: int) -> int:
    """Records (non-blank lines) whose line starts in ``[start, stop)``."""
    count = 0
    for _, line in _lines(path, start, stop):
        count += bool(line.strip())
    return count


def _lines(path: Path, start: int, stop: int) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as fh:
        fh.seek(start)
        offset = start
        while offset < stop:
            line = fh.readline()
            if not line:
                return
            yield offset, line
            offset += len(line)


def jsonl(path: Path, unit: Unit, column: str, label: str | None) -> Iterator[tuple]:
    """``(index, text, label)`` of the records of a ``.jsonl`` unit (a byte range)."""
    stop = unit.stop if unit.stop >= 0 else path.stat().st_size
    index = unit.first
    for offset, raw in _lines(path, unit.start, stop):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise ConfigError(
                f"--data {path}: the record at byte {offset} is not UTF-8; re-encode the file "
                "as UTF-8"
            ) from None
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"--data {path}: the line at byte {offset} is not JSON ({exc.msg}); write one "
                "JSON object per line"
            ) from None
        text = _field(record, column, "--text-column", "text", path, index)
        value = (
            None
            if label is None
            else _field(record, label, "--partition-label", "label", path, index)
        )
        yield index, text, value
        index += 1


def _field(record, name: str, flag: str, what: str, path: Path, index: int):
    if not isinstance(record, dict) or name not in record:
        fields = ", ".join(record) if isinstance(record, dict) else "none"
        raise ConfigError(
            f"{flag} {name!r}: record {index} of {path} has no such field (fields: {fields}); "
            f"set {flag} to the field that holds the {what}"
        )
    return record[name]


def _pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            "reading .parquet needs the datasets package; pip install datasets (or pyarrow), or "
            "convert the file to .jsonl"
        ) from None
    return pq


def parquet_row_groups(path: Path) -> list[int]:
    """The number of rows of each row group of a ``.parquet`` file."""
    pq = _pyarrow()
    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as exc:  # pyarrow raises ArrowInvalid and kin for a bad file
        raise ConfigError(f"--data {path}: not a readable .parquet file ({exc})") from None
    return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]


def parquet(path: Path, unit: Unit, column: str, label: str | None) -> Iterator[tuple]:
    """``(index, text, label)`` of the rows of a ``.parquet`` unit (row groups start .. stop)."""
    pq = _pyarrow()
    pf = pq.ParquetFile(path)
    columns = [column] + ([label] if label is not None and label != column else [])
    names = pf.schema_arrow.names
    for name, flag, what in (
        (column, "--text-column", "text"),
        (label, "--partition-label", "label"),
    ):
        if name is not None and name not in names:
            raise ConfigError(
                f"{flag} {name!r}: {path} has no such column (columns: {', '.join(names)}); "
                f"set {flag} to the one with the {what}"
            )
    stop = unit.stop if unit.stop >= 0 else pf.num_row_groups
    index = unit.first
    for batch in pf.iter_batches(BATCH_ROWS, row_groups=range(unit.start, stop), columns=columns):
        texts = batch.column(column).to_pylist()
        labels = batch.column(label).to_pylist() if label is not None else [None] * len(texts)
        for text, value in zip(texts, labels):
            yield index, text, value
            index += 1


def open_arrow(path: Path):
    """A ``datasets`` dataset directory, memory-mapped (a DatasetDict must have a ``train``
    split)."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"--data {path}: a dataset directory needs the datasets package; pip install datasets"
        ) from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ConfigError(
                f"--data {path}: a DatasetDict without a 'train' split (splits: "
                f"{', '.join(ds)}); point --data at the split's own directory"
            )
        ds = ds["train"]
    return ds


def arrow(path: Path, unit: Unit, column: str, label: str | None) -> Iterator[tuple]:
    """``(index, text, label)`` of the rows ``start .. stop`` of a dataset directory."""
    ds = open_arrow(path)
    for name, flag, what in (
        (column, "--text-column", "text"),
        (label, "--partition-label", "label"),
    ):
        if name is not None and name not in ds.column_names:
            raise ConfigError(
                f"{flag} {name!r}: {path} has no such column (columns: "
                f"{', '.join(ds.column_names)}); set {flag} to the one with the {what}"
            )
    stop = unit.stop if unit.stop >= 0 else len(ds)
    for begin in range(unit.start, stop, BATCH_ROWS):
        rows = ds[begin : min(stop, begin + BATCH_ROWS)]
        texts = rows[column]
        labels = rows[label] if label is not None else [None] * len(texts)
        for offset, (text, value) in enumerate(zip(texts, labels)):
            yield begin + offset, text, value
