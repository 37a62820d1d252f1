"""The long-lived group behind one Flower client: K torchrun ranks and a local control service.

Flower starts a fresh ClientApp process for every message, so the sharded model and the inner
optimizer cannot live there. They live here, in a torchrun job that outlives the messages. Rank 0
serves a small gRPC service (on a Unix socket in an owner-only directory, or on loopback) with
four calls: ``Health``, ``Train`` (load the global weights, run T steps, then either return
the full weights or average the shards with the other groups), ``Evaluate`` and ``GetWeights``.

Rank 0 turns each call into a command that it broadcasts to all ranks over a gloo control
group; every rank then runs the command collectively (loading weights, FSDP steps, gathering).
Commands run one at a time, in order.

On failure: a call whose configuration is invalid is answered with an error and changes
nothing. An exception in the middle of a collective command leaves the ranks out of step, so
the whole job exits (torchrun stops every rank) and whoever started it restarts it.

Started by ``flower-shard node``: ``torchrun --nproc-per-node K -m
flower_shard.flower.group.service --address unix:PATH --work-dir DIR``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import signal
import sys
import time
from concurrent import futures
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from flower_shard import protocol as P
from flower_shard import runfiles as F
from flower_shard.config import ConfigError
from flower_shard.config.federation import train_config_from_message
from flower_shard.flower import wire
from flower_shard.flower.wire import flatten, pack, unpack
from flower_shard.preflight import check, prepare_for
from flower_shard.runtime import checkpoint as C
from flower_shard.runtime import compression as Z
from flower_shard.runtime.distributed import init_distributed
from flower_shard.runtime.outer_sync import OuterSync

IDLE_TIMEOUT = timedelta(days=7)  # ranks wait for the next command as long as the group lives


VALUE_FAULTS = ("nan", "huge")  # spoil the weights themselves (before any compression)
FORMAT_FAULTS = ("shape", "missing", "extra")  # spoil what goes on the wire


def inject_fault(
    fault_file: str | None, server_round: int, arrays: dict, only: tuple[str, ...] | None = None
) -> dict:
    """Fault injection for tests and drills: spoil the weights this group sends.

    ``fault_file`` holds ``ROUND:KIND`` items separated by commas, read every round (so a
    running group can be turned bad and good again). KIND: ``nan`` (a non-finite value),
    ``shape`` (one array loses a row), ``missing`` (one array is left out), ``extra`` (an
    unexpected array is added), ``huge`` (every value times 1e6). ``only`` limits the kinds
    applied (value faults go in before compression, format faults after).
    """
    kinds = [k for k in fault_kinds(fault_file, server_round) if only is None or k in only]
    if not kinds or not arrays:
        return arrays
    arrays = dict(arrays)
    first = next(iter(arrays))
    for kind in kinds:
        if kind == "nan":
            bad = arrays[first].copy()
            bad.reshape(-1)[0] = np.nan
            arrays[first] = bad
        elif kind == "shape":
            arrays[first] = arrays[first][:-1]
        elif kind == "missing":
            arrays.pop(first)
        elif kind == "extra":
            arrays["injected.extra"] = np.zeros(3, dtype=np.float32)
        elif kind == "huge":
            arrays = {k: v * np.float32(1e6) for k, v in arrays.items()}
    return arrays


def inject_death(fault_file: str | None, server_round: int) -> None:
    """Fault injection: ``ROUND:die`` in the fault file kills every rank of the group (SIGKILL)
    just before the cross-group sync of that round."""
    if "die" in fault_kinds(fault_file, server_round):
        os.kill(os.getpid(), signal.SIGKILL)


def fault_kinds(fault_file: str | None, server_round: int) -> list[str]:
    """The faults that ``fault_file`` (``ROUND:KIND`` items, comma-separated) sets for a round;
    read every round, so a running group can be turned bad and good again."""
    if not fault_file or not os.path.exists(fault_file):
        return []
    items = [i.split(":", 1) for i in Path(fault_file).read_text().split(",") if i.strip()]
    return [kind.strip() for rnd, kind in items if int(rnd) == server_round]


def run_key(config: dict) -> dict:
    """What identifies a run in a message's config: everything but the per-round keys."""
    per_round = (
        P.SERVER_ROUND,
        P.COLLECTIVE_PREFIX,
        P.SYNC_RANK,
        P.SYNC_SIZE,
        P.ROUND_STEPS,
        P.ROUND_SECONDS,
    )
    return {k: v for k, v in config.items() if k not in per_round}


