"""Per-round metrics: one JSON object per line in ``OUT/metrics.jsonl``, and a readable line.

Field names are :mod:`flower_shard.protocol`'s metric names, so the writers (group runtime,
Flower server) and the readers (tests, benchmarks, plots) cannot drift apart.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from flower_shard import protocol as P
from flower_shard import runfiles as F
from flower_shard.ux.progress import RoundDisplay


class MetricsLogger:
    """Appends rounds to ``directory/metrics.jsonl``, flushed each line: a crash loses nothing.

    Parameters
    ----------
    directory
        The run's output directory.
    echo
        Show the rounds (:class:`~flower_shard.ux.progress.RoundDisplay`): a live progress bar and
        a final table on a terminal, otherwise one
        :func:`~flower_shard.ux.formatting.format_round` line per round.
    total_rounds
        Rounds in the run, for the display (0: unknown).
    total_steps
        Inner steps in the run, when the caller reports each one with :meth:`step` (the
        display's step bar; 0: none).
    tensorboard
        Also write every round's numeric fields as TensorBoard scalars to
        ``directory/tensorboard`` (:data:`F.TENSORBOARD_DIR`): tag = the field's name, step = the
        round (the one axis that the group runtime and the Flower server share; the global
        step is the ``step`` scalar). Needs the ``tensorboard`` package (ConfigError if not).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        echo: bool = True,
        total_rounds: int = 0,
        *,
        total_steps: int = 0,
        tensorboard: bool = False,
    ):
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory, F.METRICS_FILE)
        self.echo = echo
        self.total_rounds = total_rounds
        self.tensorboard = tensorboard_writer(directory) if tensorboard else None
        self._fh = open(self.path, "a")
        # Last: a live display that started must be stopped (close), so nothing may fail after.
        self.display = RoundDisplay(total_rounds, total_steps) if echo else None

    def log(self, record: dict) -> None:
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        if self.tensorboard is not None:
            add_scalars(self.tensorboard, record)
        if self.display is not None:
            self.display.round(record)

    def step(self, step: int) -> None:
        """Inner step ``step`` of the run is done (moves the display's step bar)."""
        if self.display is not None:
            self.display.step(step)

    def close(self) -> None:
        """Stop the display (printing its table on a terminal) and close the files."""
        try:
            if self.display is not None:
                self.display.close()
        finally:
            self._fh.close()
            if self.tensorboard is not None:
                self.tensorboard.close()


def tensorboard_writer(directory: str | os.PathLike):
    """A ``torch.utils.tensorboard.SummaryWriter`` on ``directory/tensorboard``.

    Raises
    ------
    ConfigError
        The ``tensorboard`` package is missing (``torch.utils.tensorboard`` needs it).
    """
    from flower_shard.config import ConfigError
    from flower_shard.preflight import require_tensorboard

    require_tensorboard()
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # present but unusable (torch checks its version)
        raise ConfigError(f"--tensorboard: torch.utils.tensorboard cannot start: {exc}") from None
    return SummaryWriter(log_dir=str(Path(directory, F.TENSORBOARD_DIR)))


def add_scalars(writer, record: dict) -> None:
    """Every numeric field of a round's record as a scalar: tag = its name, step = the round.

    Lists, strings, booleans and None (a non-finite value as the server writes it) are not
    scalars and are left out, as is ``round`` itself (it is the step).
    """
    rnd = record[P.ROUND]
    for key, value in record.items():
        if key != P.ROUND and isinstance(value, (int, float)) and not isinstance(value, bool):
            writer.add_scalar(key, value, rnd)
    writer.flush()  # SummaryWriter flushes every 2 min by default: show each round at once


def read_metrics(directory: str | os.PathLike) -> list[dict]:
    path = Path(directory, F.METRICS_FILE)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def keep_rounds(source: str | os.PathLike, target: str | os.PathLike, through: int) -> None:
    """A resumed run's log: the records of rounds <= ``through`` from ``source``'s metrics.

    Written to ``target``'s metrics file (a temporary file, then renamed), which the resumed
    run then appends to; rounds after the checkpoint are dropped since they will run again.
    """
    src = Path(source, F.METRICS_FILE)
    records = read_metrics(source) if src.exists() else []
    kept = [json.dumps(r) + "\n" for r in records if r.get(P.ROUND, 0) <= through]
    Path(target).mkdir(parents=True, exist_ok=True)
    tmp = Path(target, F.METRICS_FILE + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(Path(target, F.METRICS_FILE))
