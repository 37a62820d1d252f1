"""A Flower group's own checkpoints: where it keeps them per run, and which one it loads.

A group checkpoints its whole state (weights, AdamW, LR schedule, data position, the collective
transport's outer state) with :class:`~flower_shard.runtime.group_checkpoint.GroupCheckpointer`
under ``WORK_DIR/checkpoints/KEY/``, KEY naming the run and the group's place in it. It loads
one when it (re)builds its runtime in the middle of a run: the run was resumed (``resume-round``)
or the group was restarted and rejoins.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch.distributed as dist

from flower_shard import protocol as P
from flower_shard.config import ConfigError, TrainConfig
from flower_shard.config import identity as I
from flower_shard.runtime import checkpoint as C
from flower_shard.runtime.group_checkpoint import REQUIRED
from flower_shard.runtime.group_trainer import GroupTrainer

log = logging.getLogger(__name__)


def run_key(config: dict) -> dict:
    """What identifies a run in a message's config: everything but the per-round keys."""
    return {k: v for k, v in config.items() if k not in P.PER_ROUND_KEYS}


def checkpoint_key(config: dict) -> str:
    """Where a group keeps its checkpoints of a run: by the run's name (the server's first
    out-dir, which a resumed run inherits) and the group's place in it. Not by all settings: a
    resumed run may change some (a new rendezvous address, a longer round timeout)."""
    key = [config.get(P.RUN_NAME, ""), config[P.GROUP_INDEX], config[P.NUM_GROUPS]]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def resume_round(config: dict) -> int:
    """The round a resumed run continues after (0: not resumed)."""
    return int(config.get(P.RESUME_ROUND, 0))


def is_collective(config: dict) -> bool:
    return config.get(P.TRANSPORT) == P.COLLECTIVE


class GroupCheckpoints:
    """The checkpoints of every run this group took part in, under ``root``.

    Which one a group loads when it builds its runtime mid-run (rank 0 chooses, all ranks load):

    - a resumed run (``resume-round`` R), flower transport: the newest good one up to R (the
      global weights come from the server; the checkpoint gives AdamW state, LR schedule and
      data position);
    - a resumed run, collective transport: exactly R's, since the weights themselves come from
      it (:meth:`check_resumable` refuses the run before any rank acts if it is missing);
    - a restarted group rejoining round r: the newest good one before r (collective: its
      weights are the global model only if that is r - 1's; else the group catches up from
      the others, :mod:`~flower_shard.runtime.catch_up`).

    On failure: a corrupt or incomplete checkpoint is refused (logged) and the previous one is
    tried; without one the group goes on from the global weights with a fresh inner optimizer.
    """

    def __init__(self, root: Path, control_pg):
        self.root, self.control = root, control_pg

    def root_of(self, config: dict) -> Path:
        return self.root / checkpoint_key(config)

    def due_at_start(self, config: dict, cfg: TrainConfig) -> bool:
        """Whether a runtime built for ``config`` loads a checkpoint of the run first."""
        return resume_round(config) > 0 or bool(
            cfg.checkpoint_every and int(config[P.SERVER_ROUND]) > 1
        )

    def resume_point(self, config: dict) -> Path | None:
        """Rank 0: the checkpoint to load (see the class), or None."""
        resume = resume_round(config)
        root = self.root_of(config)
        exact = resume and is_collective(config)  # the weights themselves come from it
        wanted = (lambda r: r == resume) if exact else (lambda r: True)
        found = C.latest_good(
            root,
            at_most=resume or int(config[P.SERVER_ROUND]) - 1,
            accept=lambda r: wanted(r) and self._ours(C.round_dir(root, r), config),
            log=log.warning,
            required=REQUIRED,
        )
        return found[1] if found else None

    @staticmethod
    def _ours(path: Path, config: dict) -> bool:
        """Whether the checkpoint at ``path`` records this run and this group (logged if not:
        a directory copied or linked from another run's or group's)."""
        try:
            I.check_identity(
                C.read_identity(path), config.get(P.RUN_NAME, ""), config[P.GROUP_INDEX], str(path)
            )
        except (ConfigError, C.CheckpointError) as exc:
            log.warning("checkpoint refused: %s", exc)
            return False
        return True

    def check_resumable(self, config: dict) -> None:
        """Rank 0: refuse a resumed collective run whose checkpoint this group lacks."""
        if resume_round(config) > 0 and is_collective(config) and self.resume_point(config) is None:
            raise ConfigError(
                f"resume: this group has no good checkpoint of round {resume_round(config)} "
                f"under {self.root_of(config)}; the collective transport needs it "
                "(the weights live in the groups): resume from an earlier run directory"
            )

    def load(self, config: dict, trainer: GroupTrainer) -> tuple[int, dict]:
        """Every rank: load what :meth:`resume_point` chose on rank 0; returns the checkpoint's
        round and ``extra`` (0 and empty without one, logged)."""
        rank = dist.get_rank()
        box = [str(self.resume_point(config) or "")] if rank == 0 else [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        if not box[0]:
            if rank == 0:
                log.warning(
                    "no checkpoint to load for round %s: continuing from the global weights "
                    "with a fresh inner optimizer",
                    config[P.SERVER_ROUND],
                )
            return 0, {}
        loaded = trainer.checkpointer.load(box[0])
        if rank == 0:
            how = "resumed" if resume_round(config) else "rejoined"
            log.info(
                "%s round %s with the state of its checkpoint of round %d (%s)",
                how,
                config[P.SERVER_ROUND],
                loaded.round,
                box[0],
            )
        return loaded.round, loaded.extra

    def save(self, config: dict, trainer: GroupTrainer, rnd: int, extra: dict | None) -> None:
        """Every rank: checkpoint the state after round ``rnd``; the folder's and the
        checkpoint's ``run.json`` say which run and group it belongs to, and its settings."""
        root = self.root_of(config)
        identity = I.make_identity(
            str(config.get(P.RUN_NAME, "")), int(config[P.GROUP_INDEX]), run_key(config)
        )
        if dist.get_rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            C.write_identity(root, identity)
        trainer.checkpointer.save(root, rnd, extra, identity)
