"""`flower-shard train` end to end: real torchrun, 2 groups x 2 ranks, 3 rounds."""

from __future__ import annotations

import json

from conftest import assert_tensorboard_is_metrics, train_cli

from flower_shard import protocol as P
from flower_shard import runfiles as F
from flower_shard.ux import metrics as M
from flower_shard.ux.formatting import format_round


def test_train_end_to_end(tmp_path):
    out = tmp_path / "run"
    proc = train_cli(
        out,
        "--groups",
        "2",
        "--nproc-per-group",
        "2",
        "--local-steps",
        "4",
        "--rounds",
        "3",
        "--model",
        "tiny",
        "--seq-len",
        "64",
        "--batch-size",
        "4",
        "--lr",
        "3e-3",
        "--outer",
        "nesterov",
        "--tensorboard",
    )
    rounds = M.read_metrics(out)
    assert [r[P.ROUND] for r in rounds] == [1, 2, 3]
    for r in rounds:
        for field in (*P.REQUIRED_FIELDS, P.EVAL_PPL):
            assert field in r, f"{field} missing from round {r[P.ROUND]}"
        assert r[P.OUTER_SYNC_BYTES] > 0 and r[P.OUTER_SYNC_S] > 0 and r[P.TOKENS_PER_S] > 0
    assert [r[P.STEP] for r in rounds] == [4, 8, 12]
    assert rounds[-1][P.TOKENS] == 12 * 4 * 64 * 4  # steps x batch x seq_len x N
    assert rounds[-1][P.TRAIN_LOSS] < rounds[0][P.TRAIN_LOSS]
    assert rounds[-1][P.EVAL_PPL] < rounds[0][P.EVAL_PPL]
    # Off a terminal (captured here): the plain line per round, exactly, and no live display.
    lines = [line for line in proc.stdout.splitlines() if line.startswith("round ")]
    assert lines == [format_round(r, 3) for r in rounds]
    assert "\x1b[" not in proc.stdout
    # The ranks log at the default level (info): rank 0 says what runs, on stderr.
    assert "flower-shard: " in proc.stderr and "G=2 K=2 T=4 outer=nesterov" in proc.stderr
    assert json.loads((out / F.CONFIG_FILE).read_text())["outer"] == "nesterov"
    # --tensorboard: the same rounds as TensorBoard scalars (tag = field, step = round).
    assert_tensorboard_is_metrics(out)


def test_the_log_level_reaches_the_ranks(tmp_path):
    """`--log-level warning` (after the command) is exported to torchrun's ranks: rank 0's
    info line is gone, the rounds (the command's output, not logs) are still printed."""
    out = tmp_path / "run"
    proc = train_cli(
        out,
        *("--groups", "1", "--nproc-per-group", "1", "--rounds", "1", "--local-steps", "2"),
        *("--seq-len", "32", "--batch-size", "2", "--eval-every", "0"),
        *("--log-level", "warning"),
    )
    assert "G=1 K=1 T=2" not in proc.stderr, proc.stderr[-2000:]
    (record,) = M.read_metrics(out)
    assert [ln for ln in proc.stdout.splitlines() if ln.startswith("round ")] == [
        format_round(record, 1)
    ]
