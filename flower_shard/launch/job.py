"""The one torch job's entry on every rank: ``python -m flower_shard.launch.job OUT/config.json``.

torchrun (:mod:`flower_shard.launch.torchrun`) starts it on each of the N ranks; it runs the
runtime's one-job driver (:class:`flower_shard.runtime.trainer.JobTrainer`) with rank 0's round
log (``metrics.jsonl`` and the display), which lives up here so that the runtime imports no UI.
"""

from __future__ import annotations

import logging
import sys

from flower_shard import logs
from flower_shard.config import TrainConfig
from flower_shard.launch.guard import die_with_agent
from flower_shard.runtime.distributed import exit_now
from flower_shard.runtime.trainer import JobTrainer, RoundLog

log = logging.getLogger(__name__)


def open_metrics_log(cfg: TrainConfig, resumed: int) -> RoundLog:
    """Rank 0's round log: ``OUT/metrics.jsonl`` and the rounds' display (a resumed run first
    carries the rounds up to its checkpoint over from the run it resumes)."""
    from flower_shard.ux import metrics as M

    if resumed:
        M.keep_rounds(cfg.resume, cfg.out, resumed)
    return M.MetricsLogger(
        cfg.out,
        echo=not cfg.quiet,
        total_rounds=0 if cfg.adaptive_t else cfg.rounds,  # adaptive: rounds vary
        total_steps=cfg.total_steps,
        tensorboard=cfg.tensorboard,
    )


def main(argv: list[str] | None = None) -> int:
    die_with_agent()  # a rank whose torchrun is gone could only hang in a collective
    argv = sys.argv[1:] if argv is None else argv
    logs.setup(prefix="flower-shard")
    if len(argv) != 1:
        log.error("usage: python -m flower_shard.launch.job OUT/config.json (started by torchrun)")
        return 2
    job = JobTrainer(TrainConfig.from_json(argv[0]))
    clean = False
    try:
        job.train(open_metrics_log)
        clean = True
    finally:
        job.close(clean)
    exit_now(0)  # see exit_now: a clean rank must not abort in the interpreter's finalization


if __name__ == "__main__":
    sys.exit(main())
