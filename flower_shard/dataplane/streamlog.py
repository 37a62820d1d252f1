"""One line per data-plane stream: who sent or fetched what, when, and how it ended.

Each aggregator appends a JSON line to ``WORK_DIR/streams.jsonl`` as each upload or download
ends, refused ones included. A line holds:

- ``kind``: ``upload``, ``download`` or ``follow``;
- ``run``, ``round``, ``group``, ``rank``, as the stream declared them;
- ``peer``: gRPC's address of the other end;
- ``start`` and ``end``: wall-clock seconds (``time.time()``), which compare across the
  processes of one host;
- ``frames`` and ``bytes``: the frames and payload bytes that went through;
- ``outcome``: ``ok`` or the reason the stream was refused or cut.

Operators use it to see which rank was slow or which stream broke off. The benchmarks use it
to measure how busy a slow link was while the streams that cross it were open
(``bench/multitier.py``). A line is about 250 bytes: G groups of K ranks and A aggregators
write at most 3 G K A lines a round.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

FILE_NAME = "streams.jsonl"


class StreamLog:
    """Appends the lines of one aggregator (thread-safe: the streams run on gRPC's threads)."""

    def __init__(self, work_dir: Path):
        self.path = Path(work_dir) / FILE_NAME
        self._lock = threading.Lock()

    def open(self, kind: str, peer: str) -> dict:
        """A stream's record, started now; the handler fills it in and calls :meth:`close`."""
        return {
            "kind": kind,
            "run": None,
            "round": None,
            "group": None,
            "rank": None,
            "peer": peer,
            "start": time.time(),
            "frames": 0,
            "bytes": 0,
            "outcome": "ok",
        }

    def close(self, record: dict) -> None:
        """Stamp the end and append the line; an unwritable log never fails a stream."""
        line = json.dumps(record | {"end": time.time()}, default=str) + "\n"
        with self._lock:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                with os.fdopen(fd, "a") as fh:
                    fh.write(line)
            except OSError:
                pass


def read(path: Path) -> list[dict]:
    """The lines of a stream log (a line cut off by a killed aggregator is skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
