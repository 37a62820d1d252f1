"""The pieces a corpus is read in: a unit of work (part of one file) and one document.

A leaf module: the readers (:mod:`.sources`, :mod:`.records`, :mod:`.pretokenized`) and the
workers (:mod:`.prepare`) all speak of these.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Unit:
    """A contiguous piece of one corpus file that one worker reads: a whole text file, or the
    records ``first`` .. of a record file that lie in ``[start, stop)`` (bytes for ``.jsonl``,
    record indices otherwise)."""

    rel: str
    """The file's path relative to the corpus root (POSIX)."""
    kind: str
    """``text``, ``jsonl``, ``parquet`` or ``arrow``."""
    start: int = 0
    stop: int = -1
    """-1: to the end."""
    first: int = 0
    """The index of the unit's first record in its file (documents are named ``rel#index``)."""
    size: int = 0
    """Bytes to read (for planning and progress)."""


@dataclass(frozen=True)
class Document:
    """One document: its name (held-out hash), its file, its UTF-8 text, its label or None."""

    name: str
    rel: str
    text: bytes
    label: str | None
