"""The arrays of a reply, checked and decoded: what a transport's aggregation reads.

A reply's ``arrays`` record is checked for its type, its arrays' names, shapes and dtypes, and
for finite values (also after decoding a compressed update, whose finite int8 scales can still
overflow float32), before any value in it is used. A failed check raises :class:`Rejected` with
a one-line reason; :mod:`~flower_shard.flower.server.replies` (which checks the rest of a reply
and re-exports :class:`Rejected`) turns it into that reply's rejection.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, RecordDict

from flower_shard import protocol as P
from flower_shard.flower.server.aggregation import Norms
from flower_shard.flower.wire import Arrays, Spec, unflatten_flat, unpack

DELTA = "delta"
"""A compressed reply's decoded pseudo-gradient: one flat float32 vector in sorted-name order."""


class Rejected(ValueError):
    """A reply the server cannot use; the message is the reason (one line)."""


@dataclass(frozen=True)
class Payload:
    """The arrays of a reply, checked and decoded, as the transport's aggregation reads them."""

    arrays: Mapping[str, np.ndarray]
    """The model's named arrays, or ``{DELTA: flat pseudo-gradient}`` (compressed); once
    kept, read from the disk (:mod:`~flower_shard.flower.server.reply_spool`)."""
    nbytes: int
    """The size of the ``arrays`` record as it crossed Flower."""
    decode_s: float
    """The server's time to check and decode it (a part of the flower transport's sync)."""
    norms: Norms | None = None
    """The size of its update, where taken on arrival (before its arrays went to disk)."""


def array_record(content: RecordDict, why: str) -> tuple[dict[str, np.ndarray], int]:
    """The named numpy arrays of a reply's ``arrays`` record, and its size on the wire."""
    if P.ARRAYS not in content:
        raise Rejected(f"no {P.ARRAYS!r} record ({why})")
    record = content[P.ARRAYS]
    if not isinstance(record, ArrayRecord):
        raise Rejected(f"{P.ARRAYS!r} is a {type(record).__name__}, not an ArrayRecord")
    try:
        arrays = {k: v.numpy() for k, v in record.items()}
    except Exception as exc:  # a malformed Array fails to decode
        raise Rejected(f"undecodable arrays: {type(exc).__name__}: {exc}") from None
    return arrays, record.count_bytes()


def check_arrays(arrays: Arrays, expected: Spec) -> str | None:
    """Why a group's weights cannot be used, or None if they can.

    Checks, in order: missing keys, extra keys, shapes, dtypes, non-finite values.
    """
    missing = sorted(set(expected) - set(arrays))
    if missing:
        return f"missing arrays {missing[:3]}{'...' if len(missing) > 3 else ''}"
    extra = sorted(set(arrays) - set(expected))
    if extra:
        return f"unexpected arrays {extra[:3]}{'...' if len(extra) > 3 else ''}"
    for name, (shape, dtype) in expected.items():
        a = arrays[name]
        if tuple(a.shape) != shape:
            return f"{name} has shape {tuple(a.shape)}, expected {shape}"
        if str(a.dtype) != dtype:
            return f"{name} has dtype {a.dtype}, expected {dtype}"
    for name, a in arrays.items():
        if not np.isfinite(a).all():
            return f"{name} has non-finite values"
    return None


def packed_weights(content: RecordDict, expected: Spec) -> Payload:
    """A group's trained weights in the flower transport's wire format (one packed Array)."""
    start = time.perf_counter()
    arrays, nbytes = array_record(content, "transport flower needs the weights")
    reason, arrays = unpack(arrays, expected)
    reason = reason or check_arrays(arrays, expected)
    if reason:
        raise Rejected(reason)
    return Payload(arrays, nbytes, time.perf_counter() - start)


def compressed_delta(content: RecordDict, expected: Spec, kind: str, chunk: int) -> Payload:
    """A group's compressed pseudo-gradient (``global - trained``), decoded to
    ``{DELTA: flat float32}`` in sorted-name order."""
    import torch

    from flower_shard.runtime import compression as Z

    start = time.perf_counter()
    arrays, nbytes = array_record(content, "transport flower needs the update")
    if any(a.dtype.kind not in "fiub" for a in arrays.values()):
        raise Rejected(f"compressed payload has non-numeric arrays {sorted(arrays)}")
    payload = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
    numel = sum(math.prod(shape) for shape, _ in expected.values())
    reason = Z.check_payload(payload, kind, numel, chunk)
    if reason:
        raise Rejected(reason)
    delta = Z.decompress(payload, kind, chunk).numpy()
    if not np.isfinite(delta).all():  # finite int8 scales can still overflow float32
        raise Rejected("the decoded update has non-finite values")
    return Payload({DELTA: delta}, nbytes, time.perf_counter() - start)


def delta_arrays(delta: np.ndarray, expected: Spec) -> dict[str, np.ndarray]:
    """A decoded flat pseudo-gradient cut into the model's named arrays (sorted-name order)."""
    return unflatten_flat(delta, expected, sorted(expected))
