"""Generate ``docs/configuration.md`` from the code, so the reference cannot drift from it.

    python -m flower_shard.ux.docs_gen > docs/configuration.md

Sources: the field docstrings of :class:`~flower_shard.config.TrainConfig`,
:class:`~flower_shard.flower.node.config.NodeConfig` and
:class:`~flower_shard.config.federation.FederationConfig`
(read by :func:`flower_shard.ux.cli.field_docs`, the same text the CLI shows as help), the flags of
the real ``flower-shard train`` / ``flower-shard node`` parsers, and the run-config keys with
their defaults in ``pyproject.toml`` ``[tool.flwr.app.config]``. ``tests/test_docs.py`` fails
when the committed file differs from what this prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from flower_shard import logs
from flower_shard.config.choices import choices_of
from flower_shard.config.federation import RENAMED, FederationConfig
from flower_shard.config.train import TrainConfig
from flower_shard.flower.node.config import NodeConfig, add_node_flags
from flower_shard.launch.deployment import toml_value
from flower_shard.launch.fab import APP_DIR
from flower_shard.ux.cli import add_config_flags, field_docs

COMMAND = "python -m flower_shard.ux.docs_gen > docs/configuration.md"
PYPROJECT = APP_DIR / "pyproject.toml"

# What a field's docstring cannot say about its run-config key: where Flower puts the value.
RUN_CONFIG_NOTES = {
    "data": "Flower: read by the ServerApp's held-out evaluation only; each node trains on its "
    'own `flower-shard node --data` (`""` = the standard library\'s source).',
    "tokenizer": '`""` = bytes.',
    "text-column": "Flower: sent to every group, which reads it from its node's "
    "`flower-shard node --data` records (and the ServerApp from `data`'s).",
    "tensorboard": "Flower: the ServerApp writes `out-dir/tensorboard` (on the SuperLink's "
    "machine, which then needs the tensorboard package).",
    "partition-label": '`""` = none. Flower: each group partitions its node\'s own data, taking '
    "the part of its `group-index` among `num-groups`.",
    "out-dir": "Flower: where the ServerApp writes metrics.jsonl, summary.json, "
    "final_model.safetensors (every transport) and its evaluation data, on the SuperLink's "
    "machine, relative to where `flower-superlink` was started: give an absolute path.",
    "eval-every": "Flower: the ServerApp evaluates the global model (flower transport) or asks "
    "the groups to (collective transport).",
}


def read_run_config(pyproject: Path = PYPROJECT) -> dict:
    """``[tool.flwr.app.config]`` of ``pyproject``: the run-config keys and their defaults."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10; flwr depends on tomli there
        import tomli as tomllib

    with open(pyproject, "rb") as fh:
        return tomllib.load(fh)["tool"]["flwr"]["app"]["config"]


def run_config_field(key: str) -> tuple[type, str]:
    """The dataclass and field a run-config key fills, as FederationConfig.from_run_config maps it.

    Raises
    ------
    ValueError
        The key fills no field (nothing would read it).
    """
    name = RENAMED.get(key, key.replace("-", "_"))
    for cls in (FederationConfig, TrainConfig):
        if name != "train" and name in {f.name for f in dataclasses.fields(cls)}:
            return cls, name
    raise ValueError(f"run-config key {key!r} fills no field of FederationConfig or TrainConfig")


def parser_flags(add_flags) -> dict[str, argparse.Action]:
    """The actions of a parser built by ``add_flags(parser)``, by destination (field name)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_flags(parser)
    return {a.dest: a for a in parser._actions}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _with_choices(doc: str, field: dataclasses.Field) -> str:
    """A field's docstring, with its allowed values when it has a fixed set."""
    allowed = choices_of(field)
    if allowed is None:
        return doc
    return f"{doc} One of: {', '.join(f'`{c}`' for c in allowed)}."


