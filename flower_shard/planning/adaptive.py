"""Adaptive T: choose each round's number of local steps from the last round's timings.

A round of T local steps costs ``T x step_s`` of compute plus one exchange of ``exchange_s``
(the outer sync, or a Flower round trip), so the exchange's share of the round is
``exchange_s / (T x step_s + exchange_s)``. The rule picks the smallest T that keeps that share
at or under a target:

    T* = ceil(exchange_s x (1 - target) / (target x step_s))

the smallest, because syncing more often is what keeps the groups' models close (better
perplexity for the same tokens). T* is then clamped to ``[t_min, t_max]`` and to at most a
doubling or a halving of the current T per round, so that one noisy round (a retransmission, a
garbage collection) cannot swing T across its whole range. When the link speeds up, T comes
down again the same way.

The run's budget is in inner steps (``rounds x local_steps`` of the configuration), so the
learning-rate schedule is the same as with a fixed T; only the number of rounds changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptiveT:
    """The rule above, with its bounds.

    Parameters
    ----------
    target
        Largest share of a round the exchange may take, in (0, 1).
    t_min, t_max
        Bounds on T.
    """

    target: float
    t_min: int
    t_max: int

    def ideal(self, step_s: float, exchange_s: float) -> int:
        """T*: the smallest T whose exchange share is at most ``target`` (unclamped, >= 1)."""
        if step_s <= 0:
            return self.t_max
        need = exchange_s * (1 - self.target) / (self.target * step_s)
        # A hair of tolerance: T x step_s that meets the target exactly must not round up.
        return max(1, math.ceil(need - 1e-9))

    def next(self, t: int, step_s: float, exchange_s: float) -> int:
        """The next round's T after a round of ``t`` steps of ``step_s`` seconds each and an
        exchange of ``exchange_s`` seconds."""
        want = self.ideal(step_s, exchange_s)
        want = min(max(want, t // 2, 1), 2 * t)
        return min(max(want, self.t_min), self.t_max)


def exchange_share(t: int, step_s: float, exchange_s: float) -> float:
    """The exchange's share of a round of ``t`` steps."""
    total = t * step_s + exchange_s
    return exchange_s / total if total > 0 else 0.0
