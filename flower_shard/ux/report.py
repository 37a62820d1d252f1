"""``flower-shard report``: plots and a summary table from one or more runs' ``metrics.jsonl``.

Reads both kinds of run directory: a ``flower-shard train`` run (``config.json``) and a Flower
run (the ServerApp's ``summary.json``). Writes ``report.md`` (a summary table, one row per run)
and, when matplotlib is installed (the ``bench`` extra), PNG plots with one line per run, so
FL+FSDP and its FSDP baseline compare at a glance::

    flower-shard report runs/fl-fsdp --vs runs/fsdp --out runs/report

The arithmetic is :mod:`flower_shard.ux.run_stats`' (pure functions), the drawing
:mod:`flower_shard.ux.plots`'; this module reads the files and writes the table.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from flower_shard import protocol as P
from flower_shard import runfiles as F
from flower_shard.config.train import TrainConfig
from flower_shard.errors import ConfigError
from flower_shard.ux import metrics as M
from flower_shard.ux.formatting import human_bytes
from flower_shard.ux.plots import INSTALL_HINT, PLOTS, plot
from flower_shard.ux.run_stats import RunSummary, is_flower, series, summarise

logger = logging.getLogger(__name__)

REPORT_FILE = "report.md"

# What every round must carry for the report; lr and the like are not needed here.
NEEDED = (P.ROUND, P.STEP, P.TOKENS, P.TOKENS_PER_S, P.ROUND_S, P.OUTER_SYNC_S, P.OUTER_SYNC_BYTES)


class ReportError(ConfigError):
    """A run directory cannot be read; the message is one line naming the file and the fix.

    A :class:`~flower_shard.config.ConfigError`, so the CLI prints it and exits with status 2.
    """


@dataclass
class Run:
    """One run directory as the report sees it."""

    path: Path
    records: list[dict]
    config: TrainConfig | None = None
    """``config.json`` of a ``flower-shard train`` run (the ServerApp writes none)."""
    summary: dict | None = None
    """``summary.json`` of a Flower run (status, transport)."""
    label: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def flower(self) -> bool:
        """Written by the Flower ServerApp rather than by the one-torch-job trainer."""
        return is_flower(self.records)


# -- reading run directories -------------------------------------------------------------------


def load_run(directory: str | Path) -> Run:
    """Read a run directory: ``metrics.jsonl`` (required), ``config.json``, ``summary.json``.

    Raises
    ------
    ReportError
        One line naming the file and the fix: no directory, no or empty metrics file, a line
        that is not JSON or lacks a field the report needs, an unreadable JSON side file.
    """
    path = Path(directory)
    if not path.is_dir():
        raise ReportError(
            f"{path}: no such run directory; give the --out of `flower-shard train` or the "
            "out-dir of a Flower run"
        )
    run = Run(path, _read_records(path), summary=_side_file(path / F.SUMMARY_FILE))
    config = _side_file(path / F.CONFIG_FILE)
    if config is not None and run.flower:
        # The ServerApp writes no config.json: one found here was left by another run.
        run.notes.append(
            f"{F.CONFIG_FILE} ignored: a Flower run writes none, so it is another run's"
        )
    elif config is not None:
        try:
            run.config = TrainConfig.from_json(path / F.CONFIG_FILE)
        except ConfigError as exc:  # names the file
            raise ReportError(f"{exc}; delete it or rerun the run") from None
    status = (run.summary or {}).get(P.S_STATUS)
    if status not in (None, P.STATUS_OK):
        run.notes.append(f"run {status}: {run.summary.get(P.S_ERROR, '?')}")
    return run


def _read_records(path: Path) -> list[dict]:
    """The rounds of ``path/metrics.jsonl``, each checked to carry what the report needs."""
    metrics = path / F.METRICS_FILE
    if not metrics.is_file():
        raise ReportError(
            f"{metrics}: no such file; give the --out directory of a `flower-shard train` run "
            "or the out-dir of a Flower run (both write metrics.jsonl)"
        )
    try:
        records = M.read_metrics(path)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ReportError(_bad_line(metrics)) from None
    if not records:
        raise ReportError(
            f"{metrics} is empty: the run has not finished a round yet; wait for its first "
            "round or rerun it"
        )
    for i, r in enumerate(records, 1):
        missing = [k for k in NEEDED if not isinstance(r, dict) or not _number(r.get(k))]
        if missing:
            raise ReportError(
                f"{metrics}: round record {i} lacks a number for {missing[0]!r}; this is not a "
                "flower-shard metrics file, or an older one: rerun the run"
            )
    return records


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _bad_line(metrics: Path) -> str:
    """The one-line error for the first line of ``metrics`` that is not JSON."""
    raw = metrics.read_bytes().split(b"\n")
    for number, line in enumerate(raw, 1):
        if not line.strip():
            continue
        try:
            json.loads(line.decode())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            last = number == len(raw) or (number == len(raw) - 1 and not raw[-1])
            why = " (a run stopped in mid-write leaves a partial last line)" if last else ""
            return (
                f"{metrics} line {number} is not valid JSON ({exc}); delete or repair that "
                f"line{why}"
            )
    return f"{metrics} is not valid JSON lines; rerun the run"


def _side_file(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path} is not valid JSON ({exc}); delete it or rerun the run") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path} is not a JSON object; delete it or rerun the run")
    return data


def transport(run: Run) -> str | None:
    """The Flower transport of a Flower run (summary.json), None for a trainer run or when
    unknown."""
    if run.config or not run.flower:
        return None
    return (run.summary or {}).get(P.S_TRANSPORT)


def summary_of(run: Run) -> RunSummary:
    """The run's summary row; the flower transport is known from summary.json when written."""
    kind = transport(run)
    return summarise(run.records, None if kind is None else kind == P.FLOWER)


