"""Fault injection for tests and drills: a group that sends bad weights, or dies before a sync.

A fault file (``flower-shard node --fault-file``, passed on to the group) holds ``ROUND:KIND``
items separated by commas. It is read every round, so a running group can be turned bad and
good again. KIND:

- ``nan``: one value becomes NaN; ``huge``: every value times 1e6 (the weights themselves,
  before any compression);
- ``shape``: one array loses a row; ``missing``: one array is left out; ``extra``: an
  unexpected array is added (what goes on the wire);
- ``die``: every rank of the group is killed (SIGKILL) just before the cross-group sync;
- ``die-upload``: every rank of the group is killed in the middle of its streaming upload, once
  its first chunk has gone (the aggregators hold part of the group's update).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np

NAN = "nan"
HUGE = "huge"
SHAPE = "shape"
MISSING = "missing"
EXTRA = "extra"
DIE = "die"
DIE_UPLOAD = "die-upload"

VALUE_FAULTS = (NAN, HUGE)  # spoil the weights themselves (before any compression)
FORMAT_FAULTS = (SHAPE, MISSING, EXTRA)  # spoil what goes on the wire
EXTRA_ARRAY = "injected.extra"


def fault_kinds(fault_file: str | None, server_round: int) -> list[str]:
    """The faults that ``fault_file`` sets for ``server_round`` (none without a file)."""
    if not fault_file or not os.path.exists(fault_file):
        return []
    items = [i.split(":", 1) for i in Path(fault_file).read_text().split(",") if i.strip()]
    return [kind.strip() for rnd, kind in items if int(rnd) == server_round]


def inject_fault(
    fault_file: str | None, server_round: int, arrays: dict, only: tuple[str, ...] | None = None
) -> dict:
    """Spoil the arrays this group sends as the fault file says for this round (a copy; the
    input is not changed). ``only`` limits the kinds applied (:data:`VALUE_FAULTS` go in
    before compression, :data:`FORMAT_FAULTS` after)."""
    kinds = [k for k in fault_kinds(fault_file, server_round) if only is None or k in only]
    if not kinds or not arrays:
        return arrays
    arrays = dict(arrays)
    first = next(iter(arrays))
    for kind in kinds:
        if kind == NAN:
            bad = arrays[first].copy()
            bad.reshape(-1)[0] = np.nan
            arrays[first] = bad
        elif kind == SHAPE:
            arrays[first] = arrays[first][:-1]
        elif kind == MISSING:
            arrays.pop(first)
        elif kind == EXTRA:
            arrays[EXTRA_ARRAY] = np.zeros(3, dtype=np.float32)
        elif kind == HUGE:
            arrays = {k: v * np.float32(1e6) for k, v in arrays.items()}
    return arrays


def inject_death(fault_file: str | None, server_round: int) -> None:
    """``ROUND:die``: kill this rank (SIGKILL) now; every rank of the group calls it before the
    cross-group sync of that round, so the whole group dies."""
    if DIE in fault_kinds(fault_file, server_round):
        os.kill(os.getpid(), signal.SIGKILL)


def upload_hook(fault_file: str | None, server_round: int):
    """``ROUND:die-upload``: a callback for each chunk a rank streams, which kills the rank
    (SIGKILL) once one chunk has gone; None when the fault file says nothing of it."""
    if DIE_UPLOAD not in fault_kinds(fault_file, server_round):
        return None
    sent = [0]

    def on_chunk() -> None:
        sent[0] += 1
        if sent[0] > 1:
            os.kill(os.getpid(), signal.SIGKILL)

    return on_chunk
