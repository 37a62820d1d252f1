"""`flower-shard report`: the summary against the metrics file, real PNGs, one-line errors.

Two real `flower-shard train` runs (FL+FSDP, G = 2 groups of 1 rank, and its FSDP baseline,
G = 1 group of 2 ranks; 2 rounds each) are compared with a run in the Flower ServerApp's
format, written here with round numbers chosen to be exact in binary.
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
from flower_shard.ux import plots
from flower_shard.ux import report as R
from flower_shard.ux import run_stats as S
from flower_shard.ux.cli import main as cli_main
from flower_shard.ux.formatting import human_bytes

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
GROUPS, RANKS, ROUNDS, STEPS, BATCH, SEQ = 2, 1, 2, 2, 2, 32


def _train(out, groups: int, ranks: int):
    train_cli(
        out,
        *("--groups", str(groups), "--nproc-per-group", str(ranks)),
        *("--rounds", str(ROUNDS), "--local-steps", str(STEPS)),
        *("--batch-size", str(BATCH), "--seq-len", str(SEQ)),
        *("--eval-sequences", "8", "--quiet"),
    )
    return out


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    """FL+FSDP: G = 2 groups of 1 rank."""
    return _train(tmp_path_factory.mktemp("report") / "fl-fsdp", GROUPS, RANKS)


@pytest.fixture(scope="module")
def baseline_run(tmp_path_factory):
    """The FSDP baseline: G = 1 group of 2 ranks (its communication is all inside the group)."""
    return _train(tmp_path_factory.mktemp("report") / "fsdp", 1, 2)


def flower_record(rnd, tokens, eval_ppl=None, train_loss=3.0, **over) -> dict:
    """One round as ShardedFedAvg writes it: round 4 s = groups 1.5 s + control 2 s + server
    evaluation 0.5 s; compute 1 s, of which 0.25 s in FSDP's collectives."""
    record = {
        P.ROUND: rnd,
        P.STEP: 4 * rnd,
        P.TOKENS: tokens,
        P.TOKENS_PER_S: 0.0,
        P.TRAIN_LOSS: train_loss,
        P.LR: 1e-3,
        P.ROUND_S: 4.0,
        P.COMPUTE_S: 1.0,
        P.INTRA_BYTES: 500,
        P.INTRA_COMM_S: 0.25,
        P.OUTER_SYNC_S: 0.25,
        P.OUTER_SYNC_BYTES: 1000,
        P.GROUPS_OK: 2,
        P.GROUPS_REJECTED: 0,
        P.REJECTED: [],
        P.EXCHANGE_BYTES: 4000,
        P.PUSH_S: 0.125,
        P.REPLY_WAIT_S: 3.0,
        P.EVAL_S: 0.5,
        P.GROUP_ROUND_S: 1.5,
        P.CONTROL_OVERHEAD_S: 2.0,
    }
    if eval_ppl is not None:
        record[P.EVAL_LOSS], record[P.EVAL_PPL] = 1.0, eval_ppl
    return record | over