def describe(run: Run) -> str:
    """What ran, in a few words, from the side files."""
    if run.config:
        c = run.config
        words = [f"G={c.groups} K={c.nproc_per_group} T={c.local_steps}", c.sharding]
        if c.groups > 1:
            words.append(f"outer {c.outer}")
        return "torch job, " + " ".join(words)
    if run.flower:
        return f"Flower, transport {transport(run) or '?'}"
    return "torch job"


def label_runs(runs: list[Run]) -> None:
    """Each run's label: its directory name, or the path where names repeat."""
    names = [r.path.name or str(r.path) for r in runs]
    for run, name in zip(runs, names):
        run.label = name if names.count(name) == 1 else str(run.path)


# -- writing -----------------------------------------------------------------------------------

HEAD = (
    "run",
    "what ran",
    "rounds",
    "final train loss",
    "final eval ppl",
    "tokens",
    "training time (s)",
    "tokens/s (median round, metrics.jsonl `tokens_per_s`)",
    "vs `{base}`",
    "comm share (inside + between groups)",
    "sent inside groups, per rank",
    "sent between groups, per rank",
    "Flower messages (all groups, both ways)",
)

DEFINITIONS = (
    "Training time: the rounds' `round_s` without evaluation and without start-up (a Flower "
    "round's `round_s` includes the server-side evaluation, `eval_s`, and its first round the "
    "groups' start-up: both are taken out; a `flower-shard train` round has neither). "
    "Tokens/s: metrics.jsonl's `tokens_per_s`, as the console shows it: a round's tokens over "
    "its `round_s` as recorded (so a Flower round's includes its evaluation); the median over "
    "the rounds. Comm share: time in communication over the training time; inside groups, "
    "FSDP/HSDP's collectives (`intra_comm_s`); between groups, the outer sync (`outer_sync_s`) "
    "or, in a Flower run, everything outside the groups' compute (messages, weights, "
    "aggregation, polling). Bytes: what one rank sent over the run, inside its group "
    "(`intra_bytes_per_rank`) and to other groups (`outer_sync_bytes`; n/a with the flower "
    "transport, where the weights travel in Flower messages instead); Flower messages: the "
    "weights in the run's messages, all groups, to and from the server (`exchange_bytes`). "
    "Final values: the last round that reports one."
)


