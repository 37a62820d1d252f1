"""The flower transport's replies, kept on disk from their arrival to the round's aggregation.

The strategy checks each training reply as it is pulled (one message at a time: see
:class:`~flower_shard.flower.server.exchange.Messenger`); the flower transport then writes the
reply's checked, decoded arrays to one file here (:meth:`ReplySpool.keep`) and the message's
arrays are dropped. So the ServerApp holds one reply's arrays at a time, whatever G; the
aggregation reads the files back array by array, slice by slice
(:func:`~flower_shard.flower.server.aggregation.weighted_mean`), in group order, so the mean is
the same bits whatever order the replies arrived in.

Cost: each valid reply is written once and read once per round (twice with ``clip-outliers``),
through the page cache while memory allows; disk: G x M per round, in a private directory
(mode 0700, under ``TMPDIR``) that is emptied every round and removed when the run ends.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

PREFIX = "flower-shard-replies-"


class SpooledArrays(Mapping):
    """One reply's named arrays in a file: each read is a read-only memory map of the file's
    part (so a slice of it reads only that slice), or an empty array."""

    def __init__(self, path: Path, layout: dict[str, tuple[int, tuple[int, ...], str]]):
        self.path = path
        self.layout = layout
        """Name -> (byte offset, shape, dtype), in the order written."""

    def __getitem__(self, name: str) -> np.ndarray:
        offset, shape, dtype = self.layout[name]
        if 0 in shape:  # an empty file part cannot be mapped
            return np.empty(shape, dtype=dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=offset, shape=shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout)

    def __len__(self) -> int:
        return len(self.layout)


class ReplySpool:
    """A private directory of reply files for the run: :meth:`open`, :meth:`keep` per valid
    reply, :meth:`clear` after each round's aggregation, :meth:`close` at the end."""

    def __init__(self) -> None:
        self.directory: Path | None = None

    def open(self) -> None:
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix=PREFIX))

    def keep(self, name: str, arrays: Mapping[str, np.ndarray]) -> SpooledArrays:
        """Write ``arrays`` to the file ``name`` and return them as read from it."""
        if self.directory is None:
            raise RuntimeError("ReplySpool.keep before open(): the transport was not opened")
        path = self.directory / name
        layout, offset = {}, 0
        with open(path, "wb") as fh:
            for key, value in arrays.items():
                value = np.ascontiguousarray(value)
                layout[key] = (offset, tuple(value.shape), str(value.dtype))
                value.tofile(fh)
                offset += value.nbytes
        return SpooledArrays(path, layout)

    def clear(self) -> None:
        """Delete the round's files (their maps close as the replies holding them go)."""
        if self.directory is not None:
            for path in self.directory.iterdir():
                path.unlink(missing_ok=True)

    def close(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
