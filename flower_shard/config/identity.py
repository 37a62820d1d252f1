"""Which run a checkpoint belongs to, and which of its settings a resumed run may change.

Every checkpoint records an identity (``run.json``, written by
:mod:`flower_shard.runtime.checkpoint`): the run's name (made once when a run starts, inherited
by every resume of it), the group's index (None for the server's) and the settings the run had
(the field names of :class:`~flower_shard.config.TrainConfig` and
:class:`~flower_shard.config.federation.FederationConfig`). Before a resumed run starts anything
its settings are compared with the checkpoint's (:func:`compare`): a change in
:data:`MUST_MATCH` (what shapes the training: G, T, the model, data and schedule, the outer
optimizer, compression, the transport, ...) is refused in one line; any other change (K, the
round timeout, evaluation and checkpoint intervals, addresses, ...) is allowed and reported.
A pure module: no I/O.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flower_shard import protocol as P
from flower_shard.config.presets import is_preset
from flower_shard.errors import ConfigError

if TYPE_CHECKING:
    from flower_shard.config.federation import FederationConfig
    from flower_shard.config.train import TrainConfig

RUN, GROUP, SETTINGS = P.RUN_NAME, P.GROUP_INDEX, "settings"
"""The keys of an identity."""

MUST_MATCH = frozenset(
    {
        # the topology between groups and the length of the run
        "groups",
        "local_steps",
        "adaptive_t",
        "exchange_share",
        "min_local_steps",
        "max_local_steps",
        "rounds",
        "round_seconds",
        # the model, its data and its inner optimizer
        "model",
        "data",
        "text_column",
        "partition",
        "partition_label",
        "dirichlet_alpha",
        "tokenizer",
        "eval_fraction",
        "seq_len",
        "batch_size",
        "lr",
        "min_lr_ratio",
        "warmup_frac",
        "weight_decay",
        "grad_clip",
        "bf16",
        "seed",
        # the exchange between groups and the state it keeps
        "outer",
        "outer_lr",
        "outer_momentum",
        "sync_optimizer_state",
        "compression",
        "compression_chunk",
        "error_feedback",
        "transport",
        "aggregators",
        "downlink_compression",
    }
)
"""Settings a resumed run must keep (a checkpoint's state only means something with them)."""

NOT_COMPARED = frozenset({"resume", "out", "quiet"})
"""Settings that differ between a run and its resumption by nature."""

PATH_SETTINGS = ("model", "data", "tokenizer")


def new_run_name() -> str:
    """A name for a new run, unique across runs and hosts."""
    return uuid.uuid4().hex


def make_identity(run: str, group: int | None, settings: dict[str, Any]) -> dict:
    """What a checkpoint records (JSON): run name, group index (None: the server), settings."""
    return {RUN: run, GROUP: group, SETTINGS: settings}


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _resolved(settings: dict[str, Any]) -> dict[str, Any]:
    """Paths made absolute, so that a relative and an absolute name of one directory match."""
    out = dict(settings)
    for name in PATH_SETTINGS:
        value = out.get(name)
        if isinstance(value, str) and not (name == "model" and is_preset(value)):
            out[name] = str(Path(value).resolve())
    return out


def train_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The settings of a one-job run, as checkpoints record them."""
    return _json(_resolved(dataclasses.asdict(cfg)))


def federation_settings(fed: FederationConfig) -> dict[str, Any]:
    """The settings of a Flower run (the server's), as its checkpoints record them."""
    own = {f.name: getattr(fed, f.name) for f in dataclasses.fields(fed) if f.name != "train"}
    return _json(_resolved(dataclasses.asdict(fed.train) | own))


def compare(saved: dict[str, Any], now: dict[str, Any], source: str) -> list[str]:
    """Raise :class:`ConfigError` on the first setting in :data:`MUST_MATCH` whose value
    differs between ``saved`` (the checkpoint's, from ``source``) and ``now``; return the
    other changes as ``name: old -> new``."""
    changed = []
    for name in sorted(set(saved) | set(now)):
        if name in NOT_COMPARED:
            continue
        old, new = saved.get(name), _json(now.get(name))
        if old == new:
            continue
        if name in MUST_MATCH:
            raise ConfigError(
                f"resume: {name} is {new!r} but the run in {source} had {old!r}; resume with "
                f"the run's own {name}, or start a new run (a fresh --out / out-dir)"
            )
        changed.append(f"{name}: {old!r} -> {new!r}")
    return changed


def check_identity(identity: dict, run: str | None, group: int | None, source: str) -> str:
    """Raise :class:`ConfigError` unless ``identity`` is of run ``run`` (None: any run) and of
    group ``group``; return its run name."""
    name = identity.get(RUN)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{source}: the checkpoint names no run; it cannot be resumed")
    if run is not None and name != run:
        raise ConfigError(
            f"{source} is a checkpoint of another run ({name}, not {run}): a run directory "
            "holds one run's checkpoints; resume from that run's own directory"
        )
    if identity.get(GROUP) != group:
        raise ConfigError(
            f"{source} is group {identity.get(GROUP)}'s checkpoint, not group {group}'s (a copied "
            "or linked directory?); each group resumes from its own"
        )
    return name
