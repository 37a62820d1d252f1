"""The round display: the per-round table, the live bar, and the unchanged plain lines off a TTY."""

from __future__ import annotations

import os
import sys
import threading
from io import StringIO

import pytest
from rich.console import Console

from flower_shard import protocol as P
from flower_shard.preflight import check
from flower_shard.ux import metrics as M
from flower_shard.ux.formatting import format_round
from flower_shard.ux.progress import RoundDisplay, format_table, is_interactive

# Two rounds of `flower-shard train` (G = 2: an outer sync; evaluated in round 1 only) ...
TRAIN = [
    {
        P.ROUND: 1,
        P.STEP: 4,
        P.TOKENS: 4096,
        P.TOKENS_PER_S: 1530.4,
        P.TRAIN_LOSS: 4.12345,
        P.LR: 1e-3,
        P.ROUND_S: 1.25,
        P.OUTER_SYNC_S: 0.0123,
        P.OUTER_SYNC_BYTES: 4096,
        P.EVAL_PPL: 61.7,
    },
    {
        P.ROUND: 2,
        P.STEP: 8,
        P.TOKENS: 8192,
        P.TOKENS_PER_S: 12345.6,
        P.TRAIN_LOSS: 3.5,
        P.LR: 5e-4,
        P.ROUND_S: 0.95,
        P.OUTER_SYNC_S: 0.008,
        P.OUTER_SYNC_BYTES: 4096,
    },
]
# ... and one of the Flower ServerApp (weights through Flower, a group rejected, no loss).
FLOWER = {
    P.ROUND: 1,
    P.STEP: 2,
    P.TOKENS: 512,
    P.TOKENS_PER_S: 800.0,
    P.TRAIN_LOSS: None,
    P.LR: 3e-3,
    P.OUTER_SYNC_S: 0.0,
    P.OUTER_SYNC_BYTES: 0,
    "exchange_bytes": 2_500_000,
    "groups_ok": 2,
    "groups_rejected": 1,
    "rejected": ["node 7: non-finite values"],
    P.ROUND_S: 3.04,
    P.EVAL_PPL: 200.0,
}

TRAIN_TABLE = [
    "rounds (2/3)",
    " round   step     loss     ppl    tok/s         lr           sync   round s",
    "─" * 76,
    "     1      4   4.1235   61.70    1,530   1.00e-03   12 ms 4.1 kB       1.2",
    "     2      8   3.5000           12,346   5.00e-04    8 ms 4.1 kB       0.9",
]
# What `format_round` printed before the display existed: scripts and tests parse these.
TRAIN_LINES = [
    "round 1/3 | step 4 | loss 4.1235 | ppl 61.70 | 1,530 tok/s | lr 1.00e-03 | sync 12 ms "
    "4.1 kB | round 1.2 s",
    "round 2/3 | step 8 | loss 3.5000 | 12,346 tok/s | lr 5.00e-04 | sync 8 ms 4.1 kB | "
    "round 0.9 s",
]


def rendered(table, width: int = 100) -> list[str]:
    buf = StringIO()
    Console(file=buf, width=width).print(table)
    return [line.rstrip() for line in buf.getvalue().splitlines()]


def test_table_has_one_row_per_round_with_the_values_of_the_plain_lines():
    assert rendered(format_table(TRAIN, 3)) == TRAIN_TABLE


def test_table_of_flower_rounds_shows_exchange_and_groups_and_drops_empty_columns():
    assert rendered(format_table([FLOWER])) == [
        "rounds (1)",
        " round   step   loss      ppl   tok/s         lr   exchanged   groups ok/rejected"
        "   round s",
        "─" * 92,
        "     1      2    n/a   200.00     800   3.00e-03      2.5 MB                  2/1"
        "       3.0",
    ]


def test_off_a_terminal_the_rounds_are_the_plain_lines_as_before(tmp_path, capsys):
    assert not sys.stdout.isatty()  # pytest's capture
    logger = M.MetricsLogger(tmp_path, echo=True, total_rounds=3, total_steps=12)
    assert not logger.display.live
    for r in TRAIN:
        for step in range(r[P.STEP] - 3, r[P.STEP] + 1):
            logger.step(step)  # nothing to draw off a terminal
        logger.log(r)
    logger.close()
    assert capsys.readouterr().out.splitlines() == TRAIN_LINES
    assert [format_round(r, 3) for r in TRAIN] == TRAIN_LINES
    assert M.read_metrics(tmp_path) == TRAIN


def test_live_display_draws_the_last_round_then_the_table_and_starts_no_thread():
    buf = StringIO()
    console = Console(file=buf, force_terminal=True, color_system=None, width=120)
    threads = threading.active_count()
    display = RoundDisplay(3, total_steps=12, console=console)
    try:
        assert threading.active_count() == threads  # rich's refresh thread is off
        for r in TRAIN:
            for step in range(r[P.STEP] - 3, r[P.STEP] + 1):
                display.step(step)
            display.round(r)
    finally:
        display.close()
    display.close()  # twice is harmless
    out = buf.getvalue()
    # The cursor is shown again right after the first frame, before any step: a rank killed
    # mid-run leaves a usable terminal.
    assert out.index("\x1b[?25h") < out.index(" 1/12 ")
    assert "loss 4.1235 | ppl 61.70 | 1,530 tok/s" in out  # round 1 on the bar
    assert "2/3" in out and "loss 3.5000 | 12,346 tok/s" in out
    assert " 8/12 " in out  # the step bar follows the run's global step
    assert "round 1/3 |" not in out  # no plain lines on a terminal
    # After the display ended (the cursor is shown again): exactly the table, nothing else.
    after = out.rsplit("\x1b[?25h", 1)[1]
    assert [line.rstrip() for line in after.splitlines()] == TRAIN_TABLE


def test_only_a_real_terminal_gets_the_live_display(monkeypatch):
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich would call a pipe a terminal with this
    assert not is_interactive(StringIO())
    main, other = os.openpty()
    try:
        with os.fdopen(other, "w", closefd=False) as tty:
            assert is_interactive(tty)
            monkeypatch.setenv("TERM", "dumb")
            assert not is_interactive(tty)
    finally:
        os.close(main)
        os.close(other)


def test_tensorboard_missing_fails_before_anything_starts(tmp_path, monkeypatch, capsys):
    from flower_shard.config import ConfigError, TrainConfig
    from flower_shard.ux.cli import main

    # None in sys.modules is how Python marks a module as not importable.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        check(TrainConfig(tensorboard=True))
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        M.MetricsLogger(tmp_path / "log", tensorboard=True)
    assert main(["train", "--out", str(tmp_path / "run"), "--tensorboard"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "flower-shard: error: --tensorboard needs the tensorboard package: pip install "
        "tensorboard (it is in flower-shard's dev extra)"
    ]
    assert not (tmp_path / "run").exists()  # nothing was prepared or launched
