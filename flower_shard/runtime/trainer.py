"""The group runtime: what every rank runs, ``train`` -> ``train_round`` -> ``train_step``.

Started by torchrun (``python -m flower_shard.runtime.trainer OUT/config.json``); the launcher has
validated the configuration and prepared the corpus in ``OUT/data`` before any rank starts.

A round is T inner steps of FSDP2/HSDP inside each group, then the outer sync over the
``group`` mesh dimension (skipped for G = 1, which is the plain FSDP/HSDP baseline), then, every
E rounds, held-out perplexity of the synchronised model. At the end, rank 0 writes the final
global model to ``OUT/final_model.safetensors`` (``flower-shard export`` turns it into a
``transformers`` directory).
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from flower_shard import protocol as P
from flower_shard import runfiles
from flower_shard.config import ConfigError, TrainConfig
from flower_shard.data.batches import eval_shard, rank_batches
from flower_shard.data.corpus import CorpusInfo
from flower_shard.planning.adaptive import AdaptiveT
from flower_shard.runtime import checkpoint as C
from flower_shard.runtime import intra_comm
from flower_shard.runtime.distributed import init_distributed, shutdown
from flower_shard.runtime.evaluation import lm_loss, loss_sums, perplexity
from flower_shard.runtime.models import build_model, is_meta, materialize
from flower_shard.runtime.outer_sync import OuterSync
from flower_shard.runtime.parallelize import parallelize
from flower_shard.runtime.schedule import warmup_cosine
from flower_shard.runtime.topology import Topology
from flower_shard.ux import metrics as M


class GroupTrainer:
    """One rank of an FL+FSDP / FL+HSDP run: its model shards, inner optimizer, data and outer sync.

    Each rank builds the same seeded model, shards it over its group's sub-mesh (so every group
    starts from identical weights), and trains on its own disjoint part of the corpus. The
    inner optimizer is AdamW with warm-up + cosine; its state never leaves the rank. Every T
    steps :class:`~flower_shard.runtime.outer_sync.OuterSync` averages the groups.

    On failure: any exception on one rank aborts that rank; torchrun then stops the whole
    world (the run is one torch job; loose coupling across failures is the Flower transport's job).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        data_dir: str | Path | None = None,
        *,
        group_index: int | None = None,
        num_groups: int | None = None,
    ):
        """Build this rank's part of the run.

        By default the torch world holds all G groups (the ``collective`` layout inside one
        job). With ``group_index`` / ``num_groups`` the world is ONE group of a federation (a
        Flower client): the mesh has G = 1 and the data part is that group's.
        """
        self.cfg = cfg
        self.device = init_distributed(cfg.device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if group_index is None:
            if self.world != cfg.world_size:
                raise ConfigError(
                    f"torchrun started {self.world} ranks but the configuration needs N = G x K "
                    f"= {cfg.world_size}; launch with --nproc-per-node / --nnodes matching it"
                )
            self.topology = Topology(self.world, cfg.groups, cfg.sharding, cfg.replicate)
            self.group, num_groups = self.topology.group_of(self.rank), cfg.groups
        else:
            self.topology = Topology(self.world, 1, cfg.sharding, cfg.replicate)
            self.group = group_index
        self.mesh = self.topology.build_mesh(self.device.type)

        data_dir = Path(data_dir or Path(cfg.out, runfiles.DATA_DIR))
        self.corpus = CorpusInfo.load(data_dir)
        self.batches = rank_batches(
            data_dir,
            cfg.seq_len,
            cfg.batch_size,
            num_groups,
            self.topology.group_size,
            self.group,
            self.topology.rank_in_group(self.rank),
            cfg.seed,
            how=cfg.partition,
            label=cfg.partition_label,
            alpha=cfg.dirichlet_alpha,
        )
        self.eval_blocks = eval_shard(
            data_dir, cfg.seq_len, cfg.eval_sequences, self.rank, self.world
        )
        self.eval_total = dist_sum(len(self.eval_blocks), self.device)

        self.model = build_model(cfg.model, self.corpus.vocab_size, cfg.seed, cfg.seq_len)
        parallelize(self.model, self.topology.sharding_mesh(self.mesh), bf16=cfg.bf16)
        # The intra-group tier's bytes and time, counted on FSDP's own collectives.
        self.intra = intra_comm.install(self.model, cfg.replicate, self.device)
        if is_meta(self.model):
            materialize(self.model, self.device, cfg.seed)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.lr,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=cfg.weight_decay,
        )
        warmup = int(cfg.warmup_frac * cfg.total_steps)
        self.lr_position: float | None = None
        """Time-budgeted rounds: where the run is in the LR schedule, in steps of the nominal
        ``total_steps`` (set from the clock); None: the optimizer step is the position."""
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: warmup_cosine(
                step if self.lr_position is None else int(self.lr_position),
                cfg.total_steps,
                warmup,
                cfg.min_lr_ratio,
            ),
        )
        self.outer = None
        if cfg.groups > 1 and group_index is None:
            self.outer = OuterSync(
                self.model,
                self.optimizer,
                self.mesh.get_group("group"),
                kind=cfg.outer,
                lr=cfg.outer_lr,
                momentum=cfg.outer_momentum,
                sync_optimizer_state=cfg.sync_optimizer_state,
                compression=cfg.compression,
                chunk=cfg.compression_chunk,
                error_feedback=cfg.error_feedback,
                replicate_pg=self.topology.replicate_group(self.mesh),
            )
        self.step = 0
        self.round = 0
        self.local_steps = cfg.local_steps
        """T of the next round (changes only with --adaptive-t)."""
        self.adaptive = None
        if cfg.adaptive_t and self.outer is not None:
            self.adaptive = AdaptiveT(cfg.exchange_share, cfg.min_local_steps, cfg.max_local_steps)
        self.loaded_extra: dict = {}
        """State that group rank 0 alone saved in the last loaded checkpoint (``extra``)."""
        self.tokens = 0
        self._group_pg = None
        self.on_step = None
        """Called with the step after each inner step (rank 0 of ``flower-shard train``: the
        progress bar)."""

    # -- the loop ----------------------------------------------------------------------------

    def train(self) -> None:
        cfg = self.cfg
        if cfg.resume:
            self.resume(cfg.resume)
        logger = None
        if self.rank == 0:
            if not cfg.quiet:
                print(
                    f"flower-shard: {self.topology.describe()}, G={cfg.groups} "
                    f"K={self.topology.group_size} T={cfg.local_steps} outer={cfg.outer} "
                    f"model={cfg.model} on {self.device.type}",
                    flush=True,
                )
            logger = M.MetricsLogger(
                cfg.out,
                echo=not cfg.quiet,
                total_rounds=0 if cfg.adaptive_t else cfg.rounds,  # adaptive: rounds vary
                total_steps=cfg.total_steps,
                tensorboard=cfg.tensorboard,
            )
            self.on_step = logger.step
        try:
            # The budget is in inner steps: with a fixed T that is exactly cfg.rounds rounds;
            # with --adaptive-t the number of rounds follows from the T chosen each round.
            while self.step < cfg.total_steps:
                record = self.train_round(min(self.local_steps, cfg.total_steps - self.step))
                last = self.step >= cfg.total_steps
                self.adapt_local_steps(record)
                if cfg.eval_every and (self.round % cfg.eval_every == 0 or last):
                    eval_loss = self.evaluate()
                    record[P.EVAL_LOSS] = eval_loss
                    record[P.EVAL_PPL] = perplexity(eval_loss)
                if cfg.checkpoint_due(self.round) or (last and cfg.checkpoint_every):
                    self.save_checkpoint(self.checkpoint_root(cfg.out), self.round, self.outer)
                if logger:
                    logger.log(record)
            self.save_final_model(Path(cfg.out, runfiles.FINAL_MODEL))
        finally:  # a live display left running would leave the terminal mid-redraw
            self.on_step = None
            if logger:
                logger.close()

    def save_final_model(self, path: str | Path) -> None:
        """Every rank: gather the full model; global rank 0 writes it to ``path`` (safetensors).

        After the last outer sync every group holds the global model, so group 0's copy is it.
        The gather is a collective inside each group: every rank must call this.
        """
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.rank == 0:
            tensors, storages = {}, set()
            for name, tensor in state.items():
                tensor = tensor.contiguous()
                # Tied weights (GPT-2's embedding and LM head) share storage, which safetensors
                # refuses: write a copy; loading ties them again.
                if tensor.untyped_storage().data_ptr() in storages:
                    tensor = tensor.clone()
                storages.add(tensor.untyped_storage().data_ptr())
                tensors[name] = tensor
            path = Path(path)
            tmp = path.with_name(f".{path.name}.tmp")
            save_file(tensors, str(tmp), metadata={"format": "pt"})
            os.replace(tmp, path)  # never a half-written final model under the real name
        dist.barrier()

    def train_round(self, n: int | None = None) -> dict:
        """``n`` (default T) inner steps, then the outer sync; returns the round's metrics."""
        n = self.cfg.local_steps if n is None else n
        start = time.perf_counter()
        steps = self.train_steps(n)
        stats = self.outer.sync() if self.outer else None
        round_s = time.perf_counter() - start
        self.round += 1
        # HSDP's striped exchange ends with an all-gather among a group's replicas: intra-group.
        intra_bytes = steps["intra_bytes"] + (stats.replicate_bytes if stats else 0)
        return {
            P.ROUND: self.round,
            P.STEP: self.step,
            P.TOKENS: self.tokens,
            P.TOKENS_PER_S: steps["tokens"] / round_s,
            P.TRAIN_LOSS: steps["loss"],
            P.LR: self.scheduler.get_last_lr()[0],
            P.ROUND_S: round_s,
            P.COMPUTE_S: steps["seconds"],
            P.OUTER_SYNC_S: stats.seconds if stats else 0.0,
            P.OUTER_SYNC_BYTES: stats.sent_bytes if stats else 0,
            P.OUTER_SYNC_PAYLOAD_BYTES: stats.payload_bytes if stats else 0,
            P.INTRA_BYTES: intra_bytes,
            P.INTRA_COMM_S: steps["intra_s"],
            P.INTRA_COMM: steps["intra"],
            P.INTER_BYTE_SHARE: _share(stats.sent_bytes if stats else 0, intra_bytes),
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
        box = torch.tensor([t], dtype=torch.int64, device=self.device)
        dist.broadcast(box, src=0)
        self.local_steps = int(box.item())

    def train_steps(
        self, n: int, seconds: float | None = None, progress: tuple[int, int] | None = None
    ) -> dict:
        """``n`` inner steps on every rank of this world; returns loss, steps, tokens, seconds.

        Time-budgeted (``seconds``): steps until ``seconds`` have passed, at least one and at
        most ``n``. Rank 0's clock decides, broadcast after each step, so every rank of the
        group stops after the same step (FSDP needs every rank in every collective).
        ``progress`` = (rounds done, rounds in the run): the LR schedule then follows the
        run's time, ``(done + elapsed / seconds) / rounds`` of the way through, so a fast and
        a slow group decay alike instead of by their own step counts.
        """
        cfg = self.cfg
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=self.device)
        clock = torch.zeros(1, dtype=torch.float64, device=self.device)
        done = 0
        self.intra.take()  # what evaluation or loading gathered is not this round's steps
        while done < n:
            if seconds is not None and progress is not None:
                # The position at this step's start sets the LR of the next step (one step of
                # lag), the same on every rank since the clock is rank 0's.
                rounds_done, rounds = progress
                fraction = min(1.0, (rounds_done + clock.item() / seconds) / rounds)
                self.lr_position = fraction * cfg.total_steps
            inputs, targets = next(self.batches)
            loss_sum += self.train_step(inputs.to(self.device), targets.to(self.device))
            done += 1
            if self.on_step is not None:
                self.on_step(self.step)
            if seconds is not None:
                clock.fill_(_elapsed(start, self.device))
                dist.broadcast(clock, src=0)
                if clock.item() >= seconds:
                    break
        elapsed = _elapsed(start, self.device)
        tokens = done * cfg.batch_size * cfg.seq_len * self.world
        self.tokens += tokens
        loss = dist_sum(loss_sum, self.device) / (done * self.world)
        intra = self.intra.take()
        return {
            "loss": loss,
            "steps": done,
            "tokens": tokens,
            "seconds": elapsed,
            "intra": intra,
            "intra_bytes": sum(k["bytes"] for k in intra.values()),
            "intra_s": sum(k["seconds"] for k in intra.values()),
        }

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One inner AdamW step on this rank's batch; returns the (detached) loss."""
        self.model.train()
        loss = lm_loss(self.model, inputs, targets)
        loss.backward()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss.detach()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean held-out loss over the fixed evaluation set, over all ranks.

        Every rank of a group must run the same number of forwards (FSDP gathers inside them),
        so ranks with fewer sequences pad with zero-weighted rows.
        """
        per_rank = math.ceil(self.eval_total / self.world)
        forwards = math.ceil(per_rank / self.cfg.batch_size)
        total = loss_sums(
            self.model, self.eval_blocks, self.cfg.batch_size, self.device, forwards=forwards
        )
        dist.all_reduce(total)
        return (total[0] / total[1]).item()

    # -- checkpoints ---------------------------------------------------------------------------

    def checkpoint_root(self, run_dir: str | Path) -> Path:
        """Where this group's checkpoints of the run in ``run_dir`` live."""
        return Path(run_dir, runfiles.CHECKPOINTS_DIR, runfiles.group_checkpoints(self.group))

    def resume(self, run_dir: str | Path) -> int:
        """Load the newest round that every group has a good checkpoint of; return that round.

        A refused checkpoint (corrupt, truncated, incomplete) is logged and the previous one is
        used. Rank 0 also carries the metrics of the rounds up to it over into this run's log.
        """
        root = self.checkpoint_root(run_dir)
        good: list[int] = []
        if dist.get_rank(self.group_pg) == 0:  # the group's head verifies, the others wait
            good = list(
                C.good_rounds(root, log=lambda m: print(f"flower-shard: {m}", file=sys.stderr))
            )
        every: list = [None] * self.world
        dist.all_gather_object(every, good)
        k = self.topology.group_size
        common = set.intersection(*(set(every[g * k]) for g in range(self.world // k)))
        if not common:
            raise C.CheckpointError(
                f"--resume {run_dir}: no round has a good checkpoint in every group; "
                "start the run afresh"
            )
        rnd = max(common)
        self.load_checkpoint(C.round_dir(root, rnd), self.outer)
        if self.rank == 0:
            M.keep_rounds(run_dir, self.cfg.out, rnd)
        return rnd

    @property
    def group_pg(self):
        """The process group of this rank's group (the world, when the world is one group)."""
        if self._group_pg is None:
            if self.topology.groups == 1:
                self._group_pg = dist.group.WORLD
            else:  # every rank must create every group's subgroup, in the same order
                k = self.topology.group_size
                self._group_pg, _ = dist.new_subgroups_by_enumeration(
                    [list(range(g * k, (g + 1) * k)) for g in range(self.topology.groups)]
                )
        return self._group_pg

    def _sharded_state(self, outer: OuterSync | None) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        state = {"model": model, "optim": optim}
        if outer is not None:
            state["outer"] = outer.sharded_state(self.model)
        return state

    def save_checkpoint(
        self,
        root: str | Path,
        rnd: int,
        outer: OuterSync | None = None,
        extra: dict | None = None,
    ) -> None:
        """Every rank of the group: save the state after round ``rnd`` under ``root``.

        Sharded weights, AdamW state and the outer state go through DCP (each rank writes its
        shards); group rank 0 adds ``trainer.pt`` (step, LR schedule, every rank's data
        position, and ``extra``: state that rank holds alone, such as the Flower transport's
        error-feedback residual) and commits the directory atomically. ``root`` must be one
        directory that all ranks of the group see (a shared file system when the group spans
        hosts).
        """
        import torch.distributed.checkpoint as dcp

        pg = self.group_pg
        head = dist.get_rank(pg) == 0
        tmp = C.staging_dir(root, rnd) if head else None
        box = [str(tmp)]
        dist.broadcast_object_list(box, group_src=0, group=pg)
        dcp.save(self._sharded_state(outer), checkpoint_id=box[0], process_group=pg)
        data = [None] * dist.get_world_size(pg)
        dist.all_gather_object(data, self.batches.state_dict(), group=pg)
        if head:
            torch.save(
                {
                    "round": rnd,
                    "step": self.step,
                    "tokens": self.tokens,
                    "group": self.group,
                    "scheduler": self.scheduler.state_dict(),
                    "data": data,
                    "extra": extra or {},
                    "local_steps": self.local_steps,
                },
                Path(box[0]) / C.GROUP_TRAINER,
            )
            C.commit(Path(box[0]), root, rnd, keep=self.cfg.keep_checkpoints)
        dist.barrier(group=pg)

    def load_checkpoint(self, path: str | Path, outer: OuterSync | None = None) -> int:
        """Every rank of the group: load a checkpoint saved by :meth:`save_checkpoint`.

        ``path`` must have been verified (:func:`flower_shard.runtime.checkpoint.good_rounds`, done
        once by the rank that chose it): hashing the whole checkpoint again on every rank
        would multiply the cost of a load by the group size.

        The checkpoint may come from a group with another number of ranks: DCP reshards the
        weights and the optimizer state. The data position carries over only with the same
        number of ranks (the data partition depends on it); otherwise the data starts afresh.
        Returns the checkpoint's round.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._sharded_state(outer)
        dcp.load(state, checkpoint_id=str(path), process_group=self.group_pg)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        meta = torch.load(Path(path) / C.GROUP_TRAINER, weights_only=False)
        self.step, self.tokens, self.round = meta["step"], meta["tokens"], meta["round"]
        self.scheduler.load_state_dict(meta["scheduler"])
        self.loaded_extra = meta.get("extra", {})
        self.local_steps = meta.get("local_steps", self.cfg.local_steps)
        if len(meta["data"]) == dist.get_world_size(self.group_pg):
            self.batches.load_state_dict(meta["data"][dist.get_rank(self.group_pg)])
        return meta["round"]

    def close(self, clean: bool = False) -> None:
        shutdown(clean)


def _share(inter: float, intra: float) -> float:
    return inter / (inter + intra) if inter + intra else 0.0


def dist_sum(value, device: torch.device) -> float:
    """Sum a scalar over the whole world."""
    t = torch.as_tensor(value, dtype=torch.float64, device=device).clone()
    dist.all_reduce(t)
    return t.item()


def _elapsed(start: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(
            "usage: python -m flower_shard.runtime.trainer OUT/config.json (started by torchrun)",
            file=sys.stderr,
        )
        return 2
    cfg = TrainConfig.from_json(argv[0])
    trainer = GroupTrainer(cfg)
    clean = False
    try:
        trainer.train()
        clean = True
    finally:
        trainer.close(clean)
    return 0


if __name__ == "__main__":
    sys.exit(main())
