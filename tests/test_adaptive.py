"""Adaptive T: the rule on synthetic timings, and real runs whose T follows it."""

from __future__ import annotations

import pytest
from conftest import train_cli

from flower_shard import protocol as P
from flower_shard.config import ConfigError, TrainConfig
from flower_shard.planning.adaptive import AdaptiveT, exchange_share
from flower_shard.ux import metrics as M
from flower_shard.ux.formatting import format_round


def test_ideal_t_is_the_smallest_meeting_the_target():
    rule = AdaptiveT(target=0.2, t_min=1, t_max=64)
    # 1 s steps, 4 s exchange: T = 16 gives 4 / 20 = 0.2 exactly; T = 15 gives 4 / 19 > 0.2.
    assert rule.ideal(step_s=1.0, exchange_s=4.0) == 16
    assert exchange_share(16, 1.0, 4.0) == pytest.approx(0.2)
    assert exchange_share(15, 1.0, 4.0) > 0.2
    assert rule.ideal(step_s=1.0, exchange_s=0.0) == 1
    assert rule.ideal(step_s=0.0, exchange_s=1.0) == 64  # no compute measured: as loose as allowed


def test_next_t_moves_at_most_by_two_and_stays_in_bounds():
    rule = AdaptiveT(target=0.1, t_min=2, t_max=32)
    # The link slows down: T* = 90 but T only doubles per round, then stops at t_max.
    ts, t = [], 4
    for _ in range(5):
        t = rule.next(t, step_s=0.1, exchange_s=1.0)
        ts.append(t)
    assert ts == [8, 16, 32, 32, 32]
    # The link recovers (T* = 1): T halves each round down to t_min.
    ts = []
    for _ in range(5):
        t = rule.next(t, step_s=0.1, exchange_s=0.001)
        ts.append(t)
    assert ts == [16, 8, 4, 2, 2]
    # Within a factor 2, T jumps straight to T*.
    assert rule.next(10, step_s=1.0, exchange_s=1.5) == 14  # ceil(1.5 x 0.9 / 0.1) = 14


def test_bad_adaptive_settings_fail_in_one_line():
    with pytest.raises(ConfigError, match="--exchange-share in \\(0, 1\\)"):
        TrainConfig(adaptive_t=True, exchange_share=1.0).validate()
    with pytest.raises(ConfigError, match="--min-local-steps <= --max-local-steps"):
        TrainConfig(adaptive_t=True, min_local_steps=8, max_local_steps=4).validate()


def run(out, start_t: int, rounds: int, share: float):
    flags = ["--groups", "2", "--nproc-per-group", "1", "--model", "tiny", "--seq-len", "32"]
    flags += ["--batch-size", "2", "--eval-every", "0", "--adaptive-t", "--max-local-steps", "8"]
    flags += ["--local-steps", str(start_t), "--rounds", str(rounds)]
    proc = train_cli(out, *flags, "--exchange-share", str(share))
    records = M.read_metrics(out)
    # The printed rounds do not claim a total: with adaptive T the number of rounds varies.
    lines = [line for line in proc.stdout.splitlines() if line.startswith("round ")]
    assert lines == [format_round(r) for r in records]
    return records


def test_trainer_follows_the_rule_within_the_step_budget(tmp_path):
    # A target no exchange can meet (0.1 %): T doubles every round towards the bound, and the
    # budget (rounds x local-steps = 14 inner steps) ends the run: the last round is cut to fit.
    rounds = run(tmp_path, start_t=1, rounds=14, share=0.001)
    assert [r[P.ROUND_LOCAL_STEPS] for r in rounds] == [1, 2, 4, 7]
    assert [r[P.STEP] for r in rounds] == [1, 3, 7, 14]
    assert all(r[P.OUTER_SYNC_S] > 0 for r in rounds)
