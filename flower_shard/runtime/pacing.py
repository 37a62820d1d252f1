"""Paced cross-group collectives: an overlapped sync's exchange spread evenly over time.

An overlapped sync (:mod:`.streaming_sync`) starts its exchange at the fragment's sync point and
needs the result one round later. Started whole, the exchange goes out at the link's full rate
and the link then idles: fragments shorten each burst but the peak rate stays the link's.
Paced, the exchange is cut into pieces (consecutive ranges of its buffer) that a
:class:`Pacer` thread issues evenly over a *window* of wall-clock time: the time until the next
fragment's sync point, from the measured step time. The slow link then carries each fragment
over its own slice of the round, and its peak rate falls toward the round's average (Streaming
DiLoCo's "peak bandwidth" argument holds only for an exchange spread like this). Whatever is not
issued when the result is needed (a slow link, a round that ended early, the drain) is issued
then, at once.

Order: every rank must issue the same collectives in the same order on the cross-group process
group. The pacer issues one exchange's pieces after another (first in, first out), and the
exchanges are submitted at the same sync points on every rank, so the order is the same
everywhere; only the timing differs, and a collective waits for its peers. A piece of a SUM
all-reduce of float32 is the sum of the same values as the whole (bit for bit with two groups;
gloo's ring may add three or more in another order at another cut); a piece of an all-gather of
bytes is the same bytes.

Memory: nothing of the model's size: the pieces are views of the exchange's own buffers. The
exchanges run on a process group of their own (:func:`~.streaming_sync.own_group`): with NCCL,
one more communicator's buffers.

On failure: an ``issue`` that raises stops that exchange's pieces; its
:meth:`PacedCollective.finish` returns the error after waiting for what was issued (a striped
exchange must first join its replicas' all-gather, or they would hang in it).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

WINDOW_SHARE = 0.8
"""The share of its window a paced exchange is spread over (its last piece must land in time:
the cost model prices the paced peak rate with it too)."""


def piece_bounds(total: int, pieces: int) -> list[tuple[int, int]]:
    """``pieces`` consecutive ranges that cover ``[0, total)``, sizes differing by at most one
    (fewer when ``total`` is smaller: no range is empty)."""
    if pieces < 1:
        raise ValueError(f"pieces must be >= 1, got {pieces}")
    n = max(1, min(pieces, total))
    cuts = [total * i // n for i in range(n + 1)]
    return list(zip(cuts, cuts[1:]))


class PacedCollective:
    """One collective over ``[0, total)`` issued in ``pieces``: all at once when ``pacer`` is
    None (one piece: the collective started whole), else by ``pacer`` over ``window_s``.

    Parameters
    ----------
    issue
        ``issue(start, stop)`` starts the collective of that range and returns its work.
    total
        The size of the buffer (elements or bytes: whatever ``issue`` takes).
    """

    def __init__(
        self,
        issue: Callable[[int, int], object],
        total: int,
        pieces: int = 1,
        pacer: Pacer | None = None,
        window_s: float = 0.0,
    ):
        self._issue, self._bounds = issue, piece_bounds(total, pieces)
        self._works: list = []
        self._lock = threading.Lock()
        self._pacer = pacer
        self.failed: Exception | None = None
        if pacer is None:
            while self.advance():
                pass
        else:
            pacer.submit(self, window_s)

    @property
    def left(self) -> int:
        """How many pieces are not issued yet (none once one failed)."""
        with self._lock:
            return 0 if self.failed is not None else len(self._bounds) - len(self._works)

    def advance(self) -> int:
        """Issue the next piece, if any is left and none failed: its size (0: none)."""
        with self._lock:
            if self.failed is not None or len(self._works) == len(self._bounds):
                return 0
            start, stop = self._bounds[len(self._works)]
            try:
                self._works.append(self._issue(start, stop))
            except Exception as exc:  # noqa: BLE001 - returned by finish (module docstring)
                self.failed = exc
                return 0
            return stop - start

    def finish(self, wait: Callable[[object], None]) -> Exception | None:
        """Issue what is left (after what the pacer holds before it), wait for every piece
        (``wait(work)``); the error, or None."""
        if self._pacer is not None:
            self._pacer.flush(self)
        while self.advance():
            pass
        for work in self._works:
            try:
                wait(work)
            except Exception as exc:  # noqa: BLE001 - returned; the pieces after it fail too
                return exc
        return self.failed


class Pacer:
    """A thread that issues :class:`PacedCollective` pieces evenly over each one's window,
    one collective after another in the order they were submitted (see the module docstring).
    ``device``: the CUDA device the thread makes current (a new thread starts on device 0;
    NCCL takes the issuing thread's current stream of the tensors' device).
    """

    def __init__(self, device=None):
        self._device = device
        self._cv = threading.Condition()
        self._queue: deque[tuple[int, PacedCollective, float]] = deque()
        self._submitted = 0
        self._urgent = 0  # every collective up to this sequence number goes out at once
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="outer-sync-pacer", daemon=True)
        self._thread.start()

    def submit(self, paced: PacedCollective, window_s: float) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("the pacer is closed")
            self._submitted += 1
            self._queue.append((self._submitted, paced, max(0.0, window_s)))
            self._cv.notify_all()

    def flush(self, paced: PacedCollective) -> None:
        """Issue ``paced`` and everything submitted before it now; returns when they are out."""
        with self._cv:
            seq = next((s for s, p, _ in self._queue if p is paced), None)
            if seq is None:  # issued already
                return
            self._urgent = max(self._urgent, seq)
            self._cv.notify_all()
            self._cv.wait_for(lambda: all(p is not paced for _, p, _ in self._queue))

    def close(self) -> None:
        """Stop the thread; what it still holds is not issued (a run that drained holds
        nothing; one that failed must not start more collectives with peers that may be
        gone): a :meth:`PacedCollective.finish` after it issues its own rest itself."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    def _run(self) -> None:
        try:
            self._issue_all()
        finally:  # whatever ended the thread, a flush must not wait for it for ever
            with self._cv:
                self._closed = True
                self._queue.clear()
                self._cv.notify_all()

    def _issue_all(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            import torch

            torch.cuda.set_device(self._device)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                seq, paced, window = self._queue[0]
            start, interval, issued = time.monotonic(), window / max(1, paced.left), 0
            while not self._closed and paced.advance():
                issued += 1
                self._hold(seq, start + issued * interval)
            with self._cv:
                if self._closed:
                    return
                self._queue.popleft()
                self._cv.notify_all()

    def _hold(self, seq: int, deadline: float) -> None:
        """Wait until ``deadline`` (monotonic), or until collective ``seq`` is urgent."""
        with self._cv:
            self._cv.wait_for(
                lambda: self._urgent >= seq or self._closed or time.monotonic() >= deadline,
                timeout=max(0.0, deadline - time.monotonic()),
            )
