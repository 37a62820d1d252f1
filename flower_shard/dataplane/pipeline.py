"""The pipelined commit: fold each parameter as soon as the round's groups have all sent it, and
serve its new values to the ranks that follow the round, while the rest still arrives.

Across sites the synchronous order (every upload, then the commit, then every download) uses
one direction of a site link at a time: a group's upload crosses it one way, then its download
the other way, so the exchange takes about twice one transfer, where a ring all-reduce sends
both ways at once. Pipelined, a rank opens a *follow* download as it starts its upload; the
aggregator streams it each parameter's new values once every expected group's upload of that
parameter is complete, so the download runs one parameter behind the upload and the exchange
takes about one transfer plus one parameter.

What the followers get is provisional: the ServerApp still screens the groups' replies (token
counts, norms, robust rules) before it commits. The fold is made with the weights the groups
declared in their streams and the new values are computed from it without touching the state,
so nothing needs undoing: if the commit accepts exactly the expected groups with those weights,
the fold is kept, the same element-wise outer step makes the committed model, and the
followers already hold it bit for bit (their next pull is answered ``current``). Otherwise the
commit folds the accepted groups again from the spools, and the followers' copies are void:
their next pull gets a full snapshot. A follow stream whose round can no longer be kept (an
expected group was rejected after a parameter was folded, the commit left one out, a newer
round began, or it waited past its timeout) ends with ``ABORTED``.

Groups the commit will refuse are not waited for, so one careless or hostile group does not
void every round's pipelining: an expected group whose declared weight is not a finite
positive number at most ``max_weight`` (the cap the ServerApp's rules derive from the
accepted history), or whose upload is refused here, is dropped from the expected groups while
no parameter is folded yet (it cannot be, before that group's first frame: a fold needs every
expected group's). The ServerApp does not expect the groups it left out the round before.

Memory: nothing beyond the aggregator's own accumulator (the fold lands where the commit's
would); a frame's provisional values are computed per chunk (one chunk of float32, plus one for
nesterov's momentum and, with a compressed downlink, one for the quantized delta).
Cost: a parameter is folded while others still arrive, from its frames in the spools; the
commit then only takes the outer step.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from flower_shard.config import choices as C
from flower_shard.dataplane import wire

log = logging.getLogger(__name__)


class Superseded(Exception):
    """The round a follower asked for will not be (or was not) committed as folded."""


class Pipeline:
    """The pipelined fold of one :class:`~.state.AggregatorState` (its lock guards this)."""

    def __init__(self, state):
        self.state = state
        self.kept_round = -1
        """The last round whose commit kept the pipelined fold."""
        self.epoch = 0
        """Counts resets and commits: a frame computed outside the lock across one is redone."""
        self.reset()

    def reset(self) -> None:
        """Forget the round's fold (the caller drained it: :meth:`drain`)."""
        self.expected: list[int] | None = None
        self.ready: set[int] = set()
        self.folding: set[int] = set()
        self.weights: dict[int, float] | None = None
        self.max_weight = math.inf
        self.void: str | None = None
        self.epoch += 1

    def drain(self) -> None:
        """Wait until no parameter is being folded (before anything rewrites the state)."""
        self.state._lock.wait_for(lambda: not self.folding)

    def expect(self, groups: list[int], max_weight: float | None = None) -> None:
        self.drain()
        self.reset()  # a second call starts over: no fold of another list of groups is kept
        spools = self.state.spools
        # a group whose upload was refused already is not waited for either
        self.expected = sorted(
            {int(g) for g in groups} - {g for g, s in spools.items() if s.rejected}
        )
        self.max_weight = math.inf if max_weight is None else float(max_weight)
        if not self.expected:
            self.abandon("no group expected")
        for param in self.state.by_index:  # uploads that came before the list did
            self.arrived(param)

    def exclude(self, group: int, reason: str) -> bool:
        """Stop waiting for ``group`` (the commit will refuse it): dropped from the expected
        groups while nothing is folded, else the round's pipelining is void. Whether it was
        dropped (the caller then folds what the others sent: :meth:`recheck`)."""
        if self.expected is None or self.void or group not in self.expected:
            return False
        if self.ready or self.folding:
            self.abandon(f"group {group}: {reason}")
            return False
        self.expected.remove(group)
        log.info("round %s: not waiting for group %d: %s", self.state.open_round, group, reason)
        if not self.expected:
            self.abandon("no expected group left")
        self.state._lock.notify_all()
        return True

    def _screen_weights(self) -> bool:
        """Exclude the expected groups whose declared weight the commit will refuse; whether
        any was."""
        dropped = False
        for g in list(self.expected or ()):
            spool = self.state.spools.get(g)
            w = None if spool is None else spool.weight
            if w is not None and not (math.isfinite(w) and 0 < w <= self.max_weight):
                why = f"declared weight {w:g} (the bound is {self.max_weight:g})"
                dropped = self.exclude(g, why) or dropped
        return dropped

    def abandon(self, reason: str) -> None:
        if self.expected is not None and self.void is None:
            self.void = reason
            log.info("round %s: no pipelined commit: %s", self.state.open_round, reason)
            self.state._lock.notify_all()

    def screen(self) -> None:
        """Stop waiting for the expected groups whose declared weight the commit will refuse
        (then fold what the others have all sent)."""
        with self.state._lock:
            if self.expected is None or self.void or not self._screen_weights():
                return
        self.recheck()

    def recheck(self) -> None:
        """After :meth:`exclude`: fold what the remaining groups have all sent."""
        for p in list(self.state.by_index):
            self.arrived(p)

    def arrived(self, param: int) -> None:
        """A group sent all of ``param``: fold it if every expected group has. The fold runs
        outside the lock (its slice of the accumulator is this parameter's alone); anything
        that rewrites the state first waits for it (:meth:`drain`)."""
        state = self.state
        with state._lock:
            # screen first (a weight may have been declared since): the screen and the weights
            # are read under one hold of the lock, so no fold uses a weight the screen missed
            rescan = self.expected is not None and not self.void and self._screen_weights()
            groups = list(self.expected or ())
            spools = [state.spools.get(g) for g in groups]
            if (
                self.void
                or not groups
                or param in self.ready
                or param in self.folding
                or any(s is None or not s.has_param(param) for s in spools)
            ):
                spools = None
            else:
                weights = {g: s.weight for g, s in zip(groups, spools)}
                total = float(sum(weights.values()))
                if not (math.isfinite(total) and total > 0):  # each is finite and > 0: the
                    self.abandon(f"declared weights {weights} sum to {total}")  # sum may not
                    spools = None
                else:
                    self.folding.add(param)
        if spools is not None:
            self._fold_now(param, groups, spools, weights, total)
        if rescan:
            self.recheck()  # what the groups left have all sent

    def _fold_now(self, param: int, groups: list, spools: list, weights: dict, total: float):
        """Fold ``param`` of ``groups`` (claimed in :attr:`folding`) into the accumulator."""
        state = self.state
        at, n = state.offsets[param], state.by_index[param].numel
        error = "the fold did not finish"
        try:
            state._acc[at : at + n].fill(0.0)
            for g, spool in zip(groups, spools):
                scale = np.float32(weights[g] / total)
                spool.fold_param_into(state._acc, state.offsets, param, scale)
            error = None
        except OSError as exc:
            error = str(exc)
        finally:  # whatever happened, nothing may wait for this fold for ever (drain)
            with state._lock:
                self.folding.discard(param)
                if error:
                    self.abandon(error)
                elif self.void is None:
                    self.ready.add(param)
                    self.weights = weights
                state._lock.notify_all()

    def matches(self, accepted: dict[int, float]) -> bool:
        """Whether the pipelined fold is exactly the commit of ``accepted``."""
        return (
            self.void is None
            and self.weights is not None
            and len(self.ready) == len(self.state.by_index)
            and accepted == self.weights
        )

    def committed(self, rnd: int, kept: bool) -> None:
        self.epoch += 1
        if kept:
            self.kept_round = rnd
        elif self.expected is not None:
            self.abandon("the commit accepted other groups")

    def forget(self) -> None:
        """After a checkpoint is loaded: no fold in flight, nothing followed before is kept."""
        self.drain()
        self.reset()
        self.kept_round = -1

    def unkeep(self, rnd: int) -> None:
        """Another aggregator could not keep round ``rnd``'s fold: treat it as not kept here
        too, so every aggregator answers the followers alike (a full snapshot)."""
        if self.kept_round == rnd:
            self.kept_round = -1

    def kept(self, rnd: int) -> bool:
        return rnd >= 0 and rnd == self.kept_round

    # -- followers -----------------------------------------------------------------------

    def follow(
        self, rnd: int, param: int, start: int, stop: int, mode: str, timeout: float, alive=None
    ):
        """Frames of ``param``'s elements ``[start, stop)`` of round ``rnd``'s model, each as
        soon as it is known (see the module docstring); raises :class:`Superseded`. Waiting
        stops early when ``alive()`` turns false (the follower hung up)."""
        state = self.state
        p = state.by_index.get(param)
        if p is None or not 0 <= start <= stop <= p.numel:
            raise ValueError(f"no elements [{start}, {stop}) of parameter {param} here")
        if mode == "current":  # the round committed, as this rank holds it: nothing to send
            return
        deadline = time.monotonic() + timeout
        for a in range(start, stop, wire.CHUNK_VALUES):
            b = min(stop, a + wire.CHUNK_VALUES)
            with state._lock:
                while not self._settled(rnd, param):
                    left = deadline - time.monotonic()
                    if left <= 0 or (alive is not None and not alive()):
                        break
                    state._lock.wait(min(left, 1.0))
                frame, epoch = self._frame(rnd, param, a, b, mode), self.epoch
            if frame is None:  # provisional: computed outside the lock, redone if it moved
                frame = self._provisional(param, a, b, mode)
                with state._lock:
                    if self.epoch != epoch:
                        frame = self._frame(rnd, param, a, b, mode) or self._provisional(
                            param, a, b, mode
                        )
            yield frame

    def _settled(self, rnd: int, param: int) -> bool:
        state = self.state
        return (
            state.round >= rnd
            or state.open_round != rnd
            or self.void is not None
            or param in self.ready
        )

    def _frame(self, rnd: int, param: int, a: int, b: int, mode: str) -> bytes | None:
        """The committed frame, None for a provisional one (the caller makes it), or
        :class:`Superseded`."""
        state = self.state
        if state.round == rnd:  # committed meanwhile: the committed values, if they are these
            if not self.kept(rnd):
                raise Superseded(f"round {rnd} was committed with other groups; pull again")
            return next(state.frames(param, a, b, mode))
        if state.round > rnd or state.open_round != rnd:
            raise Superseded(f"round {rnd} is over; pull again")
        if self.void is not None:
            raise Superseded(f"round {rnd}: {self.void}; pull again")
        if param not in self.ready:
            raise Superseded(f"round {rnd}: waited too long for the other groups")
        return None

    def _provisional(self, param: int, a: int, b: int, mode: str) -> bytes:
        """The frame the commit will make (:meth:`~.state.AggregatorState.frames`), from the
        fold, computed for the elements it needs: a delta's int8 scale blocks whole."""
        state = self.state
        at, kind, sc = state.offsets[param], state.downlink, state.scale_chunk
        if state.view is None:
            return wire.encode_chunk(param, a, state.stepped(at + a, at + b), C.NO_COMPRESSION, 1)
        lo, hi = a, b
        if kind == C.INT8:  # the blocks that hold [a, b), whole, as the commit encodes them
            lo, hi = a // sc * sc, min(state.by_index[param].numel, -(-b // sc) * sc)
        delta = state.stepped(at + lo, at + hi) - state.view[at + lo : at + hi]
        scales, data = wire.quantize(delta, lo, kind, sc)
        if kind == C.INT8:
            first, last = wire.blocks_of(a, b - a, sc)
            scales = scales[first - lo // sc : last - lo // sc]
        data = data[a - lo : b - lo]
        if mode == "delta":
            return wire.encode_chunk(param, a, None, kind, sc, (scales, data))
        view = state.view[at + a : at + b] + wire.dequantize(scales, data, a, kind, sc)
        return wire.encode_chunk(param, a, view, C.NO_COMPRESSION, 1)
