"""How a run shows its rounds: a live progress bar on a terminal, plain lines anywhere else.

On a terminal, :class:`RoundDisplay` draws a rich progress bar of the rounds (and of the
run's inner steps, where the process runs them) with the last round's loss,
perplexity and tokens/s, and prints a per-round table (:func:`format_table`) when it stops.
Anywhere else (a pipe, a log file, CI, pytest's capture) it prints
:func:`~flower_shard.ux.formatting.format_round`'s one line per round, unchanged: scripts and tests
parse those lines.

The display starts no thread: rich's auto-refresh thread is off and the bar is redrawn when a
step or a round ends, so nothing can keep the process alive or draw after :meth:`close`. rich
is imported only where a live display or a table is drawn: ranks and piped runs never load it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from flower_shard import protocol as P
from flower_shard.ux.formatting import format_round, human_bytes, number

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

STEP_REFRESH_S = 0.1
"""Redraw the bar at most this often on steps (a tiny model runs hundreds of steps a second)."""


def is_interactive(stream) -> bool:
    """Whether ``stream`` is a terminal that can redraw a live display in place.

    Only the stream decides (``isatty()``): rich also treats a pipe as a terminal when
    ``FORCE_COLOR`` or ``TTY_COMPATIBLE`` is set (as some CI systems do), and a piped run must
    keep its plain lines. ``TERM=dumb`` cannot move the cursor.
    """
    try:
        return bool(stream.isatty()) and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # no isatty(), or a closed stream
        return False


def round_summary(r: dict) -> str:
    """The last round on the bar: ``loss 4.1230 | ppl 61.70 | 1,530 tok/s``."""
    parts = [f"loss {number(r.get(P.TRAIN_LOSS), 4)}"]
    if r.get(P.EVAL_PPL) is not None:
        parts.append(f"ppl {r[P.EVAL_PPL]:.2f}")
    parts.append(f"{r[P.TOKENS_PER_S]:,.0f} tok/s")
    return " | ".join(parts)


def _sync(r: dict) -> str:
    if not r.get(P.OUTER_SYNC_BYTES):
        return ""
    return f"{1e3 * r[P.OUTER_SYNC_S]:.0f} ms {human_bytes(r[P.OUTER_SYNC_BYTES])}"


# (header, the cell of one record, whether the column is shown for these records). The cells
# are formatted as in formatting.format_round, so the table and the plain lines read alike.
_COLUMNS: tuple[tuple[str, Callable[[dict], str], Callable[[list[dict]], bool]], ...] = (
    ("round", lambda r: str(r[P.ROUND]), lambda rs: True),
    ("step", lambda r: str(r[P.STEP]), lambda rs: True),
    ("loss", lambda r: number(r.get(P.TRAIN_LOSS), 4), lambda rs: True),
    (
        "ppl",
        lambda r: "" if r.get(P.EVAL_PPL) is None else f"{r[P.EVAL_PPL]:.2f}",
        lambda rs: any(r.get(P.EVAL_PPL) is not None for r in rs),
    ),
    ("tok/s", lambda r: f"{r[P.TOKENS_PER_S]:,.0f}", lambda rs: True),
    ("lr", lambda r: f"{r[P.LR]:.2e}", lambda rs: True),
    (  # a Flower round
        "exchanged",
        lambda r: human_bytes(r[P.EXCHANGE_BYTES]) if P.EXCHANGE_BYTES in r else "",
        lambda rs: any(P.EXCHANGE_BYTES in r for r in rs),
    ),
    (
        "groups ok/rejected",
        lambda r: f"{r[P.GROUPS_OK]}/{r[P.GROUPS_REJECTED]}" if P.EXCHANGE_BYTES in r else "",
        lambda rs: any(P.EXCHANGE_BYTES in r for r in rs),
    ),
    ("sync", _sync, lambda rs: any(r.get(P.OUTER_SYNC_BYTES) for r in rs)),
    (
        "round s",
        lambda r: f"{r[P.ROUND_S]:.1f}" if P.ROUND_S in r else "",
        lambda rs: any(P.ROUND_S in r for r in rs),
    ),
)


def format_table(records: list[dict], total_rounds: int = 0) -> Table:
    """One row per round: the fields of :func:`~flower_shard.ux.formatting.format_round` in columns.

    Columns that no record fills (``ppl`` without evaluation, ``sync`` for G = 1, the Flower
    columns for one torch job) are left out; a record without a value shows an empty cell.

    Parameters
    ----------
    records
        Metrics records as :class:`~flower_shard.ux.metrics.MetricsLogger` writes them.
    total_rounds
        The run's number of rounds, named in the title when given.

    Returns
    -------
    rich.table.Table
        Print it with a rich ``Console``.
    """
    from rich import box
    from rich.table import Table

    shown = [(header, cell) for header, cell, present in _COLUMNS if present(records)]
    done = f"{len(records)}/{total_rounds}" if total_rounds else str(len(records))
    table = Table(
        title=f"rounds ({done})", box=box.SIMPLE_HEAD, show_edge=False, title_justify="left"
    )
    for header, _ in shown:
        table.add_column(header, justify="right")
    for r in records:
        table.add_row(*(cell(r) for _, cell in shown))
    return table


class RoundDisplay:
    """Shows a run's rounds as they end: a live bar on a terminal, else one plain line each.

    Parameters
    ----------
    total_rounds
        Rounds in the run (0: unknown).
    total_steps
        Inner steps in the run, when this process runs them and calls :meth:`step`; 0 shows
        no step bar. Counting all the run's steps, not a round's, holds whatever T each round
        has (``--adaptive-t``) and wherever a resumed run starts.
    console
        Draw the live display on this console (a caller's own, or a test's). None: live on
        stdout when it is a terminal (:func:`is_interactive`), otherwise plain lines.
    """

    def __init__(self, total_rounds: int = 0, total_steps: int = 0, console: Console | None = None):
        self.total_rounds = total_rounds
        self.total_steps = total_steps
        self.records: list[dict] = []
        self.live = console is not None or is_interactive(sys.stdout)
        self.console = console
        self._progress: Progress | None = None
        self._steps = None
        self._drawn = 0.0
        if self.live:
            self._start()

    def _start(self) -> None:
        """Start the live bars (rounds, and steps when counted) on the console."""
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.console = self.console or Console()
        self._progress = Progress(
            TextColumn("{task.description:>6}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[last]}"),
            console=self.console,
            auto_refresh=False,  # no refresh thread: redrawn on each step and round
        )
        total = self.total_rounds or None
        self._rounds = self._progress.add_task("rounds", total=total, last="")
        if self.total_steps:
            self._steps = self._progress.add_task("steps", total=self.total_steps, last="")
        self._progress.start()
        # rich hides the cursor while live; a rank that torchrun stops with SIGTERM runs no
        # `finally`, and would leave the user's terminal without one.
        self.console.show_cursor(True)

    def step(self, step: int) -> None:
        """Inner step ``step`` of the run (counted from its start, as metrics' ``step``) is done."""
        if self._progress is None or self._steps is None:
            return
        self._progress.update(self._steps, completed=step)
        now = time.monotonic()
        if now - self._drawn >= STEP_REFRESH_S:
            self._drawn = now
            self._progress.refresh()

    def round(self, record: dict) -> None:
        """A round ended with these metrics (a :class:`~flower_shard.ux.metrics.MetricsLogger`
        record): the plain line, or the bar moves on and shows its loss, ppl and tokens/s."""
        self.records.append(record)
        if not self.live:
            print(format_round(record, self.total_rounds), flush=True)
            return
        if self._progress is None:  # closed
            return
        self._progress.update(self._rounds, completed=record[P.ROUND], last=round_summary(record))
        if self._steps is not None:
            self._progress.update(self._steps, completed=record[P.STEP])
        self._progress.refresh()

    def close(self) -> None:
        """Stop the live display and print the table of the rounds seen; safe to call twice."""
        progress, self._progress = self._progress, None
        if progress is None:
            return
        progress.stop()
        if self.records:
            self.console.print(format_table(self.records, self.total_rounds))
