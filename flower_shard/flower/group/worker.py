"""The Flower group's driver: what every rank of the group does with each command.

A thin driver of the group runtime (:class:`~flower_shard.runtime.group_trainer.GroupTrainer`):
it builds the runtime for the run a message describes (one Flower group: a
:meth:`~flower_shard.runtime.placement.Placement.one_group` world, the group's data part, and,
for the collective transport, an outer sync without a fixed process group), then turns each
train / evaluate / get-weights command into calls on it. The weights' wire formats and the
group's own checkpoints of a Flower run live in :mod:`~flower_shard.flower.group.exchange` and
:mod:`~flower_shard.flower.group.resume`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path

import numpy as np
import torch.distributed as dist

from flower_shard import protocol as P
from flower_shard import runfiles as F
from flower_shard.config import TrainConfig
from flower_shard.config.federation import FederationConfig, train_config_from_message
from flower_shard.dataplane.client import DataPlaneError
from flower_shard.flower.group import exchange
from flower_shard.flower.group.abandon import Abandonment
from flower_shard.flower.group.faults import inject_death, inject_metric_fault, upload_hook
from flower_shard.flower.group.overlap import OverlappedRounds
from flower_shard.flower.group.resume import GroupCheckpoints, resume_round, run_key
from flower_shard.flower.group.streaming import StreamExchange
from flower_shard.preflight import check, prepare_for
from flower_shard.runtime.catch_up import catch_up, parse_joiners
from flower_shard.runtime.commit import sync_or_rollback
from flower_shard.runtime.cross_group import CrossGroup, Membership
from flower_shard.runtime.data_part import DataPart
from flower_shard.runtime.distributed import init_distributed
from flower_shard.runtime.group_trainer import GroupTrainer, StepStats
from flower_shard.runtime.outer_sync import build_outer_sync
from flower_shard.runtime.placement import Placement

IDLE_TIMEOUT = timedelta(days=7)  # ranks wait for the next command as long as the group lives


def membership(config: dict) -> Membership:
    """The round's cross-group membership, as the server chose it (a dead group is left out)."""
    return Membership(
        prefix=str(config[P.COLLECTIVE_PREFIX]),
        rank=int(config.get(P.SYNC_RANK, config[P.GROUP_INDEX])),
        size=int(config.get(P.SYNC_SIZE, config[P.NUM_GROUPS])),
    )


@dataclass
class GroupRun:
    """What the group holds for one run; a new run (or a restarted server) replaces it whole."""

    key: dict
    """The run's identity (:func:`~flower_shard.flower.group.resume.run_key`)."""
    trainer: GroupTrainer
    cross: CrossGroup | None = None
    """Collective transport: this rank's process group across the groups."""
    exchange: exchange.FlowerExchange | None = None
    """Flower transport: the reply's weights (and compression's state)."""
    stream: StreamExchange | None = None
    """Streaming transport: this rank's link to the aggregators (its view, its encoder)."""
    overlap: OverlappedRounds | None = None
    """Streaming transport with outer-overlap: the update in flight or pending."""
    holds_global: bool = True
    """Collective transport: the group's model is the last round's global model (False for a
    runtime rebuilt mid-run without that round's checkpoint, until it catches up)."""