def flag_table(cls, actions: dict[str, argparse.Action]) -> list[str]:
    """One row per dataclass field: its flag(s), default and docstring."""
    docs = field_docs(cls)
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(cls):
        action = actions.get(f.name)
        if action is None:
            flag = f"(Python API only: `{f.name}`)"
        else:
            flag = " / ".join(f"`{s}`" for s in action.option_strings)
            if action.help == argparse.SUPPRESS:
                flag += " (hidden: tests and debugging)"
            if isinstance(action, argparse._StoreFalseAction):  # the flag turns it off
                flag += " (turns it off)"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        meaning = _with_choices(docs.get(f.name, ""), f)
        rows.append(f"| {flag} | {_default(default)} | {_cell(meaning)} |")
    return rows


def run_config_table(run_config: dict) -> list[str]:
    """One row per run-config key: its pyproject default, meaning and the field it fills."""
    docs = {cls: field_docs(cls) for cls in (FederationConfig, TrainConfig)}
    rows = ["| key | default | meaning | fills |", "|---|---|---|---|"]
    for key, value in run_config.items():
        cls, name = run_config_field(key)
        field = next(f for f in dataclasses.fields(cls) if f.name == name)
        meaning = _with_choices(docs[cls].get(name, ""), field)
        meaning = " ".join(filter(None, (meaning, RUN_CONFIG_NOTES.get(key))))
        rows.append(
            f"| `{key}` | `{toml_value(value)}` | {_cell(meaning)} | `{cls.__name__}.{name}` |"
        )
    return rows


def generate(pyproject: Path = PYPROJECT) -> str:
    """The whole text of ``docs/configuration.md``.

    Raises
    ------
    ValueError
        A run-config key fills no field, or a FederationConfig field has no run-config key:
        either way the code and ``pyproject.toml`` disagree.
    """
    run_config = read_run_config(pyproject)
    keys = {run_config_field(k) for k in run_config}
    for f in dataclasses.fields(FederationConfig):
        if f.name != "train" and (FederationConfig, f.name) not in keys:
            raise ValueError(f"FederationConfig.{f.name} has no key in [tool.flwr.app.config]")
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated by `{COMMAND}` from the field docstrings in flower_shard/config/train.py, "
        "flower_shard/flower/node/config.py, flower_shard/config/federation.py and from "
        "pyproject.toml. Do not edit "
        "by hand: edit those and regenerate. -->",
        "",
        "Three places take settings: `flower-shard train` (one torch job, `TrainConfig`), "
        "`flower-shard node` (one Flower client, `NodeConfig`), and the Flower run config "
        '(`flwr run . CONNECTION --run-config "key=value ..."`, read by the ServerApp into '
        "`FederationConfig` and sent on to every group). A wrong value fails with one line "
        "(exit status 2 for the CLI, a failed run with the reason in `summary.json` for Flower).",
        "",
        f"Every `flower-shard` command takes `--log-level {{{','.join(logs.LEVELS)}}}`, before or "
        f"after the command (default: `${logs.LEVEL_ENV}`, else `{logs.DEFAULT_LEVEL}`); the "
        "processes it starts (torchrun ranks, a node's group and SuperNode) log at the same "
        "level. Results (the rounds, the report's path, ...) go to stdout, logs to stderr.",
        "",
        "## `flower-shard train`: `TrainConfig`",
        "",
        "Every field of `flower_shard.config.TrainConfig` is one flag. `flower-shard train` also "
        "takes `--node-rank` and `--rdzv-endpoint` (multi-node).",
        "",
        *flag_table(TrainConfig, parser_flags(lambda p: add_config_flags(p, TrainConfig()))),
        "",
        "## `flower-shard node`: `NodeConfig`",
        "",
        "One node is a torchrun group of K ranks plus a `flower-supernode`; the group takes its "
        "training settings from the run config of each round, not from these flags.",
        "",
        *flag_table(NodeConfig, parser_flags(add_node_flags)),
        "",
        "## Flower run config: `[tool.flwr.app.config]`",
        "",
        "The keys `flwr run` accepts (defaults from `pyproject.toml`; override with "
        '`--run-config "key=value ..."`, TOML values: strings in quotes). Keys named after a '
        "`TrainConfig` field reach the groups; the rest configure the ServerApp and "
        "`ShardedFedAvg` (`FederationConfig`). G is the number of connected nodes and K each "
        "node's `--nproc-per-group`, so neither is a key.",
        "",
        *run_config_table(run_config),
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    sys.stdout.write(generate())
    return 0


if __name__ == "__main__":
    sys.exit(main())
