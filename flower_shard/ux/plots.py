"""The report's PNG plots, one curve per run: loss and perplexity, progress, throughput and the
communication share.

Drawn with matplotlib (the ``bench`` extra), imported only here and only when plotting, with
the Agg backend (files only: no display on a cluster node). The curves are
:func:`flower_shard.ux.run_stats.series`'. Every panel has a title and a legend; each run has
its own marker and line style, and later runs are drawn thinner on top with hollow markers,
so two identical curves still show as two. Times are training time (no evaluation, no
start-up), so every run starts at 0 s; the log axis of perplexity has plain tick labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flower_shard.ux.run_stats import Series

PLOTS = {
    "loss.png": "training loss and held-out perplexity against training time and tokens",
    "progress.png": "tokens processed against training time",
    "throughput.png": "tokens/s per round, as metrics.jsonl records it",
    "comm_share.png": "communication share of each round's training time",
}
INSTALL_HINT = "pip install 'flower-shard[bench]'"
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))


@dataclass(frozen=True)
class Style:
    """How run ``index`` is drawn: distinct marker and dashes, thinner and hollow on top."""

    index: int

    def kwargs(self) -> dict:
        i = self.index
        return {
            "marker": MARKERS[i % len(MARKERS)],
            "linestyle": LINESTYLES[i % len(LINESTYLES)],
            "linewidth": max(0.8, 2.6 - 0.6 * i),
            "markersize": max(3.0, 8.0 - 1.5 * i),
            "markerfacecolor": "none" if i else None,
            "zorder": 2 + i,
        }


def _plain_log_axis(ax) -> None:
    """Log scale with tick labels as plain numbers (20, 50, not 2x10^1)."""
    from matplotlib.ticker import LogFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


def _draw(ax, curves, x: str, y: str, title: str, xlabel: str, ylabel: str, origin=None):
    """One line per run; ``origin`` is a point prepended to every curve (e.g. (0, 0))."""
    for i, (label, s) in enumerate(curves):
        points = [(a, b) for a, b in zip(getattr(s, x), getattr(s, y)) if b is not None]
        if origin is not None:
            points = [origin, *points]
        if points:
            ax.plot(*zip(*points), label=label, **Style(i).kwargs())
    if x != "round":  # training time and tokens start at 0
        ax.set_xlim(left=0)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def figures(curves: list[tuple[str, Series]], title: str) -> dict:
    """The figures of :data:`PLOTS` for ``(label, series)`` curves, by file name.

    Raises ImportError when matplotlib is missing.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out = {}
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    time, tokens = "training time (s)", "tokens"
    _draw(axes[0, 0], curves, "wall_s", "train_loss", "training loss vs time", time, "loss")
    _draw(axes[0, 1], curves, "tokens", "train_loss", "training loss vs tokens", tokens, "loss")
    ppl = "held-out perplexity"
    _draw(axes[1, 0], curves, "eval_wall_s", "eval_ppl", f"{ppl} vs time", time, ppl)
    _draw(axes[1, 1], curves, "eval_tokens", "eval_ppl", f"{ppl} vs tokens", tokens, ppl)
    for ax in axes[1]:  # perplexity falls by orders of magnitude early on
        _plain_log_axis(ax)
    fig.suptitle(title)
    out["loss.png"] = fig

    fig, ax = plt.subplots(figsize=(8, 4.5))
    _draw(ax, curves, "wall_s", "tokens", "tokens processed", time, tokens, origin=(0.0, 0))
    fig.suptitle(title)
    out["progress.png"] = fig

    for name, key, text, ylabel, scale in (
        ("throughput.png", "tokens_per_s", "tokens/s per round (metrics.jsonl)", "tokens/s", 1),
        (
            "comm_share.png",
            "comm_share",
            "communication share of each round (inside + between groups)",
            "share of the round's training time (%)",
            100,
        ),
    ):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        scaled = [(label, _scaled(s, key, scale)) for label, s in curves]
        _draw(ax, scaled, "round", key, text, "round", ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.suptitle(title)
        out[name] = fig
    return out


def _scaled(s: Series, key: str, scale: float) -> Series:
    copy = Series(**vars(s))
    setattr(copy, key, [scale * v for v in getattr(s, key)])
    return copy


def plot(curves: list[tuple[str, Series]], out: Path, title: str = "flower-shard report") -> list:
    """Write the PNGs of ``(label, series)`` curves into ``out``; return their file names.

    Raises ImportError when matplotlib is missing.
    """
    import matplotlib.pyplot as plt

    figs = figures(curves, title)
    for name, fig in figs.items():
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
    return list(figs)