FLOWER_RECORDS = [
    # The first round also starts the groups: 4 s more of control overhead (8 s in all).
    flower_record(1, 1024, eval_ppl=40.0, round_s=8.0, control_overhead_s=6.0, tokens_per_s=128),
    # A round where no group replied validly: no loss, no tokens, one rejection.
    flower_record(2, 1024, train_loss=None, groups_ok=0, groups_rejected=1, exchange_bytes=2000),
    flower_record(3, 3072, eval_ppl=20.0, train_loss=2.5, tokens_per_s=512.0),
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
    assert run.config.world_size == GROUPS * RANKS and not run.flower and not run.notes
    s = R.summary_of(run)
    series = S.series(records)

    tokens = ROUNDS * STEPS * BATCH * SEQ * GROUPS * RANKS
    assert s.tokens == records[-1][P.TOKENS] == sum(series.round_tokens) == tokens
    assert s.rounds == ROUNDS and s.steps == ROUNDS * STEPS
    # tokens/s is metrics.jsonl's, bit for bit (what the console printed).
    assert series.tokens_per_s == [r[P.TOKENS_PER_S] for r in records]
    assert s.tokens_per_s_median == statistics.median(r[P.TOKENS_PER_S] for r in records)
    wall = sum(r[P.ROUND_S] for r in records)
    assert s.train_s == pytest.approx(wall, rel=1e-12) and s.startup_s == 0
    assert series.wall_s[-1] == s.train_s
    sync = sum(r[P.OUTER_SYNC_S] for r in records)
    intra = sum(r[P.INTRA_COMM_S] for r in records)
    assert s.inter_comm_s == pytest.approx(sync, rel=1e-12) and sync > 0
    assert s.intra_comm_s == pytest.approx(intra, rel=1e-12)
    assert s.comm_share == pytest.approx((sync + intra) / wall, rel=1e-12)
    assert series.comm_share == [
        (r[P.INTRA_COMM_S] + r[P.OUTER_SYNC_S]) / r[P.ROUND_S] for r in records
    ]
    # Bytes in one scope: what one rank sent over the run.
    nbytes = sum(r[P.OUTER_SYNC_BYTES] for r in records)
    assert s.inter_bytes_per_rank == nbytes > 0
    assert s.intra_bytes_per_rank == sum(r[P.INTRA_BYTES] for r in records)
    assert s.message_bytes is None and s.groups_rejected is None
    assert s.final_train_loss == records[-1][P.TRAIN_LOSS]
    assert s.final_eval_ppl == records[-1][P.EVAL_PPL]
    assert series.eval_tokens == [r[P.TOKENS] for r in records]


def test_the_fsdp_baselines_communication_is_counted(baseline_run):
    """G = 1 has no outer sync: its communication is FSDP's collectives inside the group."""
    records = M.read_metrics(baseline_run)
    s = R.summary_of(R.load_run(baseline_run))
    intra_s = sum(r[P.INTRA_COMM_S] for r in records)
    assert s.inter_comm_s == 0 and s.inter_bytes_per_rank == 0
    assert s.intra_comm_s == pytest.approx(intra_s, rel=1e-12) and intra_s > 0
    assert s.comm_share == pytest.approx(intra_s / sum(r[P.ROUND_S] for r in records))
    assert s.intra_bytes_per_rank == sum(r[P.INTRA_BYTES] for r in records) > 0


def test_flower_rounds_exclude_evaluation_and_start_up_and_count_messages():
    s = S.summarise(FLOWER_RECORDS)
    series = S.series(FLOWER_RECORDS)
    # Each round: 3.5 s of training time (4 s - 0.5 s evaluation), 1 s of compute; the first
    # round's 4 s of start-up (control overhead 6 s, the later rounds' median 2 s) is out.
    assert s.startup_s == 4.0
    assert S.round_times(FLOWER_RECORDS[1]) == S.RoundTimes(3.5, 0.25, 2.5)
    assert S.round_times(FLOWER_RECORDS[0], s.startup_s) == S.RoundTimes(3.5, 0.25, 2.5)
    assert series.wall_s == [3.5, 7.0, 10.5]
    assert series.round_tokens == [1024, 0, 2048]
    assert series.tokens_per_s == [128.0, 0.0, 512.0]  # as metrics.jsonl records them
    assert series.train_loss == [3.0, None, 2.5]
    assert series.comm_share == [2.75 / 3.5] * 3
    assert (series.eval_wall_s, series.eval_ppl) == ([3.5, 10.5], [40.0, 20.0])
    assert s.tokens == 3072 and s.train_s == 10.5
    assert s.tokens_per_s_median == 128.0
    assert (s.intra_comm_s, s.inter_comm_s) == (0.75, 7.5)
    assert s.comm_share == 8.25 / 10.5 and s.intra_share == 0.75 / 10.5
    # The flower transport: no rank sends to another group; messages both ways, all groups.
    assert (s.inter_bytes_per_rank, s.message_bytes, s.intra_bytes_per_rank) == (
        None,
        10000,
        1500,
    )
    assert (s.final_train_loss, s.final_eval_ppl) == (2.5, 20.0)
    assert s.groups_rejected == 1
    # Records from before eval_s existed: the evaluation is what the groups and control left.
    old = {k: v for k, v in FLOWER_RECORDS[1].items() if k != P.EVAL_S}
    assert S.round_times(old) == S.round_times(FLOWER_RECORDS[1])
    # Collective transport: nothing goes through Flower; each rank's all-reduce bytes count.
    collective = [flower_record(1, 1024, exchange_bytes=0), flower_record(2, 2048)]
    t = S.summarise(collective, flower_transport=False)
    assert (t.inter_bytes_per_rank, t.message_bytes) == (2000, 4000)


def _run_report(out, *dirs):
    proc = subprocess.run(
        [sys.executable, "-m", "flower_shard.ux.cli", "report", str(dirs[0])]
        + ["--vs", *map(str, dirs[1:]), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"flower-shard report: {out / R.REPORT_FILE}"
    return (out / R.REPORT_FILE).read_text()


def test_report_compares_runs_in_one_scope_with_valid_pngs(
    trainer_run, baseline_run, flower_run, tmp_path
):
    from matplotlib.image import imread

    out = tmp_path / "report"
    text = _run_report(out, trainer_run, baseline_run, flower_run)
    for name in plots.PLOTS:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 1000, name
        assert f"]({name})" in text and f"**{name}**: {plots.PLOTS[name]}" in text
    assert imread(out / "loss.png").shape[:2] == (800, 1100)  # 11 x 8 in at 100 dpi
    head, _, *rows = [line for line in text.splitlines() if line.startswith("|")]
    columns = head.strip("| ").split(" | ")
    assert columns[7] == "tokens/s (median round, metrics.jsonl `tokens_per_s`)"
    assert columns[-3:] == [
        "sent inside groups, per rank",
        "sent between groups, per rank",
        "Flower messages (all groups, both ways)",
    ]
    cells = {row.split(" | ")[0]: row.strip("| ").split(" | ") for row in rows}
    fl, fsdp, flower = cells["| `fl-fsdp`"], cells["| `fsdp`"], cells["| `flower`"]
    assert fl[1] == "torch job, G=2 K=1 T=2 fsdp outer fedavg"
    assert fl[5] == f"{ROUNDS * STEPS * BATCH * SEQ * GROUPS:,}" and fl[-1] == "n/a"
    # The baseline's communication: FSDP's collectives inside its one group.
    base = R.summary_of(R.load_run(baseline_run))
    assert (
        fsdp[9] == (f"{100 * base.comm_share:.1f}% ({100 * base.intra_share:.1f}% + 0.0%)")
        and base.comm_share > 0
    )
    assert fsdp[10] == human_bytes(base.intra_bytes_per_rank) != "0 B" and fsdp[11] == "0 B"
    # The Flower run: training time without evaluation and start-up; tokens/s as recorded.
    assert flower[5:8] == ["3,072", "10.5", "128"]
    assert flower[9:] == ["78.6% (7.1% + 71.4%)", "1.5 kB", "n/a", "10.0 kB"]
    assert "`flower`: start-up of 4.0 s taken out of round 1" in text
    assert "config.json ignored" in text  # the stale side file was noticed, not used


def test_every_panel_has_a_title_a_legend_and_a_style_per_run(trainer_run, flower_run):
    """What the plots show, read from the figures (no pixels): titles, a legend in every
    panel, identical curves told apart, a plain log axis, time axes from 0."""
    import matplotlib.pyplot as plt

    curves = [("a", S.series(FLOWER_RECORDS)), ("b", S.series(FLOWER_RECORDS))]  # identical
    figs = plots.figures(curves, "a vs b")
    assert set(figs) == set(plots.PLOTS)
    for name, fig in figs.items():
        assert fig.get_suptitle() == "a vs b", name
        for ax in fig.axes:
            assert ax.get_title(), name
            assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b"], name
            first, second = ax.get_lines()
            assert first.get_marker() != second.get_marker()
            assert first.get_linestyle() != second.get_linestyle()
            assert first.get_linewidth() > second.get_linewidth()  # the top one is thinner
            if "time" in ax.get_xlabel() or ax.get_xlabel() == "tokens":
                assert ax.get_xlim()[0] == 0
    loss = figs["loss.png"]
    for ax in loss.axes[2:]:  # perplexity: log scale, plain numbers
        assert ax.get_yscale() == "log"
        assert ax.yaxis.get_major_formatter()(100.0) == "100"
        assert ax.yaxis.get_minor_formatter()(20.0) in ("20", "")
    progress = figs["progress.png"].axes[0].get_lines()[0]
    assert (progress.get_xdata()[0], progress.get_ydata()[0]) == (0.0, 0)
    assert list(progress.get_xdata()[1:]) == S.series(FLOWER_RECORDS).wall_s
    for fig in figs.values():
        plt.close(fig)


def test_without_matplotlib_the_report_says_how_to_get_plots(
    flower_run, tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    out = tmp_path / "report"
    assert cli_main(["report", str(flower_run), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    warning = f"flower-shard report: no plots: they need matplotlib ({plots.INSTALL_HINT})"
    assert captured.err.splitlines() == [warning]  # logged; stdout has the result alone
    assert captured.out.splitlines() == [f"flower-shard report: {out / R.REPORT_FILE}"]
    text = (out / R.REPORT_FILE).read_text()
    assert plots.INSTALL_HINT in text and ".png" not in text
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
