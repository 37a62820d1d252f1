"""The one-job driver: all G groups in one torch job, ``train`` -> ``train_round`` -> steps.

Started on every rank by :mod:`flower_shard.launch.job` (``python -m flower_shard.launch.job
OUT/config.json`` under torchrun); the launcher has validated the configuration and prepared
the corpus in ``OUT/data`` before any rank starts.

A round is T inner steps of FSDP2/HSDP inside each group, then the outer sync over the
``group`` mesh dimension (skipped for G = 1, which is the plain FSDP/HSDP baseline), then, every
E rounds, held-out perplexity of the synchronised model. At the end, rank 0 writes the final
global model to ``OUT/final_model.safetensors`` (``flower-shard export`` turns it into a
``transformers`` directory). The Flower transports drive the same runtime from
:mod:`flower_shard.flower.group.worker` instead.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from flower_shard import protocol as P
from flower_shard import runfiles
from flower_shard.config import TrainConfig
from flower_shard.planning.adaptive import AdaptiveT
from flower_shard.runtime.data_part import DataPart
from flower_shard.runtime.distributed import init_distributed
from flower_shard.runtime.evaluation import perplexity
from flower_shard.runtime.group_checkpoint import checkpoint_root
from flower_shard.runtime.group_trainer import GroupTrainer, StepStats
from flower_shard.runtime.outer_sync import SyncStats, build_outer_sync
from flower_shard.runtime.placement import Placement
from flower_shard.runtime.streaming_sync import StreamingSync
from flower_shard.runtime.weights import full_state, write_safetensors

log = logging.getLogger(__name__)


class RoundLog(Protocol):
    """Where rank 0 reports the run: each inner step, and each round's record."""

    def step(self, step: int) -> None: ...

    def log(self, record: dict) -> None: ...

    def close(self) -> None: ...


def build_job_trainer(cfg: TrainConfig, data_dir: str | Path | None = None) -> GroupTrainer:
    """Every rank of the job: the group runtime of this rank, with the outer sync over the
    mesh's ``group`` dimension (none for G = 1). ``data_dir``: default ``OUT/data``."""
    device = init_distributed(cfg.device)
    place = Placement.whole_run(cfg, device)
    data = DataPart.load(Path(data_dir or Path(cfg.out, runfiles.DATA_DIR)), cfg, place)
    outer = None
    if cfg.groups > 1:
        outer = partial(
            build_outer_sync, cfg, group_pg=place.outer_pg(), replicate_pg=place.replicate_pg()
        )
    return GroupTrainer(cfg, place, data, outer)


