"""Which rounds a run has, and how many inner steps each: fixed T, adaptive T or a time budget.

The budget is in inner steps: with a fixed T that is exactly ``num-server-rounds`` rounds; with
``adaptive-t`` the number of rounds follows from the T chosen each round (the rule of
:class:`~flower_shard.planning.adaptive.AdaptiveT`, applied to the last round's record, so a
resumed run picks the same T). Time-budgeted rounds (``round-seconds``): ``num-server-rounds``
rounds, each group as many steps as fit, at most ``max-local-steps``.
"""

from __future__ import annotations

from dataclasses import dataclass

from flower_shard import protocol as P
from flower_shard.config import TrainConfig
from flower_shard.planning.adaptive import AdaptiveT


@dataclass(frozen=True)
class RoundPlan:
    """One round as it is sent."""

    round: int
    steps: int
    """T sent to the groups (max-local-steps when time-budgeted)."""
    seconds: float
    """The time budget of each group (0: train exactly ``steps``)."""
    step_before: int
    """Inner steps done before this round."""
    tokens_before: int
    """Tokens processed before this round."""
    last: bool
    evaluate: bool


class RoundSchedule:
    """The run's rounds, one :class:`RoundPlan` at a time, continued from a resumed history."""

    def __init__(
        self, train: TrainConfig, num_rounds: int, round_seconds: float, history: list[dict]
    ):
        self.train = train
        self.num_rounds = num_rounds
        self.round_seconds = round_seconds
        last = history[-1] if history else None
        self.round = int(last[P.ROUND]) if last else 0
        self.step = int(last[P.STEP]) if last else 0
        self.tokens = int(last[P.TOKENS]) if last else 0
        self.budget = num_rounds * train.local_steps
        self.local = next_local_steps(train, last) if last else train.local_steps

    @property
    def timed(self) -> bool:
        return self.round_seconds > 0

    @property
    def total(self) -> str:
        """The run's length, as the round banner shows it."""
        if self.timed or not self.train.adaptive_t:
            return f"/{self.num_rounds}"
        return f", steps {self.step}/{self.budget}"

    def next(self) -> RoundPlan | None:
        """The next round, or None when the run is done."""
        if (self.round >= self.num_rounds) if self.timed else (self.step >= self.budget):
            return None
        rnd = self.round + 1
        n = self.train.max_local_steps if self.timed else min(self.local, self.budget - self.step)
        last = rnd >= self.num_rounds if self.timed else self.step + n >= self.budget
        every = self.train.eval_every
        return RoundPlan(
            round=rnd,
            steps=n,
            seconds=float(self.round_seconds),
            step_before=self.step,
            tokens_before=self.tokens,
            last=last,
            evaluate=bool(every) and (rnd % every == 0 or last),
        )

    def trained(self, plan: RoundPlan, most_steps: int) -> int:
        """The round's T as recorded: the steps sent, or (time-budgeted) the most steps a
        valid group trained."""
        return most_steps if plan.seconds else plan.steps

    def done(self, record: dict) -> None:
        """Advance past a finished round, given its metrics record."""
        self.round = int(record[P.ROUND])
        self.step = int(record[P.STEP])
        self.tokens = int(record[P.TOKENS])
        self.local = next_local_steps(self.train, record)


def next_local_steps(train: TrainConfig, record: dict) -> int:
    """The next round's T: the configured one, or with adaptive-t the rule of
    :class:`~flower_shard.planning.adaptive.AdaptiveT` applied to the round's record. The
    exchange is everything in the round but the groups' compute and the evaluation: gathering,
    Flower's messaging, the aggregation (or the collective sync), loading the new weights."""
    if not train.adaptive_t:
        return train.local_steps
    n = record.get(P.ROUND_LOCAL_STEPS, train.local_steps)
    compute = record[P.COMPUTE_S]
    exchange = record[P.CONTROL_OVERHEAD_S] + record[P.GROUP_ROUND_S] - compute
    rule = AdaptiveT(train.exchange_share, train.min_local_steps, train.max_local_steps)
    return rule.next(n, compute / n, max(0.0, exchange))
