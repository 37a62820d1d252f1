"""Tokenise a corpus in bounded memory on several worker processes, then join the pieces.

The corpus is cut into **units** (a text file, a byte range of a ``.jsonl`` file, row groups of
a ``.parquet`` file, rows of a dataset directory: :mod:`flower_shard.data.records`) in document
order, and the units into **tasks** of about :data:`TASK_BYTES` of input. Each task is one
worker call: it reads its units one document at a time, tokenises them in batches of about
:data:`BATCH_BYTES`, and appends the ids to its own **shard** files (training and held-out
streams, the training documents' starts, sources and labels) as it goes. Memory per worker is
one batch plus write buffers, whatever the corpus size.

The parent then **joins** the shards in task order into the files the ranks memory-map
(``train.npy``, ``eval.npy``, ``train_docs.npz``), copying through fixed-size windows. Since the
tasks cover the documents in order, the result is the same, token for token, as tokenising the
documents one after the other in one process, whatever the number of workers.

Workers are ``spawn``ed (a group's rank 0 runs gRPC threads, which ``fork`` does not survive);
with one worker or one task everything runs in the calling process.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flower_shard import runfiles as F
from flower_shard.data import pretokenized
from flower_shard.data.sources import is_held_out, read_unit, source_of
from flower_shard.data.units import Document, Unit

log = logging.getLogger(__name__)

TASK_BYTES = 16 << 20  # input per task (one shard)
PIECE_BYTES = 64 << 20  # a larger record file is cut into pieces of about this size
BATCH_BYTES = 1 << 20  # text per tokenizer call
WINDOW = 8 << 20  # values copied at a time when the shards are joined
PROGRESS_S = 2.0  # seconds between progress lines (none for a preparation shorter than that)


@dataclass(frozen=True)
class Job:
    """What every task of one preparation shares."""

    root: str
    tokenizer: str | None
    eval_fraction: float
    text_column: str
    label_field: str | None
    shard_dir: str
    dtype: str


@dataclass(frozen=True)
class Shard:
    """What one task wrote: its index and the sizes of its pieces."""

    index: int
    train_tokens: int
    eval_tokens: int
    train_docs: int
    eval_docs: int
    input_bytes: int


_COUNTERS = None  # this worker's view of the shared progress counters (documents, tokens, bytes)
_TOKENIZERS: dict = {}


def _init_worker(counters) -> None:
    global _COUNTERS
    _COUNTERS = counters
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the workers are the parallelism


def _tokenizer(spec: str | None):
    from flower_shard.data.tokenizers import load_tokenizer

    if spec not in _TOKENIZERS:
        _TOKENIZERS[spec] = load_tokenizer(spec)
    return _TOKENIZERS[spec]


class _ShardWriter:
    """Appends one task's tokens and document records to its shard files."""

    def __init__(self, job: Job, index: int):
        self.base = Path(job.shard_dir, f"{index:06d}")
        self.dtype = np.dtype(job.dtype)
        self.streams = {
            False: open(f"{self.base}.train", "wb"),
            True: open(f"{self.base}.eval", "wb"),
        }
        self.tokens = {False: 0, True: 0}
        self.docs = {False: 0, True: 0}
        self.starts: list[int] = []
        self.sources: list[str] = []
        self.labels: list[str | None] = []

    def add(self, doc: Document, held_out: bool, ids: np.ndarray, eos: int) -> None:
        if not held_out:
            self.starts.append(self.tokens[False])
            self.sources.append(source_of(doc.rel))
            self.labels.append(doc.label)
        ids = np.append(ids.astype(self.dtype, copy=False), self.dtype.type(eos))
        self.streams[held_out].write(ids.tobytes())
        self.tokens[held_out] += ids.size
        self.docs[held_out] += 1

    def close(self, index: int, input_bytes: int) -> Shard:
        for fh in self.streams.values():
            fh.close()
        sources = sorted(set(self.sources))
        labels = sorted({lab for lab in self.labels if lab is not None})
        np.savez(
            f"{self.base}.docs.npz",
            starts=np.asarray(self.starts, dtype=np.int64),
            source_ids=np.searchsorted(sources, self.sources).astype(np.int64),
            sources=np.asarray(sources, dtype=str),
            label_ids=np.searchsorted(labels, [lab or "" for lab in self.labels]).astype(np.int64)
            if labels
            else np.zeros(0, np.int64),
            labels=np.asarray(labels, dtype=str),
        )
        return Shard(index, self.tokens[False], self.tokens[True], *self.docs.values(), input_bytes)


