"""The pacer (runtime/pacing.py): pieces go out in order, spread over their window, one
collective after another; a flush sends what is held at once; a failed piece stops its
collective and is returned, not raised; closing issues nothing more. (Values and the order
across real ranks: the paced cases of tests/test_streaming_sync.py.)"""

from __future__ import annotations

import threading
import time

import pytest

from flower_shard.runtime.pacing import PacedCollective, Pacer


class Issued:
    """What ``issue`` was called with, in order (the work handed back is the range)."""

    def __init__(self, fail_at: tuple[str, int] | None = None):
        self.calls: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()
        self.fail_at = fail_at

    def issue(self, name: str):
        def call(start: int, stop: int):
            with self.lock:
                if self.fail_at == (name, start):
                    raise RuntimeError(f"{name} failed at {start}")
                self.calls.append((name, start, stop))
            return (name, start, stop)

        return call

    def of(self, name: str) -> list[tuple[int, int]]:
        with self.lock:
            return [(a, b) for n, a, b in self.calls if n == name]


def until(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_without_a_pacer_the_collective_goes_out_whole_at_once():
    issued = Issued()
    paced = PacedCollective(issued.issue("a"), 10, pieces=4)
    assert issued.of("a") == [(0, 2), (2, 5), (5, 7), (7, 10)] and paced.left == 0
    waited = []
    assert paced.finish(waited.append) is None
    assert waited == [("a", 0, 2), ("a", 2, 5), ("a", 5, 7), ("a", 7, 10)]


def test_pieces_are_held_over_the_window_and_a_flush_sends_the_rest_in_order():
    issued, pacer = Issued(), Pacer()
    try:
        a = PacedCollective(issued.issue("a"), 12, pieces=4, pacer=pacer, window_s=600.0)
        b = PacedCollective(issued.issue("b"), 6, pieces=2, pacer=pacer, window_s=0.0)
        until(lambda: issued.of("a"))  # the first piece goes out at once...
        time.sleep(0.2)
        assert issued.of("a") == [(0, 3)] and a.left == 3  # ...the next one in 150 s
        assert issued.of("b") == [] and b.left == 2  # b waits for a: one after another
        waited = []
        assert b.finish(waited.append) is None  # b is needed: a's rest and b go out now
        assert [c[:2] for c in issued.calls] == [("a", 0), ("a", 3), ("a", 6), ("a", 9)] + [
            ("b", 0),
            ("b", 3),
        ]
        assert waited == [("b", 0, 3), ("b", 3, 6)] and a.left == 0
        assert a.finish(waited.append) is None
    finally:
        pacer.close()


def test_the_pieces_are_spread_over_the_window():
    issued, pacer = Issued(), Pacer()
    try:
        start = time.monotonic()
        paced = PacedCollective(issued.issue("a"), 4, pieces=4, pacer=pacer, window_s=1.2)
        until(lambda: paced.left == 0)
        assert time.monotonic() - start >= 0.9 - 0.05  # the last piece at 3/4 of the window
    finally:
        pacer.close()


def test_a_failed_piece_stops_its_collective_and_is_returned():
    issued, pacer = Issued(fail_at=("a", 4)), Pacer()
    try:
        a = PacedCollective(issued.issue("a"), 12, pieces=3, pacer=pacer, window_s=0.0)
        b = PacedCollective(issued.issue("b"), 4, pieces=2, pacer=pacer, window_s=0.0)
        error = a.finish(lambda work: None)
        assert isinstance(error, RuntimeError) and "a failed at 4" in str(error)
        assert issued.of("a") == [(0, 4)] and a.left == 0  # nothing after the failed piece
        assert b.finish(lambda work: None) is None and issued.of("b") == [(0, 2), (2, 4)]
    finally:
        pacer.close()


def test_closing_issues_nothing_more_and_refuses_more():
    issued, pacer = Issued(), Pacer()
    paced = PacedCollective(issued.issue("a"), 8, pieces=4, pacer=pacer, window_s=600.0)
    until(lambda: issued.of("a"))
    pacer.close()  # a failed run: no more collectives from the thread
    assert issued.of("a") == [(0, 2)] and paced.left == 3
    assert paced.finish(lambda work: None) is None  # the caller's own finish still can
    assert len(issued.of("a")) == 4
    with pytest.raises(RuntimeError, match="closed"):
        PacedCollective(issued.issue("b"), 8, pieces=2, pacer=pacer, window_s=1.0)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_flush_does_not_wait_for_a_pacer_whose_thread_died():
    import torch

    issued = Issued()
    # Without CUDA the thread dies making the device current; with it, it runs: either way
    # the caller gets every piece out and no wait hangs.
    pacer = Pacer(device=torch.device("cuda", 0))
    try:
        paced = PacedCollective(issued.issue("a"), 8, pieces=4, pacer=pacer, window_s=600.0)
    except RuntimeError as exc:  # the thread was already gone: nothing is submitted to it
        assert "closed" in str(exc)
        return
    finally:
        if torch.cuda.is_available():
            pacer.close()
    assert paced.finish(lambda work: None) is None and len(issued.of("a")) == 4
