"""``flower-shard train --config FILE``: the settings of a run from a file instead of flags.

A TOML file (``lr = 3e-3``, ``local-steps = 8``) or JSON object, keyed by the flags' names
(``local-steps``), the fields' (``local_steps``) or the Flower run config's
(``num-server-rounds``, ``out-dir``, ``outer-optimizer``): so a run directory's saved
``config.json`` is a config file, and so are the keys of ``pyproject.toml``'s run config that
a one-host run shares. Precedence: the defaults, then the file, then the flags given on the
command line. "" stands for "none" (TOML has no null).

Light to import (the standard library and the config dataclasses only).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path

from flower_shard.config.federation import RENAMED
from flower_shard.config.ranges import base_type
from flower_shard.config.train import TrainConfig
from flower_shard.errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def read_settings(path: str) -> dict:
    """The TrainConfig fields that ``path`` sets, by field name, typed as the fields are.

    Raises
    ------
    ConfigError
        The file is missing, is neither TOML nor JSON, or names a setting that does not exist
        (with the closest names), or gives a value of the wrong kind (one line each).
    """
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--config {path}: no such file")
    text = file.read_text(errors="replace")
    try:
        raw = json.loads(text) if file.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        kind = "JSON" if file.suffix == ".json" else "TOML"
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"--config {path}: not valid {kind} ({first})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: must hold key = value settings, not a list")
    settings = {}
    for key, value in raw.items():
        name = RENAMED.get(key, key.replace("-", "_"))
        if name not in FIELDS:
            flags = [n.replace("_", "-") for n in FIELDS]
            near = difflib.get_close_matches(key.replace("_", "-"), flags, n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise ConfigError(f"--config {path}: {key!r} is no setting of train{hint}")
        settings[name] = _typed(path, key, FIELDS[name], value)
    return settings


def _typed(path: str, key: str, field: dataclasses.Field, value):
    """``value`` as the field holds it: "" as None where None is allowed, an integer where a
    float is expected as that float; anything else is left to the field checks."""
    kind, optional = base_type(field)
    if value == "" and optional:
        return None
    if isinstance(value, dict | list):
        raise ConfigError(f"--config {path}: {key} must be a single value, not {value!r}")
    if kind in ("int", "float") and isinstance(value, str | bool):
        raise ConfigError(f"--config {path}: {key} must be a number, got {value!r}")
    if kind == "float" and isinstance(value, int):
        return float(value)
    return value
