"""`flower-shard report`: the summary against the metrics file, real PNGs, one-line errors.

One real `flower-shard train` run (G = 2 groups of 1 rank, 2 rounds) is compared with a run in
the Flower ServerApp's format, written here with round numbers chosen to be exact in binary.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
from conftest import train_cli

from flower_shard import protocol as P
from flower_shard import runfiles as F
from flower_shard.ux import metrics as M
from flower_shard.ux import report as R
from flower_shard.ux.cli import main as cli_main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
GROUPS, RANKS, ROUNDS, STEPS, BATCH, SEQ = 2, 1, 2, 2, 2, 32


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "fl-fsdp"
    train_cli(
        out,
        *("--groups", str(GROUPS), "--nproc-per-group", str(RANKS)),
        *("--rounds", str(ROUNDS), "--local-steps", str(STEPS)),
        *("--batch-size", str(BATCH), "--seq-len", str(SEQ)),
        *("--eval-sequences", "8", "--quiet"),
    )
    return out


def flower_record(rnd, tokens, eval_ppl=None, train_loss=3.0, **over) -> dict:
    """One round as ShardedFedAvg writes it (round 4 s: groups 1.5 s, control 2 s, eval 0.5 s)."""
    record = {
        P.ROUND: rnd,
        P.STEP: 4 * rnd,
        P.TOKENS: tokens,
        P.TOKENS_PER_S: 0.0,
        P.TRAIN_LOSS: train_loss,
        P.LR: 1e-3,
        P.ROUND_S: 4.0,
        P.COMPUTE_S: 1.0,
        P.OUTER_SYNC_S: 0.25,
        P.OUTER_SYNC_BYTES: 1000,
        "groups_ok": 2,
        "groups_rejected": 0,
        "rejected": [],
        "exchange_bytes": 4000,
        "push_s": 0.125,
        "reply_wait_s": 3.0,
        "group_round_s": 1.5,
        "control_overhead_s": 2.0,
    }
    if eval_ppl is not None:
        record[P.EVAL_LOSS], record[P.EVAL_PPL] = 1.0, eval_ppl
    return record | over


FLOWER_RECORDS = [
    flower_record(1, 1024, eval_ppl=40.0),
    # A round where no group replied validly: no loss, no tokens, one rejection.
    flower_record(2, 1024, train_loss=None, groups_ok=0, groups_rejected=1, exchange_bytes=2000),
    flower_record(3, 3072, eval_ppl=20.0, train_loss=2.5),
]


@pytest.fixture
def flower_run(tmp_path):
    out = tmp_path / "flower"
    out.mkdir()
    (out / F.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in FLOWER_RECORDS))
    (out / F.SUMMARY_FILE).write_text(json.dumps({"status": "ok", "transport": "flower"}))
    # Left by an earlier `flower-shard train` into the same directory: must not be used.
    (out / F.CONFIG_FILE).write_text(json.dumps({"groups": 8, "nproc_per_group": 8}))
    return out


def test_summary_of_a_real_run_matches_its_metrics_file(trainer_run):
    records = M.read_metrics(trainer_run)
    run = R.load_run(trainer_run)
    assert R.world_size(run) == GROUPS * RANKS and not run.flower and not run.notes
    s = R.summarise(run.records, R.world_size(run))
    series = R.series(records)

    tokens = ROUNDS * STEPS * BATCH * SEQ * GROUPS * RANKS
    assert s["tokens"] == records[-1][P.TOKENS] == sum(series["round_tokens"]) == tokens
    assert s["rounds"] == ROUNDS and s["steps"] == ROUNDS * STEPS
    # A trainer round's tokens/s is recomputed bit for bit from its tokens and round_s.
    assert series["tokens_per_s"] == [r[P.TOKENS_PER_S] for r in records]
    assert s["tokens_per_s_median"] == statistics.median(r[P.TOKENS_PER_S] for r in records)
    wall = sum(r[P.ROUND_S] for r in records)
    assert s["wall_s"] == pytest.approx(wall, rel=1e-12)
    assert s["tokens_per_s_overall"] == pytest.approx(tokens / wall, rel=1e-12)
    sync = sum(r[P.OUTER_SYNC_S] for r in records)
    assert s["comm_s"] == pytest.approx(sync, rel=1e-12) and sync > 0
    assert s["comm_share"] == pytest.approx(sync / wall, rel=1e-12)
    assert series["comm_share"] == [r[P.OUTER_SYNC_S] / r[P.ROUND_S] for r in records]
    # Every rank sends outer_sync_bytes per round; the run's total is that times N.
    nbytes = sum(r[P.OUTER_SYNC_BYTES] for r in records) * GROUPS * RANKS
    assert (s["inter_group_bytes"], s["inter_group_bytes_scope"]) == (nbytes, "all ranks")
    assert nbytes > 0
    assert s["final_train_loss"] == records[-1][P.TRAIN_LOSS]
    assert s["final_eval_ppl"] == records[-1][P.EVAL_PPL]
    assert series["eval_tokens"] == [r[P.TOKENS] for r in records]
    assert s["groups_rejected"] is None


def test_flower_rounds_exclude_evaluation_and_count_messages():
    s = R.summarise(FLOWER_RECORDS)
    series = R.series(FLOWER_RECORDS)
    # Each round: 4 s, of which 0.5 s evaluation (4 - 1.5 - 2); 3.5 s train, 1 s compute.
    assert R.round_times(FLOWER_RECORDS[0]) == (2.5, 3.5)
    assert series["wall_s"] == [3.5, 7.0, 10.5]
    assert series["round_tokens"] == [1024, 0, 2048]
    assert series["tokens_per_s"] == [1024 / 3.5, 0.0, 2048 / 3.5]
    assert series["train_loss"] == [3.0, None, 2.5]
    assert (series["eval_wall_s"], series["eval_ppl"]) == ([3.5, 10.5], [40.0, 20.0])
    assert s["tokens"] == 3072 and s["wall_s"] == 10.5
    assert s["tokens_per_s_median"] == 1024 / 3.5
    assert s["comm_s"] == 7.5 and s["comm_share"] == 7.5 / 10.5
    assert (s["inter_group_bytes"], s["inter_group_bytes_scope"]) == (10000, "flower messages")
    assert (s["final_train_loss"], s["final_eval_ppl"]) == (2.5, 20.0)
    assert s["groups_rejected"] == 1
    # Records from before group_round_s existed keep their evaluation in the round.
    old = {k: v for k, v in FLOWER_RECORDS[0].items() if k != "group_round_s"}
    assert R.round_times(old) == (3.0, 4.0)
    # Collective transport: nothing goes through Flower, the server does not know N.
    collective = [flower_record(1, 1024, exchange_bytes=0)]
    assert R.inter_group_bytes(collective) == (1000, "per rank")


def test_report_compares_two_runs_with_valid_pngs(trainer_run, flower_run, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "flower_shard.ux.cli", "report", str(trainer_run)]
        + ["--vs", str(flower_run), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"flower-shard report: {out / R.REPORT_FILE}"
    for name in R.PLOTS:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 1000, name
    from matplotlib.image import imread

    assert imread(out / "loss.png").shape[:2] == (800, 1100)  # 11 x 8 in at 100 dpi
    text = (out / R.REPORT_FILE).read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert [row.split(" | ")[0] for row in rows] == ["| `fl-fsdp`", "| `flower`"]
    assert "torch job, G=2 K=1 T=2 fsdp outer fedavg" in rows[0]
    assert f"| {ROUNDS * STEPS * BATCH * SEQ * GROUPS:,} |" in rows[0]
    assert "| 3,072 | 10.5 | 293 |" in rows[1]
    assert "| 71.4% | 10.0 kB (flower messages) |" in rows[1]
    assert "config.json ignored" in text  # the stale side file was noticed, not used
    for name in R.PLOTS:
        assert f"]({name})" in text


def test_without_matplotlib_the_report_says_how_to_get_plots(
    flower_run, tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    out = tmp_path / "report"
    assert cli_main(["report", str(flower_run), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"flower-shard report: no plots: they need matplotlib ({R.INSTALL_HINT})"
    text = (out / R.REPORT_FILE).read_text()
    assert R.INSTALL_HINT in text and ".png" not in text
    assert not list(out.glob("*.png"))


def _write(path, text):
    path.mkdir(parents=True, exist_ok=True)
    (path / F.METRICS_FILE).write_text(text)
    return path


@pytest.mark.parametrize(
    "case, expected",
    [
        ("no-dir", "no such run directory"),
        ("no-metrics", "metrics.jsonl: no such file"),
        ("empty", "metrics.jsonl is empty"),
        ("malformed", "metrics.jsonl line 2 is not valid JSON"),
        ("missing-field", "round record 1 lacks a number for 'tokens'"),
        ("bad-summary", "summary.json is not valid JSON"),
    ],
)
def test_bad_input_fails_with_one_line_and_status_2(case, expected, tmp_path, capsys):
    good = json.dumps(FLOWER_RECORDS[0]) + "\n"
    run = tmp_path / "run"
    if case == "no-metrics":
        run.mkdir()
    elif case == "empty":
        _write(run, "\n")
    elif case == "malformed":
        _write(run, good + good[:40] + "\n")
    elif case == "missing-field":
        _write(run, json.dumps({k: v for k, v in FLOWER_RECORDS[0].items() if k != P.TOKENS}))
    elif case == "bad-summary":
        _write(run, good)
        (run / F.SUMMARY_FILE).write_text("{")
    assert cli_main(["report", str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("flower-shard: error: "), err
    assert expected in err and str(run) in err


def test_bad_input_exit_status_of_the_command(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "flower_shard.ux.cli", "report", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert f"{tmp_path / F.METRICS_FILE}: no such file" in proc.stderr
