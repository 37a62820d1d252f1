"""Paced cross-group collectives: an overlapped sync's exchange spread over the round's steps.

An overlapped sync (:mod:`.streaming_sync`) starts its exchange at the fragment's sync point and
needs the result one round later. Started whole, the exchange goes out at the link's full rate
and the link then idles: fragments shorten each burst but the peak rate stays the link rate.
Paced, the exchange is cut into ``pieces`` consecutive ranges of its buffer; the first goes out
at once and one more after each inner step, so the slow link carries about 1/T of the fragment
per step and its peak rate drops toward the round's average (Streaming DiLoCo's "peak bandwidth"
argument holds only for an exchange that is spread over its window like this). Whatever was not
issued when the result is needed (a round that ended early, the drain) goes out then.

Every rank issues the same pieces in the same order (the cut depends only on the buffer's size
and the piece count; the schedule only on the inner steps), so the collectives on the
cross-group process group match. A piece of a SUM all-reduce of float32 is the sum of the same
values as the whole (bit for bit with two groups; gloo's ring may add three or more in another
order at another cut); a piece of an all-gather of bytes is the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable


def piece_bounds(total: int, pieces: int) -> list[tuple[int, int]]:
    """``pieces`` consecutive ranges that cover ``[0, total)``, sizes differing by at most one
    (fewer when ``total`` is smaller: no range is empty)."""
    if pieces < 1:
        raise ValueError(f"pieces must be >= 1, got {pieces}")
    n = max(1, min(pieces, total))
    cuts = [total * i // n for i in range(n + 1)]
    return list(zip(cuts, cuts[1:]))


class PacedCollective:
    """One collective over ``[0, total)`` issued in pieces: the first at construction, the next
    at each :meth:`advance`, the rest in :meth:`finish`.

    Parameters
    ----------
    issue
        ``issue(start, stop)`` starts the collective of that range and returns its work.
    total
        The size of the buffer (elements or bytes: whatever ``issue`` takes).
    pieces
        How many pieces; 1 is the collective started whole.

    On failure: an ``issue`` that raises stops the issuing; :meth:`finish` waits for what was
    issued and returns the error instead of raising it (a striped exchange must first join its
    replicas' all-gather, or they would hang in it).
    """

    def __init__(self, issue: Callable[[int, int], object], total: int, pieces: int = 1):
        self._issue, self._bounds = issue, piece_bounds(total, pieces)
        self._works: list = []
        self.failed: Exception | None = None
        self.advance()

    @property
    def left(self) -> int:
        """How many pieces are not issued yet."""
        return len(self._bounds) - len(self._works)

    def advance(self) -> int:
        """Issue the next piece, if any is left and none failed: its size (0: none)."""
        if self.failed is not None or len(self._works) == len(self._bounds):
            return 0
        start, stop = self._bounds[len(self._works)]
        try:
            self._works.append(self._issue(start, stop))
        except Exception as exc:  # noqa: BLE001 - returned by finish, see the class docstring
            self.failed = exc
            return 0
        return stop - start

    def finish(self, wait: Callable[[object], None]) -> Exception | None:
        """Issue what is left, wait for every piece (``wait(work)``); the error, or None."""
        while self.advance():
            pass
        for work in self._works:
            try:
                wait(work)
            except Exception as exc:  # noqa: BLE001 - returned; the pieces after it fail too
                return exc
        return self.failed
