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
import logging
import shlex
import sys
from pathlib import Path

from flower_shard import logs
from flower_shard.config import choices as C
from flower_shard.config.choices import choices_of
from flower_shard.config.train import TrainConfig
from flower_shard.errors import ConfigError

# Each subcommand's flags come from a module that is light to import (no torch, numpy, rich,
# cryptography or flwr: a test checks); what a subcommand runs is imported when it runs.
from flower_shard.flower.node.config import add_node_flags
from flower_shard.planning.plan_flags import add_plan_flags
from flower_shard.ux.demo import add_demo_flags
from flower_shard.ux.export import add_export_flags
from flower_shard.ux.report import add_report_flags

logger = logging.getLogger(__name__)


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
    """One flag per :class:`TrainConfig` field, its docstring as help, its choices if any."""
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
            continue
        choices = choices_of(f)
        parser.add_argument(
            flag,
            dest=f.name,
            type={"int": int, "float": float}.get(str(f.type), str),
            default=default,
            choices=choices,
            metavar=None if choices else f.name.upper(),
            help=f"{help_} (default: {default})",
        )


def add_log_level(parser: argparse.ArgumentParser, default=None) -> None:
    parser.add_argument(
        "--log-level",
        choices=logs.LEVELS,
        default=default,
        help=f"verbosity of this command and of the processes it starts (default: "
        f"${logs.LEVEL_ENV}, else {logs.DEFAULT_LEVEL})",
    )


# (name, help, the function that adds its flags)
SUBCOMMANDS = (
    ("node", "run one Flower client: a torchrun group plus flower-supernode", add_node_flags),
    (
        "demo",
        "a local Flower deployment (SuperLink, G nodes of K ranks) running FL+FSDP",
        add_demo_flags,
    ),
    ("plan", "rank (G, K, T, sharding) layouts for a cluster with the cost model", add_plan_flags),
    ("report", "plots and a summary table (report.md) from runs' metrics.jsonl", add_report_flags),
    (
        "export",
        "save a finished run's final model (and tokenizer) with transformers' save_pretrained",
        add_export_flags,
    ),
)


def versions() -> str:
    """``flower-shard X (flwr Y, torch Z, Python V)``: from the installed metadata, without
    importing them."""
    from importlib.metadata import PackageNotFoundError, version

    from flower_shard import __version__

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    python = ".".join(map(str, sys.version_info[:3]))
    return f"flower-shard {__version__} (flwr {of('flwr')}, torch {of('torch')}, Python {python})"


class _VersionAction(argparse.Action):
    """``--version``: :func:`versions`, looked up only when asked (30 ms of package metadata
    that no other command should pay at start-up)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print the versions and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(versions())
        parser.exit()


def build_parser(train_settings: dict | None = None) -> argparse.ArgumentParser:
    """``flower-shard [--log-level L] COMMAND [--log-level L] ...``: the level is taken before
    or after the command. ``train_settings``: ``train``'s defaults as a ``--config`` file
    sets them (flags still win)."""
    parser = _Parser(prog="flower-shard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action=_VersionAction)
    add_log_level(parser)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    text = "train FL+FSDP / FL+HSDP (or the G=1 baseline) in one torch job on this host"
    p = sub.add_parser("train", help=text, description=text)
    add_config_flags(p, TrainConfig(**(train_settings or {})))
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="a TOML or JSON file of settings keyed like these flags (local-steps = 8), e.g. a "
        "run directory's config.json; flags given here win over it",
    )
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
    add_log_level(p, argparse.SUPPRESS)  # SUPPRESS: a level given before the command stays
    for name, text, add_flags in SUBCOMMANDS:
        p = sub.add_parser(name, help=text, description=text)
        add_flags(p)
        add_log_level(p, argparse.SUPPRESS)
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The one place where command-line values become a TrainConfig (``--model DIR`` with a
    tokenizer and no ``--tokenizer``: that tokenizer)."""
    from flower_shard.preflight import with_model_tokenizer

    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    return with_model_tokenizer(cfg)


def train_from_args(args: argparse.Namespace) -> int:
    """``flower-shard train``: check, prepare and launch this host's ranks (or, with
    ``--dry-run``, print the torchrun command)."""
    from flower_shard import runfiles
    from flower_shard.launch.torchrun import launch_train, torchrun_command
    from flower_shard.preflight import check, check_out

    cfg = config_from_args(args)
    if not args.dry_run:
        return launch_train(cfg, node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint)
    # The command may be meant for another host: CUDA need not be present here.
    check_out(check(dataclasses.replace(cfg, device=C.AUTO)))
    logger.info("settings that differ from the defaults: %s", cfg.non_defaults())
    cmd = torchrun_command(
        cfg,
        Path(cfg.out, runfiles.CONFIG_FILE),
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
    )
    print(shlex.join(cmd))
    return 0


def run_command(args: argparse.Namespace) -> int:
    """Import and run the subcommand ``args.command``."""
    if args.command == "node":
        from flower_shard.flower.node.config import node_config_from_args
        from flower_shard.flower.node.launcher import run_node

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
    return train_from_args(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup(args.log_level, prefix=f"flower-shard {args.command}")
    try:
        if args.command == "train" and args.config:
            from flower_shard.ux.config_file import read_settings

            args = build_parser(read_settings(args.config)).parse_args(argv)
        return run_command(args)
    except ConfigError as exc:
        print(f"flower-shard: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