def run_task(job: Job, index: int, units: list[Unit]) -> Shard:
    """Tokenise ``units`` in order into shard ``index`` (a worker's call)."""
    tok = None if pretokenized.is_pretokenized(job.root) else _tokenizer(job.tokenizer)
    writer = _ShardWriter(job, index)
    batch: list[tuple[Document, bool]] = []
    size = done = 0

    def flush() -> None:
        nonlocal size
        ids = tok.encode_batch([d.text for d, _ in batch])
        tokens = 0
        for (doc, held), doc_ids in zip(batch, ids):
            writer.add(doc, held, doc_ids, tok.eos_id)
            tokens += doc_ids.size + 1
        _count(len(batch), tokens, size)
        batch.clear()
        size = 0

    root = Path(job.root)
    for unit in units:
        if unit.kind == pretokenized.TOKENS:  # ids already: copied, not tokenised
            spec = pretokenized.read_spec(root)
            for name, ids in pretokenized.read(root, unit, spec):
                doc = Document(name, unit.rel, b"", None)
                writer.add(doc, is_held_out(name, job.eval_fraction), ids, spec.eos_id)
                done += ids.nbytes
                _count(1, ids.size + 1, ids.nbytes)
            continue
        for doc in read_unit(root, unit, job.text_column, job.label_field):
            batch.append((doc, is_held_out(doc.name, job.eval_fraction)))
            size += len(doc.text)
            done += len(doc.text)
            if size >= BATCH_BYTES:
                flush()
    if batch:
        flush()
    return writer.close(index, done)


def _count(docs: int, tokens: int, nbytes: int) -> None:
    if _COUNTERS is not None:
        with _COUNTERS.get_lock():
            _COUNTERS[0] += docs
            _COUNTERS[1] += tokens
            _COUNTERS[2] += nbytes


def tasks_of(units: list[Unit]) -> list[list[Unit]]:
    """Consecutive units grouped into tasks of about :data:`TASK_BYTES` of input."""
    tasks: list[list[Unit]] = [[]]
    size = 0
    for unit in units:
        if tasks[-1] and size + unit.size > TASK_BYTES:
            tasks.append([])
            size = 0
        tasks[-1].append(unit)
        size += unit.size
    return [t for t in tasks if t]