class JobTrainer:
    """Drives one torch job holding all G groups through the run.

    On failure: any exception on one rank aborts that rank; torchrun then stops the whole
    world (the run is one torch job; loose coupling across failures is the Flower transports'
    job). ``--resume`` restarts from the newest round that every group checkpointed.
    """

    def __init__(self, cfg: TrainConfig, data_dir: str | Path | None = None):
        self.cfg = cfg
        self.trainer = build_job_trainer(cfg, data_dir)
        self.streaming = None
        if self.trainer.outer is not None and (cfg.outer_fragments > 1 or cfg.outer_overlap):
            self.streaming = StreamingSync(
                self.trainer.outer,
                self.trainer.model,
                cfg.outer_fragments,
                cfg.outer_overlap,
                cfg.outer_pace,
            )
        self.adaptive = None
        if cfg.adaptive_t and self.trainer.outer is not None:
            self.adaptive = AdaptiveT(cfg.exchange_share, cfg.min_local_steps, cfg.max_local_steps)

    def train(self, open_log=None) -> None:
        """The run, to the end; ``open_log(cfg, resumed_round)`` makes rank 0's
        :class:`RoundLog` (0: a fresh run)."""
        cfg, t = self.cfg, self.trainer
        resumed = t.checkpointer.resume_world(cfg.resume) if cfg.resume else 0
        rounds_log = None
        if t.place.rank == 0:
            if not cfg.quiet:
                log.info(
                    "%s, G=%d K=%d T=%d outer=%s model=%s on %s",
                    t.place.topology.describe(),
                    cfg.groups,
                    t.place.group_size,
                    cfg.local_steps,
                    cfg.outer,
                    cfg.model,
                    t.device.type,
                )
            rounds_log = open_log(cfg, resumed) if open_log is not None else None
            t.on_step = rounds_log.step if rounds_log is not None else None
        try:
            # The budget is in inner steps: with a fixed T that is exactly cfg.rounds rounds;
            # with --adaptive-t the number of rounds follows from the T chosen each round.
            while t.state.step < cfg.total_steps:
                record = self.train_round(min(t.state.local_steps, cfg.total_steps - t.state.step))
                self.end_round(record, last=t.state.step >= cfg.total_steps)
                if rounds_log is not None:
                    rounds_log.log(record)
            self.save_final_model(Path(cfg.out, runfiles.FINAL_MODEL))
        finally:  # a live display left running would leave the terminal mid-redraw
            t.on_step = None
            if self.streaming is not None:
                self.streaming.close()
            if rounds_log is not None:
                rounds_log.close()

    def train_round(self, n: int | None = None) -> dict:
        """``n`` (default T) inner steps, then the outer sync; returns the round's record.

        Fragmented or overlapped (:class:`~flower_shard.runtime.streaming_sync.StreamingSync`):
        the fragments sync between the steps; the round drains the syncs in flight when a
        checkpoint or the run's end follows it.
        """
        t = self.trainer
        n = self.cfg.local_steps if n is None else n
        start = time.perf_counter()
        if self.streaming is None:
            steps = t.train_steps(n)
            stats = t.outer.sync() if t.outer is not None else None
        else:
            steps = t.train_steps(n, between=partial(self.streaming.after_step, steps=n))
            stats = self.streaming.end_round()
            last = t.state.step >= self.cfg.total_steps
            if last or self.cfg.checkpoint_due(t.state.round + 1):
                drained = self.streaming.drain()
                stats.seconds += drained.seconds
                stats.payload_bytes += drained.payload_bytes
                stats.sent_bytes += drained.sent_bytes
        round_s = time.perf_counter() - start
        t.state.round += 1
        return self.round_record(n, steps, stats, round_s)

    def end_round(self, record: dict, last: bool) -> None:
        """After a round: choose the next T, evaluate and checkpoint when due."""
        cfg, t = self.cfg, self.trainer
        self.adapt_local_steps(record)
        if cfg.eval_every and (t.state.round % cfg.eval_every == 0 or last):
            eval_loss = t.evaluate()
            record[P.EVAL_LOSS] = eval_loss
            record[P.EVAL_PPL] = perplexity(eval_loss)
        if cfg.checkpoint_due(t.state.round) or (last and cfg.checkpoint_every):
            t.checkpointer.save(checkpoint_root(cfg.out, t.place.group), t.state.round)

    def round_record(
        self, n: int, steps: StepStats, stats: SyncStats | None, round_s: float
    ) -> dict:
        """The round's line of ``metrics.jsonl`` (protocol metric names)."""
        t = self.trainer
        sent = stats.sent_bytes if stats else 0
        # HSDP's striped exchange ends with an all-gather among a group's replicas: intra-group.
        intra_bytes = steps.intra_bytes + (stats.replicate_bytes if stats else 0)
        return {
            P.ROUND: t.state.round,
            P.STEP: t.state.step,
            P.TOKENS: t.state.tokens,
            P.TOKENS_PER_S: steps.tokens / round_s,
            P.TRAIN_LOSS: steps.loss,
            P.LR: t.schedule.lr,
            P.ROUND_S: round_s,
            P.COMPUTE_S: steps.seconds,
            P.OUTER_SYNC_S: stats.seconds if stats else 0.0,
            P.OUTER_SYNC_BYTES: sent,
            P.OUTER_SYNC_PAYLOAD_BYTES: stats.payload_bytes if stats else 0,
            P.INTRA_BYTES: intra_bytes,
            P.INTRA_COMM_S: steps.intra_s,
            P.INTRA_COMM: steps.intra,
            P.INTER_BYTE_SHARE: sent / (sent + intra_bytes) if sent + intra_bytes else 0.0,
            P.ROUND_LOCAL_STEPS: n,
        }

    def adapt_local_steps(self, record: dict) -> None:
        """--adaptive-t: set the next round's T from this round's timings (rank 0 decides with
        :class:`~flower_shard.planning.adaptive.AdaptiveT` and broadcasts: every rank must
        agree)."""
        if self.adaptive is None:
            return
        n = record[P.ROUND_LOCAL_STEPS]
        t = self.adaptive.next(n, record[P.COMPUTE_S] / n, record[P.OUTER_SYNC_S])
        box = torch.tensor([t], dtype=torch.int64, device=self.trainer.device)
        dist.broadcast(box, src=0)
        self.trainer.state.local_steps = int(box.item())

    def save_final_model(self, path: str | Path) -> None:
        """Every rank: gather the full model; global rank 0 writes it to ``path`` (safetensors).

        After the last outer sync every group holds the global model, so group 0's copy is it.
        The gather is a collective inside each group: every rank must call this.
        """
        state = full_state(self.trainer.model)
        if self.trainer.place.rank == 0:
            write_safetensors(state, path)
        dist.barrier()

    def close(self, clean: bool = False) -> None:
        self.trainer.close(clean)
