"""Already-tokenised corpora: a directory of token files made by another pipeline.

The directory holds ``tokens.json`` (``{"vocab_size": V, "eos_id": E}``, and ``"dtype"`` for raw
``.bin`` files: ``uint16`` or ``uint32``) and token files: ``.npy`` (a 1-D integer array) or
``.bin`` (raw little-endian values, as nanoGPT writes them). Each file is a stream of documents,
each ended by ``eos_id`` (a last one without it is a document too); document ``k`` of file
``rel`` is named ``rel#k`` and held out by the same hash as any other document. The ids are
copied, not re-tokenised; every id must be below ``vocab_size``, and the model's vocabulary is
checked against ``vocab_size`` before any rank starts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flower_shard.config import ConfigError
from flower_shard.data.sources import TOKEN_SUFFIXES, TOKENS_META
from flower_shard.data.units import Unit

TOKENS = "tokens"  # the kind of a token file
META = TOKENS_META
SUFFIXES = TOKEN_SUFFIXES
SCAN = 16 << 20  # values scanned at a time for end-of-document ids


@dataclass(frozen=True)
class TokenSpec:
    """What ``tokens.json`` says."""

    vocab_size: int
    eos_id: int
    dtype: str = "uint16"

    @property
    def name(self) -> str:
        return f"tokens:{self.vocab_size}:{self.eos_id}"


def is_pretokenized(root: str | Path | None) -> bool:
    """True if ``root`` is a directory of token files (it holds ``tokens.json``)."""
    return root is not None and Path(root, META).is_file()


def read_spec(root: Path) -> TokenSpec:
    """``tokens.json`` of a token directory; ConfigError if it is malformed."""
    try:
        raw = json.loads(Path(root, META).read_text())
        spec = TokenSpec(
            int(raw["vocab_size"]), int(raw["eos_id"]), str(raw.get("dtype", "uint16"))
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"--data {root}: {META} must be a JSON object with integer vocab_size and eos_id "
            f"({type(exc).__name__}: {exc})"
        ) from None
    if not 0 <= spec.eos_id < spec.vocab_size or spec.dtype not in ("uint16", "uint32"):
        raise ConfigError(
            f"--data {root}: {META} needs 0 <= eos_id < vocab_size and dtype uint16 or uint32, "
            f"got {spec}"
        )
    return spec


def open_tokens(path: Path, spec: TokenSpec) -> np.ndarray:
    """A token file as a read-only 1-D array (memory-mapped)."""
    try:
        if path.suffix == ".npy":
            arr = np.load(path, mmap_mode="r")
        else:
            arr = np.memmap(path, dtype=np.dtype(spec.dtype).newbyteorder("<"), mode="r")
    except (ValueError, OSError) as exc:
        raise ConfigError(f"--data {path}: not a token file ({exc})") from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ConfigError(
            f"--data {path}: a token file holds a 1-D integer array, got {arr.dtype} {arr.shape}"
        )
    return arr


def units(root: Path, rel: str, piece: int) -> list[Unit]:
    """A token file cut into pieces of about ``piece`` bytes that end after an end-of-document
    id; each piece knows how many documents come before it."""
    spec = read_spec(root)
    arr = open_tokens(root / rel, spec)
    step = max(1, piece // arr.itemsize)
    out, start, first = [], 0, 0
    while start < arr.size:
        stop = min(arr.size, start + step)
        while stop < arr.size:  # extend to just after the next end-of-document id
            ends = np.flatnonzero(arr[stop : stop + SCAN] == spec.eos_id)
            if ends.size:
                stop += int(ends[0]) + 1
                break
            stop = min(arr.size, stop + SCAN)
        out.append(Unit(rel, TOKENS, start, stop, first, (stop - start) * arr.itemsize))
        first += _count(arr[start:stop], spec.eos_id) + (
            stop == arr.size and arr[-1] != spec.eos_id
        )
        start = stop
    return out


def _count(arr: np.ndarray, eos: int) -> int:
    return sum(int(np.count_nonzero(arr[i : i + SCAN] == eos)) for i in range(0, arr.size, SCAN))


def read(root: Path, unit: Unit, spec: TokenSpec) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, ids without the end-of-document id)`` of the documents of a token unit."""
    arr = open_tokens(root / unit.rel, spec)[unit.start : unit.stop]
    top = int(arr.max()) if arr.size else 0
    if top >= spec.vocab_size or (arr.size and int(arr.min()) < 0):
        raise ConfigError(
            f"--data {root / unit.rel}: token ids must lie in [0, vocab_size {spec.vocab_size}) "
            f"of {META}, found {top}"
        )
    ends = np.flatnonzero(arr == spec.eos_id)
    begin, k = 0, unit.first
    for end in [*ends.tolist(), *([arr.size] if not ends.size or ends[-1] != arr.size - 1 else [])]:
        if end > begin or end < arr.size:
            yield f"{unit.rel}#{k}", np.asarray(arr[begin:end])
            k += 1
        begin = end + 1
