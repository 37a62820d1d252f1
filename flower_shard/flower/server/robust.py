"""The server's rules on the groups' updates: how much one group, or a few, can weigh and move.

A reply that passed every check (:mod:`~flower_shard.flower.server.replies`) is still a claim:
a token count (its weight) and an update. :class:`RobustRules` bounds both, relative to the
other groups of the round and to the updates it accepted in the last rounds, with one factor
``f`` (``outlier-factor``). All quantities are per inner step (``steps`` of the reply), so
rounds of different T (adaptive-t) and groups that trained different numbers of steps
(round-seconds) compare fairly.

1. **Weight.** The tokens per step of a group (batch x seq x K: its size K as it claims it) is
   capped at ``f`` x its reference; or, where the server cannot change a weight (the
   streaming transport), a reply above the cap is rejected.
2. **Free riders.** An update whose norm per step is below ``1/f`` of its reference is
   rejected: a model sent back unchanged, or barely trained, to dilute the others' work. The
   reference is the LOWER median of every group's norm, its own included (big updates cannot
   push honest ones under the bar unless they are more than half of the pool), and needs two
   values, except for an update of exactly zero. Its history is the last round only: honest
   updates shrink toward the end of a cosine schedule (about 7x between the last two rounds
   with min-lr-ratio 0).
3. **Weighted contribution.** For the rest, ``omega`` = the (capped) weight per step over the
   median of the survivors'; the weighted update norm ``omega x ||d||_2`` per step and the
   weighted largest coordinate ``omega x ||d||_inf`` per step must each be at most ``f`` x
   its reference. A huge weight with a modest update, or an update that puts its whole norm
   on one coordinate, fails here. An update beyond a bound is rejected, or with ``clip``
   scaled to the norm bound and its coordinates clamped to the coordinate bound.

A reference is the median of one pool: the OTHER groups' values this round (leave-one-out:
with two groups, the other one; the free-rider rule: every group's) and the values accepted
in the last :data:`HISTORY_ROUNDS` rounds, positive values only (a round of unchanged models
must not make every later update an outlier). Colluders who are a majority of one round are a
minority of the pool once there is a history, so they cannot exceed ``f`` x what the rounds
before accepted. What each rule withstands is written up in SECURITY.md: in short, within one
round up to floor(G/2) colluders; across rounds, as many as the history outnumbers; not a
majority that is hostile from the first round on (or from the first round after a resume: the
history is not saved), nor a patient majority; and with two groups no rule can tell which one
is honest.

On failure: nothing raises; a rejected update is left out with a one-line reason, a capped
weight or a clipped update goes in with a one-line note, both logged by the transport.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

HISTORY_ROUNDS = 5
"""Rounds whose accepted updates join the references (rounds that accepted none not counted)."""
WEIGHT, NORM, PUSH, PEAK = "weight", "norm", "push", "peak"
"""The values the rules compare (and remember): tokens per step, update norm per step, and the
weighted update norm and weighted largest coordinate per step."""


@dataclass(frozen=True)
class Update:
    """What the rules read of one valid reply."""

    weight: float
    """Its token count (finite, > 0)."""
    steps: int
    """The inner steps it trained (>= 1)."""
    l2: float
    """The Euclidean norm of its update (``trained - global``)."""
    linf: float | None = None
    """The largest coordinate of its update in absolute value; None: not known (streaming)."""


@dataclass
class Decision:
    """What to do with each update of a round (lists indexed like the updates)."""

    weights: list[float]
    """The weight to aggregate with (the token count, or its cap)."""
    scales: list[float] = field(default_factory=list)
    """Clip: the factor on the update (1.0: unchanged)."""
    bounds: list[float | None] = field(default_factory=list)
    """Clip: the bound on each coordinate of the update (None: none)."""
    rejected: dict[int, str] = field(default_factory=dict)
    """Index -> why the update is left out."""
    notes: dict[int, str] = field(default_factory=dict)
    """Index -> what was capped or clipped."""


@dataclass(frozen=True)
class _Ref:
    value: float
    source: str


class RobustRules:
    """The rules above, with the history of the updates they accepted.

    Parameters
    ----------
    factor
        ``f``; 0 disables every rule (weights and updates are taken as they come).
    clip
        Clip updates beyond a bound instead of rejecting them.
    cap_weights
        Cap a weight beyond its bound (else reject the reply).
    history_rounds
        Rounds of accepted updates that join the references.
    """

    def __init__(
        self,
        factor: float,
        *,
        clip: bool = False,
        cap_weights: bool = True,
        history_rounds: int = HISTORY_ROUNDS,
    ):
        self.factor = factor
        self.clip = clip
        self.cap_weights = cap_weights
        self.history: deque[dict[str, list[float]]] = deque(maxlen=history_rounds)
        """Per past round: value name -> the accepted updates' values."""

    def judge(self, updates: list[Update]) -> Decision:
        """Decide the round's weights, rejections and clips; remember the accepted updates."""
        n = len(updates)
        d = Decision([float(u.weight) for u in updates], [1.0] * n, [None] * n)
        if self.factor == 0 or not updates:
            return d
        self._weights(updates, d)
        self._free_riders(updates, d)
        accepted = self._contributions(updates, d)
        if accepted.get(PUSH):  # a round that took nothing does not push good rounds out
            self.history.append(accepted)
        return d

    def weight_cap(self, steps: int) -> float | None:
        """The token count above which the pipelined commit does not wait for a group of
        ``steps`` inner steps: ``f`` x the history's reference x steps; None with no rule or
        no history. Rule 1's reference also takes this round's other groups, so it may accept
        more: such a group, accepted after all, makes the commit fold again from the spools
        (the pipelining of that round is lost, the mean is the same)."""
        ref = self._reference(WEIGHT, []) if self.factor else None
        return None if ref is None else self.factor * ref.value * steps

    # -- the three rules ------------------------------------------------------------------------

    def _weights(self, updates: list[Update], d: Decision) -> None:
        f = self.factor
        per_step = [u.weight / u.steps for u in updates]
        for i, u in enumerate(updates):
            ref = self._reference(WEIGHT, per_step[:i] + per_step[i + 1 :])
            if ref is None or per_step[i] <= f * ref.value:
                continue
            what = (
                f"token weight {per_step[i]:.4g} per step is {_ratio(per_step[i], ref.value)}x "
                f"{ref.source} ({ref.value:.4g}); the limit is {f:g}x"
            )
            if self.cap_weights:
                d.weights[i] = f * ref.value * u.steps
                d.notes[i] = f"{what}: capped to {d.weights[i]:.4g} tokens"
            else:
                d.rejected[i] = what

    def _free_riders(self, updates: list[Update], d: Decision) -> None:
        f = self.factor
        alive = [i for i in range(len(updates)) if i not in d.rejected]
        norm = {i: updates[i].l2 / updates[i].steps for i in alive}
        out = {}
        for i in alive:
            # Its own norm in the pool too: then a group is below the bar only if most of the
            # pool is f times above it, and big colluders cannot outvote the honest ones here
            # at c = G/2, where the others alone would be theirs.
            pool = [norm[j] for j in alive]
            ref = self._reference(NORM, pool, low=True, need=1 if norm[i] == 0 else 2)
            if ref is not None and norm[i] < ref.value / f:
                out[i] = (
                    f"update norm {norm[i]:.4g} per step is below 1/{f:g} of {ref.source} "
                    f"({ref.value:.4g}): a model sent back unchanged or barely trained"
                )
        d.rejected |= out

    def _contributions(self, updates: list[Update], d: Decision) -> dict[str, list[float]]:
        """Rule 3 on the survivors; returns their values as accepted (after clipping)."""
        alive = [i for i in range(len(updates)) if i not in d.rejected]
        if not alive:
            return {}
        weight = {i: d.weights[i] / updates[i].steps for i in alive}
        middle = _median(list(weight.values()))
        omega = {i: weight[i] / middle for i in alive}
        push = {i: omega[i] * updates[i].l2 / updates[i].steps for i in alive}
        peak = {
            i: omega[i] * updates[i].linf / updates[i].steps
            for i in alive
            if updates[i].linf is not None
        }
        kept = {PUSH: dict(push), PEAK: dict(peak)}
        for name, values in ((PUSH, push), (PEAK, peak)):
            for i, value in values.items():
                ref = self._reference(name, [v for j, v in values.items() if j != i])
                if ref is None or value <= self.factor * ref.value:
                    continue
                self._beyond(name, i, value, ref, d, updates[i].steps / omega[i])
                kept[name][i] = self.factor * ref.value
        accepted = [i for i in alive if i not in d.rejected]
        return {
            WEIGHT: [weight[i] for i in accepted],
            NORM: [kept[PUSH][i] / omega[i] for i in accepted],
            PUSH: [kept[PUSH][i] for i in accepted],
            PEAK: [kept[PEAK][i] for i in accepted if i in kept[PEAK]],
        }

    def _beyond(self, name: str, i: int, value: float, ref: _Ref, d: Decision, unit: float) -> None:
        """Reject, or clip, update ``i`` whose ``name`` value is beyond its bound (``unit``:
        what turns a bound on the value into one on the update itself)."""
        f = self.factor
        what = "update norm" if name == PUSH else "largest coordinate of the update"
        reason = (
            f"{what} {value:.4g} per step, weighted by its tokens, is {_ratio(value, ref.value)}x "
            f"{ref.source} ({ref.value:.4g}); the limit is {f:g}x"
        )
        if not self.clip:
            d.rejected.setdefault(i, reason)
        elif name == PUSH:
            d.scales[i] = f * ref.value / value
            d.notes[i] = _join(d.notes.get(i), f"{reason}: scaled by {d.scales[i]:.4g}")
        else:
            d.bounds[i] = f * ref.value * unit
            d.notes[i] = _join(d.notes.get(i), f"{reason}: clamped to +-{d.bounds[i]:.4g}")

    # -- references -----------------------------------------------------------------------------

    def _reference(
        self, name: str, others: list[float], low: bool = False, need: int = 1
    ) -> _Ref | None:
        """The median (``low``: the lower median, and the last round's history only) of the
        pool of the groups' values given (``others``) and the history's, positive values only;
        None with fewer than ``need`` of them."""
        rounds = list(self.history)[-1:] if low else self.history
        past = [v for rnd in rounds for v in rnd.get(name, []) if v > 0]
        now = [v for v in others if v > 0]
        pool = now + past
        if not pool or len(pool) < need:
            return None
        where = [("the groups'" if low else "the other groups'")] if now else []
        if past:
            where.append("the last round's accepted" if low else "the last rounds' accepted")
        kind = "the lower median of " if low else "the median of "
        value = _low_median(pool) if low else _median(pool)
        return _Ref(value, kind + " and ".join(where))


def _median(values: list[float]) -> float:
    """The median, without overflow (the middle pair is halved before it is added)."""
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else s[mid - 1] / 2 + s[mid] / 2


def _low_median(values: list[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


def _ratio(value: float, ref: float) -> str:
    return f"{value / ref:.1f}" if ref > 0 else "inf"


def _join(first: str | None, second: str) -> str:
    return f"{first}; {second}" if first else second
