"""What one aggregator holds and does: its parameters' global weights, the round's spools, the
outer step, and the downlink (full snapshots or the compressed global delta).

Memory, for the 1/A of the model this aggregator owns (M_a bytes in float32): the global weights
(M_a, inside the outer optimizer), the fold's accumulator (M_a), nesterov's
momentum (M_a), and with a compressed downlink the groups' view of the global weights (M_a)
plus the round's encoded delta (M_a / 4 for int8, / 2 for bf16). Nothing grows with G: the
groups' updates are spooled (:mod:`.spool`).

Downlink. Uncompressed, a rank downloads its slices of the global weights. Compressed, the
aggregator keeps ``view``, the weights every in-sync group holds; after a commit it encodes
``delta = global - view`` once (int8 scales aligned to each parameter's element 0, so every
slice decodes the same for any K) and advances ``view += decode(delta)``: what the encoding
lost stays in ``global - view`` and goes out with the next delta (server-side error feedback).
A group whose last global round is not the previous one (new, rejoining, or after a resume)
gets a full float32 snapshot of ``view`` instead.

Pipelined commit (:mod:`.pipeline`): with the round's groups named (:meth:`expect`), a
parameter is folded as soon as every one of them has sent it whole, and ranks that follow the
round download its new values at once, computed from the fold without touching the state, while
the other parameters still arrive. The commit applies the same element-wise outer step, so what
they downloaded is the committed model bit for bit, unless the ServerApp accepts other groups
(one died or was rejected): then the round is folded again from the spools and the followers'
copies are void (:meth:`mode` sends them a full snapshot).

The outer step is element-wise float32 arithmetic, one rounding per operation (numpy ufuncs: no
fused multiply-add), so its result for an element does not depend on how the values are cut
into chunks: fedavg ``w - g``; nesterov ``m = mu m + g``, ``w = w - lr (g + mu m)`` with ``g``
the mean pseudo-gradient: the update of torch's SGD with nesterov momentum and dampening 0,
each product rounded on its own (torch's kernels may fuse them: the last bit can differ from
the outer optimizer of the other transports).
"""

from __future__ import annotations

import logging
import shutil
import threading
import uuid
from pathlib import Path

import numpy as np

from flower_shard.config import choices as C
from flower_shard.dataplane import wire
from flower_shard.dataplane.layout import Layout, Param
from flower_shard.dataplane.pipeline import Pipeline
from flower_shard.dataplane.spool import GroupSpool

log = logging.getLogger(__name__)


