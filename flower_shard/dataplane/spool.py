"""One group's update for one round, spooled to disk as it arrives and checked frame by frame.

Frames are appended to the group's file as they arrive (the page cache absorbs them while
memory allows; the aggregator's resident memory does not grow with G). Each frame is checked
before it is kept: a parameter this aggregator owns, an element range inside it that overlaps
nothing the group already sent, the exact payload size of the stream's compression, finite
values. The first bad frame rejects the whole group (its file is deleted, later frames are
refused); a group is complete when its frames cover every element of every owned parameter
exactly once. Only complete groups that the ServerApp accepts are folded, in group order
(:meth:`GroupSpool.fold_into`), so a group that failed or was rejected mid-stream never
reaches the mean, and the mean is the same bit for bit whatever order the streams arrived in.
The spool also knows where each parameter's frames lie in its file, so a parameter that every
expected group has sent whole can be folded before the rest arrive (the pipelined commit,
:mod:`.state`): :meth:`GroupSpool.fold_param_into`, the same float32 operations per element.

Cost: each accepted group's update is written once and read once per round on the aggregator's
disk (compressed as it travelled: 1/4 of float32 for int8).
"""

from __future__ import annotations

import bisect
import math
import os
import struct
import threading
from pathlib import Path

import numpy as np

from flower_shard.dataplane import wire
from flower_shard.dataplane.layout import Param

RECORD = struct.Struct("<I")  # length of the frame that follows


