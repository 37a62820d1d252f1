"""The ``flower-shard`` command.

``flower-shard train``: validate, prepare data, start N = G x K ranks with torchrun on this host.

Multi-node: run the same command on every host with ``--nnodes H --node-rank I
--rdzv-endpoint HOST0:PORT``; each host starts N / H ranks, and groups are consecutive ranks,
so with K = ranks per host every group lives on one host (its fast tier).

``flower-shard node``: one Flower client, i.e. a torchrun group plus ``flower-supernode``.

``flower-shard demo``: a real local Flower deployment on loopback (SuperLink, 2 nodes of 2 ranks)
running FL+FSDP on the default corpus with the tiny model.

``flower-shard report RUN_DIR [--vs OTHER_RUN_DIR ...]``: plots and a summary table of runs.

``flower-shard export RUN_DIR --out DIR``: the run's final model as a ``transformers`` directory.

Flags are made from :class:`~flower_shard.config.TrainConfig`'s fields (``--local-steps`` for
``local_steps``), with the field docstrings as help, so the CLI and the config cannot disagree.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import shlex
import sys
from pathlib import Path

from flower_shard.config import ConfigError, TrainConfig
from flower_shard.flower.node.launcher import add_node_flags
from flower_shard.planning.planner import add_plan_flags
from flower_shard.ux.demo import add_demo_flags
from flower_shard.ux.export import add_export_flags
from flower_shard.ux.report import add_report_flags


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + line
        self.exit(2, f"flower-shard: error: {message}\n")


def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string literal under each field)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def add_config_flags(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    docs = field_docs(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        help_ = docs.get(f.name, "")
        if isinstance(default, bool):
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_,
            )
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            parser.add_argument(
                flag,
                dest=f.name,
                type=kind,
                default=default,
                metavar=f.name.upper(),
                help=f"{help_} (default: {default})",
            )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flower-shard", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    text = "train FL+FSDP / FL+HSDP (or the G=1 baseline) in one torch job on this host"
    p = sub.add_parser("train", help=text, description=text)
    add_config_flags(p, TrainConfig())
    p.add_argument("--node-rank", type=int, default=0, help="this host's index (multi-node)")
    p.add_argument(
        "--rdzv-endpoint",
        default=None,
        help="HOST:PORT of host 0 (--node-rank 0), where the rendezvous runs; the same on every "
        "host",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the configuration and print the torchrun command; start nothing",
    )

    text = "run one Flower client: a torchrun group plus flower-supernode"
    add_node_flags(sub.add_parser("node", help=text, description=text))

    text = "a local Flower deployment (SuperLink, G nodes of K ranks) running FL+FSDP"
    add_demo_flags(sub.add_parser("demo", help=text, description=text))

    text = "rank (G, K, T, sharding) layouts for a cluster with the cost model"
    add_plan_flags(sub.add_parser("plan", help=text, description=text))

    text = "plots and a summary table (report.md) from runs' metrics.jsonl"
    add_report_flags(sub.add_parser("report", help=text, description=text))

    text = "save a finished run's final model (and tokenizer) with transformers' save_pretrained"
    add_export_flags(sub.add_parser("export", help=text, description=text))
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The one place where command-line values become a TrainConfig."""
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "node":
            from flower_shard.flower.node.launcher import node_config_from_args, run_node

            return run_node(node_config_from_args(args))
        if args.command == "plan":
            from flower_shard.planning.planner import plan_from_args

            return plan_from_args(args)
        if args.command == "demo":
            from flower_shard.ux.demo import demo_from_args

            return demo_from_args(args)
        if args.command == "report":
            from flower_shard.ux.report import report_from_args

            return report_from_args(args)
        if args.command == "export":
            from flower_shard.ux.export import export_from_args

            return export_from_args(args)
        from flower_shard import runfiles
        from flower_shard.launch.torchrun import launch_train, torchrun_command
        from flower_shard.preflight import check

        cfg = config_from_args(args)
        if args.dry_run:
            # The command may be meant for another host: CUDA need not be present here.
            check(dataclasses.replace(cfg, device="auto"))
            cmd = torchrun_command(
                cfg,
                Path(cfg.out, runfiles.CONFIG_FILE),
                node_rank=args.node_rank,
                rdzv_endpoint=args.rdzv_endpoint,
            )
            print(shlex.join(cmd))
            return 0
        return launch_train(cfg, node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint)
    except ConfigError as exc:
        print(f"flower-shard: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