class AggregatorState:
    """Aggregator ``index`` of a layout: see the module docstring.

    Parameters
    ----------
    layout, index
        The model's layout and which of its aggregators this is.
    initial
        Name -> float32 array of every owned parameter (the run's first global weights).
    spool_dir
        Where the round's group spools go (this aggregator's own directory).
    uplink, downlink, scale_chunk
        Compression of the groups' updates and of the global delta (``none``, ``bf16``,
        ``int8``) and the int8 block size.
    outer, outer_lr, outer_momentum
        The outer optimizer (``fedavg`` or ``nesterov``) applied to the mean pseudo-gradient.
    follow_timeout
        Seconds a rank that follows a round waits for a parameter's fold.
    """

    def __init__(
        self,
        layout: Layout,
        index: int,
        initial: dict[str, np.ndarray],
        spool_dir: Path,
        *,
        uplink: str = C.NO_COMPRESSION,
        downlink: str = C.NO_COMPRESSION,
        scale_chunk: int = 2048,
        outer: str = C.FEDAVG,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        follow_timeout: float = 600.0,
    ):
        self.layout, self.index = layout, index
        self.params: list[Param] = layout.owned(index)
        self.by_index = {p.index: p for p in self.params}
        self.offsets: dict[int, int] = {}
        at = 0
        for p in self.params:
            self.offsets[p.index] = at
            at += p.numel
        self.numel = at
        self.weights = np.empty(self.numel, dtype=np.float32)
        """The global weights of the owned parameters, flat."""
        for p in self.params:
            self.weights[self.offsets[p.index] : self.offsets[p.index] + p.numel] = np.asarray(
                initial[p.name], dtype=np.float32
            ).reshape(-1)
        # nesterov keeps a momentum buffer (zeros: the first step is torch's, whose lazily
        # made buffer is a copy of the first gradient); fedavg is w - g (lr 1, no state).
        nesterov = outer == C.NESTEROV
        self.momentum = np.zeros(self.numel, np.float32) if nesterov else None
        self.lr = np.float32(outer_lr if nesterov else 1.0)
        self.mu = np.float32(outer_momentum if nesterov else 0.0)
        self.uplink, self.downlink, self.scale_chunk = uplink, downlink, scale_chunk
        self.follow_timeout = follow_timeout
        """Seconds a follower waits for a parameter (then it pulls after the commit)."""
        self.view = self.weights.copy() if downlink != C.NO_COMPRESSION else None
        self.delta: tuple[np.ndarray, np.ndarray] | None = None
        self.delta_round = -1
        self.round = 0
        """The last committed round (its global weights are what downloads serve)."""
        self.spool_dir = Path(spool_dir)
        self.spools: dict[int, GroupSpool] = {}
        self.open_round = -1
        # the fold's accumulator, for the whole run, touched now: a fresh array costs seconds
        # of first-touch page faults per GB (gVisor-like sandboxes), not to be paid in a round
        self._acc = np.full(self.numel, 0.0, dtype=np.float32)  # written, so every page mapped
        self._lock = threading.Condition()
        self.pipe = Pipeline(self)

    def buffers(self) -> dict[str, np.ndarray]:
        """The outer state itself (global weights, nesterov's momentum), to save or to load
        in place."""
        out = {"weights": self.weights}
        if self.momentum is not None:
            out["momentum"] = self.momentum
        return out

    # -- a round -------------------------------------------------------------------------

    def begin(self, rnd: int) -> None:
        """Open round ``rnd`` for uploads (the previous round's spools are dropped)."""
        with self._lock:
            self.pipe.drain()
            for spool in self.spools.values():
                spool.delete()
            self.spools = {}
            shutil.rmtree(self.spool_dir, ignore_errors=True)
            self.spool_dir.mkdir(parents=True, exist_ok=True)
            self.open_round = rnd
            self.pipe.reset()
            self._lock.notify_all()  # followers of an older round give up

    def expect(self, rnd: int, groups: list[int], max_weight: float | None = None) -> None:
        """The groups of round ``rnd`` the ServerApp expects to accept: the pipelined commit
        folds a parameter once all of them sent it (any that declares a weight above
        ``max_weight`` is not waited for)."""
        with self._lock:
            if rnd != self.open_round:
                open_ = self.open_round
                raise ValueError(f"groups expected in round {rnd}, but round {open_} is open")
            self.pipe.expect(groups, max_weight)

    def spool(self, group: int, rnd: int) -> GroupSpool | None:
        """``group``'s spool of round ``rnd``; None once that round is committed or no longer
        open (a stream admitted just before must not write into the next round's spools)."""
        with self._lock:
            if rnd != self.open_round or self.round >= rnd:
                return None
            if group not in self.spools:
                # a name no other spool had: a stream of an older round, or of a state this
                # process held before a new configure, can only unlink its own file
                path = self.spool_dir / f"round_{rnd}_group_{group}_{uuid.uuid4().hex[:12]}.bin"
                self.spools[group] = GroupSpool(
                    path,
                    self.by_index,
                    self.uplink,
                    self.scale_chunk,
                    on_param=self.pipe.arrived,
                )
            return self.spools[group]

    def declare(self, spool: GroupSpool, weight: float) -> str | None:
        """A stream declared ``weight`` for ``spool``'s group: why it is refused, or None."""
        reason = spool.declare(weight)
        if reason is None and self._current(spool) is not None:
            self.pipe.screen()
        return reason

    def reject(self, spool: GroupSpool, reason: str) -> None:
        """Drop the upload ``spool`` holds (a bad frame, a broken stream); the pipelined
        commit stops waiting for its group if that is still this round's."""
        spool.reject(reason)
        with self._lock:
            group = self._current(spool)
            dropped = group is not None and self.pipe.exclude(
                group, f"its upload was refused: {reason}"
            )
        if dropped:
            self.pipe.recheck()

    def _current(self, spool: GroupSpool) -> int | None:
        """The group ``spool`` belongs to if it is one of the open round's, else None."""
        with self._lock:
            return next((g for g, s in self.spools.items() if s is spool), None)

    def status(self) -> dict[int, dict]:
        """Per group that streamed this round: complete, weight, squared norm, bytes, reason."""
        return {
            g: {
                "complete": s.complete,
                "weight": s.weight,
                "sq_norm": s.sq_norm,
                "bytes": s.bytes,
                "received": s.received,
                "expected": s.expected,
                "rejected": s.rejected,
            }
            for g, s in sorted(self.spools.items())
        }

    def commit(self, rnd: int, accepted: dict[int, float]) -> dict:
        """Fold the accepted complete groups (group -> weight) in group order, take the outer
        step, and prepare the downlink. With none accepted the global weights stay. When the
        pipelined fold already holds exactly these groups with these weights, it is kept."""
        with self._lock:
            if rnd != self.open_round:
                raise ValueError(f"commit of round {rnd}, but round {self.open_round} is open")
            missing = [g for g in accepted if g not in self.spools or not self.spools[g].complete]
            if missing:
                raise ValueError(f"groups {missing} did not complete their upload here")
            self.pipe.drain()
            kept = self.pipe.matches(accepted)
            if accepted and not kept:
                total = total_of(accepted)
                self._acc.fill(0.0)
                for g in sorted(accepted):
                    scale = np.float32(accepted[g] / total)
                    self.spools[g].fold_into(self._acc, self.offsets, scale)
            if accepted:
                self._step_in_place()
            for spool in self.spools.values():
                spool.delete()
            self.spools = {}
            self.round = rnd
            self.pipe.committed(rnd, kept)
            how = "the pipelined fold kept" if kept else "folded from the spools"
            log.info("round %d: committed groups %s, %s", rnd, sorted(accepted), how)
            self._encode_delta()
            self._lock.notify_all()
        return {
            "round": rnd,
            "groups": sorted(accepted),
            "weight": total_of(accepted),
            "kept": kept,
        }

    # -- the outer step, element-wise (see the module docstring) --------------------------

    def stepped(self, lo: int, hi: int) -> np.ndarray:
        """The new global weights of flat elements ``[lo, hi)`` from the fold in the
        accumulator, without changing anything."""
        w, g = self.weights[lo:hi], self._acc[lo:hi]
        if self.momentum is None:
            return np.subtract(w, g)
        return self._nesterov(w, g, self.momentum[lo:hi], np.empty_like(g))[0]

    def _nesterov(self, w, g, m, m_out) -> tuple[np.ndarray, np.ndarray]:
        np.multiply(m, self.mu, out=m_out)
        np.add(m_out, g, out=m_out)  # m' = mu m + g
        step = np.multiply(m_out, self.mu)
        np.add(step, g, out=step)  # g + mu m' (nesterov)
        np.multiply(step, self.lr, out=step)
        return np.subtract(w, step, out=step), m_out

    def _step_in_place(self) -> None:
        for lo in range(0, self.numel, wire.CHUNK_VALUES):
            hi = min(self.numel, lo + wire.CHUNK_VALUES)
            w, g = self.weights[lo:hi], self._acc[lo:hi]
            if self.momentum is None:
                np.subtract(w, g, out=w)
            else:
                m = self.momentum[lo:hi]
                new, _ = self._nesterov(w, g, m, m)
                w[:] = new

    def _encode_delta(self) -> None:
        if self.view is None:
            return
        from flower_shard.dataplane.wire import dequantize, quantize

        delta = self.weights - self.view
        scales, data = [], []
        for p in self.params:
            at = self.offsets[p.index]
            s, d = quantize(delta[at : at + p.numel], 0, self.downlink, self.scale_chunk)
            self.view[at : at + p.numel] += dequantize(s, d, 0, self.downlink, self.scale_chunk)
            scales.append(s)
            data.append(d)
        self.delta = (scales, data)
        self.delta_round = self.round

    # -- downlink ------------------------------------------------------------------------

    def mode(self, have_round: int, provisional: bool = False) -> str:
        """``current`` for a rank that already holds the last committed round's model (it
        evaluated it, or followed the round and the commit kept what it followed), ``delta``
        for one whose last global model is the round before (with a compressed downlink), else
        ``full``."""
        if provisional and not self.pipe.kept(have_round):
            return "full"
        if have_round == self.round and have_round >= 0:
            return "current"
        if self.view is not None and self.delta is not None and have_round == self.delta_round - 1:
            return "delta"
        return "full"

    def follow_mode(self, rnd: int, have_round: int, provisional: bool = False) -> str:
        """The mode of a follower of round ``rnd`` (see :meth:`mode`): ``delta`` for a rank that
        holds the model the round starts from, with a compressed downlink."""
        if self.round >= rnd:  # committed already: what any pull would get
            return self.mode(have_round, provisional)
        if provisional and not self.pipe.kept(have_round):
            return "full"
        # a rank at the last committed round holds ``view`` (snapshots serve it, deltas advance
        # it): the round's delta applies, also to round 1's (its base is the initial model)
        in_sync = have_round >= 0 and have_round == self.round
        return "delta" if self.view is not None and in_sync else "full"

    def frames(self, param: int, start: int, stop: int, mode: str):
        """Frames of parameter ``param``'s elements ``[start, stop)``: the encoded delta
        (``delta``) or float32 values of the view (compressed downlink) or of the global
        weights (``full``)."""
        p = self.by_index.get(param)
        if p is None or not 0 <= start <= stop <= p.numel:
            raise ValueError(f"no elements [{start}, {stop}) of parameter {param} here")
        if mode == "current":
            return
        at = self.offsets[param]
        source = self.view if self.view is not None else self.weights
        k = self.params.index(p)
        for a in range(start, stop, wire.CHUNK_VALUES):
            b = min(stop, a + wire.CHUNK_VALUES)
            if mode == "delta":
                scales, data = self.delta[0][k], self.delta[1][k]
                first, last = wire.blocks_of(a, b - a, self.scale_chunk)
                s = scales[first:last] if self.downlink == C.INT8 else scales
                yield wire.encode_chunk(
                    param, a, None, self.downlink, self.scale_chunk, (s, data[a:b])
                )
            else:
                yield wire.encode_chunk(param, a, source[at + a : at + b], C.NO_COMPRESSION, 1)


def total_of(accepted: dict[int, float]) -> float:
    """The accepted groups' total weight, summed in group order."""
    return float(sum(accepted[g] for g in sorted(accepted)))
