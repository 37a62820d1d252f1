"""``flower-shard demo`` (and ``make demo``): FL+FSDP through a real local Flower deployment.

Brings up ``flower-superlink`` and G nodes (each a torchrun group of K ranks plus
``flower-supernode``) on loopback, runs a few rounds on the default corpus with the tiny model,
prints one line per round, writes the results to ``--out`` and stops everything.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

from flower_shard import protocol as P
from flower_shard import runfiles as F
from flower_shard.config import choices as C
from flower_shard.config.federation import FederationConfig
from flower_shard.config.train import TrainConfig
from flower_shard.errors import ConfigError
from flower_shard.launch.processes import free_port
from flower_shard.preflight import require_tensorboard
from flower_shard.ux.progress import RoundDisplay

logger = logging.getLogger(__name__)

DEMO = TrainConfig(model="tiny", seq_len=128, batch_size=4, lr=3e-3, eval_every=1)
"""The demo's run: the defaults of ``flower-shard train`` for G, K, T and rounds, the tiny
model, evaluation every round."""


def add_demo_flags(parser: argparse.ArgumentParser) -> None:
    d, fed = DEMO, FederationConfig()
    parser.add_argument("--groups", type=int, default=d.groups, help="G: nodes, one group each")
    parser.add_argument(
        "--nproc-per-group", type=int, default=d.nproc_per_group, help="K: ranks per group"
    )
    parser.add_argument("--rounds", type=int, default=d.rounds, help="Flower rounds")
    parser.add_argument(
        "--local-steps", type=int, default=d.local_steps, help="T: inner steps per round"
    )
    parser.add_argument("--transport", default=fed.transport, choices=P.TRANSPORTS)
    parser.add_argument("--outer", default=d.outer, choices=C.OUTER_OPTIMIZERS)
    parser.add_argument("--out", default="runs/demo", help="where the results go")
    parser.add_argument(
        "--tensorboard",
        action="store_true",
        help="also write each round's metrics to OUT/tensorboard (needs tensorboard installed)",
    )


def demo_run_config(args: argparse.Namespace, out: Path) -> dict:
    """The run config of the demo's Flower run (kebab-case keys, as ``flwr run`` takes them)."""
    fixed = {P.kebab(f): getattr(DEMO, f) for f in ("model", "seq_len", "batch_size", "lr")}
    return fixed | {
        P.NUM_SERVER_ROUNDS: args.rounds,
        P.LOCAL_STEPS: args.local_steps,
        P.TRANSPORT: args.transport,
        P.OUTER_OPTIMIZER: args.outer,
        P.MIN_GROUPS: args.groups,
        P.OUT_DIR: str(out),
        P.EVAL_EVERY: DEMO.eval_every,
        P.COLLECTIVE_ADDRESS: f"127.0.0.1:{free_port()}",
        P.TENSORBOARD: args.tensorboard,
    }


def demo_from_args(args: argparse.Namespace) -> int:
    """Run the demo; its headline and result go to stdout, the steps in between are logged."""
    from flower_shard.launch.deployment import LocalDeployment

    for flag in ("groups", "nproc_per_group", "rounds", "local_steps"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.tensorboard:  # here, not in the ServerApp once the deployment is up
        require_tensorboard()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    print(
        f"flower-shard demo: FL+FSDP, {args.groups} groups x {args.nproc_per_group} ranks, "
        f"T={args.local_steps}, {args.rounds} rounds, transport={args.transport}",
        flush=True,
    )
    with (
        tempfile.TemporaryDirectory(prefix="flower-shard-demo-") as work,
        LocalDeployment(work, args.groups, args.nproc_per_group, log=logger.info) as deployment,
    ):
        logger.info("running (the first round also builds the groups' models)")
        # A live bar and a final table on a terminal, the plain round lines anywhere else.
        display = RoundDisplay(args.rounds)
        try:
            summary = deployment.run(demo_run_config(args, out), on_round=display.round)
        finally:
            display.close()
        logger.info("stopping the deployment")
    # Every transport's ServerApp writes the final model (the collective one fetches it from a
    # group at the end): list what is there.
    files = [f for f in (F.METRICS_FILE, F.SUMMARY_FILE, F.FINAL_MODEL) if (out / f).is_file()]
    status = summary[P.S_STATUS]
    print(
        f"flower-shard demo: {status} in {time.monotonic() - start:.0f} s; "
        f"results in {out} ({', '.join(files)})",
        flush=True,
    )
    return 0 if status == P.STATUS_OK else 1
