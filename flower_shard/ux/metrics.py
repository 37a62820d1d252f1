"""Per-round metrics: one JSON object per line in ``OUT/metrics.jsonl``, and a readable line.

Field names are shared constants, so the writers (group runtime, Flower server) and the readers
(tests, benchmarks, plots) cannot drift apart.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

METRICS_FILE = "metrics.jsonl"

ROUND = "round"
STEP = "step"
TOKENS = "tokens"
TOKENS_PER_S = "tokens_per_s"
TRAIN_LOSS = "train_loss"
EVAL_PPL = "eval_ppl"
EVAL_LOSS = "eval_loss"
LR = "lr"
ROUND_S = "round_s"
COMPUTE_S = "compute_s"  # the inner steps' wall clock, their intra-group collectives included
OUTER_SYNC_S = "outer_sync_s"
OUTER_SYNC_BYTES = "outer_sync_bytes"
OUTER_SYNC_PAYLOAD_BYTES = "outer_sync_payload_bytes"
INTRA_BYTES = "intra_bytes_per_rank"  # per round: what FSDP/HSDP's collectives sent (intra_comm)
INTRA_COMM_S = "intra_comm_s"  # per round: time in them (CPU: blocked, a part of compute_s)
INTRA_COMM = "intra_comm"  # per round: {allgather, reduce_scatter, replicate_allreduce}: calls, ...
INTER_BYTE_SHARE = "inter_byte_share"  # outer sync bytes / all bytes a rank sends
LOCAL_STEPS = "local_steps"  # T of this round (varies with --adaptive-t)

REQUIRED_FIELDS = (
    ROUND,
    STEP,
    TOKENS,
    TOKENS_PER_S,
    TRAIN_LOSS,
    LR,
    OUTER_SYNC_S,
    OUTER_SYNC_BYTES,
)


class MetricsLogger:
    """Appends rounds to ``directory/metrics.jsonl``, flushed each line: a crash loses nothing.

    Parameters
    ----------
    directory
        The run's output directory.
    echo
        Show the rounds (:class:`~flower_shard.ux.progress.RoundDisplay`): a live progress bar and
        a final table on a terminal, otherwise one :func:`format_round` line per round.
    total_rounds
        Rounds in the run, for the display (0: unknown).
    total_steps
        Inner steps in the run, when the caller reports each one with :meth:`step` (the
        display's step bar; 0: none).
    tensorboard
        Also write every round's numeric fields as TensorBoard scalars to
        ``directory/tensorboard`` (:data:`TENSORBOARD_DIR`): tag = the field's name, step = the
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
        from flower_shard.ux.progress import RoundDisplay  # progress imports this module

        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory, METRICS_FILE)
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


TENSORBOARD_DIR = "tensorboard"


def tensorboard_writer(directory: str | os.PathLike):
    """A ``torch.utils.tensorboard.SummaryWriter`` on ``directory/tensorboard``.

    Raises
    ------
    ConfigError
        The ``tensorboard`` package is missing (``torch.utils.tensorboard`` needs it).
    """
    from flower_shard.config.train import ConfigError, require_tensorboard

    require_tensorboard()
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # present but unusable (torch checks its version)
        raise ConfigError(f"--tensorboard: torch.utils.tensorboard cannot start: {exc}") from None
    return SummaryWriter(log_dir=str(Path(directory, TENSORBOARD_DIR)))


def add_scalars(writer, record: dict) -> None:
    """Every numeric field of a round's record as a scalar: tag = its name, step = the round.

    Lists, strings, booleans and None (a non-finite value as the server writes it) are not
    scalars and are left out, as is ``round`` itself (it is the step).
    """
    rnd = record[ROUND]
    for key, value in record.items():
        if key != ROUND and isinstance(value, (int, float)) and not isinstance(value, bool):
            writer.add_scalar(key, value, rnd)
    writer.flush()  # SummaryWriter flushes every 2 min by default: show each round at once


def format_round(r: dict, total_rounds: int = 0) -> str:
    """One readable line: ``round 3/5 | step 12 | loss 4.123 | ppl 61.7 | 1,530 tok/s | ...``"""
    of = f"/{total_rounds}" if total_rounds else ""
    parts = [f"round {r[ROUND]}{of}", f"step {r[STEP]}", f"loss {_num(r.get(TRAIN_LOSS), 4)}"]
    if r.get(EVAL_PPL) is not None:
        parts.append(f"ppl {r[EVAL_PPL]:.2f}")
    parts += [f"{r[TOKENS_PER_S]:,.0f} tok/s", f"lr {r[LR]:.2e}"]
    if "exchange_bytes" in r:  # a Flower round
        parts.append(f"exchanged {_human_bytes(r['exchange_bytes'])}")
        parts.append(f"groups {r['groups_ok']} ok/{r['groups_rejected']} rejected")
    if r.get(OUTER_SYNC_BYTES):
        parts.append(f"sync {1e3 * r[OUTER_SYNC_S]:.0f} ms {_human_bytes(r[OUTER_SYNC_BYTES])}")
    if ROUND_S in r:
        parts.append(f"round {r[ROUND_S]:.1f} s")
    return " | ".join(parts)


def _num(x, digits: int) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def read_metrics(directory: str | os.PathLike) -> list[dict]:
    path = Path(directory, METRICS_FILE)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def keep_rounds(source: str | os.PathLike, target: str | os.PathLike, through: int) -> None:
    """A resumed run's log: the records of rounds <= ``through`` from ``source``'s metrics.

    Written to ``target``'s metrics file (a temporary file, then renamed), which the resumed
    run then appends to; rounds after the checkpoint are dropped since they will run again.
    """
    src = Path(source, METRICS_FILE)
    records = read_metrics(source) if src.exists() else []
    kept = [json.dumps(r) + "\n" for r in records if r.get(ROUND, 0) <= through]
    Path(target).mkdir(parents=True, exist_ok=True)
    tmp = Path(target, METRICS_FILE + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(Path(target, METRICS_FILE))


def perplexity(mean_loss: float) -> float:
    return math.exp(min(mean_loss, 700.0))


def _human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
