"""``flower-shard report``: plots and a summary table from one or more runs' ``metrics.jsonl``.

Reads both kinds of metrics file: the one-torch-job trainer's (``flower-shard train``) and the
Flower ServerApp's (which adds ``groups_ok``, ``groups_rejected``, ``exchange_bytes``,
``control_overhead_s``, ...). Writes ``report.md`` (a summary table, one row per run) and, when
matplotlib is installed (the ``bench`` extra), PNG plots with one line per run, so FL+FSDP and
its FSDP baseline compare at a glance::

    flower-shard report runs/fl-fsdp --vs runs/fsdp --out runs/report

All the arithmetic lives in pure functions (:func:`round_times`, :func:`series`,
:func:`summarise`); reading files and drawing are kept apart from it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from flower_shard import protocol as P
from flower_shard import runfiles as F
from flower_shard.config import ConfigError
from flower_shard.ux import metrics as M
from flower_shard.ux.formatting import human_bytes

# The side files' names, as launch.CONFIG_FILE and server_app.SUMMARY_FILE spell them (a test
# checks): importing those modules would pull torch and flwr into every `flower-shard` call.
REPORT_FILE = "report.md"
PLOTS = {
    "loss.png": "training loss and held-out perplexity against wall time and tokens",
    "throughput.png": "tokens/s per round",
    "comm_share.png": "communication share of each round",
}
INSTALL_HINT = "pip install 'flower-shard[bench]'"

# Fields of a Flower ServerApp round (strategies/sharded_fedavg.py) that the trainer lacks.

# What every round must carry for the report; lr and the like are not needed here.
NEEDED = (P.ROUND, P.STEP, P.TOKENS, P.ROUND_S, P.OUTER_SYNC_S, P.OUTER_SYNC_BYTES)


class ReportError(ConfigError):
    """A run directory cannot be read; the message is one line naming the file and the fix.

    A :class:`~flower_shard.config.ConfigError`, so the CLI prints it and exits with status 2.
    """


@dataclass
class Run:
    """One run directory as the report sees it."""

    path: Path
    records: list[dict]
    config: dict | None = None
    """``config.json`` of a ``flower-shard train`` run (the ServerApp writes none)."""
    summary: dict | None = None
    """``summary.json`` of a Flower run (status, transport)."""
    label: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def flower(self) -> bool:
        """Written by the Flower ServerApp rather than by the one-torch-job trainer."""
        return any(P.EXCHANGE_BYTES in r for r in self.records)


# -- pure functions: rounds in, numbers out ----------------------------------------------------


def round_times(record: dict) -> tuple[float, float]:
    """Communication seconds and round seconds (without evaluation) of one round.

    Trainer rounds: ``round_s`` already excludes evaluation, and the communication between
    groups is the outer sync (``outer_sync_s``); FSDP's own collectives inside a group run
    within the steps and cannot be timed apart from ``compute_s``.

    Flower rounds: ``round_s`` runs from the first push to the end of the server-side
    evaluation. Evaluation is taken out (``round_s - group_round_s - control_overhead_s``), and
    everything that is not the groups' training compute counts as communication: pushing and
    pulling messages, gathering and loading full weights, aggregation, polling latency.
    Records written before ``group_round_s`` existed keep their evaluation in.

    Returns
    -------
    tuple[float, float]
        ``(comm_s, round_s)``, with ``0 <= comm_s <= round_s``.
    """
    if P.CONTROL_OVERHEAD_S in record:
        round_s = record[P.ROUND_S]
        busy = record.get(P.GROUP_ROUND_S)
        if busy is not None:
            round_s = min(round_s, busy + record[P.CONTROL_OVERHEAD_S])
        return max(0.0, round_s - (record.get(P.COMPUTE_S) or 0.0)), round_s
    return min(record[P.OUTER_SYNC_S], record[P.ROUND_S]), record[P.ROUND_S]


def series(records: list[dict]) -> dict[str, list]:
    """Per-round curves of a run, in round order.

    Returns
    -------
    dict
        ``round``, ``wall_s`` (cumulative round time without evaluation, at the end of each
        round), ``tokens`` (cumulative), ``round_tokens``, ``tokens_per_s`` (round tokens over
        round time without evaluation: for trainer rounds exactly the recorded value),
        ``train_loss`` (None where no group trained), ``comm_s``, ``comm_share``; and the rounds
        that evaluated: ``eval_wall_s``, ``eval_tokens``, ``eval_ppl``.
    """
    out: dict[str, list] = {
        k: []
        for k in (
            "round",
            "wall_s",
            "tokens",
            "round_tokens",
            "tokens_per_s",
            "train_loss",
            "comm_s",
            "comm_share",
            "eval_wall_s",
            "eval_tokens",
            "eval_ppl",
        )
    }
    wall, previous = 0.0, 0
    for r in records:
        comm_s, round_s = round_times(r)
        wall += round_s
        tokens = r[P.TOKENS] - previous
        previous = r[P.TOKENS]
        out["round"].append(r[P.ROUND])
        out["wall_s"].append(wall)
        out["tokens"].append(r[P.TOKENS])
        out["round_tokens"].append(tokens)
        out["tokens_per_s"].append(tokens / round_s if round_s > 0 else 0.0)
        out["train_loss"].append(_finite(r.get(P.TRAIN_LOSS)))
        out["comm_s"].append(comm_s)
        out["comm_share"].append(comm_s / round_s if round_s > 0 else 0.0)
        ppl = _finite(r.get(P.EVAL_PPL))
        if ppl is not None:
            out["eval_wall_s"].append(wall)
            out["eval_tokens"].append(r[P.TOKENS])
            out["eval_ppl"].append(ppl)
    return out


def inter_group_bytes(records: list[dict], world_size: int | None = None) -> tuple[float, str]:
    """Bytes that crossed between groups over the run, and what they count.

    Flower transport: every byte of the weights in Flower Messages, to and from the groups
    (``exchange_bytes``). All-reduce between groups (one torch job, or Flower's collective
    transport): ``outer_sync_bytes`` is what ONE rank sends per round, so with the world size
    known the total is that times N; without it (a Flower run's server does not know K), the
    figure stays per rank.

    Returns
    -------
    tuple[float, str]
        ``(bytes, scope)``, scope one of ``flower messages``, ``all ranks``, ``per rank``.
    """
    flower = sum(r.get(P.EXCHANGE_BYTES) or 0 for r in records)
    if flower:
        return float(flower), "flower messages"
    per_rank = float(sum(r[P.OUTER_SYNC_BYTES] or 0 for r in records))
    if world_size:
        return per_rank * world_size, "all ranks"
    return per_rank, "per rank"


def summarise(records: list[dict], world_size: int | None = None) -> dict:
    """The figures of one run's summary row.

    Parameters
    ----------
    records
        The run's rounds, as in ``metrics.jsonl`` (at least one).
    world_size
        N, when known (``config.json`` of a trainer run): turns per-rank outer-sync bytes into
        the run's total.

    Returns
    -------
    dict
        ``rounds``, ``steps``, ``tokens`` (the last cumulative count), ``wall_s`` (sum of the
        rounds without evaluation), ``final_train_loss`` / ``final_eval_ppl`` (of the last
        round that reports one, else None), ``tokens_per_s_median`` (median over rounds of
        :func:`series`' ``tokens_per_s``), ``tokens_per_s_overall`` (tokens / wall_s),
        ``comm_s``, ``comm_share`` (comm_s / wall_s: time-weighted, not a mean of shares),
        ``inter_group_bytes`` and ``inter_group_bytes_scope`` (see :func:`inter_group_bytes`),
        ``groups_rejected`` (Flower runs; None otherwise).
    """
    s = series(records)
    wall = s["wall_s"][-1]
    comm = sum(s["comm_s"])
    nbytes, scope = inter_group_bytes(records, world_size)
    losses = [x for x in s["train_loss"] if x is not None]
    flower = any(P.GROUPS_REJECTED in r for r in records)
    return {
        "rounds": len(records),
        "steps": records[-1][P.STEP],
        "tokens": records[-1][P.TOKENS],
        "wall_s": wall,
        "final_train_loss": losses[-1] if losses else None,
        "final_eval_ppl": s["eval_ppl"][-1] if s["eval_ppl"] else None,
        "tokens_per_s_median": statistics.median(s["tokens_per_s"]),
        "tokens_per_s_overall": records[-1][P.TOKENS] / wall if wall > 0 else 0.0,
        "comm_s": comm,
        "comm_share": comm / wall if wall > 0 else 0.0,
        "inter_group_bytes": nbytes,
        "inter_group_bytes_scope": scope,
        "groups_rejected": sum(r.get(P.GROUPS_REJECTED) or 0 for r in records) if flower else None,
    }


def _finite(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


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
    metrics = path / F.METRICS_FILE
    if not path.is_dir():
        raise ReportError(
            f"{path}: no such run directory; give the --out of `flower-shard train` or the "
            "out-dir of a Flower run"
        )
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
    run = Run(path, records, _side_file(path / F.CONFIG_FILE), _side_file(path / F.SUMMARY_FILE))
    if run.flower and run.config is not None:
        # The ServerApp writes no config.json: one found here was left by another run.
        run.notes.append(
            f"{F.CONFIG_FILE} ignored: a Flower run writes none, so it is another run's"
        )
        run.config = None
    if run.summary and run.summary.get("status") not in (None, "ok"):
        run.notes.append(f"run {run.summary.get('status')}: {run.summary.get('error', '?')}")
    return run


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


def world_size(run: Run) -> int | None:
    """N = G x K of a trainer run, from its config.json."""
    c = run.config or {}
    g, k = c.get("groups"), c.get("nproc_per_group")
    return g * k if isinstance(g, int) and isinstance(k, int) else None


def describe(run: Run) -> str:
    """What ran, in a few words, from the side files."""
    if run.config:
        c = run.config
        words = [
            f"G={c.get('groups')} K={c.get('nproc_per_group')} T={c.get('local_steps')}",
            str(c.get("sharding", "")),
        ]
        if c.get("groups", 1) > 1:
            words.append(f"outer {c.get('outer')}")
        return "torch job, " + " ".join(w for w in words if w)
    if run.flower:
        transport = (run.summary or {}).get("transport", "?")
        return f"Flower, transport {transport}"
    return "torch job"


def label_runs(runs: list[Run]) -> None:
    """Each run's label: its directory name, or the path where names repeat."""
    names = [r.path.name or str(r.path) for r in runs]
    for run, name in zip(runs, names):
        run.label = name if names.count(name) == 1 else str(run.path)


# -- writing -----------------------------------------------------------------------------------


def markdown(runs: list[Run], plots: list[str], missing_matplotlib: bool = False) -> str:
    """``report.md``: the summary table, the notes, the plots (or why there are none)."""
    rows = []
    summaries = [summarise(run.records, world_size(run)) for run in runs]
    base = summaries[0]["tokens_per_s_median"]
    for run, s in zip(runs, summaries):
        rel = s["tokens_per_s_median"] / base if base else float("nan")
        scope = s["inter_group_bytes_scope"]
        rows.append(
            [
                f"`{run.label}`",
                describe(run),
                str(s["rounds"]),
                _fmt(s["final_train_loss"], "{:.4f}"),
                _fmt(s["final_eval_ppl"], "{:.2f}"),
                f"{s['tokens']:,}",
                f"{s['wall_s']:.1f}",
                f"{s['tokens_per_s_median']:,.0f}",
                f"{rel:.2f}x",
                f"{100 * s['comm_share']:.1f}%",
                f"{human_bytes(s['inter_group_bytes'])} ({scope})",
            ]
        )
    head = [
        "run",
        "what ran",
        "rounds",
        "final train loss",
        "final eval ppl",
        "tokens",
        "wall time (s)",
        "tokens/s (median)",
        f"vs `{runs[0].label}`",
        "comm share",
        "bytes between groups",
    ]
    lines = ["# flower-shard report", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += [
        "",
        "Wall time: the rounds' time without evaluation and start-up. Tokens/s: a round's "
        "tokens over that time. Comm share: the time outside the groups' training compute "
        "(one torch job: the outer sync; Flower: message exchange, weight gathering, "
        "aggregation and polling) over that time. Bytes between groups: Flower messages both "
        "ways, or the outer all-reduce's bytes sent by all ranks (per rank when N is unknown). "
        "Final values: the last round that reports one.",
    ]
    notes = [f"- `{r.label}`: {n}" for r in runs for n in r.notes]
    if notes:
        lines += ["", "Notes:", "", *notes]
    lines += [""]
    if missing_matplotlib:
        lines += [f"No plots: they need matplotlib (`{INSTALL_HINT}`).", ""]
    for name in plots:
        lines += [f"![{PLOTS[name]}]({name})", ""]
    return "\n".join(lines)


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else spec.format(x)


def plot(runs: list[Run], out: Path) -> list[str]:
    """Write the PNGs into ``out`` (matplotlib, Agg); returns their file names.

    Raises ImportError when matplotlib is missing.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    curves = [(run.label, series(run.records)) for run in runs]

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = (
        (axes[0, 0], "wall_s", "train_loss", "wall time (s)", "training loss"),
        (axes[0, 1], "tokens", "train_loss", "tokens", "training loss"),
        (axes[1, 0], "eval_wall_s", "eval_ppl", "wall time (s)", "held-out perplexity"),
        (axes[1, 1], "eval_tokens", "eval_ppl", "tokens", "held-out perplexity"),
    )
    for ax, x, y, xlabel, ylabel in panels:
        for label, s in curves:
            points = [(a, b) for a, b in zip(s[x], s[y]) if b is not None]
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    for ax in axes[1]:  # perplexity falls by orders of magnitude early on
        ax.set_yscale("log")
    axes[0, 0].legend()
    _save(fig, out / "loss.png")

    for name, key, ylabel, scale in (
        ("throughput.png", "tokens_per_s", "tokens/s", 1.0),
        ("comm_share.png", "comm_share", "communication share of the round (%)", 100.0),
    ):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for label, s in curves:
            ax.plot(s["round"], [scale * v for v in s[key]], marker="o", label=label)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        _save(fig, out / name)
    return list(PLOTS)


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Read the runs, write the plots and ``report.md`` into ``out``; return report.md's path.

    Without matplotlib the report has no plots, and one line on stdout says how to get them.
    """
    runs = [load_run(d) for d in run_dirs]
    label_runs(runs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        plots, missing = plot(runs, out), False
    except ImportError:
        plots, missing = [], True
        print(f"flower-shard report: no plots: they need matplotlib ({INSTALL_HINT})", flush=True)
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