class GroupWorker:
    """Every rank of the group: the runtime of the current run, driven command by command.

    On failure: an exception inside a command propagates (the ranks are out of step; the
    service ends the job and the node restarts it), except a failed cross-group sync, which
    the group rolls back as a whole (:func:`~flower_shard.runtime.commit.sync_or_rollback`) and
    answers with an error while it lives on with its own weights.
    """

    def __init__(
        self,
        work_dir: Path,
        data: str | None,
        device: str,
        dump_dir: str | None,
        fault_file: str | None = None,
        root_certificates: str | None = None,
    ):
        self.work_dir, self.data, self.device_pref = work_dir, data, device
        self.dump_dir, self.fault_file = dump_dir, fault_file
        self.root_certificates = root_certificates
        """The CA that signed the streaming aggregators' certificate (the node's own)."""
        self.device = init_distributed(device)
        self.rank = dist.get_rank()
        self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.abandonment = Abandonment()
        self.command: int | None = None
        """The number of the command being run (rank 0 numbers them)."""
        self.checkpoints = GroupCheckpoints(work_dir / F.CHECKPOINTS_DIR, self.control)
        self.run: GroupRun | None = None

    @property
    def trainer(self) -> GroupTrainer | None:
        return self.run.trainer if self.run is not None else None

    @property
    def data_dir(self) -> Path:
        return self.work_dir / F.DATA_DIR

    def train_config(self, config: dict) -> TrainConfig:
        """The group's TrainConfig of the run ``config`` describes (with this node's K)."""
        return train_config_from_message(
            config, nproc_per_group=dist.get_world_size(), data=self.data, device=self.device_pref
        )

    # -- run set-up --------------------------------------------------------------------------

    def check(self, config: dict) -> None:
        """Rank 0, before any rank acts: validate the run and prepare its data.

        A run that is already built passed this check when it started: later rounds skip it
        (it would list and stat the whole corpus every round).
        """
        if self.run is not None and run_key(config) == self.run.key:
            return
        prepare_for(self.data_dir, check(self.train_config(config)))
        self.checkpoints.check_resumable(config)

    def refusal(self, config: dict) -> str | None:
        """Rank 0, before any rank acts: why this run's message cannot be served as it is (a
        compressed downlink delta from a model this group does not hold), or None."""
        if P.DOWNLINK not in config:
            return None
        same_run = self.run is not None and run_key(config) == self.run.key
        if not same_run or self.run.exchange is None:
            return (
                "downlink: a delta came for a model this group does not hold (it started or "
                "restarted since); the server sends a snapshot next round"
            )
        return self.run.exchange.refusal(config)

    def ensure_run(self, config: dict) -> None:
        """Build (or keep) the runtime for the run that ``config`` describes."""
        key = run_key(config)
        if self.run is not None and key == self.run.key:
            return
        cfg = self.train_config(config)
        place = Placement.one_group(cfg, self.device, int(config[P.GROUP_INDEX]))
        data = DataPart.load(self.data_dir, cfg, place)
        if config.get(P.TRANSPORT) == P.COLLECTIVE:
            outer = partial(build_outer_sync, cfg, replicate_pg=place.replicate_pg())
            timeout = float(config.get(P.SYNC_TIMEOUT, FederationConfig.sync_timeout))
            cross = CrossGroup(str(config[P.COLLECTIVE_ADDRESS]), self.rank, self.device, timeout)
            self.run = GroupRun(key, GroupTrainer(cfg, place, data, outer), cross=cross)
        elif config.get(P.TRANSPORT) == P.STREAMING:
            trainer = GroupTrainer(cfg, place, data)
            replicas = place.replicate_pg()
            stream = StreamExchange(cfg, trainer.model, replicas, self.root_certificates)
            overlap = OverlappedRounds(stream) if config.get(P.OUTER_OVERLAP) else None
            self.run = GroupRun(key, trainer, stream=stream, overlap=overlap)
        else:
            flower = exchange.FlowerExchange(cfg, self.rank, self.fault_file)
            self.run = GroupRun(key, GroupTrainer(cfg, place, data), exchange=flower)
        rnd, resumed = int(config[P.SERVER_ROUND]), resume_round(config)
        loaded = 0
        if self.checkpoints.due_at_start(config, cfg):
            loaded, extra = self.checkpoints.load(config, self.run.trainer)
            if self.run.exchange is not None:
                self.run.exchange.restore(extra)
        # Mid-run, only the last round's checkpoint holds the collective's global model.
        self.run.holds_global = rnd == 1 or bool(resumed) or loaded == rnd - 1

    # -- commands (run on every rank) --------------------------------------------------------

    def execute(self, command: dict, arrays: dict[str, np.ndarray]) -> tuple[dict, dict]:
        """Run one command on this rank; returns the reply's header and arrays (rank 0's)."""
        method = command[P.H_METHOD]
        self.command = command.get(P.H_COMMAND)
        if method == P.GET_WEIGHTS:
            trainer = self.trainer
            return {}, exchange.full_weights(trainer.model) if trainer is not None else {}
        config = command[P.H_CONFIG]
        self.ensure_run(config)
        if command.get(P.H_HAS_ARRAYS):
            if self.run.exchange is not None and self.rank == 0:  # a snapshot or a delta
                shapes = exchange.model_shapes(self.trainer.model)
                arrays = self.run.exchange.receive(arrays, config, shapes)
            loaded = exchange.load_weights(self.trainer.model, arrays, self.device)
            if self.run.exchange is not None:  # compression replies with the delta from these
                self.run.exchange.set_global(loaded)
            self.dump(config, "loaded")
        pulled_s = 0.0
        overlap = self.run.overlap
        if self.run.stream is not None and not (overlap and overlap.skips_pull()):
            try:
                pulled_s = self.run.stream.pull(config, self.control)
            except DataPlaneError as exc:
                return {P.H_ERROR: f"streaming: {exc}"}, {}
            self.dump(config, "loaded" if method == P.TRAIN else "evaluated")
        if method == P.EVALUATE:
            metrics = {P.EVAL_LOSS: self.trainer.evaluate()}
            if self.run.stream is not None:  # the download of this round happened here
                metrics[P.EVAL_PULL_S] = pulled_s
            return {P.H_METRICS: metrics}, {}
        return self.train(config, pulled_s)

    def train(self, config: dict, pulled_s: float = 0.0) -> tuple[dict, dict]:
        """A round: the inner steps, then the cross-group sync (collective), the weights to
        send (flower) or the pseudo-gradient to stream (streaming), then a checkpoint when
        due."""
        t = self.trainer
        start = time.perf_counter()
        rnd = int(config[P.SERVER_ROUND])
        if self.run.cross is not None and (refusal := self.join(config)):
            return {P.H_ERROR: refusal}, {}
        overlap, hook = self.run.overlap, upload_hook(self.fault_file, rnd)
        if overlap is not None:  # the last round's update goes out while this one trains
            try:
                rebased = partial(self.dump, config, "rebased")
                overlap.before_steps(config, self.control, rebased, hook)
            except DataPlaneError as exc:
                overlap.reset()
                return {P.H_ERROR: f"streaming: {exc}"}, {}
        steps = self.train_steps(config)
        metrics = step_metrics(config, steps, t)
        arrays = {}
        if self.run.cross is not None:  # collective: average with the other groups, send nothing
            failure = self.sync(config, steps, metrics)
            if failure is not None:  # the group lives on with its own weights; the server hears why
                return {P.H_ERROR: f"{P.SYNC_ABANDONED}, weights kept: {failure}"}, {}
        elif self.run.stream is not None:
            self.dump(config, "trained")
            try:
                if overlap is not None:
                    metrics |= overlap.after_steps(config, steps, self.control, hook)
                    metrics[P.OUTER_SYNC_S] += pulled_s
                else:
                    pushed_s, sent = self.run.stream.push(config, steps.tokens, self.control, hook)
                    metrics |= {P.OUTER_SYNC_S: pulled_s + pushed_s, P.OUTER_SYNC_BYTES: sent}
            except DataPlaneError as exc:
                if overlap is not None:
                    overlap.reset()
                return {P.H_ERROR: f"streaming: {exc}"}, {}
        else:
            trained = exchange.full_weights(t.model)
            if self.rank == 0:
                self.write_dump(trained, config, "trained")
            arrays = self.run.exchange.reply(trained, rnd)
        if t.cfg.checkpoint_due(rnd):
            saving = time.perf_counter()
            extra = self.run.exchange.extra() if self.run.exchange is not None else None
            self.checkpoints.save(config, t, rnd, extra)
            metrics[P.CHECKPOINT_S] = time.perf_counter() - saving
        metrics[P.GROUP_ROUND_S] = time.perf_counter() - start
        return {P.H_METRICS: inject_metric_fault(self.fault_file, rnd, metrics)}, arrays

    def train_steps(self, config: dict) -> StepStats:
        """The round's inner steps: ``round-steps`` (T), or as many as fit in ``round-seconds``."""
        n = int(config.get(P.ROUND_STEPS, config[P.LOCAL_STEPS]))
        budget = float(config.get(P.ROUND_SECONDS, 0.0))
        if budget > 0:  # time-budgeted: as many steps as fit, at most n (max-local-steps)
            progress = (int(config[P.SERVER_ROUND]) - 1, int(config[P.NUM_SERVER_ROUNDS]))
            return self.trainer.train_steps(n, seconds=budget, progress=progress)
        return self.trainer.train_steps(n)

    def join(self, config: dict) -> str | None:
        """Collective transport, before the inner steps: take part in the catch-up of the
        round's joiners (:mod:`~flower_shard.runtime.catch_up`); returns why this group cannot
        train the round (it does not hold the global model), or None."""
        joiners = parse_joiners(config.get(P.SYNC_JOINERS))
        seat = membership(config)
        if joiners:
            failure = catch_up(
                self.trainer.outer,
                self.run.cross,
                seat,
                joiners,
                vote_pg=self.control,
                abandoned=self.abandonment.checker(self.command) if self.command else None,
            )
            if seat.rank in joiners and failure is None:
                self.run.holds_global = True
                self.dump(config, "caught-up")
        if not self.run.holds_global:
            return (
                "collective: this group does not hold the global model (it restarted without "
                "its checkpoint of the last round, or its catch-up failed); the server brings "
                "it back through a catch-up from the other groups"
            )
        return None

    def sync(self, config: dict, steps: StepStats, metrics: dict) -> str | None:
        """Collective transport: the group's cross-group sync, all or nothing (weighted by the
        tokens trained); adds its metrics, or returns why it was rolled back."""
        self.dump(config, "trained")
        inject_death(self.fault_file, int(config[P.SERVER_ROUND]))
        outcome = sync_or_rollback(
            self.trainer.outer,
            self.run.cross,
            membership(config),
            vote_pg=self.control,
            weight=steps.tokens,
            abandoned=self.abandonment.checker(self.command) if self.command else None,
        )
        if not outcome.committed:
            return outcome.failure
        stats = outcome.stats
        metrics |= {P.OUTER_SYNC_S: stats.seconds, P.OUTER_SYNC_BYTES: stats.sent_bytes}
        metrics[P.INTRA_BYTES] += stats.replicate_bytes  # HSDP: the replicas' all-gather
        self.dump(config, "synced")
        return None

    # -- debugging aid -----------------------------------------------------------------------

    def dump(self, config: dict, stage: str) -> None:
        """Debug/test aid (``--dump-dir``): write the group's full weights at a stage of a round
        (every rank gathers; rank 0 writes)."""
        if self.dump_dir:
            arrays = exchange.full_weights(self.trainer.model)
            if self.rank == 0:
                self.write_dump(arrays, config, stage)

    def write_dump(self, arrays: dict[str, np.ndarray], config: dict, stage: str) -> None:
        if self.dump_dir:
            from safetensors.numpy import save_file

            name = f"g{config[P.GROUP_INDEX]}_r{config[P.SERVER_ROUND]}_{stage}.safetensors"
            save_file(arrays, str(Path(self.dump_dir, name)))


def step_metrics(config: dict, steps: StepStats, trainer: GroupTrainer) -> dict:
    """The reply's metrics of a round's inner steps (protocol metric names)."""
    return {
        P.GROUP: int(config[P.GROUP_INDEX]),
        P.STEPS: steps.steps,
        P.NUM_TOKENS: steps.tokens,
        P.TRAIN_LOSS: steps.loss,
        P.COMPUTE_S: steps.seconds,
        P.INTRA_BYTES: steps.intra_bytes,
        P.INTRA_COMM_S: steps.intra_s,
        P.STEP: trainer.state.step,
        P.LR: trainer.schedule.lr,
    }
