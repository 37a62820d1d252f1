"""The closed sets of values that settings take, each defined once, and the field that uses one.

A setting with a fixed set of values is declared with :func:`choice`: the dataclass check
(:func:`check_choices`), the CLI's ``choices=`` (``flower-shard train``, ``node``, ``demo``,
``plan``) and the generated reference (docs/configuration.md) all read the set from the field,
so no list is restated. The transports are :data:`flower_shard.protocol.TRANSPORTS` (the group
and the server agree on them). A pure module: no imports from flower_shard but the errors.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flower_shard.errors import ConfigError

# -- sharding inside a group (mesh dims: group x shard, or group x replicate x shard) ----------
FSDP = "fsdp"
HSDP = "hsdp"
SHARDING_MODES = (FSDP, HSDP)

# -- outer optimizer, applied to the averaged pseudo-gradient once per round ------------------
FEDAVG = "fedavg"  # the mean replaces the weights
NESTEROV = "nesterov"  # DiLoCo's outer Nesterov step
OUTER_OPTIMIZERS = (FEDAVG, NESTEROV)

# -- the pseudo-gradient between groups --------------------------------------------------------
NO_COMPRESSION = "none"
BF16 = "bf16"
INT8 = "int8"
COMPRESSIONS = (NO_COMPRESSION, BF16, INT8)

# -- where a rank computes ----------------------------------------------------------------------
AUTO = "auto"  # CUDA when available
CPU = "cpu"
CUDA = "cuda"
DEVICES = (AUTO, CPU, CUDA)

# -- how the training blocks are split between groups -------------------------------------------
IID = "iid"
BY_SOURCE = "by-source"
DIRICHLET = "dirichlet"
PARTITIONS = (IID, BY_SOURCE, DIRICHLET)

# -- how the server combines the groups' updates ------------------------------------------------
MEAN = "mean"  # token-weighted
TRIMMED_MEAN = "trimmed-mean"  # coordinate-wise, robust to a few bad groups
AGGREGATIONS = (MEAN, TRIMMED_MEAN)

CHOICES = "choices"
"""The dataclass field metadata key that holds a field's allowed values."""


def choice(default: str, choices: tuple[str, ...]) -> Any:
    """A dataclass field whose value is one of ``choices`` (``default`` is one of them)."""
    if default not in choices:
        raise ValueError(f"default {default!r} is not among the choices {choices}")
    return dataclasses.field(default=default, metadata={CHOICES: choices})


def choices_of(field: dataclasses.Field) -> tuple[str, ...] | None:
    """The allowed values of a field declared with :func:`choice`, else None."""
    return field.metadata.get(CHOICES)


def check_choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise :class:`ConfigError` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ConfigError(f"{flag} {value!r} is unknown; choose one of {', '.join(choices)}")


def check_choices(config, prefix: str = "--") -> None:
    """:func:`check_choice` for every :func:`choice` field of the dataclass ``config``; the flag
    named in an error is ``prefix`` + the field's kebab-case name (``--sharding``, ``transport``).
    """
    for f in dataclasses.fields(config):
        allowed = choices_of(f)
        if allowed is not None:
            check_choice(prefix + f.name.replace("_", "-"), getattr(config, f.name), allowed)