def _row(run: Run, s: RunSummary, base: float) -> list[str]:
    rel = s.tokens_per_s_median / base if base else float("nan")
    return [
        f"`{run.label}`",
        describe(run),
        str(s.rounds),
        _fmt(s.final_train_loss, "{:.4f}"),
        _fmt(s.final_eval_ppl, "{:.2f}"),
        f"{s.tokens:,}",
        f"{s.train_s:.1f}",
        f"{s.tokens_per_s_median:,.0f}",
        f"{rel:.2f}x",
        f"{100 * s.comm_share:.1f}% ({100 * s.intra_share:.1f}% + "
        f"{100 * (s.comm_share - s.intra_share):.1f}%)",
        human_bytes(s.intra_bytes_per_rank),
        "n/a" if s.inter_bytes_per_rank is None else human_bytes(s.inter_bytes_per_rank),
        "n/a" if s.message_bytes is None else human_bytes(s.message_bytes),
    ]


def markdown(runs: list[Run], plots: list[str], missing_matplotlib: bool = False) -> str:
    """``report.md``: the summary table, its definitions, the notes, the plots (or why there
    are none)."""
    summaries = [summary_of(run) for run in runs]
    head = [h.format(base=runs[0].label) for h in HEAD]
    lines = ["# flower-shard report", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = summaries[0].tokens_per_s_median
    lines += ["| " + " | ".join(_row(run, s, base)) + " |" for run, s in zip(runs, summaries)]
    lines += ["", DEFINITIONS]
    notes = [f"- `{r.label}`: {n}" for r in runs for n in r.notes]
    notes += [
        f"- `{r.label}`: start-up of {s.startup_s:.1f} s taken out of round 1 (its control "
        "overhead above the later rounds' median)"
        for r, s in zip(runs, summaries)
        if s.startup_s > 0
    ]
    if notes:
        lines += ["", "Notes:", "", *notes]
    lines += [""]
    if missing_matplotlib:
        lines += [f"No plots: they need matplotlib (`{INSTALL_HINT}`).", ""]
    for name in plots:
        lines += [f"**{name}**: {PLOTS[name]}", "", f"![{PLOTS[name]}]({name})", ""]
    return "\n".join(lines)


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else spec.format(x)


def write_report(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Read the runs, write the plots and ``report.md`` into ``out``; return report.md's path.

    Without matplotlib the report has no plots, and a logged warning says how to get them.
    """
    runs = [load_run(d) for d in run_dirs]
    label_runs(runs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        curves = [(run.label, series(run.records)) for run in runs]
        title = " vs ".join(run.label for run in runs)
        plots, missing = plot(curves, out, f"flower-shard report: {title}"), False
    except ImportError:
        plots, missing = [], True
        logger.warning("no plots: they need matplotlib (%s)", INSTALL_HINT)
    path = out / REPORT_FILE
    path.write_text(markdown(runs, plots, missing))
    return path


def add_report_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run's output directory")
    parser.add_argument(
        "--vs",
        nargs="+",
        action="extend",
        default=[],
        metavar="OTHER_RUN_DIR",
        help="runs to compare with RUN_DIR (one line each in every plot, one row in the table)",
    )
    parser.add_argument(
        "--out", default=None, help="where the report goes (default: RUN_DIR/report)"
    )


def report_from_args(args: argparse.Namespace) -> int:
    out = args.out or str(Path(args.run_dir, "report"))
    path = write_report([args.run_dir, *args.vs], out)
    print(f"flower-shard report: {path}", flush=True)
    return 0
