"""Fault injection for tests and drills: a group that sends bad weights, or dies before a sync.

A fault file (``flower-shard node --fault-file``, passed on to the group) holds ``ROUND:KIND``
items separated by commas. It is read every round, so a running group can be turned bad and
good again. KIND:

- ``nan``: one value becomes NaN; ``huge``: every value times 1e6 (the weights themselves,
  before any compression);
- ``shape``: one array loses a row; ``missing``: one array is left out; ``extra``: an
  unexpected array is added (what goes on the wire);
- ``free-rider``: the round's global weights sent back unchanged (flower transport);
  ``spike``: the update's whole norm put on one coordinate (flower transport);
- ``metric-nan``, ``metric-inf``, ``metric-list``: the reply's train loss NaN, its compute time
  infinite, its step count a list; ``weight-1e30``, ``weight-max``, ``weight-int64``: its token
  count (its weight in the mean) 1e30, 1.7e308 (near the largest float64) or the largest
  int64 (what a hostile group claims);
- ``die``: every rank of the group is killed (SIGKILL) just before the cross-group sync;
- ``die-upload``: every rank of the group is killed in the middle of its streaming upload, once
  its first chunk has gone (the aggregators hold part of the group's update).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np

from flower_shard import protocol as P

NAN = "nan"
HUGE = "huge"
SHAPE = "shape"
MISSING = "missing"
EXTRA = "extra"
FREE_RIDER = "free-rider"
SPIKE = "spike"
METRIC_NAN = "metric-nan"
METRIC_INF = "metric-inf"
METRIC_LIST = "metric-list"
WEIGHT_1E30 = "weight-1e30"
WEIGHT_MAX = "weight-max"
WEIGHT_INT64 = "weight-int64"
DIE = "die"
DIE_UPLOAD = "die-upload"

VALUE_FAULTS = (NAN, HUGE)  # spoil the weights themselves (before any compression)
FORMAT_FAULTS = (SHAPE, MISSING, EXTRA)  # spoil what goes on the wire
UPDATE_FAULTS = (FREE_RIDER, SPIKE)  # a plausible update that games the mean (needs the global)
# The reply's figures: non-finite, not a number, or weights no round can produce.
METRIC_FAULTS = (METRIC_NAN, METRIC_INF, METRIC_LIST, WEIGHT_1E30, WEIGHT_MAX, WEIGHT_INT64)
SPIKE_NORM = 5.0
"""``spike``: its update's norm, in multiples of the group's honest update's."""
HOSTILE_REPLIES = VALUE_FAULTS + FORMAT_FAULTS + UPDATE_FAULTS + METRIC_FAULTS
"""Every kind of bad reply a group can be made to send (``die*`` stop it instead)."""
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


def inject_update_fault(
    fault_file: str | None,
    server_round: int,
    trained: dict[str, np.ndarray],
    global_arrays: dict[str, np.ndarray] | None,
) -> dict[str, np.ndarray]:
    """``free-rider``: the global weights instead of the trained ones; ``spike``: the global
    weights plus an update of :data:`SPIKE_NORM` x the trained update's norm, all on one
    coordinate (within the norm bound of the default outlier-factor, far beyond any honest
    coordinate). A copy; nothing without the round's global weights (they are kept only where
    a fault file is given)."""
    kinds = [k for k in fault_kinds(fault_file, server_round) if k in UPDATE_FAULTS]
    if not kinds or not trained or global_arrays is None:
        return trained
    if FREE_RIDER in kinds:
        return {k: global_arrays[k].copy() for k in trained}
    squares = (np.sum((trained[k] - global_arrays[k]).astype(np.float64) ** 2) for k in trained)
    norm = np.sqrt(sum(squares))
    spiked = {k: global_arrays[k].copy() for k in trained}
    first = next(iter(spiked))
    spiked[first].reshape(-1)[0] += np.float32(SPIKE_NORM * norm)
    return spiked


def inject_metric_fault(fault_file: str | None, server_round: int, metrics: dict) -> dict:
    """The reply's metrics spoiled as the fault file says for this round (a copy)."""
    kinds = [k for k in fault_kinds(fault_file, server_round) if k in METRIC_FAULTS]
    if not kinds:
        return metrics
    spoiled = dict(metrics)
    for kind in kinds:
        if kind == METRIC_NAN:
            spoiled[P.TRAIN_LOSS] = float("nan")
        elif kind == METRIC_INF:
            spoiled[P.COMPUTE_S] = float("inf")
        elif kind == METRIC_LIST:
            spoiled[P.STEPS] = [int(metrics[P.STEPS])] * 2
        elif kind == WEIGHT_1E30:
            spoiled[P.NUM_TOKENS] = 1e30
        elif kind == WEIGHT_MAX:
            spoiled[P.NUM_TOKENS] = 1.7e308
        elif kind == WEIGHT_INT64:
            spoiled[P.NUM_TOKENS] = (1 << 63) - 1
    return spoiled


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