class GroupSpool:
    """The frames one group sent to this aggregator in one round."""

    def __init__(
        self, path: Path, owned: dict[int, Param], kind: str, scale_chunk: int, on_param=None
    ):
        self.path = path
        self.owned, self.kind, self.scale_chunk = owned, kind, scale_chunk
        self.expected = sum(p.numel for p in owned.values())
        self.received = 0
        self.sq_norm = 0.0
        """Sum of squares of the values received (the group's update norm on this part)."""
        self.weight: float | None = None
        self.rejected: str | None = None
        self.bytes = 0
        self._ranges: dict[int, list[tuple[int, int]]] = {}
        self._counts: dict[int, int] = {}  # values received per parameter
        self._where: dict[int, list[tuple[int, int]]] = {}  # parameter -> (file offset, size)
        self._end = 0
        self.on_param = on_param
        """Called with a parameter's index once this group sent all of its values here."""
        self._lock = threading.Lock()
        self._fh = open(path, "wb")

    @property
    def complete(self) -> bool:
        return self.rejected is None and self.received == self.expected

    def declare(self, weight: float) -> str | None:
        """A stream's declared token weight (finite, > 0); every rank of a group must declare
        the same. Why it is refused, or None."""
        if not (math.isfinite(weight) and weight > 0):
            return f"declared token weight {weight} is not a finite positive number"
        with self._lock:
            if self.weight is None:
                self.weight = float(weight)
            elif self.weight != float(weight):
                return f"ranks declared different weights ({self.weight} and {weight})"
        return None

    def add(self, frame: bytes) -> str | None:
        """Check and keep one frame; the reason it is refused, or None."""
        try:
            param, start, count = wire.decode_header(frame)
        except ValueError as exc:
            return str(exc)
        p = self.owned.get(param)
        if p is None:
            return f"parameter {param} is not held by this aggregator"
        if count <= 0 or count > wire.MAX_MESSAGE or start + count > p.numel:
            return f"elements [{start}, {start + count}) outside {p.name} ({p.numel} values)"
        want = wire.payload_size(self.kind, start, count, self.scale_chunk)
        if len(frame) - wire.HEADER.size != want:
            return (
                f"a chunk of {count} values of {p.name} has {len(frame) - wire.HEADER.size} "
                f"bytes, expected {want} for compression {self.kind}"
            )
        values = wire.decode_values(frame, self.kind, self.scale_chunk)
        # summed in float64 through einsum's small buffers: no float64 copy of the frame per
        # concurrent stream. One pass for both checks: float32 squares cannot overflow a
        # float64 sum of 2^26 of them, so the sum is finite exactly when every value is
        sq = float(np.einsum("i,i->", values, values, dtype=np.float64))
        if not math.isfinite(sq):
            return f"non-finite values in {p.name}[{start}:{start + count}]"
        with self._lock:
            if self.rejected:
                return self.rejected
            reason = self._claim(param, start, start + count, p.name)
            if reason:
                return reason
            self._fh.write(RECORD.pack(len(frame)))
            self._fh.write(frame)
            self._where.setdefault(param, []).append((self._end + RECORD.size, len(frame)))
            self._end += RECORD.size + len(frame)
            self._counts[param] = done = self._counts.get(param, 0) + count
            self.received += count
            self.sq_norm += sq
            self.bytes += len(frame)
        if done == p.numel and self.on_param is not None:
            self.on_param(param)
        return None

    def has_param(self, param: int) -> bool:
        """Whether every value of ``param`` came (each exactly once) and the group stands."""
        p = self.owned[param]
        return self.rejected is None and self._counts.get(param, 0) == p.numel

    def _claim(self, param: int, start: int, stop: int, name: str) -> str | None:
        ranges = self._ranges.setdefault(param, [])
        i = bisect.bisect(ranges, (start, stop))
        if (i > 0 and ranges[i - 1][1] > start) or (i < len(ranges) and ranges[i][0] < stop):
            return f"elements [{start}, {stop}) of {name} were sent twice"
        ranges.insert(i, (start, stop))
        return None

    def reject(self, reason: str) -> None:
        """Drop the group: its file goes, later frames are refused with ``reason``."""
        with self._lock:
            if self.rejected is not None:  # dropped already (or deleted: the file is gone)
                return
            self.rejected = reason
            self.close()
            self.path.unlink(missing_ok=True)

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    def fold_into(self, acc: np.ndarray, offsets: dict[int, int], scale: np.float32) -> None:
        """``acc[param's slice] += scale x values`` for every frame, in the order they came."""
        self.close()
        fold = _Fold(acc, offsets, scale, self.kind, self.scale_chunk)
        with open(self.path, "rb") as fh:
            while True:
                head = fh.read(RECORD.size)
                if not head:
                    return
                fold.frame(fh, RECORD.unpack(head)[0], self.path)

    def fold_param_into(
        self, acc: np.ndarray, offsets: dict[int, int], param: int, scale: np.float32
    ) -> None:
        """:meth:`fold_into` for the frames of ``param`` alone (while others still arrive)."""
        with self._lock:
            if self.rejected:
                raise OSError(f"the group was rejected: {self.rejected}")
            self._fh.flush()
            where = list(self._where.get(param, []))
        fold = _Fold(acc, offsets, scale, self.kind, self.scale_chunk)
        with open(self.path, "rb") as fh:
            for offset, size in where:
                fh.seek(offset)
                fold.frame(fh, size, self.path)

    def delete(self) -> None:
        """The round is over: the file goes; a stream still sending is refused."""
        with self._lock:
            if self.rejected is None:
                self.rejected = "its round is over"
            self.close()
            if self.path.exists():
                os.unlink(self.path)


class _Fold:
    """Adds ``scale x values`` of frames read from a spool into ``acc``, through one reused
    read buffer and one scratch array (no allocation per frame)."""

    def __init__(self, acc, offsets, scale, kind, scale_chunk):
        self.acc, self.offsets, self.scale = acc, offsets, scale
        self.kind, self.scale_chunk = kind, scale_chunk
        self.buf, self.scaled = bytearray(), np.empty(0, np.float32)

    def frame(self, fh, size: int, path: Path) -> None:
        if len(self.buf) < size:
            self.buf = bytearray(size)
        frame = memoryview(self.buf)[:size]
        if fh.readinto(frame) != size:
            raise OSError(f"{path} ends inside a frame (truncated spool)")
        param, start, count = wire.decode_header(frame)
        values = wire.decode_values(frame, self.kind, self.scale_chunk)
        if self.scaled.size < count:
            self.scaled = np.empty(count, np.float32)
        scaled, acc = self.scaled[:count], self.acc
        np.multiply(values, self.scale, out=scaled)  # the same float32 ops as acc += scale *
        at = self.offsets[param] + start  # values, without temporaries
        np.add(acc[at : at + count], scaled, out=acc[at : at + count])