def checkpoint_key(config: dict) -> str:
    """Where a group keeps its checkpoints of a run: by the run's name (the server's first
    out-dir, which a resumed run inherits) and the group's place in it. Not by all settings: a
    resumed run may change some (a new rendezvous address, a longer round timeout)."""
    key = [config.get(P.RUN_NAME, ""), config[P.GROUP_INDEX], config[P.NUM_GROUPS]]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def resume_round(config: dict) -> int:
    return int(config.get(P.RESUME_ROUND, 0))


class GroupWorker:
    """What every rank of the group holds between rounds: the trainer for the current run."""

    def __init__(
        self,
        work_dir: Path,
        data: str | None,
        device: str,
        dump_dir: str | None,
        fault_file: str | None = None,
    ):
        self.work_dir, self.data, self.device_pref, self.dump_dir = work_dir, data, device, dump_dir
        self.fault_file = fault_file
        self.device = init_distributed(device)
        self.rank = dist.get_rank()
        self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.trainer = None
        self.run_key = None
        self.outer: OuterSync | None = None
        self._store = None

    # -- run set-up ------------------------------------------------------------------------

    def ensure_run(self, config: dict) -> None:
        """Build (or keep) the trainer for the run that ``config`` describes."""
        from flower_shard.runtime.trainer import GroupTrainer

        key = run_key(config)
        if key == self.run_key:
            return
        cfg = train_config_from_message(
            config, nproc_per_group=dist.get_world_size(), data=self.data, device=self.device_pref
        )
        self.trainer = GroupTrainer(
            cfg, self.data_dir, group_index=int(config[P.GROUP_INDEX]), num_groups=cfg.groups
        )
        self.outer = None
        self.feedback = None
        self._global = None
        self._store = None  # a new run (or a restarted server) has its own rendezvous store
        if config.get(P.TRANSPORT) == "collective":
            self.outer = OuterSync(
                self.trainer.model,
                self.trainer.optimizer,
                kind=cfg.outer,
                lr=cfg.outer_lr,
                momentum=cfg.outer_momentum,
                sync_optimizer_state=cfg.sync_optimizer_state,
                compression=cfg.compression,
                chunk=cfg.compression_chunk,
                error_feedback=cfg.error_feedback,
                replicate_pg=self.trainer.topology.replicate_group(self.trainer.mesh),
            )
        self.run_key = key
        if resume_round(config) > 0 or (cfg.checkpoint_every and int(config[P.SERVER_ROUND]) > 1):
            self.load_own_checkpoint(config)

    def checkpoint_root(self, config: dict) -> Path:
        return self.work_dir / "checkpoints" / checkpoint_key(config)

    def resume_point(self, config: dict) -> Path | None:
        """Rank 0: the checkpoint this group loads when it builds its trainer mid-run, or None.

        A resumed run (``resume-round`` R): with the flower transport the newest good one up
        to R (the global weights come from the server; the checkpoint gives AdamW state, LR
        schedule and data position); with the collective transport exactly R's, since the
        weights themselves come from it (:meth:`check` refuses the run if it is missing).
        A restarted group rejoining round r (flower transport): the newest good one before r.
        """
        resume = resume_round(config)
        collective = config.get(P.TRANSPORT) == "collective"
        if resume == 0 and collective:  # a dropped group does not rejoin the collective
            return None
        found = C.latest_good(
            self.checkpoint_root(config),
            at_most=resume or int(config[P.SERVER_ROUND]) - 1,
            accept=(lambda r: r == resume) if collective else (lambda r: True),
            log=lambda m: print(f"flower-shard group: {m}", file=sys.stderr, flush=True),
        )
        return found[1] if found else None

    def load_own_checkpoint(self, config: dict) -> None:
        """Every rank: load what :meth:`resume_point` chose on rank 0; without one, the
        group goes on with the global weights and a fresh inner optimizer (logged)."""
        box = [str(self.resume_point(config) or "")] if self.rank == 0 else [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        if not box[0]:
            if self.rank == 0:
                print(
                    f"flower-shard group: no checkpoint to load for round "
                    f"{config[P.SERVER_ROUND]}: continuing from the global weights with a "
                    "fresh inner optimizer",
                    file=sys.stderr,
                    flush=True,
                )
            return
        loaded = self.trainer.load_checkpoint(box[0], self.outer)
        residual = self.trainer.loaded_extra.get("error_feedback")
        if residual is not None and self.rank == 0:  # flower transport, compressed
            cfg = self.trainer.cfg
            self.feedback = Z.ErrorFeedback(
                cfg.compression, cfg.compression_chunk, residual.numel(), cfg.error_feedback
            )
            self.feedback.residual.copy_(residual)
        if self.rank == 0:
            how = "resumed" if resume_round(config) else "rejoined"
            print(
                f"flower-shard group: {how} round {config[P.SERVER_ROUND]} with the state of "
                f"its checkpoint of round {loaded} ({box[0]})",
                flush=True,
            )

    @property
    def data_dir(self) -> Path:
        return self.work_dir / "data"

    def check(self, config: dict) -> None:
        """Rank 0, before any rank acts: validate the run and prepare its data.

        A run that is already built passed this check when it started: later rounds skip it
        (it would list and stat the whole corpus every round).
        """
        if run_key(config) == self.run_key:
            return
        cfg = train_config_from_message(
            config, nproc_per_group=dist.get_world_size(), data=self.data, device=self.device_pref
        )
        prepare_for(self.data_dir, check(cfg))
        if (
            resume_round(config) > 0
            and config.get(P.TRANSPORT) == "collective"
            and self.resume_point(config) is None
        ):
            raise ConfigError(
                f"resume: this group has no good checkpoint of round {resume_round(config)} "
                f"under {self.checkpoint_root(config)}; the collective transport needs it "
                "(the weights live in the groups): resume from an earlier run directory"
            )

    # -- commands (run on every rank) ----------------------------------------------------------

    def run(self, command: dict, arrays: dict[str, np.ndarray]) -> tuple[dict, dict]:
        method = command[P.H_METHOD]
        if method == P.GET_WEIGHTS:
            return {}, self.full_weights() if self.trainer else {}
        config = command[P.H_CONFIG]
        self.ensure_run(config)
        if command.get(P.H_HAS_ARRAYS):
            arrays = self.load_weights(arrays)
            # Flower transport with compression: the reply is the delta from these weights.
            self._global = arrays if self.trainer.cfg.compression != "none" else None
            self.dump(config, "loaded")
        if method == P.EVALUATE:
            return {P.H_METRICS: {P.EVAL_LOSS: self.trainer.evaluate()}}, {}
        return self.train(config)

    def train(self, config: dict) -> tuple[dict, dict]:
        t = self.trainer
        start = time.perf_counter()
        n = int(config.get(P.ROUND_STEPS, config[P.LOCAL_STEPS]))
        budget = float(config.get(P.ROUND_SECONDS, 0.0))
        if budget > 0:  # time-budgeted: as many steps as fit, at most n (max-local-steps)
            progress = (int(config[P.SERVER_ROUND]) - 1, int(config[P.NUM_SERVER_ROUNDS]))
            steps = t.train_steps(n, seconds=budget, progress=progress)
        else:
            steps = t.train_steps(n)
        t.round = int(config[P.SERVER_ROUND])
        metrics = {
            P.GROUP: int(config[P.GROUP_INDEX]),
            P.STEPS: steps["steps"],
            P.NUM_TOKENS: steps["tokens"],
            P.TRAIN_LOSS: steps["loss"],
            P.COMPUTE_S: steps["seconds"],
            P.INTRA_BYTES: steps["intra_bytes"],
            P.INTRA_COMM_S: steps["intra_s"],
            P.STEP: t.step,
            P.LR: t.scheduler.get_last_lr()[0],
        }
        arrays = {}
        if self.outer is not None:  # collective: average with the other groups, send nothing
            self.dump(config, "trained")
            inject_death(self.fault_file, int(config[P.SERVER_ROUND]))
            stats, failure = self.sync_or_abandon(config, steps["tokens"])
            if failure:  # the group lives on with its own weights; the server hears why
                return {P.H_ERROR: f"{P.SYNC_ABANDONED}, weights kept: {failure}"}, {}
            metrics |= {P.OUTER_SYNC_S: stats.seconds, P.OUTER_SYNC_BYTES: stats.sent_bytes}
            metrics[P.INTRA_BYTES] += stats.replicate_bytes  # HSDP: the replicas' all-gather
            self.dump(config, "synced")
        else:
            arrays = self.full_weights()
            if self.dump_dir and self.rank == 0:
                self._save(arrays, config, "trained")
            rnd = int(config[P.SERVER_ROUND])
            arrays = inject_fault(self.fault_file, rnd, arrays, only=VALUE_FAULTS)
            if t.cfg.compression != "none" and arrays:
                arrays = self.compressed_update(arrays)
            elif arrays:  # rank 0: the wire format of the flower transport
                arrays = {P.PACKED: pack(arrays)}
            arrays = inject_fault(self.fault_file, rnd, arrays, only=FORMAT_FAULTS)
        rnd = int(config[P.SERVER_ROUND])
        if t.cfg.checkpoint_due(rnd):
            saving = time.perf_counter()
            root = self.checkpoint_root(config)
            if self.rank == 0 and not (root / F.RUN_FILE).exists():  # which run this folder is
                root.mkdir(parents=True, exist_ok=True)
                (root / F.RUN_FILE).write_text(json.dumps(run_key(config), indent=1) + "\n")
            extra = {"error_feedback": self.feedback.residual} if self.feedback else None
            t.save_checkpoint(root, rnd, self.outer, extra=extra)
            metrics[P.CHECKPOINT_S] = time.perf_counter() - saving
        metrics[P.GROUP_ROUND_S] = time.perf_counter() - start
        return {P.H_METRICS: metrics}, arrays

    def sync_or_abandon(self, config: dict, weight: int):
        """The cross-group sync, or, if any rank's part of it fails, none of it.

        A dead or missing peer group makes the rendezvous or the all-reduce fail after
        ``sync-timeout``. Each rank syncs its own shard with its own cross-group process
        group, so one rank can succeed while another fails: the ranks agree over the group's
        control group, and if any failed, all put back what they had before (shards, synced
        moments, outer state). Returns (stats, None) or (None, the reason).
        """
        saved = self.outer.snapshot()
        error = None
        try:
            stats = self.outer.sync(self.cross_group(config), weight=weight)
        except Exception as exc:  # a timeout, a closed connection: DistError and kin
            error, stats = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}", None
        failed = torch.tensor([0.0 if error is None else 1.0])
        dist.all_reduce(failed, group=self.control)
        if failed.item() == 0:
            return stats, None
        self.outer.restore(saved)
        self._store = None  # the rendezvous may be what broke: connect afresh next round
        return None, error or "another rank of this group failed its part of the sync"

    def compressed_update(self, trained: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Rank 0, flower transport with compression: the pseudo-gradient ``global - trained``
        over all weights (flattened in sorted name order, as the server reads it), compressed
        with this group's error feedback, as the arrays of the reply."""
        if self._global is None:
            raise RuntimeError("compression needs the round's global weights; none were sent")
        order = sorted(trained)
        delta = flatten(self._global, order) - flatten(trained, order)
        if self.feedback is None:  # the first round of the run (or after a restart)
            cfg = self.trainer.cfg
            self.feedback = Z.ErrorFeedback(
                cfg.compression, cfg.compression_chunk, delta.numel(), cfg.error_feedback
            )
        payload = self.feedback.compress(delta)
        return {k: v.numpy() for k, v in payload.items()}

    # -- weights ---------------------------------------------------------------------------

    def load_weights(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Load full float32 arrays (present on rank 0 only) into the sharded model: named, or
        ``packed`` (one flat vector in sorted-name order, cut by this model's own shapes)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if P.PACKED in arrays:
            shapes = self.trainer.model.state_dict()
            reason, arrays = unpack(arrays, {k: (tuple(v.shape), "") for k, v in shapes.items()})
            if reason:
                raise ValueError(f"the server's weights do not fit this group's model: {reason}")

        state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
        if self.device.type == "cuda":
            state = {k: v.to(self.device) for k, v in state.items()}
        set_model_state_dict(
            self.trainer.model,
            state if self.rank == 0 else {},
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        return arrays

    def full_weights(self) -> dict[str, np.ndarray]:
        """The full weights, gathered to rank 0 (empty elsewhere), as float32 numpy arrays."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(
            self.trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return {k: v.detach().float().numpy() for k, v in state.items()} if self.rank == 0 else {}

    def dump(self, config: dict, stage: str) -> None:
        """Debug/test aid: write the group's full weights at a stage of a round."""
        if self.dump_dir:
            arrays = self.full_weights()
            if self.rank == 0:
                self._save(arrays, config, stage)

    def _save(self, arrays, config, stage):
        from safetensors.numpy import save_file

        name = f"g{config[P.GROUP_INDEX]}_r{config[P.SERVER_ROUND]}_{stage}.safetensors"
        save_file(arrays, os.path.join(self.dump_dir, name))

    # -- the collective transport ----------------------------------------------------------

    def cross_group(self, config: dict):
        """A gloo/NCCL group of the ranks that hold this rank's shard in every group.

        Rendezvous through the TCPStore that the ServerApp hosts at ``collective-address``,
        under a prefix the server picks per round (so a new membership starts clean).
        """
        host, port = str(config[P.COLLECTIVE_ADDRESS]).rsplit(":", 1)
        timeout = timedelta(seconds=float(config.get(P.SYNC_TIMEOUT, 120)))
        if self._store is None:
            self._store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        prefix = f"{config[P.COLLECTIVE_PREFIX]}/shard{self.rank}"
        store = dist.PrefixStore(prefix, self._store)
        # The round's live groups, which the server chose (a dead group is left out).
        g = int(config.get(P.SYNC_RANK, config[P.GROUP_INDEX]))
        n = int(config.get(P.SYNC_SIZE, config[P.NUM_GROUPS]))
        if self.device.type == "cuda":
            return dist.ProcessGroupNCCL(store, g, n)
        return dist.ProcessGroupGloo(store, g, n, timeout)


class ControlServer:
    """Rank 0's gRPC service: turns calls into commands for the rank-0 main loop."""

    def __init__(self, address: str):
        import grpc

        self.commands: queue.Queue = queue.Queue()
        self.status = {P.H_READY: False, P.H_RANKS: dist.get_world_size(), P.H_STEP: 0}
        handlers = {m: grpc.unary_unary_rpc_method_handler(self._handler(m)) for m in P.METHODS}
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4), options=wire.GRPC_OPTIONS
        )
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(P.SERVICE, handlers),)
        )
        if self.server.add_insecure_port(address) == 0 and not address.startswith("unix:"):
            raise RuntimeError(f"cannot bind the group control service to {address}")
        self.server.start()

    def _handler(self, method: str):
        def handle(request: bytes, context) -> bytes:
            if method == P.HEALTH:
                return wire.encode(self.status)
            header, arrays = wire.decode(request)
            done: futures.Future = futures.Future()
            self.commands.put((method, header, arrays, done))
            reply_header, reply_arrays = done.result()
            return wire.encode(reply_header, reply_arrays)

        return handle