def plan_units(root: Path, files: list[str], pool=None) -> list[Unit]:
    """The units of a corpus in document order; a record file larger than :data:`PIECE_BYTES`
    is cut into several (the records before each piece are counted, on ``pool`` if given)."""
    from flower_shard.data import records
    from flower_shard.data.sources import ARROW, kind_of

    units: list[Unit] = []
    counts: list[tuple[int, Path, int, int]] = []  # (unit index, path, start, stop) to count
    tokens = pretokenized.is_pretokenized(root)
    for rel in files:
        path = root / rel
        kind = pretokenized.TOKENS if tokens else kind_of(path)
        size = _size(path)
        if kind == "jsonl":
            for start, stop in records.split_jsonl(path, PIECE_BYTES):
                counts.append((len(units), path, start, stop))
                units.append(Unit(rel, kind, start, stop, 0, stop - start))
        elif kind == "parquet":
            rows = records.parquet_row_groups(path)
            first = np.cumsum([0, *rows])
            per = size / max(1, sum(rows))
            units += [
                Unit(rel, kind, g, g + 1, int(first[g]), int(r * per)) for g, r in enumerate(rows)
            ]
        elif kind == ARROW:
            n = len(records.open_arrow(path))
            step = max(1, int(n * PIECE_BYTES / max(size, 1)))
            units += [
                Unit(rel, kind, a, min(n, a + step), a, size * (min(n, a + step) - a) // max(n, 1))
                for a in range(0, n, step)
            ]
        elif kind == pretokenized.TOKENS:
            units += pretokenized.units(root, rel, PIECE_BYTES)
        else:
            units.append(Unit(rel, kind, size=size))
    if counts:
        args = [(path, start, stop) for _, path, start, stop in counts]
        found = (
            pool.starmap(records.count_jsonl, args)
            if pool
            else [records.count_jsonl(*a) for a in args]
        )
        first: dict[Path, int] = {}
        for (i, path, _, _), n in zip(counts, found):
            u = units[i]
            units[i] = Unit(u.rel, u.kind, u.start, u.stop, first.get(path, 0), u.size)
            first[path] = first.get(path, 0) + n
    return units


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def tokenise(job: Job, files: list[str], workers: int, what: str) -> list[Shard]:
    """Plan the units and run every task, on ``workers`` spawned processes when the corpus is
    larger than one task; log progress (documents, tokens, MB/s) every :data:`PROGRESS_S`."""
    global _COUNTERS
    root = Path(job.root)
    ctx = multiprocessing.get_context("spawn")
    counters = ctx.Array("q", 3)
    # Spawning costs about a second per worker: small corpora are tokenised in this process.
    if workers <= 1 or sum(_size(root / rel) for rel in files) <= 2 * TASK_BYTES:
        _COUNTERS = counters
        try:
            tasks = tasks_of(plan_units(root, files))
            return [run_task(job, i, t) for i, t in enumerate(tasks)]
        finally:
            _COUNTERS = None
    with ctx.Pool(workers, _init_worker, (counters,)) as pool:
        units = plan_units(root, files, pool)
        tasks = tasks_of(units)
        pending = [pool.apply_async(run_task, (job, i, t)) for i, t in enumerate(tasks)]
        _watch(pending, counters, sum(u.size for u in units) or 1, what)
        return [p.get() for p in pending]  # re-raises a worker's ConfigError


def _watch(pending, counters, total: int, what: str) -> None:
    start = last = time.monotonic()
    while not all(p.ready() for p in pending):
        if any(p.ready() and not p.successful() for p in pending):
            return  # the caller's get() raises the worker's error
        time.sleep(0.2)
        now = time.monotonic()
        if now - last >= PROGRESS_S:
            last = now
            docs, tokens, nbytes = counters[:]
            log.info(
                "preparing %s: %s documents, %.1fM tokens, %.1f MB/s, %.0f%%",
                what,
                f"{docs:,}",
                tokens / 1e6,
                nbytes / 1e6 / (now - start),
                100 * nbytes / total,
            )


def join(shards: list[Shard], shard_dir: Path, out: Path, dtype: str, label_field) -> None:
    """Join the shards, in order, into ``out``'s train.npy, eval.npy and train_docs.npz."""
    for suffix, name, size in (
        ("train", F.TRAIN_TOKENS, sum(s.train_tokens for s in shards)),
        ("eval", F.EVAL_TOKENS, sum(s.eval_tokens for s in shards)),
    ):
        tmp = out / f".{name}.tmp"
        # Written, not memory-mapped: a memory map's written pages count in this process's
        # resident set until it is closed, which made the peak grow with the corpus.
        with open(tmp, "wb") as fh:
            header = {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": (size,)}
            np.lib.format.write_array_header_1_0(fh, header)
            start = fh.tell()
            for s in shards:
                with open(shard_dir / f"{s.index:06d}.{suffix}", "rb") as src:
                    shutil.copyfileobj(src, fh, WINDOW * np.dtype(dtype).itemsize)
            joined = fh.tell() - start
        if joined != size * np.dtype(dtype).itemsize:  # the shards and their counts disagree
            raise RuntimeError(f"{name}: joined {joined} bytes, expected {size} tokens")
        os.replace(tmp, out / name)
    _join_docs(shards, shard_dir, out / F.TRAIN_DOCS, label_field)
    shutil.rmtree(shard_dir, ignore_errors=True)


def _join_docs(shards: list[Shard], shard_dir: Path, dest: Path, label_field) -> None:
    """train_docs.npz of all shards: starts offset by the shards before, source and label ids
    renumbered in the sorted tables of all shards (as one process would number them)."""
    parts = [np.load(shard_dir / f"{s.index:06d}.docs.npz") for s in shards]
    sources = sorted(set().union(*(p["sources"].tolist() for p in parts)))
    labels = sorted(set().union(*(p["labels"].tolist() for p in parts)))
    n = sum(s.train_docs for s in shards)
    tmp_dir = dest.parent / ".docs.tmp"
    tmp_dir.mkdir(exist_ok=True)
    arrays = {k: _memmap(tmp_dir / f"{k}.npy", n) for k in ("starts", "source_ids", "label_ids")}
    offset = tokens = 0
    for s, p in zip(shards, parts):
        end = offset + s.train_docs
        arrays["starts"][offset:end] = p["starts"] + tokens
        arrays["source_ids"][offset:end] = np.searchsorted(sources, p["sources"])[p["source_ids"]]
        if label_field is not None and len(p["labels"]):
            arrays["label_ids"][offset:end] = np.searchsorted(labels, p["labels"])[p["label_ids"]]
        offset, tokens = end, tokens + s.train_tokens
    out = {k: arrays[k] for k in ("starts", "source_ids")}
    out["sources"] = np.asarray(sources, dtype=str)
    if label_field is not None:
        out |= {
            "label_ids": arrays["label_ids"],
            "labels": np.asarray(labels, dtype=str),
            "label_field": np.asarray(label_field),
        }
    tmp = dest.with_name(f".{dest.name}.tmp")
    with open(tmp, "wb") as fh:
        np.savez(fh, **out)  # writes the memory-mapped arrays through a buffer
    os.replace(tmp, dest)
    del arrays, out
    shutil.rmtree(tmp_dir, ignore_errors=True)


def _memmap(path: Path, n: int) -> np.memmap:
    return np.lib.format.open_memmap(path, mode="w+", dtype=np.int64, shape=(n,))