def serve(args: argparse.Namespace) -> int:
    work_dir = Path(args.work_dir)
    worker = GroupWorker(work_dir, args.data, args.device, args.dump_dir, args.fault_file)
    server = None
    if worker.rank == 0:
        server = ControlServer(args.address)
        server.status[P.H_READY] = True
        print(
            f"flower-shard group: {dist.get_world_size()} ranks serving {args.address}", flush=True
        )
    while True:
        if worker.rank == 0:
            method, header, arrays, done = server.commands.get()
            command = {
                P.H_METHOD: method,
                P.H_CONFIG: header.get(P.H_CONFIG, {}),
                P.H_HAS_ARRAYS: bool(arrays),
            }
            if method != P.GET_WEIGHTS:
                try:  # refuse a bad configuration before any rank acts on it
                    worker.check(command[P.H_CONFIG])
                except (ConfigError, KeyError, ValueError, TypeError) as exc:
                    done.set_result(({P.H_ERROR: f"bad run configuration: {exc}"}, {}))
                    continue
        else:
            command, arrays, done = None, {}, None
        box = [command]
        dist.broadcast_object_list(box, src=0, group=worker.control)
        command = box[0]
        try:
            reply = worker.run(command, arrays)
        except BaseException as exc:
            if done is not None:
                done.set_result(({P.H_ERROR: f"group failed: {type(exc).__name__}: {exc}"}, {}))
                time.sleep(0.5)  # let the reply leave before the job goes down
            raise
        if done is not None:
            server.status[P.H_STEP] = worker.trainer.step if worker.trainer else 0
            done.set_result(reply)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flower_shard.flower.group.service")
    p.add_argument("--address", required=True, help="unix:/path/group.sock or 127.0.0.1:PORT")
    p.add_argument("--work-dir", required=True, help="where the group keeps its prepared data")
    p.add_argument(
        "--data", default=None, help="this node's directory of text files or .jsonl / .parquet file"
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dump-dir", default=None, help="debug: write the weights of every round")
    p.add_argument("--fault-file", default=None, help="fault injection (see inject_fault)")
    args = p.parse_args(argv)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
